"""Sharded checkpoints across the layouts tests/test_dcp.py leaves out: a zero-bubble V
schedule and context parallel, saved at one and resumed at another.

One world of 4 ranks. Run Z trains zbv pp2 x tp2 (two chunks per rank, the V placement: rank
0 holds the first and last layers) and saves at step 2; it is resumed at 1F1B pp4 (one layer
per stage: the issue's case) and at interleaved pp2 x dp2 (two chunks per rank, the loop
placement). Run K trains cp2 x dp2 ZeRO-1 (every cp rank a replica of the weights) and saves;
it is resumed at dp4 ZeRO-3 and at cp2 x tp2. Each resumed run's losses and final weights
equal the single-device run's at 1e-5 (fp32, only the order of the reductions differs, as
tests/layouts.py's parity runs; at pp4 also the micro-batches, 4 instead of 2). In the same
world, a save through the Trainer's path that finds the disk full leaves no partial file, and
a resume with another lr, beta1 and weight decay says so in the per-rank path's lines.
"""

import errno
import os
import re
import tempfile
import unittest

from scaletorch.dist import comm, destroy_pg_manager
from scaletorch.rules import safe_files
from scaletorch.trainer.checkpoint import step_dir
from scaletorch.trainer.dcp_checkpoint import load_sharded, save_sharded_checkpoint
from scaletorch.trainer.parity import max_weight_diff
from tests.harness import run_distributed, value_error
from tests.layouts import TOL, build, layout, pg_manager_for, reference
from tests.test_dcp import SAVE_AT, _resumed_run, _straight_run, assert_continues_as, config

WORLD = 4
# saved run -> layout
SAVED = {
    "Z": layout(tp=2, pp=2, schedule="zbv", virtual_pipeline_stages=2),
    "K": layout(cp=2, zero_stage=1),
}
# resumed run -> (the saved run whose checkpoint it loads, micro-batches, layout); 1F1B at pp 4
# needs 4 micro-batches to fill its pipeline: the same global batch, split finer
RESUMED = {
    "Z_1f1b_pp4": ("Z", 4, layout(pp=4)),
    "Z_interleaved_pp2_dp2": ("Z", 2, layout(pp=2, schedule="interleaved",
                                             virtual_pipeline_stages=2)),
    "K_zero3_dp4": ("K", 2, layout(zero_stage=3)),
    "K_cp2_tp2": ("K", 2, layout(cp=2, tp=2)),
}


def _resumed(saved: str, micro_batches: int, parallel: dict, root: str) -> dict:
    cfg = config(**parallel)
    cfg.data.num_micro_batches = micro_batches
    return _resumed_run(cfg, os.path.join(root, saved))


def _full_disk(f, data: bytes) -> None:
    """safe_files.write_all on a full disk for every checksum of a DCP data file (one disk:
    every rank's fails), after DCP wrote the data files themselves."""
    if ".distcp" in f.name:
        raise OSError(errno.ENOSPC, "No space left on device")
    f.write(data)


def _failed_save(root: str) -> dict:
    """Run K's layout, one step, then the Trainer's DCP save with the disk full: the error and
    what is left of the step directory (None: removed)."""
    cfg = config(**SAVED["K"])
    pgm = pg_manager_for(cfg)
    par, trainer = build(cfg, pgm)
    trainer.train_step()
    real, safe_files.write_all = safe_files.write_all, _full_disk
    try:
        message = value_error(lambda: save_sharded_checkpoint(root, 1, trainer, par, 2, {}))
    finally:
        safe_files.write_all = real
    comm.barrier()  # every rank has removed its files
    path = step_dir(root, 1)
    left = sorted(os.listdir(path)) if os.path.isdir(path) else None
    destroy_pg_manager()
    return {"message": message, "left": left, "path": path}


CHANGED = {"lr": 2e-3, "beta1": 0.8, "weight_decay": 0.05}  # make_config's: 3e-3, 0.9, 0.1


def _changed_settings(path: str) -> dict:
    """K's checkpoint resumed at dp4 ZeRO-3 with CHANGED: the lines rank 0's trainer printed,
    the lr, betas and weight decay its AdamW then steps with, and the lr it should."""
    cfg = config(**layout(zero_stage=3))
    for key, value in CHANGED.items():
        setattr(cfg.training, key, value)
    pgm = pg_manager_for(cfg)
    par, trainer = build(cfg, pgm)
    lines: list = []
    trainer._print = lambda message, **_: lines.append(message)  # every line it would print
    load_sharded(path, trainer, par)
    group = trainer.optimizer.param_groups[0]
    out = {
        "lines": lines if pgm.rank == 0 else [],
        "group": (group["lr"], group["betas"][0], group["weight_decay"]),
        "want_lr": CHANGED["lr"] * trainer.scheduler.lr_lambdas[0](SAVE_AT),
    }
    destroy_pg_manager()
    return out


def _world(rank: int, world: int, root: str) -> dict:
    out = {"failed_save": _failed_save(os.path.join(root, "full_disk"))}
    for name, parallel in SAVED.items():
        out[name] = _straight_run(config(**parallel), os.path.join(root, name))
    for name, resumed in RESUMED.items():
        out[name] = _resumed(*resumed, root)
    out["changed"] = _changed_settings(os.path.join(root, "K"))
    return out


class ZeroBubbleAndContextParallelResumeAtOtherLayouts(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        with tempfile.TemporaryDirectory() as tmp:
            cls.results = run_distributed(_world, WORLD, tmp, timeout=600)
        cls.reference = reference(config())

    def test_each_resumed_layout_continues_as_the_single_device_run(self):
        for name in RESUMED:
            # fp32, 5 AdamW steps: only the order of the reductions differs
            assert_continues_as(self, [res[name] for res in self.results], name, self.reference,
                                TOL)

    def test_the_saved_runs_themselves_match_the_single_device_run(self):
        # the checkpoint is taken from a run that is itself right: its own remaining losses
        losses, _, _ = self.reference
        for name in SAVED:
            for rank, res in enumerate(self.results):
                for step, (a, b) in enumerate(zip(res[name]["losses"], losses[SAVE_AT:])):
                    self.assertLessEqual(abs(a - b), TOL, f"{name} rank {rank} step {step}")

    def test_adam_moments_resumed_at_another_layout_are_the_saved_runs(self):
        # the moments of step 5 follow from those of step 2: the same math in another order
        for name, (saved, _, _) in RESUMED.items():
            want = self.results[0][saved]["consolidated"]["optimizer"]
            got = self.results[0][name]["consolidated"]["optimizer"]
            self.assertEqual(got["step"], want["step"], name)
            for key in ("exp_avg", "exp_avg_sq"):
                self.assertLessEqual(max_weight_diff(got[key], want[key]), TOL, f"{name} {key}")

    def test_a_failed_save_leaves_no_partial_file_on_any_rank(self):
        # as a per-rank save: each rank removes its own files, the last the directory
        for rank, res in enumerate(self.results):
            run = res["failed_save"]
            file = os.path.join(run["path"], f"__{rank}_0.distcp.sha256")
            self.assertRegex(
                run["message"],
                f"^could not write {re.escape(repr(file))}: No space left on device "
                r"\(free space there\); its partial files were removed")
            self.assertIsNone(run["left"], f"rank {rank}: {run['left']}")

    def test_a_resume_with_another_lr_betas_and_weight_decay_says_so_and_applies_them(self):
        self.assertEqual(self.results[0]["changed"]["lines"], [
            "training.lr changed from 0.003 to 0.002 at resume: from step 2 the learning rate "
            "follows 0.002's schedule",
            "training.beta1 changed from 0.9 to 0.8 at resume",
            "training.weight_decay changed from 0.1 to 0.05 at resume",
        ])  # the per-rank path's lines (Trainer.note_changed_settings)
        for rank, res in enumerate(self.results):
            run = res["changed"]
            self.assertEqual(run["group"], (run["want_lr"], 0.8, 0.05), f"rank {rank}")


if __name__ == "__main__":
    unittest.main()
