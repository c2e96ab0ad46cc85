"""``--check`` itself catches small bugs, with the tolerance it derives from a measured floor.

tests/test_planted_bugs.py holds the layouts to the plain loop at a fixed 1e-5. This module
runs the scripts' own verdict, ``check_against_reference`` (scaletorch/trainer/parity.py), on
chapter 00's run (lr 1e-2, the tour's 10 steps). Above 1e-5 it measures the floor (the
reference trained again at another micro-batch split) and holds each comparison to the larger
of 1e-5 and 32 x that floor. Three small bugs are planted inside the spawned ranks by the
patches of test_planted_bugs (no hook in the library), one run each. Data parallel on 2 ranks:
one rank's gradient scaled by 1.001; one bucket not averaged, in the last step. Pipeline, pp 2:
the message for micro-batch 1 carries micro-batch 0's activation, in the last step. Each must
make ``--check`` say FAIL; the same layouts without a bug (the controls) must say OK.

One more on chapter 04's own run (examples/configs/04_pipeline_parallel.yaml, 2 ranks, 5 steps):
every gradient message rank 1 sends back scaled by 1.001. AdamW normalizes the update, so the
losses and weights pass; only the grad norm line, relative to the reference's, fails.

    python -m tests.test_check_catches_bugs    # the table: each run's difference / tolerance
"""

import contextlib
import io
import re
import unittest
from typing import Callable, ContextManager, Dict, Optional, Tuple

import torch

from scaletorch.dist import comm, get_ledger
from scaletorch.parallel.data_parallel import BucketedDataParallel
from scaletorch.parallel.pipeline_runtime import PipelineSchedule
from scaletorch.trainer import Config, check_against_reference, parse_args
from scaletorch.trainer.parity import (SAFETY_FACTOR, floor_applies, other_split, tolerance_text,
                                       widened)
from scaletorch.trainer.precision import NORM_TOLERANCES
from tests.harness import run_distributed
from tests.layouts import layout, train
from tests.test_planted_bugs import (bucket_not_averaged, patched, pipeline_wrong_micro_batch,
                                     rank1_gradient_scaled)

WORLD = 2
STEPS = 10  # the tour's steps
CHAPTER_04_STEPS = 5


def _config(name: str) -> Config:
    """Chapter 00's run (examples/configs/00_single_device.yaml) at a 2-rank layout; "04":
    chapter 04's run (pp 2, 1F1B, 8 micro-batches) for CHAPTER_04_STEPS steps."""
    if name == "04":
        cfg = parse_args([
            "--config", "examples/configs/04_pipeline_parallel.yaml", "--steps",
            str(CHAPTER_04_STEPS)
        ])
        cfg.logging.progress = False
        return cfg
    parallel = {
        # 0.05 MB buckets: chapter 00's model fills 9 of them, so one can be skipped
        "dp2": layout(bucket_size_mb=0.05),
        "pp2": layout(pp=2),  # 1F1B, one layer per stage, 2 micro-batches
    }[name]
    cfg = parse_args(["--config", "examples/configs/00_single_device.yaml", "--steps", str(STEPS)])
    cfg.logging.progress = False
    cfg.data.num_micro_batches = 2 if name == "pp2" else 1
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


def in_last_step(plant: Callable[[], ContextManager], owner: type,
                 attr: str) -> Callable[[], ContextManager]:
    """``plant``'s patch of ``owner.attr``, active in the run's last step only (the ledger's
    step, which the Trainer sets): one wrong update among ten, the smallest version of a bug."""

    def planted() -> ContextManager:
        correct = getattr(owner, attr)
        with plant():
            wrong = getattr(owner, attr)

        def either(self, *args, **kwargs):
            return (wrong if get_ledger().step == STEPS - 1 else correct)(self, *args, **kwargs)

        return patched(owner, attr, either)

    return planted


def pipeline_gradients_scaled() -> ContextManager:
    """Pipeline: every gradient message rank 1 sends back (to stage 0) is 1.001 times too
    large, in every step."""
    post = PipelineSchedule._post

    def scaled(self, batch):
        if comm.group_rank() == 1:
            for op in batch:
                if op.op == "send" and op.kind == "grad":
                    self.box[(op.kind, op.micro_batch, op.dst)].mul_(1.001)
        return post(self, batch)

    return patched(PipelineSchedule, "_post", scaled)


GRAD_NORM_BUG = "04: rank 1's gradient messages x 1.001"
# run -> (layout, the patch or None for a control)
RUNS: Dict[str, Tuple[str, Optional[Callable[[], ContextManager]]]] = {
    "control dp2": ("dp2", None),
    "control pp2": ("pp2", None),
    "dp: rank 1's gradient x 1.001": ("dp2", rank1_gradient_scaled),
    "dp: one bucket not averaged, last step":
    ("dp2", in_last_step(bucket_not_averaged, BucketedDataParallel, "_launch")),
    "pp: wrong micro-batch's activation, last step":
    ("pp2", in_last_step(pipeline_wrong_micro_batch, PipelineSchedule, "_post")),
    "control 04": ("04", None),
    GRAD_NORM_BUG: ("04", pipeline_gradients_scaled),
}


def _world(rank: int, world: int) -> Dict[str, Tuple[bool, str]]:
    """Every run's ``--check``: (verdict, what rank 0 printed)."""
    out = {}
    for run, (name, plant) in RUNS.items():
        cfg = _config(name)
        with plant() if plant is not None else contextlib.nullcontext():
            result = train(cfg)
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                ok = check_against_reference(cfg, result["losses"], torch.device("cpu"),
                                             result["state"] if rank == 0 else None,
                                             grad_norms=result["grad_norms"])
        out[run] = (ok, printed.getvalue())
    return out


LINE = re.compile(r"parity: max \|(loss|weight|grad norm) (?:-|/) reference(?: - 1)?\| = (\S+) "
                  r".*\(tolerance (\S+?)[ ,)].*: (OK|FAIL)")


def margins(printed: str) -> Dict[str, Tuple[float, float, str]]:
    """{"loss" / "weight" / "grad norm": (difference, tolerance, verdict)} from the parity
    lines."""
    return {
        kind: (float(diff), float(tol), verdict)
        for kind, diff, tol, verdict in LINE.findall(printed)
    }


def main() -> None:
    """``python -m tests.test_check_catches_bugs``: each run's loss and weights against the
    reference, over their tolerance, and the weights' floor (- if the run passed at 1e-5 and
    ``--check`` measured none)."""
    results = run_distributed(_world, WORLD, timeout=300)[0]
    print(f"{'run (2 ranks, chapter 00 10 steps; 04: 5)':45s} {'loss':>7s} {'/tol':>6s} "
          f"{'weights':>8s} {'floor':>8s} {'tol':>8s} {'/tol':>6s} {'norm':>8s} {'/tol':>6s}  "
          f"--check")
    for run, (ok, printed) in results.items():
        found = margins(printed)
        (loss, loss_tol, _), (diff, tol, _) = found["loss"], found["weight"]
        norm, norm_tol, _ = found["grad norm"]
        floor = re.search(r"max \|weight diff\| (\S+) ", printed)
        print(f"{run:45s} {loss:7.1e} {loss / loss_tol:6.2g} {diff:8.1e} "
              f"{floor.group(1) if floor else '-':>8s} {tol:8.1e} {diff / tol:6.2g} {norm:8.1e} "
              f"{norm / norm_tol:6.2g}  {'OK' if ok else 'FAIL'}")


class CheckCatchesSmallBugs(unittest.TestCase):
    """Measured (2 gloo ranks on CPU, python -m tests.test_check_catches_bugs): the controls pass
    at 1e-5 without a floor, their losses at 0.024 and their weights at 0.063 (dp2) and 0.012
    (pp2) of it. Each bug measures the floor (chapter 00's 10 steps: 6.3e-7 in the weights,
    micro-batches 1 vs 2), so its weights are held to 32 x 6.3e-7 = 2.0e-5. Rank 1's gradient
    x 1.001 moves the weights 1.1e-3, 55 x that tolerance, and the loss 3.9e-5, 3.9 x 1e-5. One
    bucket not averaged in the last step moves the weights 8.7e-3 (430 x) and not the loss;
    micro-batch 0's activation sent for micro-batch 1 in the last step, the weights 1.1e-2
    (1100 x) and that step's loss 0.77. A bf16-sized tolerance (3.1e-2) would miss every
    weight difference, and the first two bugs altogether."""

    @classmethod
    def setUpClass(cls):
        cls.results = run_distributed(_world, WORLD, timeout=300)[0]

    def test_the_controls_pass_well_inside_the_tolerance(self):
        for run in ("control dp2", "control pp2", "control 04"):
            ok, printed = self.results[run]
            self.assertTrue(ok, printed)
            for kind, (diff, tol, verdict) in margins(printed).items():
                self.assertEqual(verdict, "OK", printed)
                self.assertLess(diff / tol, 0.3, f"{run} {kind}:\n{printed}")  # 0.063 measured

    def test_every_planted_bug_fails_the_check_at_its_floor_derived_tolerance(self):
        for run in RUNS:
            if run.startswith("control") or run == GRAD_NORM_BUG:
                continue
            ok, printed = self.results[run]
            self.assertFalse(ok, f"{run} passed --check:\n{printed}")
            floor = re.search(
                r"parity: floor = one device, micro-batches (\d+) vs (\d+): max "
                r"\|loss diff\| (\S+), max \|weight diff\| (\S+) ", printed)
            self.assertIsNotNone(floor, printed)
            m, m_floor, loss_floor, weight_floor = floor.groups()
            self.assertEqual(int(m_floor), 2 * int(m))
            found = margins(printed)
            for kind, measured in (("loss", loss_floor), ("weight", weight_floor)):
                diff, tol, _ = found[kind]
                # the line's tolerance: 1e-5, or 32 x the floor where that is larger
                self.assertAlmostEqual(tol, max(1e-5, SAFETY_FACTOR * float(measured)),
                                       delta=0.05 * tol)
                self.assertIn(f"{SAFETY_FACTOR} x floor {measured}", printed)
            self.assertEqual(found["weight"][2], "FAIL", printed)

    def test_the_smallest_bug_fails_by_a_margin(self):
        # rank 1's gradient x 1.001: weights 55 x the tolerance (measured, docstring), loss 3.9 x
        _, printed = self.results["dp: rank 1's gradient x 1.001"]
        found = margins(printed)
        self.assertGreater(found["weight"][0] / found["weight"][1], 20, printed)
        self.assertGreater(found["loss"][0] / found["loss"][1], 1.5, printed)

    def test_a_pipeline_gradient_scaled_by_1001_fails_on_the_grad_norm_alone(self):
        # Measured: the loss 2.4e-7 and the weights 2.8e-6 off, both pass (the norm's excess
        # measured the floor: weights held to 32 x 1.1e-6); the grad norm 5.0e-4 relative
        # against 1e-4. Stage 0's gradients, 1.001 x, hold about half the squared norm.
        ok, printed = self.results[GRAD_NORM_BUG]
        self.assertFalse(ok, printed)
        found = margins(printed)
        self.assertEqual((found["loss"][2], found["weight"][2]), ("OK", "OK"), printed)
        diff, tol, verdict = found["grad norm"]
        self.assertEqual((verdict, tol), ("FAIL", NORM_TOLERANCES["fp32"]), printed)
        self.assertGreater(diff / tol, 2.5, printed)  # 5.0 measured
        _, control = self.results["control 04"]
        self.assertLess(margins(control)["grad norm"][0], 0.01 * tol, control)  # 0 measured


class FloorRules(unittest.TestCase):
    """The floor's split and the parity line's tolerance text, without a world."""

    def test_the_floor_splits_the_batch_twice_as_fine_or_else_half_as_fine(self):
        cfg = _config("dp2")  # a global batch of 16 sequences
        for m, other in ((1, 2), (8, 16), (16, 8)):
            cfg.data.num_micro_batches = m
            self.assertEqual(other_split(cfg), other)
        cfg.data.global_batch_size, cfg.data.num_micro_batches = 15, 3
        self.assertIsNone(other_split(cfg))  # neither 6 nor 1.5 micro-batches: no floor
        self.assertFalse(floor_applies(cfg, "cpu"))
        cfg = _config("dp2")
        self.assertTrue(floor_applies(cfg, "cpu"))
        cfg.model.num_experts = 4  # the aux loss's statistics are per micro-batch
        self.assertFalse(floor_applies(cfg, "cpu"))
        cfg = _config("dp2")
        cfg.training.precision = "bf16"  # its tolerance is derived in precision.py
        self.assertFalse(floor_applies(cfg, "cpu"))

    def test_the_line_says_where_its_tolerance_came_from(self):
        self.assertEqual(tolerance_text(1e-5), "tolerance 1e-05")
        self.assertEqual(tolerance_text(1e-5, floor=3.04e-6),
                         "tolerance 9.6e-05 = 32 x floor 3.0e-06, measured this run")
        self.assertEqual(tolerance_text(1e-5, floor=2.4e-7),
                         "tolerance 1e-05 > 32 x floor 2.4e-07, measured this run")
        self.assertEqual(widened(1e-5, 3.04e-6), 32 * 3.0e-6)  # the floor as printed
        self.assertEqual(widened(1e-5, 2e-7), 1e-5)
        self.assertEqual(widened(1e-5, None), 1e-5)


if __name__ == "__main__":
    main()
