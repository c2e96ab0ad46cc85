"""Sharded checkpoints (scaletorch/trainer/dcp_checkpoint.py and dcp_pieces.py): saved at one
layout, resumed at the same one bit-identically, and at others equal to the single-device run.

One world of 4 ranks. Run A trains tp2 x dp2 ZeRO-1 with a padded vocabulary (63 rows at tp 2,
padded to 256: tp rank 1 holds padding only) and saves at step 2 by the Trainer's own path
(--checkpoint.format dcp, every 2 steps: step 4 too). It is resumed at the same
layout (bit-identical to A's uninterrupted steps 3-5: weights, AdamW moments, losses), at dp4
ZeRO-3 (flat shards cut across rows) and, by the Trainer, at pp2 x dp2 DDP (stages). Run B
saves at pp2 x tp2 and resumes at dp4 ZeRO-2; run C, a MoE, saves at ep2 and resumes at ep4;
run D, PyTorch's FSDP2 (impl torch: DTensors), resumes at our tp2 x dp2 ZeRO-1, and A at
FSDP2; tied embeddings: E (pp2 x dp2 ZeRO-3, a copy on the last stage) resumes at dp4 ZeRO-1
(one parameter), F (tp2, one parameter) at pp2 x dp2 ZeRO-1; G, under bf16 autocast, at dp4
ZeRO-3 gathering bf16 (against the bf16 reference at precision.py's 2^-5). Each resumed
run's losses and final weights are compared with the single-device run at 1e-5 (fp32,
reduction order only, as tests/layouts.py's parity runs). The Trainer's own path
(--checkpoint.format dcp, a killed save's leftovers cleared, --resume latest at another
layout), the converter to a consolidated file, and the damaged checkpoints each refused with
one line naming the file are checked in the same world. (A rank killed under torchrun and
restarted from chapter 07's DCP checkpoint: tests/test_resume.py's KilledRankResumes.)
"""

import math
import os
import pickle
import shutil
import tempfile
import unittest

import torch

from scaletorch.dist import comm, destroy_pg_manager
from scaletorch.rules.errors import InputError
from scaletorch.rules.safe_files import write_checksummed
from scaletorch.trainer import checkpoint as ckpt
from scaletorch.trainer.consolidated import consolidated_state, load_consolidated
from scaletorch.trainer.dcp_checkpoint import load_sharded, save_sharded, to_consolidated
from scaletorch.trainer.dcp_pieces import flat_range_boxes
from scaletorch.trainer.param_map import full_state_dict
from scaletorch.trainer.parity import max_weight_diff
from scaletorch.trainer.precision import TOLERANCES
from scripts import convert_dcp
from tests.harness import bit_exact, run_distributed, run_main, value_error
from tests.layouts import TOL, build, layout, make_config, pg_manager_for, reference
from tests.test_checksums import flip_byte
from tests.test_resume import _differences

WORLD = 4
SAVE_AT = 2  # of make_config's 5 steps: AdamW's moments and step are in use after the resume
VOCAB = 63  # odd: tp 2 pads it to 256 rows (rules/vocab.py), rank 1's rows are all padding


def config(model: str = "dense", **parallel):
    """tests/layouts.py's model and training with VOCAB; "moe" with one micro-batch (its exact
    parity, parallelize.py), "tied": embedding and head one weight, "bf16": the dense model
    under bf16 autocast (fp32 master weights and AdamW state, which the checkpoint holds)."""
    moe = model == "moe"
    cfg = make_config(moe, 1 if moe else 2, **parallel)
    cfg.model.vocab_size = VOCAB
    cfg.model.tie_word_embeddings = model == "tied"
    cfg.training.precision = "bf16" if model == "bf16" else "fp32"
    return cfg


# saved run -> (MoE, layout)
SAVED = {
    "A": ("dense", layout(tp=2, zero_stage=1)),
    "B": ("dense", layout(tp=2, pp=2)),
    "C": ("moe", layout(ep=2)),
    "D": ("dense", layout(zero_stage=3, impl="torch")),
    "E": ("tied", layout(pp=2, zero_stage=3)),
    "F": ("tied", layout(tp=2)),
    "G": ("bf16", layout(tp=2, zero_stage=1)),
}
# resumed run -> (the saved run whose checkpoint it loads, layout)
RESUMED = {
    "A_same": ("A", layout(tp=2, zero_stage=1)),
    "A_zero3_dp4": ("A", layout(zero_stage=3)),
    # A at pp2 x dp2 DDP (stages): the Trainer's run (_trainer_resumes_the_latest) resumes A
    # there, compared with the single-device run at the same 1e-5
    "B_zero2_dp4": ("B", layout(zero_stage=2)),
    "C_ep4": ("C", layout(ep=4)),  # 4 experts: 2 per rank there, 1 here
    # PyTorch's own FSDP2 (DTensor shards: DCP reads their placements itself), both ways
    "A_torch_fsdp2_dp4": ("A", layout(zero_stage=3, impl="torch")),
    "D_tp2_zero1_dp2": ("D", layout(tp=2, zero_stage=1)),
    # a tied embedding: one parameter, or under a pipeline a copy on the last stage (saved once)
    "E_zero1_dp4": ("E", layout(zero_stage=1)),
    "F_pp2_zero1_dp2": ("F", layout(pp=2, zero_stage=1)),
    # bf16: ZeRO-3 gathers bf16 copies of the fp32 shards it loaded
    "G_zero3_bf16_dp4": ("G", layout(zero_stage=3, param_dtype="bf16")),
}

# PyTorch's FSDP2 writing the checkpoint ours resumes runs in CI's long phase
# (SCALETORCH_LONG_TESTS=1, .ci/run), as the suite keeps to its 10 minutes; the suite keeps the
# other direction (A_torch_fsdp2_dp4: ours written, FSDP2's DTensor shards read)
if os.environ.get("SCALETORCH_LONG_TESTS") != "1":
    SAVED.pop("D")
    RESUMED.pop("D_tp2_zero1_dp2")
# Saved runs whose steps after the save nothing reads: G's moments are not compared (bf16: no
# derived bound), its resumed run is compared with the single-device bf16 run; B's, D's and F's
# resumed moments are compared with the uninterrupted run of the same model at another layout
# (MOMENTS_OF: A's, E's), as every resumed run's are (the same math in another order).
SAVE_ONLY = ("B", "D", "F", "G")
MOMENTS_OF = {"B": "A", "D": "A", "F": "E"}
# The runs that record the rows they train on (DataPositionResumesAtAnotherDataParallelSize):
# A at tp2 x dp2 (dp 2) and its resume at dp4 ZeRO-3
RECORDED = ("A", "A_zero3_dp4")


def checkpoint_of(root: str, name: str) -> str:
    """Where saved run ``name``'s checkpoint is: run A's, saved by the Trainer's own path
    (``_straight``), is step 2's directory under ``root``/trainer."""
    return ckpt.step_dir(os.path.join(root, "trainer"), SAVE_AT) if name == "A" else \
        os.path.join(root, name)


def _straight(name: str, root: str) -> dict:
    cfg = config(SAVED[name][0], **SAVED[name][1])
    if name in SAVE_ONLY:
        return _save_only(cfg, checkpoint_of(root, name))
    if name != "A":
        return _straight_run(cfg, checkpoint_of(root, name))
    # A: --checkpoint.format dcp every 2 steps, step 2's directory holding a killed save's
    # STALE shard first; _trainer_resumes_the_latest resumes its step 4 at another layout
    cfg.checkpoint.format, cfg.checkpoint.every = "dcp", 2
    cfg.checkpoint.dir = os.path.join(root, "trainer")
    if comm.group_rank() == 0:
        write_checksummed(os.path.join(checkpoint_of(root, name), STALE), b"old")
    comm.barrier()
    return _straight_run(cfg, checkpoint_of(root, name), record=True, at_save=True)


def _save_only(cfg, path: str) -> dict:
    """Train ``cfg`` SAVE_AT steps and save the sharded checkpoint to ``path``: what a resumed
    run loads, when only the single-device run is compared with it."""
    pgm = pg_manager_for(cfg)
    par, trainer = build(cfg, pgm)
    for _ in range(SAVE_AT):
        trainer.train_step()
    save_sharded(path, trainer, par)
    destroy_pg_manager()
    return {}


def _record_inputs(trainer) -> list:
    """[(step, token rows)] of every micro-batch this rank's embedding reads, in order."""
    seen: list = []
    for name, module in trainer.model.named_modules():
        if name.endswith("embed_tokens"):
            module.register_forward_pre_hook(lambda _, args: seen.append(
                (trainer.step, args[0].detach().clone())))
    return seen


def _data(trainer, pgm, seen: list) -> dict:
    """The rows this rank trained on at each step (``seen``), its data-parallel and tp rank,
    and every step's global batch."""
    return {
        "seen": seen,
        "dp": (pgm.data_parallel_rank, pgm.data_parallel_world_size),
        "tp": pgm.tensor_model_parallel_rank,
        "batches": [trainer.loader.get_batch(t)[0] for t in range(trainer.cfg.training.steps)],
    }


def _straight_run(cfg, path: str, record: bool = False, at_save: bool = False) -> dict:
    """Train ``cfg``, saving the sharded checkpoint at SAVE_AT to ``path`` (with
    --checkpoint.format dcp: ``Trainer.save``, the save its loop makes every
    checkpoint.every steps, into ``path``, its step directory); its remaining losses, its
    consolidated state at the end (rank 0); with ``at_save``, also then (what the converter
    must rebuild: run A's alone is read); with ``record``, the rows it trained on
    (``_data``)."""
    pgm = pg_manager_for(cfg)
    par, trainer = build(cfg, pgm)
    seen = _record_inputs(trainer) if record else None
    for _ in range(SAVE_AT):
        trainer.train_step()
    if cfg.checkpoint.format == "dcp":
        saved = trainer.save()
        if saved != path:
            raise AssertionError(f"Trainer.save wrote {saved}, not {path}")
    else:
        save_sharded(path, trainer, par)
    out = {"at_save": consolidated_state(trainer, par)} if at_save else {}
    out["losses"] = trainer.train().losses
    out["consolidated"] = consolidated_state(trainer, par)
    if record:
        out["data"] = _data(trainer, pgm, seen)
    destroy_pg_manager()
    return out


def _resumed(model: str, parallel: dict, path: str, record: bool = False) -> dict:
    return _resumed_run(config(model, **parallel), path, record)


def _resumed_run(cfg, path: str, record: bool = False) -> dict:
    """Load the sharded checkpoint at ``path`` into ``cfg``'s layout and train to the end: the
    step it started at, its losses, its consolidated state and full weights (its "model":
    full_state_dict's gather, made once) on rank 0; with ``record``, the rows it trained on
    (``_data``)."""
    pgm = pg_manager_for(cfg)
    par, trainer = build(cfg, pgm)
    seen = _record_inputs(trainer) if record else None
    load_sharded(path, trainer, par)
    start = trainer.step
    losses = trainer.train().losses
    consolidated = consolidated_state(trainer, par)  # rank 0's; None elsewhere
    out = {
        "start": start,
        "losses": losses,
        "state": consolidated and consolidated["model"],
        "consolidated": consolidated,
    }
    if record:
        out["data"] = _data(trainer, pgm, seen)
    destroy_pg_manager()
    return out


def _truncate_the_metadata(path: str) -> None:
    file = os.path.join(path, ".metadata")
    os.truncate(file, os.path.getsize(file) // 2)


class _RunsCode:
    """Pickled, it names ``print``: unpickling it would call it (any function, in an attack)."""

    def __reduce__(self):
        return print, ("this ran", )


def _code_in_the_metadata(path: str) -> None:
    """A .metadata that runs code when unpickled, with a checksum that matches (as anyone who
    shares a checkpoint can write)."""
    write_checksummed(os.path.join(path, ".metadata"), pickle.dumps(_RunsCode()))


# name -> what is done to a copy of run A's checkpoint
DAMAGE = {
    "flipped_byte": lambda path: flip_byte(os.path.join(path, "__1_0.distcp")),
    "missing_shard": lambda path: os.remove(os.path.join(path, "__2_0.distcp")),
    "truncated_metadata": _truncate_the_metadata,
    "code_in_the_metadata": _code_in_the_metadata,
    "save_stopped_before_the_end": lambda path: os.remove(os.path.join(path, ".metadata.sha256")),
}


def _bad_inputs(rank: int, root: str) -> dict:
    """Each damaged copy of A's checkpoint, loaded in turn by one run at dp4 ZeRO-3, and A's
    by a run of another model shape: the error message, and whether any weight changed in
    that load (nothing may load half)."""
    for name, damage in DAMAGE.items():
        path = os.path.join(root, f"damaged_{name}")
        if rank == 0:
            shutil.copytree(checkpoint_of(root, "A"), path)
            damage(path)
    comm.barrier()
    paths = {name: os.path.join(root, f"damaged_{name}") for name in DAMAGE}
    out = _load_errors(config(**layout(zero_stage=3)), paths)
    other = config(**layout(zero_stage=3))
    other.model.intermediate_size = 96
    out.update(_load_errors(other, {"another_model": checkpoint_of(root, "A")}))
    return out


def _load_errors(cfg, paths: dict) -> dict:
    """{name: (the error of loading paths[name] into one run of ``cfg``, whether its weights
    are unchanged after that load)}. Each refusal comes before any load: the run that refused
    one is the run that was built, so one run serves them all."""
    pgm = pg_manager_for(cfg)
    par, trainer = build(cfg, pgm)
    out = {}
    for name, path in paths.items():
        before = [p.detach().clone() for p in trainer.model.parameters()]
        message = value_error(lambda: load_sharded(path, trainer, par))
        out[name] = message, all(
            a.equal(b.detach()) for a, b in zip(before, trainer.model.parameters()))
    destroy_pg_manager()
    return out


# What a save killed before its manifest left in step 2's directory: an 8-rank run's shard
STALE = "__7_0.distcp"


def _trainer_resumes_the_latest(root: str) -> dict:
    """--checkpoint.format dcp in Trainer.train: run A's checkpoints (``_straight``: saved at
    tp2 x dp2 ZeRO-1 at steps 2 and 4, step 2's directory holding a killed save's STALE shard
    first), the latest (step 4) resumed at pp2 x dp2 by ``--resume`` alone."""
    resumed = config(**layout(pp=2))
    resumed.checkpoint.format, resumed.checkpoint.dir = "dcp", os.path.join(root, "trainer")
    resumed.checkpoint.resume = "latest"
    pgm = pg_manager_for(resumed)
    par, trainer = build(resumed, pgm)
    result = trainer.train()
    out = {"start": result.start_step, "losses": result.losses, "state": full_state_dict(par)}
    destroy_pg_manager()
    return out


def _world(rank: int, world: int, root: str) -> dict:
    # EightRanksResumeAtFour: the checkpoint 8 ranks saved before this world, at dp4 ZeRO-3
    out = {"eight_at_four": _resume_at_four(rank, world, os.path.join(root, EIGHT))}
    for name in SAVED:
        out[name] = _straight(name, root)
    out["trainer"] = _trainer_resumes_the_latest(root)
    for name, (saved, parallel) in RESUMED.items():
        out[name] = _resumed(SAVED[saved][0], parallel, checkpoint_of(root, saved), record=name
                             in RECORDED)
    out["bad"] = _bad_inputs(rank, root)
    return out


_ROOT = tempfile.TemporaryDirectory()  # removed when the process exits
_WORLD: list = []


def dcp_world() -> list:
    """The 4-rank world's per-rank results (its checkpoints under ``_ROOT``), after the 8-rank
    world that saves EIGHT, run once per process: ShardedCheckpointResumesAtAnyLayout,
    EightRanksResumeAtFour and DataPositionResumesAtAnotherDataParallelSize read it."""
    if not _WORLD:
        run_distributed(_save_at_eight, 8, os.path.join(_ROOT.name, EIGHT), timeout=600)
        _WORLD.append(run_distributed(_world, WORLD, _ROOT.name, timeout=600))
    return _WORLD[0]


def assert_continues_as(case: unittest.TestCase, runs: list, name: str, reference: tuple,
                        tol: float) -> None:
    """Each rank's resumed run (``runs``, in rank order) started at SAVE_AT, and its losses and
    (rank 0's) final weights are the single-device ``reference``'s within ``tol``."""
    losses, _, state = reference
    for rank, run in enumerate(runs):
        case.assertEqual(run["start"], SAVE_AT, name)
        case.assertEqual(len(run["losses"]), len(losses) - SAVE_AT, name)
        for step, (a, b) in enumerate(zip(run["losses"], losses[SAVE_AT:])):
            case.assertLessEqual(abs(a - b), tol, f"{name} rank {rank} step {step}")
    case.assertLessEqual(max_weight_diff(runs[0]["state"], state), tol, name)


class ShardedCheckpointResumesAtAnyLayout(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = _ROOT
        cls.results = dcp_world()
        cls.references = {
            model: reference(config(model))
            for model in ("dense", "moe", "tied", "bf16")
        }
        cls.reference = cls.references["dense"]

    @bit_exact  # the same layout: the same code and steps as the uninterrupted run
    def test_same_layout_resumes_bit_identical_weights_adam_state_and_losses(self):
        for rank, res in enumerate(self.results):
            self.assertEqual(res["A_same"]["start"], SAVE_AT)
            self.assertEqual(res["A_same"]["losses"], res["A"]["losses"], f"rank {rank}")
        self.assertEqual(
            _differences(self.results[0]["A"]["consolidated"],
                         self.results[0]["A_same"]["consolidated"]), [])

    def test_another_layout_continues_as_the_single_device_run(self):
        for name, (saved, _) in RESUMED.items():
            model = SAVED[saved][0]
            # fp32, 5 AdamW steps: only the order of the reductions differs (tests/layouts.py);
            # bf16: against the bf16 reference, precision.py's 2^-5 (derived there)
            tol = TOLERANCES["bf16"] if model == "bf16" else TOL
            assert_continues_as(self, [res[name] for res in self.results], name,
                                self.references[model], tol)

    def test_adam_moments_resumed_at_another_layout_are_the_saved_ones(self):
        # the moments of step 5 follow from those of step 2: compare them with an uninterrupted
        # run of the same model (the same math in another order: 1e-5 as the weights)
        for name, (saved, _) in RESUMED.items():
            if SAVED[saved][0] == "bf16":
                continue  # no derived bound for bf16 moments: its weights' parity covers it
            uninterrupted = MOMENTS_OF.get(saved, saved)  # the same model, uninterrupted
            want = self.results[0][uninterrupted]["consolidated"]["optimizer"]
            got = self.results[0][name]["consolidated"]["optimizer"]
            self.assertEqual(got["step"], want["step"], name)
            for key in ("exp_avg", "exp_avg_sq"):
                self.assertLessEqual(max_weight_diff(got[key], want[key]), TOL, f"{name} {key}")

    def test_a_damaged_or_partial_checkpoint_is_refused_naming_the_file_before_any_load(self):
        want = {
            "flipped_byte":
            r"__1_0\.distcp' does not match its checksum",
            "missing_shard":
            r"is missing __2_0\.distcp",
            "truncated_metadata":
            r"\.metadata' does not match its checksum",
            "save_stopped_before_the_end":
            r"\.metadata' has no checksum file",
            "code_in_the_metadata":
            r"\.metadata' needs builtins\.print to load: .* not unpickled",
            "another_model":
            r"holds another model: layers\.0\.\S+ is shape \(\d+, \d+\) there, shape "
            r"\(\d+, \d+\) for this config's model",
        }
        for rank, res in enumerate(self.results):
            for name, pattern in want.items():
                message, unchanged = res["bad"][name]
                self.assertRegex(message, pattern, f"{name} rank {rank}")
                self.assertNotIn("\n", message, name)  # one line
                self.assertTrue(unchanged, f"{name} rank {rank}: weights changed")

    def test_the_trainer_saves_dcp_and_resumes_the_latest_at_another_layout(self):
        losses, _, state = self.reference
        for rank, res in enumerate(self.results):
            run = res["trainer"]
            self.assertEqual(run["start"], 4)
            self.assertEqual(len(run["losses"]), 1)
            self.assertLessEqual(abs(run["losses"][0] - losses[4]), TOL, f"rank {rank}")
        self.assertLessEqual(max_weight_diff(self.results[0]["trainer"]["state"], state), TOL)
        root = os.path.join(self.tmp.name, "trainer")
        self.assertEqual([os.path.basename(p) for p in ckpt.list_checkpoints(root)],
                         ["step_0000002", "step_0000004"])
        latest = ckpt.step_dir(root, 4)
        self.assertEqual(ckpt.read_manifest(latest)["format"], "dcp")
        ckpt.verify_checkpoint(latest)  # the manifest holds every file's sha256
        # the killed save's files were cleared before step 2's save: only this run's are there
        step_2 = ckpt.step_dir(root, 2)
        self.assertEqual(sorted(os.listdir(step_2)), sorted(os.listdir(latest)))
        self.assertNotIn(STALE, os.listdir(step_2))

    def test_before_any_process_a_dcp_checkpoint_fits_any_layout_of_its_model_only(self):
        latest = ckpt.step_dir(os.path.join(self.tmp.name, "trainer"), 4)
        other = config(**layout(tp=2, pp=2))
        other.checkpoint.resume = latest
        ckpt.check_resume(other, world_size=8)  # another layout and world size: fits
        other.model.intermediate_size = 96
        with self.assertRaisesRegex(
                InputError, r"was written by another run: model.intermediate_size 64 -> 96 "
                r"\(checkpoint -> this run\)"):
            ckpt.check_resume(other, world_size=8)

    @bit_exact  # the same values, gathered by the converter instead of by the layout
    def test_the_converter_writes_the_consolidated_file_of_the_step_saved(self):
        want = self.results[0]["A"]["at_save"]
        out = os.path.join(self.tmp.name, "A_consolidated.pt")
        to_consolidated(checkpoint_of(self.tmp.name, "A"), out)
        got = load_consolidated(out)  # its checksum verified, tensors and plain values only
        self.assertEqual(got["step"], SAVE_AT)
        self.assertEqual(got["optimizer"]["step"], want["optimizer"]["step"])
        self.assertEqual(sorted(got["model"]), sorted(want["model"]))
        self.assertEqual(_differences(want, got), [])
        ckpt.check_consolidated(out, config())  # any layout of this model resumes it

    def test_the_converter_script_refuses_a_damaged_checkpoint_in_one_line(self):
        out = os.path.join(self.tmp.name, "refused.pt")
        damaged = os.path.join(self.tmp.name, "damaged_flipped_byte")
        status, _, err = run_main(convert_dcp.main, damaged, "--consolidated", out)
        self.assertEqual(status, 2)
        self.assertRegex(err, r"^error: .*__1_0\.distcp does not match its sha256 in the manifest")
        self.assertEqual(len(err.splitlines()), 1)
        self.assertFalse(os.path.exists(out))
        status, stdout, _ = run_main(convert_dcp.main, checkpoint_of(self.tmp.name, "A"),
                                     "--consolidated", out)
        self.assertEqual(status, 0)
        self.assertIn(f"wrote {out} (and its .sha256), step 2", stdout)
        status, _, err = run_main(convert_dcp.main, checkpoint_of(self.tmp.name, "A"),
                                  "--consolidated", out)  # never over a file that exists
        self.assertEqual(status, 2)
        self.assertRegex(err, r"^error: --consolidated .* exists: give a new path")
        self.assertEqual(load_consolidated(out)["step"], SAVE_AT)


EIGHT = "tp2_pp2_dp2_zero1"  # saved by 8 ranks (EightRanksResumeAtFour)


def _save_at_eight(rank: int, world: int, path: str) -> dict:
    return _save_only(config(**layout(tp=2, pp=2, zero_stage=1)), path)


def _resume_at_four(rank: int, world: int, path: str) -> dict:
    return _resumed("dense", layout(zero_stage=3), path)


class EightRanksResumeAtFour(unittest.TestCase):
    """The issue's case: saved by 8 ranks at tp2 x pp2 x dp2 ZeRO-1 (vocabulary padded, stages,
    flat shards of tp shards), resumed by 4 at dp4 ZeRO-3: equal to the single-device run. The
    8 ranks save before the file's 4-rank world, which resumes it (``dcp_world``)."""

    def test_tp2_pp2_dp2_zero1_resumes_at_dp4_zero3_as_the_single_device_run(self):
        results = [res["eight_at_four"] for res in dcp_world()]
        losses, _, state = reference(config())
        for rank, run in enumerate(results):
            self.assertEqual(run["start"], SAVE_AT)
            self.assertEqual(len(run["losses"]), len(losses) - SAVE_AT)
            for step, (a, b) in enumerate(zip(run["losses"], losses[SAVE_AT:])):
                self.assertLessEqual(abs(a - b), TOL, f"rank {rank} step {step}")
        # fp32, 5 AdamW steps: only the order of the reductions differs (tests/layouts.py)
        self.assertLessEqual(max_weight_diff(results[0]["state"], state), TOL)


class DataPositionResumesAtAnotherDataParallelSize(unittest.TestCase):
    """Run A, saved at tp2 x dp2 after step 2 (DCP), resumed at dp4 ZeRO-3 (A_zero3_dp4): the
    rows the data-parallel ranks train on, joined in rank order, are global batches 0, 1, then
    2, 3, 4 (8 sequences each): the next global sample, no repeat, no skip."""

    @classmethod
    def setUpClass(cls):
        cls.results = [{run: res[run]["data"] for run in RECORDED} for res in dcp_world()]

    def _global_rows(self, run: str, steps: range) -> dict:
        """{step: the rows every data-parallel rank trained on, joined in dp rank order}."""
        by_step: dict = {}
        ranks = [r[run] for r in self.results if r[run]["tp"] == 0]  # a tp peer repeats them
        for res in sorted(ranks, key=lambda r: r["dp"][0]):
            for step, rows in res["seen"]:
                if step in steps:
                    by_step.setdefault(step, []).append(rows)
        return {step: torch.cat(rows) for step, rows in by_step.items()}

    def test_the_resumed_run_continues_with_the_next_global_sample(self):
        saved, resumed = RECORDED
        batches = self.results[0][saved]["batches"]
        self.assertEqual([r[resumed]["dp"][1] for r in self.results], [4] * WORLD)
        self.assertEqual([r[saved]["dp"][1] for r in self.results], [2] * WORLD)
        # the saved run's steps before its save; the resumed run's, all of them
        before = self._global_rows(saved, range(SAVE_AT))
        after = self._global_rows(resumed, range(len(batches)))
        self.assertEqual(sorted(before), list(range(SAVE_AT)))
        self.assertEqual(sorted(after), list(range(SAVE_AT, len(batches))))
        for step, rows in {**before, **after}.items():
            self.assertTrue(torch.equal(rows, batches[step]), f"step {step}")  # exact tokens


class FlatRangeBoxes(unittest.TestCase):

    def test_every_range_of_every_shape_is_covered_once_by_at_most_2n_minus_1_boxes(self):
        for shape in [(4, 6), (2, 3, 4), (5, ), (3, 1, 2)]:
            n = math.prod(shape)
            for a in range(n + 1):
                for b in range(a, n + 1):
                    cover = torch.zeros(shape, dtype=torch.int)
                    boxes = flat_range_boxes(shape, a, b)
                    self.assertLessEqual(len(boxes), 2 * len(shape) - 1)
                    for offsets, sizes in boxes:
                        cover[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
                    want = torch.zeros(n, dtype=torch.int)
                    want[a:b] = 1
                    self.assertTrue(cover.flatten().equal(want), (shape, a, b))

    def test_the_picture_of_the_module_docstring(self):
        self.assertEqual(flat_range_boxes((4, 6), 9, 21), [((1, 3), (1, 3)), ((2, 0), (1, 6)),
                                                           ((3, 0), (1, 3))])


if __name__ == "__main__":
    unittest.main()
