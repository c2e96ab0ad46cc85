"""The layouts of chapters 01-06 through ``parallelize`` (the one code path the numbered scripts
use) on 2 gloo ranks equal the single device: losses, grad norms and full weights over 2 steps,
for ours and for PyTorch's native versions (``parallel.impl = torch``: DistributedDataParallel,
FSDP2, DTensor tensor parallel, torch.distributed.pipelining). Consolidated checkpoints written
at FSDP2 and DTensor layouts resume at other layouts, and the impl combinations that cannot run
raise ValueError.
"""

import os
import tempfile
import unittest
from typing import Optional, Tuple

from scaletorch.dist import destroy_pg_manager
from scaletorch.trainer.param_map import DTensorParamMap, ParamMap
from scaletorch.trainer.parity import max_weight_diff
from tests.harness import run_distributed
from tests.layouts import (TOL, assert_parity, build, config_of, layout, layout_refusal,
                           make_config, pg_manager_for, reference_key, references, resume_at, train)

WORLD = 2
# 2 steps: one warm-up step, then one past it on the AdamW state the first left, with clipping
# active. In fp32 a layout's difference from the single device is the order of its sums; a
# wrong shard, a missed reduction or a stage's wrong layers shows from step 0 on, so more steps
# add nothing (3 steps with 2 warm-up ones cost each of the 13 layouts a third more).
STEPS = 2
WARMUP = 1
SAVE_AT = 1  # resumed for the step after the warm-up, from the AdamW state of step 0

# name -> (moe, micro-batches, parallel config); the chapter each layout belongs to first
CHAPTERS = {
    "01_bucketed_dp2": (False, 2, layout()),
    "01_naive_dp2": (False, 2, layout(impl="naive")),
    "01_torch_ddp_dp2": (False, 2, layout(impl="torch")),
    "02_zero2_dp2": (False, 2, layout(zero_stage=2)),
    "02_fsdp2_dp2_checkpointed":
    (False, 2, layout(zero_stage=3, impl="torch", activation_checkpointing=True)),
    "03_tp2_sp": (False, 2, layout(tp=2, sequence_parallel=True)),
    "03_dtensor_tp2": (False, 2, layout(tp=2, impl="torch")),
    "03_dtensor_tp2_sp": (False, 2, layout(tp=2, impl="torch", sequence_parallel=True)),
    "04_pp2_1f1b": (False, 2, layout(pp=2)),
    "04_pp2_uneven_layer_split": (False, 2, layout(pp=2, layer_split=[1, 3])),
    "04_torch_pipelining_pp2": (False, 2, layout(pp=2, impl="torch")),
    "05_cp2_ulysses_torch_ddp": (False, 2, layout(cp=2, cp_variant="ulysses", impl="torch")),
    "06_moe_ep2": (True, 1, layout(ep=2)),
}


def chapter_config(name: str, layouts: dict = CHAPTERS):
    """``layouts[name]``'s config, STEPS steps, WARMUP of them warm-up."""
    cfg = config_of(layouts, name)
    cfg.training.steps, cfg.training.warmup_steps = STEPS, WARMUP
    return cfg


# the saved layout -> {resumed name: its parallel config}
RESUMES = {
    "02_fsdp2_dp2_checkpointed": {
        "dtensor_tp2": layout(tp=2, impl="torch"),
        "tp2": layout(tp=2)
    },
    "03_dtensor_tp2": {
        "fsdp2_dp2": layout(zero_stage=3, impl="torch"),
        "zero1_dp2": layout(zero_stage=1)
    },
}


def _saved(tmp: str, name: str) -> Optional[Tuple[int, str]]:
    """Where the parity run of ``name`` writes its consolidated step SAVE_AT (None: not saved)."""
    return (SAVE_AT, os.path.join(tmp, f"{name}.pt")) if name in RESUMES else None


def _resume(tmp: str) -> dict:
    """Resume FSDP2 dp2's step 1 at DTensor tp2 and ours tp2, DTensor tp2's at FSDP2 dp2 and
    ours ZeRO-1 dp2 (their parity runs wrote the consolidated files, as ``save_and_resume``
    would after training the step again). Each returns step 1's loss and its final weights
    (which step 1's use of the saved AdamW state moved)."""
    out = {}
    for saved, resumes in RESUMES.items():
        configs = {
            name: chapter_config(name, {name: (False, 2, parallel)})
            for name, parallel in resumes.items()
        }
        for name, resumed in resume_at(_saved(tmp, saved)[1], configs).items():
            out[f"{saved} -> {name}"] = resumed
    return out


def _invalid_impls() -> dict:
    configs = {
        "naive_zero": make_config(False, 1, **layout(zero_stage=1, impl="naive")),
        "torch_moe": make_config(True, 1, **layout(ep=2, impl="torch")),
        "torch_zero1": make_config(False, 1, **layout(zero_stage=1, impl="torch")),
    }
    return {name: layout_refusal(cfg, WORLD) for name, cfg in configs.items()}


def _stage_layers(cfg) -> list:
    """Layers per pipeline stage of ``cfg``'s parallelized model (from the pipeline's owners)."""
    pgm = pg_manager_for(cfg)
    par, _ = build(cfg, pgm)
    stage_of = {
        int(k.split(".")[1]): s
        for k, s in par.model.owner.items() if k.startswith("layers.")
    }
    destroy_pg_manager()
    return [list(stage_of.values()).count(s) for s in range(par.model.num_stages)]


def _world(rank: int, world: int, tmp: str) -> dict:
    out = {
        name: train(chapter_config(name), consolidated_at=_saved(tmp, name))
        for name in CHAPTERS
    }
    out["uneven_stage_layers"] = _stage_layers(chapter_config("04_pp2_uneven_layer_split"))
    out["resumed"] = _resume(tmp)
    return out


class ChaptersThroughParallelizeMatchSingleDevice(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.results = run_distributed(_world, WORLD, cls.tmp.name, timeout=300)
        cls.references = references(chapter_config(name) for name in CHAPTERS)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def _assert_parity(self, name: str) -> None:
        reference = self.references[reference_key(chapter_config(name))]
        assert_parity(self, self.results, name, reference)

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

    def test_chapter_04_uneven_layer_split_from_the_config_matches_single_device(self):
        # parallel.layer_split [1, 3]: stage 0 holds the embedding and layer 0, stage 1 the rest
        self.assertEqual(self.results[0]["uneven_stage_layers"], [1, 3])
        self._assert_parity("04_pp2_uneven_layer_split")

    def test_chapter_05_ulysses_under_torch_ddp(self):
        self._assert_parity("05_cp2_ulysses_torch_ddp")

    def test_chapter_06_experts(self):
        self._assert_parity("06_moe_ep2")

    def test_native_layouts_are_described_by_dtensor_layouts_and_ours_by_layouts(self):
        for name, (_, _, parallel) in CHAPTERS.items():
            native = parallel.get("impl") == "torch"
            expected = DTensorParamMap if native else ParamMap
            self.assertEqual(self.results[0][name]["param_map"], expected.__name__, name)

    def test_consolidated_checkpoints_of_native_layouts_resume_anywhere(self):
        losses, _, weights = self.references[reference_key(chapter_config("01_bucketed_dp2"))]
        resumed = self.results[0]["resumed"]
        self.assertEqual(len(resumed), 4)
        for name, run in resumed.items():
            self.assertEqual(len(run["losses"]), STEPS - SAVE_AT, name)
            for a, b in zip(run["losses"], losses[SAVE_AT:]):
                self.assertAlmostEqual(a, b, delta=TOL, msg=name)
            # the weights after the resumed step: the saved AdamW state in use
            self.assertLessEqual(max_weight_diff(run["state"], weights), TOL, name)


class RefusedImplCombinations(unittest.TestCase):
    """No world: ``parallelize`` refuses them before it reads a process group."""

    def test_impl_combinations_that_cannot_run_raise_value_errors(self):
        errors = _invalid_impls()  # tests/layouts.py's layout_refusal
        self.assertRegex(errors["naive_zero"], r"'naive'.*zero_stage 1")
        self.assertRegex(errors["torch_moe"], r"'torch'.*num_experts 4")
        self.assertRegex(errors["torch_zero1"], r"FSDP2.*ZeRO-3; got zero_stage 1")


if __name__ == "__main__":
    unittest.main()
