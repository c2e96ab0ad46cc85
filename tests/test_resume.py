"""A per-rank checkpoint of any layout resumes bit-exactly; another layout is refused.

Per-rank checkpoints hold each rank's shards: the pipeline's chunks and whatever wraps them
(DDP, ZeRO-1/2/3, expert parallel), the optimizer's shards, the schedule and the RNG. Resumed
at the same layout, the run must continue exactly as if it had never stopped: final weights
and AdamW state bit-identical to the uninterrupted run, and the same losses.

``InWorldResume``: every layout of chapter 07's parity matrix whose state no other layout
holds alike (see SAME_STATE_AS_ANOTHER), its tied ZeRO-3 run, and the pipeline combinations
the matrix lacks (pp x ZeRO-1, PyTorch's FSDP2 under its pipelining), each trained straight,
then rebuilt from scratch (a new model, a new ``parallelize``: what a restarted process does)
and resumed from a middle checkpoint. One world of 8 ranks. The matrix's straight runs are
test_nd_parallel's parity runs (3 steps, a per-rank checkpoint of step 2: ``nd_world``), so
this file only resumes them.

``KilledRankResumes``: the real thing under ``torchrun --max-restarts 1``: a rank of chapter
07 is killed mid-run and every rank restarts from the latest committed checkpoint (07's format:
DCP, compared through the last step's checkpoint converted to one consolidated file). Run here
for a two-stage pipeline, its saves async: the same launch is test_dcp_async's kill during an
async write and test_fault_tolerance's kill and restart. SCALETORCH_FULL_RESUME=1 runs every
layout (blocking saves).
"""

import contextlib
import io
import os
import tempfile
import unittest

from scaletorch.dist import destroy_pg_manager
from scaletorch.trainer import checkpoint as ckpt
from scaletorch.trainer import load_config
from scaletorch.trainer.dcp_checkpoint import to_consolidated
from tests.harness import (NCCL_CHECKS, bit_exact, run_distributed, run_forked, under_torchrun,
                           value_error, warning_lines)
from tests.layouts import (CHECKPOINT_EVERY, ND_LAYOUTS, config_of, differences, layout,
                           pg_manager_for)
from tests.layouts import resumed as _run
from tests.layouts import train
from tests.test_examples import NO_PREFLIGHT, ROOT, launch
from tests.test_nd_parallel import (SAME_STATE_AS_ANOTHER, TIED_LAYOUTS, TIED_RESUMED, nd_config_of,
                                    nd_world, tied_config)

WORLD = 8
# One step after the resume: its update uses every part of the saved state (AdamW's moments and
# step count, the scheduler, the data position, the weights), and the final weights and moments
# are compared bit for bit; a step more repeats what the first one read. The matrix's resumed
# step is past the 2 warm-up steps (the scheduler's decay); these layouts' scheduler is the
# same Trainer's.
STEPS, SAVE_AT = 2, 1
ND_SAVE_AT = CHECKPOINT_EVERY  # the matrix: 3 steps (test_nd_parallel), resumed from step 2

# The pipeline combinations whose per-rank checkpoints once lost or could not load state, and
# PyTorch's own (DTensor parameters: the files hold local pieces, placed on the new mesh), that
# the matrix does not hold. What another layout covers is not repeated: ZeRO-2 saves what
# ZeRO-1 saves (flat shards and their moments; gradients are not saved), so zero1_pp2_dp4 and
# the matrix's ckpt_zero2_cp2_dp4 cover pp x ZeRO-2; the matrix's tp2_pp2_dp2 covers pp x our
# DDP; its zero3_pp2_interleaved_dp4 and zbv_tp2_pp2_dp2 cover interleaved pp (two chunks per
# rank); its tied_zero3_tp2_pp2_dp2 covers the tie under pp x ZeRO-3 (the last stage's copy in
# a ZeRO-3 unit of its own, and its AdamW state). torch_pp2_zero3_dp4 covers PyTorch's
# pipelining stages and DTensor pieces that differ from the whole tensor (FSDP2's Shard over
# dp 4, the weights' and the moments'). A file holds each DTensor's to_local() piece and
# from_local() places it again with the parameter's own mesh and placements
# (checkpoint.py), whatever their number: DTensor tensor parallel beside it on a 2-D tp x dp
# mesh (torch tp2 x pp2 x ZeRO-3 dp2, 3 steps) ran the same lines for 19 s of CPU, not 9, its
# time in DTensor's per-operator sharding rules; FSDP2's replicate under pp holds whole
# Replicate DTensors, the same path with the piece equal to the whole.
PIPELINE_LAYOUTS = {
    "zero1_pp2_dp4": (False, 2, layout(pp=2, zero_stage=1)),
    "torch_pp2_zero3_dp4": (False, 2, layout(pp=2, zero_stage=3, impl="torch")),
}
# PyTorch's pipelining with FSDP2 (DTensor pieces on 8 ranks) resumes in CI's long phase
# (SCALETORCH_LONG_TESTS=1, .ci/run), as the suite keeps to its 10 minutes: its DTensor pieces
# are read by DCP in the suite (test_dcp's A_torch_fsdp2_dp4)
if os.environ.get("SCALETORCH_LONG_TESTS") != "1":
    PIPELINE_LAYOUTS.pop("torch_pp2_zero3_dp4")
# One layer per stage: every stage's state (chunks, wrappers, shards, moments) is there at any
# depth; the matrix's runs keep tests/layouts.py's four layers.
PIPELINE_NUM_LAYERS = 2


def _pipeline_config(layouts: dict, name: str):
    cfg = config_of(layouts, name)
    cfg.model.num_layers = PIPELINE_NUM_LAYERS
    return cfg


# Chapter 07's matrix, less the layouts whose state another's is (test_nd_parallel's
# SAME_STATE_AS_ANOTHER): dualpipev's is zbv's (two chunks per rank, the V), zb-h1's is
# tp2_pp2_dp2's (one chunk per rank; its split backward holds nothing between steps), and so
# are ckpt_tp2_sp_pp2_dp2's (sequence parallel and recomputation hold no state; the wrapped
# blocks' names are resumed in ckpt_zero2_cp2_dp4) and pp2_cp2_tp2's (cp holds no state: tp
# shards in stages under our DDP over dp x cp, as tp2_pp2_dp2's; cp resumed in
# ckpt_zero2_cp2_dp4); tp2_cp2_dp2's is moe_ep2_dp4_tp2's dense part (our DDP over dp x cp
# around tp shards). moe_pp2_dp4_ep2's is moe_ep2_dp4_tp2's expert shards and router (ep folded
# into dp) in stages, which tp2_pp2_dp2 resumes. KilledRankResumes resumes dualpipev under
# torchrun with SCALETORCH_FULL_RESUME=1. Plus the matrix's tied ZeRO-3 run (TIED_RESUMED).
ND_RESUMED = {
    **{
        k: v
        for k, v in ND_LAYOUTS.items() if k not in SAME_STATE_AS_ANOTHER
    },
    **{
        k: TIED_LAYOUTS[k]
        for k in TIED_RESUMED
    }
}
LAYOUTS = {**ND_RESUMED, **PIPELINE_LAYOUTS}

_differences = differences  # the name test_dcp and test_dcp_async import


def _resume_every_layout(rank: int, root: str) -> dict:
    out = {}
    for name in PIPELINE_LAYOUTS:
        cfg = _pipeline_config(LAYOUTS, name)
        cfg.training.steps = STEPS
        # One pg_manager for both runs: the process groups and the mesh hold no training state
        # (the files hold it all), and on the same DeviceMesh PyTorch's DTensor reuses the
        # sharding rules it worked out for the straight run (torch tp2 x pp2 x ZeRO-3 dp2's
        # resume: 9 s of CPU with a mesh of its own, 4 s on this one).
        pgm = pg_manager_for(cfg)
        straight = train(cfg, os.path.join(root, name), checkpoint_at=SAVE_AT, pgm=pgm)
        # a restarted process: a new model and strategy, then the checkpoint of SAVE_AT
        resumed, got = _run(cfg, resume=ckpt.step_dir(cfg.checkpoint.dir, SAVE_AT), pgm=pgm)
        destroy_pg_manager()
        out[name] = {
            "losses": (straight["losses"][SAVE_AT:], resumed.losses),
            "start": resumed.start_step,
            "save_at": SAVE_AT,
            "differ": None if rank else _differences(straight["consolidated"], got),
        }
    # The same files at another layout: refused, pointing to the consolidated file.
    other = _pipeline_config({"ddp_pp2_dp4": (False, 2, layout(pp=2))}, "ddp_pp2_dp4")  # no ZeRO-1
    other.checkpoint.dir = os.path.join(root, "zero1_pp2_dp4")

    def resume_elsewhere() -> None:
        try:
            _run(other, resume=ckpt.step_dir(other.checkpoint.dir, SAVE_AT))
        finally:
            destroy_pg_manager()

    out["other_layout"] = value_error(resume_elsewhere)
    return out


def _resume_the_matrix(rank: int, root: str, straight: list) -> dict:
    """Resume each layout of ND_RESUMED from step 2 of its straight run in test_nd_parallel
    (``straight``: every rank's results there; the checkpoints under ``root``)."""
    out = {}
    for name in ND_RESUMED:
        # its steps (ND_STEPS: 1 after the checkpoint)
        cfg = tied_config(name) if name in TIED_RESUMED else nd_config_of(LAYOUTS, name)
        cfg.checkpoint.every, cfg.checkpoint.dir = CHECKPOINT_EVERY, os.path.join(root, name)
        # a restarted process: a new model and strategy, then the checkpoint of step 2
        resumed, got = _run(cfg, resume=ckpt.step_dir(cfg.checkpoint.dir, ND_SAVE_AT))
        want = straight[rank][name]
        out[name] = {
            "losses": (want["losses"][ND_SAVE_AT:], resumed.losses),
            "start": resumed.start_step,
            "save_at": ND_SAVE_AT,
            "differ": None if rank else _differences(want["consolidated"], got),
        }
    return out


def _resume_all(rank: int, world: int, matrix_root: str, root: str, straight: list) -> dict:
    """One world for both: the matrix's checkpoints, then the pipeline layouts' own runs."""
    return {**_resume_the_matrix(rank, matrix_root, straight), **_resume_every_layout(rank, root)}


class InWorldResume(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        # One world of 8: the matrix's resumes, then the pipeline layouts' straight runs and
        # resumes. The matrix's straight runs (and their checkpoints) are test_nd_parallel's.
        results, _, root = nd_world()
        straight = [{
            name: {
                key: res[name].get(key)
                for key in ("losses", "consolidated")
            }
            for name in ND_RESUMED
        } for res in results]
        cls.results = run_distributed(_resume_all, WORLD, root, cls.tmp.name, straight, timeout=600)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    @bit_exact  # a resumed run is the uninterrupted run: the same code, the same steps
    def test_every_layout_resumes_bit_identical_weights_adam_state_and_losses(self):
        for name in LAYOUTS:
            for rank, res in enumerate(self.results):
                out = res[name]
                self.assertEqual(out["start"], out["save_at"], name)
                self.assertGreaterEqual(len(out["losses"][1]), 1, name)  # AdamW state in use
                straight, resumed = out["losses"]
                self.assertEqual(straight, resumed, f"{name} rank {rank}")  # exactly
            self.assertEqual(self.results[0][name]["differ"], [], name)

    def test_a_per_rank_checkpoint_at_another_layout_is_refused_naming_both(self):
        message = self.results[0]["other_layout"]
        self.assertRegex(message, r"zero_stage 1 there, 0 here")
        self.assertIn("consolidated", message)

    def test_a_script_refuses_it_once_before_any_process_group(self):
        directory = ckpt.step_dir(os.path.join(self.tmp.name, "zero1_pp2_dp4"), SAVE_AT)
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), self.assertRaises(SystemExit) as exit:
            load_config(
                "examples/configs/07_nd_parallel.yaml", "07",
                argv=["--validate-only", "--world-size", "8", "--pp", "2", "--resume", directory])
        self.assertEqual(exit.exception.code, 2)
        # the saved config is compared first (resume_check.py): the layout's fields are among
        # the changes a per-rank checkpoint cannot take
        self.assertRegex(stderr.getvalue(),
                         r"^error: --resume .* was written by another run: .*zero_stage 1 -> 0")
        self.assertEqual(len(stderr.getvalue().splitlines()), 1)


# Checkpoints at 2, 4, 6 and 8, rank 1 killed at step 7: resumed from step 6 (blocking saves)
# or, with async saves, from step 4 (step 6's write is committed only at step 8's save), two or
# four steps after it (AdamW's moments and step count in use).
RUN_STEPS, FAIL_AT = 8, 7
RUN_FLAGS = ["--steps", str(RUN_STEPS), "--checkpoint.every", "2", "--logging.log_every", "1"]
ASYNC = ["--checkpoint.async_save", "true"]


def _launch_run(tmp: str, name: str, nproc: int, args: list, fail: bool) -> tuple:
    """07 under torchrun, RUN_FLAGS (8 steps, checkpoints every 2); with ``fail`` rank 1 is
    killed at step FAIL_AT and torchrun restarts every rank once. Returns (output, the last
    step's sharded checkpoint as a consolidated state, converted offline)."""
    root = os.path.join(tmp, name)
    script, flags = "examples/07_nd_parallel.py", [*args, *RUN_FLAGS, "--checkpoint.dir", root]
    if not fail:  # on forked ranks (test_examples.launch)
        out = launch(script, nproc, *flags, env=NO_PREFLIGHT)
    else:
        # torchrun's restart is the claim: scripts/torchrun.py (as launch.sh runs it, which
        # passes --max-restarts on: tests/test_launch.py) forked from the forkserver, its
        # ranks new Pythons; the agent does not import torch again (about 3 s of a core)
        done = run_forked("scripts/torchrun.py", "--nproc-per-node", str(nproc), "--max-restarts",
                          "1", "--standalone", script, "--logging.run_dir", f"{root}_logs", *flags,
                          "--fail-at-step", str(FAIL_AT), "--fail-rank", "1", env={
                              **os.environ, "PYTHONPATH": ROOT,
                              **NCCL_CHECKS,
                              **NO_PREFLIGHT
                          }, timeout=300)
        out = done.stdout + done.stderr
        if done.returncode != 0 or warning_lines(out):
            raise AssertionError(f"torchrun {script} exited {done.returncode}:\n{out[-3000:]}")
    last = os.path.join(root, f"step_{RUN_STEPS}.pt")
    return out, to_consolidated(ckpt.step_dir(root, RUN_STEPS), last)


_STRAIGHT = tempfile.TemporaryDirectory()  # removed when the process exits
_STRAIGHT_RUNS: dict = {}


def straight_run(name: str) -> tuple:
    """The uninterrupted run of KILL_LAYOUTS[name], launched once per process (test_fault_
    tolerance's two-node test compares with ASYNC_KILLED's): (output, consolidated last step)."""
    if name not in _STRAIGHT_RUNS:
        nproc, args = KILL_LAYOUTS[name]
        _STRAIGHT_RUNS[name] = _launch_run(_STRAIGHT.name, name, nproc, args, fail=False)
    return _STRAIGHT_RUNS[name]


_KILLED_RUNS: dict = {}


def killed_run(name: str, async_save: bool) -> tuple:
    """KILL_LAYOUTS[name] under torchrun with rank 1 killed at FAIL_AT, its checkpoints async or
    not, launched once per process (test_dcp_async's claim, test_fault_tolerance's kill and
    KilledRankResumes' share the async run of ASYNC_KILLED: one torchrun launch): (output,
    consolidated last step)."""
    if (name, async_save) not in _KILLED_RUNS:
        nproc, args = KILL_LAYOUTS[name]
        _KILLED_RUNS[name,
                     async_save] = _launch_run(_STRAIGHT.name, f"{name}_killed_{async_save}", nproc,
                                               [*args, *(ASYNC if async_save else [])], fail=True)
    return _KILLED_RUNS[name, async_save]


def _last_logged_loss(output: str) -> str:
    return [line for line in output.splitlines()
            if line.startswith(f"step {RUN_STEPS:5d} |")][-1].split("|")[1]


# name -> (ranks, 07 flags). CI kills a rank of a two-stage pipeline on 2 ranks (each restart
# starts every rank's Python again: 2 ranks, not 4; test_fault_tolerance's two-node run
# reuses its straight run, one stage per node): InWorldResume resumes every layout in-process,
# test_dcp every sharded one (ZeRO-1's flat shards bit-identically); all of them here with
# SCALETORCH_FULL_RESUME=1 python run_tests.py -k KilledRankResumes
KILL_LAYOUTS = {
    "pp2": (2, ["--pp", "2"]),
}
FULL_KILL_LAYOUTS = {
    "zero1_pp2_dp2": (4, ["--pp", "2", "--zero-stage", "1"]),
    "moe_pp2_ep2":
    (4, ["--pp", "2", "--ep", "2", "--model.num_experts", "4", "--micro-batches", "2"]),
    "ddp_pp2_dp2": (4, ["--pp", "2"]),
    "zero2_pp2_dp2": (4, ["--pp", "2", "--zero-stage", "2"]),
    "zero3_pp2_dp2": (4, ["--pp", "2", "--zero-stage", "3"]),
    "interleaved_pp2_dp2": (4, ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2"]),
    "zbv_pp2_dp2": (4, ["--pp", "2", "--schedule", "zbv", "--virtual-stages", "2"]),
    "dualpipev_pp2_dp2": (4, ["--pp", "2", "--schedule", "dualpipev", "--virtual-stages", "2"]),
    "tp2_pp2_dp2": (8, ["--tp", "2", "--pp", "2"]),
    "tp2_cp2_dp2": (8, ["--tp", "2", "--cp", "2"]),
    "pp2_cp2_tp2": (8, ["--tp", "2", "--pp", "2", "--cp", "2"]),
    "zero3_dp4_tp2": (8, ["--tp", "2", "--zero-stage", "3"]),
    "zero3_pp2_interleaved_dp4":
    (8, ["--pp", "2", "--zero-stage", "3", "--schedule", "interleaved", "--virtual-stages", "2"]),
    "moe_ep2_dp4_tp2":
    (8, ["--tp", "2", "--ep", "2", "--model.num_experts", "4", "--micro-batches", "1"]),
    "sp_tp2_pp2_dp2": (8, ["--tp", "2", "--pp", "2", "--sequence-parallel"]),
}
ASYNC_KILLED = "pp2"  # killed with async saves (KilledRankResumes, test_dcp_async, ...)
if os.environ.get("SCALETORCH_FULL_RESUME") == "1":
    KILL_LAYOUTS.update(FULL_KILL_LAYOUTS)


class KilledRankResumes(unittest.TestCase):
    """torchrun restarts every rank after one is killed; the run ends where an uninterrupted
    one ends: consolidated weights and AdamW state bit-identical, the same last logged loss.

    CI's layout (pp2) saves async (test_dcp_async's kill, the same launch): the
    restart resumes from step 4, the latest committed checkpoint, neither step 6 (written, not
    committed) nor step 2. The others (SCALETORCH_FULL_RESUME=1) save blocking: from step 6."""

    @bit_exact
    @under_torchrun
    def test_kill_and_restart_is_bit_identical_to_the_uninterrupted_run(self):
        for name in KILL_LAYOUTS:
            with self.subTest(layout=name):
                async_save = name == ASYNC_KILLED
                out_a, want = straight_run(name)
                out_b, got = killed_run(name, async_save)
                self.assertIn(f"injected failure at step {FAIL_AT}", out_b)
                resumed_at = 4 if async_save else 6
                self.assertRegex(out_b,
                                 rf"resumed from \S+step_{resumed_at:07d} at step {resumed_at}")
                self.assertEqual(_differences(want, got), [])
                self.assertEqual(_last_logged_loss(out_a), _last_logged_loss(out_b))


if __name__ == "__main__":
    unittest.main()
