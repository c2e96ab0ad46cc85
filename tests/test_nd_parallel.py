"""N-D parallel on 8 gloo ranks equals the single device: losses, grad norms and final weights
of every layout of the matrix over 3 steps, a consolidated checkpoint resumed at other layouts,
activation checkpointing, and the combinations that must raise ValueError (in this process:
``parallelize`` refuses them before it reads a process group).

One world of 8 ranks for the whole file; each layout rebuilds the pg_manager inside it. The
references run in this (parent) process, which has no process group. The world runs once per
process (``nd_world``): tests/test_resume.py resumes the per-rank checkpoints its layouts write
(every layout trained once, not once per test file).
"""

import os
import tempfile
import unittest

import torch

from scaletorch.dist import RankGrid, destroy_pg_manager, init_pg_manager
from scaletorch.models import build_model, loss_fn
from scaletorch.parallel.activation_checkpointing import (apply_activation_checkpointing,
                                                          saved_activation_bytes)
from scaletorch.trainer.consolidated import load_consolidated, resume_consolidated
from scaletorch.trainer.parity import max_weight_diff
from tests.harness import bit_exact, run_distributed
from tests.layouts import (ND_LAYOUTS, TOL, assert_parity, build, layout, layout_refusal,
                           make_config, reference_key, references, resume_at, train)

# The layouts whose per-rank state another layout of the matrix holds alike: test_resume does
# not resume them (why: there), so they write no per-rank checkpoint here.
SAME_STATE_AS_ANOTHER = ("dualpipev_tp2_pp2_dp2", "zb_h1_tp2_pp2_dp2", "tp2_cp2_dp2",
                         "ckpt_tp2_sp_pp2_dp2", "pp2_cp2_tp2", "moe_pp2_dp4_ep2")

WORLD = 8
# 3 steps, not tests/layouts.py's 5: the parity of a deterministic diff shows in every step, and
# test_resume resumes each layout's checkpoint of step 2 for the last step (past make_config's 2
# warm-up steps; its update uses AdamW's moments and step count, the scheduler's position)
ND_STEPS = 3
# the consolidated checkpoint: after 2 of the 3 steps, resumed for the last (its update uses the
# saved AdamW moments and step count: the final weights show them)
SAVE_AT = 2


def nd_config(moe: bool = False, micro_batches: int = 2, **parallel):
    """tests/layouts.py's ``make_config`` over ND_STEPS steps."""
    cfg = make_config(moe, micro_batches, **parallel)
    cfg.training.steps = ND_STEPS
    return cfg


def nd_config_of(layouts: dict, name: str):
    """``layouts[name]`` = (moe, micro-batches, parallel config) as an ``nd_config``."""
    moe, m, parallel = layouts[name]
    return nd_config(moe, m, **parallel)


LAYOUTS = ND_LAYOUTS  # the parity matrix (tests/layouts.py)

# Tied embeddings (model.tie_word_embeddings): tp x pp x dp, and ZeRO-3 beside tp and pp. The
# vocabulary-parallel embedding and head split the rows alike, so the tie holds per tp rank;
# the pipeline's first and last stage each hold a copy, summed over the embedding group.
TIED_LAYOUTS = {
    "tied_tp2_pp2_dp2": (False, 2, layout(tp=2, pp=2)),
    "tied_zero3_tp2_pp2_dp2": (False, 2, layout(tp=2, pp=2, zero_stage=3)),
}

TIED_RESUMED = ("tied_zero3_tp2_pp2_dp2", )  # writes per-rank checkpoints: test_resume's


def tied_config(name: str, layouts: dict = TIED_LAYOUTS):
    cfg = nd_config_of(layouts, name)
    cfg.model.tie_word_embeddings = True
    return cfg


def _checkpoint_runs(path: str) -> dict:
    """Resume the consolidated checkpoint of tp2 x pp2 x dp2's step SAVE_AT (its parity run wrote
    it) at dp 8 and at ZeRO-3 tp2 x dp4; each returns the losses of the steps after it and the
    final weights."""
    resumes = {
        "dp8": nd_config(False, 1, **layout()),
        "zero3_tp2_dp4": nd_config(False, 1, **layout(tp=2, zero_stage=3)),
    }
    return resume_at(path, resumes)


def _invalid_combinations() -> dict:
    cp_seq = nd_config(False, 1, **layout(cp=4))  # s/cp = 3 tokens: not 2 zigzag slices
    cp_seq.data.seq_len = 12
    configs = {
        "zero_moe": nd_config(True, 1, **layout(tp=2, zero_stage=1)),
        "zero_impl_torch": nd_config(False, 1, **layout(tp=2, zero_stage=1, impl="torch")),
        "sp_moe": nd_config(True, 1, **layout(tp=2, sequence_parallel=True)),
        "torch_pp_cp": nd_config(False, 2, **layout(pp=2, cp=2, impl="torch")),
        "1f1b_m1": nd_config(False, 1, **layout(pp=2, cp=2, schedule="1f1b")),  # m < p
        "cp_seq": cp_seq,
    }
    return {name: layout_refusal(cfg, WORLD) for name, cfg in configs.items()}


def _world(rank: int, world: int, path: str, checkpoints: str) -> dict:
    # tp2 x pp2 x dp2 and its tied twin also write a consolidated checkpoint of step SAVE_AT
    saves = {"tp2_pp2_dp2": (SAVE_AT, path), "tied_tp2_pp2_dp2": (SAVE_AT, path + ".tied")}
    out = {}
    for name in LAYOUTS:
        per_rank = None if name in SAME_STATE_AS_ANOTHER else os.path.join(checkpoints, name)
        out[name] = train(nd_config_of(LAYOUTS, name), per_rank, saves.get(name))
    out["checkpoint"] = _checkpoint_runs(path)
    # test_resume resumes the tied ZeRO-3 run's per-rank checkpoints (the tie under pp x ZeRO-3)
    out.update({
        name:
        train(tied_config(name),
              os.path.join(checkpoints, name) if name in TIED_RESUMED else None, saves.get(name))
        for name in TIED_LAYOUTS
    })
    # consolidated (the tied weight once) at tp2 x pp2 x dp2, resumed at ZeRO-3 tp2 x dp4
    resume = {"tied_zero3_tp2_dp4": (False, 2, layout(tp=2, zero_stage=3))}
    out["tied_checkpoint"] = resume_at(path + ".tied",
                                       {"zero3": tied_config("tied_zero3_tp2_dp4", resume)})
    return out


_TMP = tempfile.TemporaryDirectory()  # removed when the process exits
_WORLD: list = []


def nd_world() -> tuple:
    """The 8-rank world's per-rank results, the consolidated checkpoint's path and the root of
    the layouts' per-rank checkpoints (a directory per layout); run once per process."""
    path = os.path.join(_TMP.name, "consolidated.pt")
    checkpoints = os.path.join(_TMP.name, "per_rank")
    if not _WORLD:
        _WORLD.append(run_distributed(_world, WORLD, path, checkpoints, timeout=300))
    return _WORLD[0], path, checkpoints


class NDParallelMatchesSingleDevice(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.results, cls.path, _ = nd_world()
        # one single-device reference per (model, micro-batches): losses, grad norms, weights
        cls.references = references([nd_config_of(LAYOUTS, name)
                                     for name in LAYOUTS] + [nd_config(False, 1)])
        cls.tied_reference = references([tied_config("tied_tp2_pp2_dp2")])

    def _reference(self, name: str):
        return self.references[reference_key(nd_config_of(LAYOUTS, name))]

    def _assert_parity(self, name: str) -> None:
        assert_parity(self, self.results, name, self._reference(name))

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

    def test_zero_bubble_schedules_zb_h1_zbv_dualpipev_at_tp2_pp2_dp2_match_single_device(self):
        for name in ("zb_h1_tp2_pp2_dp2", "zbv_tp2_pp2_dp2", "dualpipev_tp2_pp2_dp2"):
            with self.subTest(layout=name):
                self._assert_parity(name)

    def test_tied_embeddings_at_tp2_pp2_dp2_and_with_zero3_match_single_device(self):
        reference, = self.tied_reference.values()  # the tied model, 2 micro-batches
        for name in TIED_LAYOUTS:
            with self.subTest(layout=name):
                assert_parity(self, self.results, name, reference)
                state = self.results[0][name]["state"]  # one tensor under both names
                self.assertIs(state["lm_head.weight"], state["embed_tokens.weight"])
        resumed = self.results[0]["tied_checkpoint"]["zero3"]
        for a, b in zip(resumed["losses"], reference[0][SAVE_AT:]):
            self.assertAlmostEqual(a, b, delta=TOL)
        self.assertEqual(len(resumed["losses"]), ND_STEPS - SAVE_AT)
        self.assertLessEqual(max_weight_diff(resumed["state"], reference[2]), TOL)

    def test_clipping_is_active_so_the_grad_norm_comparison_means_something(self):
        _, norms, _ = self._reference("tp2_pp2_dp2")
        self.assertGreater(max(norms), nd_config().training.grad_clip)

    def test_consolidated_checkpoint_resumes_at_other_layouts_with_the_same_losses(self):
        losses, _, _ = self._reference("tp2_pp2_dp2")
        ref1 = self.references[reference_key(nd_config(False, 1))]  # resumed: 1 micro-batch
        for name, resumed in self.results[0]["checkpoint"].items():
            self.assertEqual(len(resumed["losses"]), ND_STEPS - SAVE_AT, name)
            for a, b in zip(resumed["losses"], ref1[0][SAVE_AT:]):
                self.assertAlmostEqual(a, b, delta=TOL, msg=name)
            self.assertLessEqual(max_weight_diff(resumed["state"], ref1[2]), TOL, name)
        # and on one device, no process group at all
        state = load_consolidated(self.path)
        self.assertEqual(state["step"], SAVE_AT)
        # resume warns when the schedule differs
        self.assertEqual(state["schedule"]["steps"], ND_STEPS)
        cfg = nd_config(False, 1)
        pgm = init_pg_manager()
        try:
            par, trainer = build(cfg, pgm, state["model"])
            resume_consolidated(trainer, par, state)
            result = trainer.train()
        finally:
            destroy_pg_manager()
        self.assertEqual(result.start_step, SAVE_AT)
        for a, b in zip(result.losses, ref1[0][SAVE_AT:]):
            self.assertAlmostEqual(a, b, delta=TOL)


class InvalidCombinations(unittest.TestCase):
    """No world: ``parallelize`` refuses them before it reads a process group (tests/layouts.py's
    ``layout_refusal``)."""

    def test_invalid_combinations_raise_value_errors_naming_the_numbers(self):
        errors = _invalid_combinations()
        self.assertRegex(errors["zero_moe"], r"zero_stage \(1\).*num_experts = 4")
        self.assertRegex(errors["zero_impl_torch"], r"'torch'.*zero_stage 1")
        self.assertRegex(errors["sp_moe"], r"sequence parallel.*num_experts = 4")
        self.assertRegex(errors["torch_pp_cp"], r"'torch' with context_parallel_size 2.*pp 2")
        self.assertRegex(errors["1f1b_m1"], r"num_micro_batches \(1\).*\(2\)")
        self.assertRegex(errors["cp_seq"], r"sequence length 12.*8")
        with self.assertRaisesRegex(ValueError, r"world size 8 .* \(3\)"):
            RankGrid(8, tensor_model_parallel_size=3)
        with self.assertRaisesRegex(ValueError, r"\(3\) does not divide .* = 4"):
            RankGrid(8, tensor_model_parallel_size=2, expert_model_parallel_size=3)


class ActivationCheckpointing(unittest.TestCase):

    @bit_exact  # recomputation runs the same forward ops again, then the same backward
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
