"""The layouts of chapters 01-06 through ``parallelize`` (the one code path the numbered scripts
use) on 2 gloo ranks equal the single device: losses, grad norms and full weights over 5 steps,
for ours and for PyTorch's native versions (``parallel.impl = torch``: DistributedDataParallel,
FSDP2, DTensor tensor parallel, torch.distributed.pipelining). Consolidated checkpoints written
at FSDP2 and DTensor layouts resume at other layouts, and the impl combinations that cannot run
raise ValueError.
"""

import os
import tempfile
import unittest

import torch

from scaletorch.dist import destroy_pg_manager
from scaletorch.models import build_model
from scaletorch.parallel.parallelize import (DTensorLayout, Layout, load_consolidated, parallelize,
                                             resume_consolidated, save_consolidated)
from scaletorch.trainer import Config, Trainer
from scaletorch.trainer.parity import max_weight_diff
from tests.harness import run_distributed, value_error
from tests.test_nd_parallel import _build, _layout, _pgm, make_config

WORLD = 2
TOL = 1e-5  # fp32, 5 AdamW steps at lr 3e-3 (test_nd_parallel.make_config)
SAVE_AT = 3

# name -> (moe, micro-batches, parallel config); the chapter each layout belongs to first
CHAPTERS = {
    "01_bucketed_dp2": (False, 2, _layout()),
    "01_naive_dp2": (False, 2, _layout(impl="naive")),
    "01_torch_ddp_dp2": (False, 2, _layout(impl="torch")),
    "02_zero2_dp2": (False, 2, _layout(zero_stage=2)),
    "02_fsdp2_dp2_checkpointed":
    (False, 2, _layout(zero_stage=3, impl="torch", activation_checkpointing=True)),
    "03_tp2_sp": (False, 2, _layout(tp=2, sequence_parallel=True)),
    "03_dtensor_tp2": (False, 2, _layout(tp=2, impl="torch")),
    "03_dtensor_tp2_sp": (False, 2, _layout(tp=2, impl="torch", sequence_parallel=True)),
    "04_pp2_1f1b": (False, 2, _layout(pp=2)),
    "04_torch_pipelining_pp2": (False, 2, _layout(pp=2, impl="torch")),
    "05_cp2_ulysses_torch_ddp": (False, 2, _layout(cp=2, cp_variant="ulysses", impl="torch")),
    "06_moe_ep2": (True, 1, _layout(ep=2)),
}


def chapter_config(name: str) -> Config:
    moe, m, parallel = CHAPTERS[name]
    return make_config(moe, m, **parallel)


def _train(name: str) -> dict:
    cfg = chapter_config(name)
    pgm = _pgm(cfg)
    par, trainer = _build(cfg, pgm)
    result = trainer.train()
    out = {
        "losses": result.losses,
        "grad_norms": result.grad_norms,
        "state": par.full_state_dict(),
        "layout": type(par.layout).__name__,
    }
    destroy_pg_manager()
    return out


def _save_and_resume(tmp: str) -> dict:
    """Save after 3 steps at FSDP2 dp2 and at DTensor tp2; resume the first at DTensor tp2 and
    ours tp2, the second at FSDP2 dp2 and ours ZeRO-1 dp2. Each returns steps 3 and 4's losses."""
    plan = {
        "02_fsdp2_dp2_checkpointed": (_layout(tp=2, impl="torch"), _layout(tp=2)),
        "03_dtensor_tp2": (_layout(zero_stage=3, impl="torch"), _layout(zero_stage=1))
    }
    out = {}
    for saved, resumes in plan.items():
        cfg = chapter_config(saved)
        pgm = _pgm(cfg)
        par, trainer = _build(cfg, pgm)
        for _ in range(SAVE_AT):
            trainer.train_step()
        path = os.path.join(tmp, f"{saved}.pt")
        save_consolidated(path, trainer, par)
        destroy_pg_manager()
        state = load_consolidated(path)
        for parallel in resumes:
            cfg = make_config(False, 2, **parallel)
            pgm = _pgm(cfg)
            par, trainer = _build(cfg, pgm, state["model"])
            resume_consolidated(trainer, par, state)
            out[f"{saved} -> {_name(parallel)}"] = trainer.train().losses
            destroy_pg_manager()
    return out


def _name(parallel: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in parallel.items() if v not in (1, 0, "scaletorch"))


def _invalid_impls() -> dict:
    out = {}
    for name, (moe, parallel) in {
            "naive_zero": (False, _layout(zero_stage=1, impl="naive")),
            "torch_moe": (True, _layout(ep=2, impl="torch")),
            "torch_zero3_tp2": (False, _layout(tp=2, zero_stage=3, impl="torch")),
    }.items():
        cfg = make_config(moe, 1, **parallel)
        pgm = _pgm(cfg)
        out[name] = value_error(
            lambda: parallelize(build_model(cfg.model, 0), cfg, pgm, torch.device("cpu")))
        destroy_pg_manager()
    return out


def _world(rank: int, world: int, tmp: str) -> dict:
    out = {name: _train(name) for name in CHAPTERS}
    out["resumed"] = _save_and_resume(tmp)
    out["errors"] = _invalid_impls()
    return out


class ChaptersThroughParallelizeMatchSingleDevice(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.results = run_distributed(_world, WORLD, cls.tmp.name, timeout=300)
        cls.references = {}  # (moe, micro-batches) -> losses, grad norms, weights
        for moe, m, _ in CHAPTERS.values():
            if (moe, m) not in cls.references:
                cfg = make_config(moe, m)
                model = build_model(cfg.model, seed=cfg.training.model_seed)
                result = Trainer(cfg, model, None, verbose=False).train()
                cls.references[(moe, m)] = (result.losses, result.grad_norms, model.state_dict())

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def _assert_parity(self, name: str) -> None:
        moe, m, _ = CHAPTERS[name]
        losses, norms, state = self.references[(moe, m)]
        for rank, res in enumerate(self.results):
            out = res[name]
            self.assertEqual(len(out["losses"]), 5)
            for a, b in zip(out["losses"], losses):
                self.assertAlmostEqual(a, b, delta=TOL, msg=f"{name} rank {rank}")
            for a, b in zip(out["grad_norms"], norms):
                self.assertAlmostEqual(a, b, delta=TOL * max(1.0, b), msg=f"{name} rank {rank}")
            if rank > 0:
                self.assertIsNone(out["state"])
        self.assertLessEqual(max_weight_diff(self.results[0][name]["state"], state), TOL, name)

    def test_chapter_01_data_parallel_bucketed_naive_and_torch_ddp(self):
        for name in ("01_bucketed_dp2", "01_naive_dp2", "01_torch_ddp_dp2"):
            self._assert_parity(name)

    def test_chapter_02_zero2_and_fsdp2_with_activation_checkpointing(self):
        self._assert_parity("02_zero2_dp2")
        self._assert_parity("02_fsdp2_dp2_checkpointed")

    def test_chapter_03_tensor_parallel_ours_and_dtensor(self):
        for name in ("03_tp2_sp", "03_dtensor_tp2", "03_dtensor_tp2_sp"):
            self._assert_parity(name)

    def test_chapter_04_pipeline_ours_and_torch_pipelining(self):
        self._assert_parity("04_pp2_1f1b")
        self._assert_parity("04_torch_pipelining_pp2")

    def test_chapter_05_ulysses_under_torch_ddp(self):
        self._assert_parity("05_cp2_ulysses_torch_ddp")

    def test_chapter_06_experts(self):
        self._assert_parity("06_moe_ep2")

    def test_native_sharding_is_described_by_dtensor_layouts(self):
        layouts = {name: self.results[0][name]["layout"] for name in CHAPTERS}
        self.assertEqual(layouts["02_fsdp2_dp2_checkpointed"], DTensorLayout.__name__)
        self.assertEqual(layouts["03_dtensor_tp2"], DTensorLayout.__name__)
        self.assertEqual(layouts["01_torch_ddp_dp2"], Layout.__name__)  # plain tensors
        self.assertEqual(layouts["04_torch_pipelining_pp2"], Layout.__name__)

    def test_consolidated_checkpoints_of_native_layouts_resume_anywhere(self):
        reference = self.references[(False, 2)][0][SAVE_AT:]
        resumed = self.results[0]["resumed"]
        self.assertEqual(len(resumed), 4)
        for name, losses in resumed.items():
            self.assertEqual(len(losses), 5 - SAVE_AT, name)
            for a, b in zip(losses, reference):
                self.assertAlmostEqual(a, b, delta=TOL, msg=name)

    def test_impl_combinations_that_cannot_run_raise_value_errors(self):
        errors = self.results[0]["errors"]
        self.assertRegex(errors["naive_zero"], r"'naive'.*zero_stage 1")
        self.assertRegex(errors["torch_moe"], r"'torch'.*num_experts 4")
        self.assertRegex(errors["torch_zero3_tp2"], r"FSDP2.*zero_stage 3, tp 2")


if __name__ == "__main__":
    unittest.main()
