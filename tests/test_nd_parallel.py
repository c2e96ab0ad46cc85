"""N-D parallel on 8 gloo ranks equals the single device: losses, grad norms and final weights
of every layout of the matrix over 5 steps, a consolidated checkpoint resumed at other layouts,
activation checkpointing, and the combinations that must raise ValueError.

One world of 8 ranks for the whole file; each layout rebuilds the pg_manager inside it. The
references run in this (parent) process, which has no process group.
"""

import os
import tempfile
import time
import unittest

import torch

from scaletorch.dist import RankGrid, destroy_pg_manager, init_pg_manager
from scaletorch.models import build_model, loss_fn
from scaletorch.parallel.parallelize import (apply_activation_checkpointing, load_consolidated,
                                             parallelize, resume_consolidated, save_consolidated,
                                             saved_activation_bytes)
from scaletorch.trainer import Config, Trainer
from scaletorch.trainer.parity import max_weight_diff
from tests.harness import run_distributed, value_error

WORLD = 8
TOL = 1e-5  # fp32, 5 AdamW steps: only the order of the reductions differs (DESIGN.md)
SAVE_AT = 3  # the checkpoint test saves after 3 of the 5 steps


def make_config(moe: bool = False, micro_batches: int = 2, **parallel) -> Config:
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.hidden_size, m.intermediate_size, m.num_layers = 64, 32, 64, 4
    m.num_attention_heads, m.num_key_value_heads, m.max_seq_len = 4, 2, 32
    if moe:  # aux loss about 0.2 of the loss, so wrong statistics would show
        m.num_experts, m.moe_top_k, m.moe_aux_loss_coeff = 4, 2, 0.1
    cfg.data.seq_len, cfg.data.global_batch_size, cfg.data.num_micro_batches = 16, 8, \
        micro_batches
    t = cfg.training
    # lr 3e-3: AdamW turns rounding-level gradient differences of elements whose gradient is
    # near 0 into weight differences of up to ~lr; at 1e-2 two single-device runs that differ
    # only in micro-batching already differ by 9e-6 in the weights.
    t.steps, t.lr, t.warmup_steps, t.grad_clip = 5, 3e-3, 2, 0.5  # clipping is active
    cfg.logging.progress = False
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


def _layout(tp=1, pp=1, cp=1, ep=1, **rest) -> dict:
    return dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                context_parallel_size=cp, expert_model_parallel_size=ep, **rest)


# name -> (moe, micro-batches, parallel config); MoE runs use 1 micro-batch (see parallelize.py)
LAYOUTS = {
    "tp2_pp2_dp2": (False, 2, _layout(tp=2, pp=2)),
    "tp2_cp2_dp2": (False, 2, _layout(tp=2, cp=2)),
    "pp2_cp2_tp2": (False, 2, _layout(tp=2, pp=2, cp=2)),
    "zero3_dp4_tp2": (False, 2, _layout(tp=2, zero_stage=3)),
    "zero3_pp2_interleaved_dp4":
    (False, 2, _layout(pp=2, zero_stage=3, schedule="interleaved", virtual_pipeline_stages=2)),
    "moe_ep2_dp4_tp2": (True, 1, _layout(tp=2, ep=2)),
    "moe_pp2_dp4_ep2": (True, 1, _layout(pp=2, ep=2, schedule="afab")),
    "ckpt_tp2_sp_pp2_dp2":
    (False, 2, _layout(tp=2, pp=2, sequence_parallel=True, activation_checkpointing=True)),
    "ckpt_zero2_cp2_dp4": (False, 2, _layout(cp=2, zero_stage=2, activation_checkpointing=True)),
}


def layout_config(name: str) -> Config:
    moe, m, parallel = LAYOUTS[name]
    return make_config(moe, m, **parallel)


def _pgm(cfg: Config):
    p = cfg.parallel
    return init_pg_manager(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                           p.context_parallel_size, p.expert_model_parallel_size)


def _build(cfg: Config, pgm, state=None):
    model = build_model(cfg.model, seed=cfg.training.model_seed)
    if state is not None:
        model.load_state_dict(state)
    par = parallelize(model, cfg, pgm, torch.device("cpu"))
    trainer = Trainer.from_parallelized(cfg, par, pgm, verbose=False)
    return par, trainer


def _train_layout(name: str) -> dict:
    cfg = layout_config(name)
    pgm = _pgm(cfg)
    start = time.perf_counter()
    par, trainer = _build(cfg, pgm)
    result = trainer.train()
    out = {
        "losses": result.losses,
        "grad_norms": result.grad_norms,
        "state": par.full_state_dict(),
        "seconds": time.perf_counter() - start
    }
    destroy_pg_manager()
    return out


def _checkpoint_runs(path: str) -> dict:
    """Save after 3 steps at tp2 x pp2 x dp2 (consolidated), resume at dp 8 and at ZeRO-3
    tp2 x dp4; each returns the losses of steps 3 and 4."""
    out = {}
    cfg = layout_config("tp2_pp2_dp2")
    pgm = _pgm(cfg)
    par, trainer = _build(cfg, pgm)
    for _ in range(SAVE_AT):
        trainer.train_step()
    save_consolidated(path, trainer, par)
    destroy_pg_manager()
    state = load_consolidated(path)
    for name, parallel in (("dp8", _layout()), ("zero3_tp2_dp4", _layout(tp=2, zero_stage=3))):
        cfg = make_config(False, 1, **parallel)
        pgm = _pgm(cfg)
        par, trainer = _build(cfg, pgm, state["model"])
        resume_consolidated(trainer, par, state)
        out[name] = trainer.train().losses
        destroy_pg_manager()
    return out


def _invalid_combinations() -> dict:
    out = {}
    cfg = make_config(True, 1, **_layout(tp=2, zero_stage=1))  # ZeRO x MoE
    pgm = _pgm(cfg)
    out["zero_moe"] = value_error(
        lambda: parallelize(build_model(cfg.model, 0), cfg, pgm, torch.device("cpu")))
    cfg = make_config(False, 1, **_layout(tp=2, zero_stage=1, impl="torch"))
    out["zero_impl_torch"] = value_error(
        lambda: parallelize(build_model(cfg.model, 0), cfg, pgm, torch.device("cpu")))
    cfg = make_config(True, 1, **_layout(tp=2, sequence_parallel=True))  # SP x MoE
    out["sp_moe"] = value_error(
        lambda: parallelize(build_model(cfg.model, 0), cfg, pgm, torch.device("cpu")))
    cfg = make_config(False, 1, **_layout(tp=2, impl="torch"))  # DTensor tp 2 in a world of 8
    out["dtensor_tp2_dp4"] = value_error(
        lambda: parallelize(build_model(cfg.model, 0), cfg, pgm, torch.device("cpu")))
    destroy_pg_manager()
    cfg = make_config(False, 2, **_layout(pp=2, cp=2, impl="torch"))  # torch pipelining x cp
    pgm = _pgm(cfg)
    out["torch_pp_cp"] = value_error(
        lambda: parallelize(build_model(cfg.model, 0), cfg, pgm, torch.device("cpu")))
    destroy_pg_manager()
    cfg = make_config(False, 1, **_layout(pp=2, cp=2, schedule="1f1b"))  # 1F1B with m < p
    pgm = _pgm(cfg)
    out["1f1b_m1"] = value_error(
        lambda: parallelize(build_model(cfg.model, 0), cfg, pgm, torch.device("cpu")))
    destroy_pg_manager()
    cfg = make_config(False, 1, **_layout(cp=4))  # seq 16 into 2 x 4 chunks: fine; s/cp % tp
    cfg.data.seq_len = 12
    pgm = _pgm(cfg)
    out["cp_seq"] = value_error(
        lambda: parallelize(build_model(cfg.model, 0), cfg, pgm, torch.device("cpu")))
    destroy_pg_manager()
    return out


def _world(rank: int, world: int, path: str) -> dict:
    out = {name: _train_layout(name) for name in LAYOUTS}
    out["checkpoint"] = _checkpoint_runs(path)
    out["errors"] = _invalid_combinations()
    return out


class NDParallelMatchesSingleDevice(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.path = os.path.join(cls.tmp.name, "consolidated.pt")
        start = time.perf_counter()
        cls.results = run_distributed(_world, WORLD, cls.path, timeout=300)
        cls.world_seconds = time.perf_counter() - start
        # one single-device reference per (model, micro-batches): losses, grad norms, weights
        cls.references = {}
        for cfg in [layout_config(name) for name in LAYOUTS] + [make_config(False, 1)]:
            key = (cfg.model.num_experts, cfg.data.num_micro_batches)
            if key not in cls.references:
                cfg.parallel = Config().parallel
                model = build_model(cfg.model, seed=cfg.training.model_seed)
                result = Trainer(cfg, model, None, verbose=False).train()
                cls.references[key] = (result.losses, result.grad_norms, model.state_dict())

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def _reference(self, name: str):
        cfg = layout_config(name)
        return self.references[(cfg.model.num_experts, cfg.data.num_micro_batches)]

    def _assert_parity(self, name: str) -> None:
        losses, norms, state = self._reference(name)
        out = self.results[0][name]
        for rank, res in enumerate(self.results):  # every rank reports the same global loss
            self.assertEqual(len(res[name]["losses"]), 5)
            for a, b in zip(res[name]["losses"], losses):
                self.assertAlmostEqual(a, b, delta=TOL, msg=f"{name} rank {rank}")
            for a, b in zip(res[name]["grad_norms"], norms):
                self.assertAlmostEqual(a, b, delta=TOL * max(1.0, b), msg=f"{name} rank {rank}")
            if rank > 0:
                self.assertIsNone(res[name]["state"])
        self.assertLessEqual(max_weight_diff(out["state"], state), TOL, name)

    def test_tp2_pp2_dp2_matches_single_device(self):
        self._assert_parity("tp2_pp2_dp2")

    def test_tp2_cp2_dp2_matches_single_device(self):
        self._assert_parity("tp2_cp2_dp2")

    def test_pp2_cp2_tp2_matches_single_device(self):
        self._assert_parity("pp2_cp2_tp2")

    def test_zero3_dp4_tp2_matches_single_device(self):
        self._assert_parity("zero3_dp4_tp2")

    def test_zero3_per_pipeline_chunk_interleaved_pp2_dp4_matches_single_device(self):
        self._assert_parity("zero3_pp2_interleaved_dp4")

    def test_moe_ep2_folded_into_dp4_tp2_matches_single_device(self):
        self._assert_parity("moe_ep2_dp4_tp2")

    def test_moe_pp2_dp4_ep2_matches_single_device(self):
        self._assert_parity("moe_pp2_dp4_ep2")

    def test_activation_checkpointing_keeps_parity_with_sp_pp_tp_and_zero2_cp(self):
        self._assert_parity("ckpt_tp2_sp_pp2_dp2")
        self._assert_parity("ckpt_zero2_cp2_dp4")

    def test_clipping_is_active_so_the_grad_norm_comparison_means_something(self):
        _, norms, _ = self._reference("tp2_pp2_dp2")
        self.assertGreater(max(norms), make_config().training.grad_clip)

    def test_consolidated_checkpoint_resumes_at_other_layouts_with_the_same_losses(self):
        losses, _, _ = self._reference("tp2_pp2_dp2")
        ref1 = self.references[(0, 1)]  # the resumed runs use 1 micro-batch
        for name, resumed in self.results[0]["checkpoint"].items():
            self.assertEqual(len(resumed), 5 - SAVE_AT, name)
            for a, b in zip(resumed, ref1[0][SAVE_AT:]):
                self.assertAlmostEqual(a, b, delta=TOL, msg=name)
        # and on one device, no process group at all
        state = load_consolidated(self.path)
        self.assertEqual(state["step"], SAVE_AT)
        cfg = make_config(False, 1)
        pgm = init_pg_manager()
        try:
            par, trainer = _build(cfg, pgm, state["model"])
            resume_consolidated(trainer, par, state)
            result = trainer.train()
        finally:
            destroy_pg_manager()
        self.assertEqual(result.start_step, SAVE_AT)
        for a, b in zip(result.losses, ref1[0][SAVE_AT:]):
            self.assertAlmostEqual(a, b, delta=TOL)

    def test_invalid_combinations_raise_value_errors_naming_the_numbers(self):
        errors = self.results[0]["errors"]
        self.assertRegex(errors["zero_moe"], r"zero_stage \(1\).*num_experts = 4")
        self.assertRegex(errors["zero_impl_torch"], r"'torch'.*zero_stage 1")
        self.assertRegex(errors["sp_moe"], r"sequence parallel.*num_experts = 4")
        self.assertRegex(errors["dtensor_tp2_dp4"], r"world size 8 != .*\(2\)")
        self.assertRegex(errors["torch_pp_cp"], r"pipelining.*pp 2.*cp 2")
        self.assertRegex(errors["1f1b_m1"], r"num_micro_batches \(1\).*\(2\)")
        self.assertRegex(errors["cp_seq"], r"sequence length 12.*8")
        with self.assertRaisesRegex(ValueError, r"world size 8 .* \(3\)"):
            RankGrid(8, tensor_model_parallel_size=3)
        with self.assertRaisesRegex(ValueError, r"\(3\) does not divide .* = 4"):
            RankGrid(8, tensor_model_parallel_size=2, expert_model_parallel_size=3)


class ActivationCheckpointing(unittest.TestCase):

    def test_checkpointing_saves_activation_memory_with_identical_gradients(self):
        cfg = make_config()
        x, y = torch.randint(0, 64, (4, 16)), torch.randint(0, 64, (4, 16))
        saved, grads = [], []
        for ckpt in (False, True):
            model = build_model(cfg.model, seed=0)
            if ckpt:
                apply_activation_checkpointing(model)
            nbytes, loss = saved_activation_bytes(model, lambda: loss_fn(model(x), y))
            loss.backward()
            saved.append(nbytes)
            grads.append([p.grad for p in model.parameters()])
            self.assertEqual(list(model.state_dict()), list(build_model(cfg.model, 0).state_dict()))
        # per block only its input (b s h) and RoPE's cos/sin stay; without: every intermediate
        self.assertLess(saved[1] * 4, saved[0])
        for a, b in zip(*grads):
            self.assertTrue(torch.equal(a, b))


if __name__ == "__main__":
    unittest.main()
