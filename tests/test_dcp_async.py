"""Async sharded checkpoints (scaletorch/trainer/dcp_async.py): training goes on while the
previous checkpoint is written, and a checkpoint counts only once its write, checksums and
manifest are complete.

One world of 4 ranks at tp2 x dp2 ZeRO-1 (tests/test_dcp.py's run A: rectangles of tp
shards and of flat shards). The held run saves at step 2, then at step 4 with its writer
held (a thread waiting on an Event before it writes a byte) while two more steps change the
weights in place: at that moment, where a kill would leave the run, ``--resume latest``
finds step 2. Released, step 4 counts, and holds the weights and AdamW state of step 4 bit
for bit (the copy was taken before the updates). ``Trainer.train`` with async saves waits for
its last one: step 4 is complete when it returns, equal to the held run's. Under torchrun,
a rank killed at step 7 while step 6's checkpoint is uncommitted restarts from step 4 and ends
bit-identical to the uninterrupted run (test_resume's runs, shared: no launch of its own).
"""

import os
import tempfile
import threading
import unittest
from typing import Any

import torch.distributed.checkpoint as dcp

from scaletorch.dist import comm, destroy_pg_manager
from scaletorch.rules.errors import InputError
from scaletorch.trainer import checkpoint as ckpt
from scaletorch.trainer.config import parse_args
from scaletorch.trainer.consolidated import consolidated_state
from scaletorch.trainer.dcp_checkpoint import to_consolidated
from tests.harness import bit_exact, run_distributed, under_torchrun
from tests.layouts import build, layout, pg_manager_for
from tests.test_dcp import config
from tests.test_resume import (ASYNC_KILLED, FAIL_AT, _differences, _last_logged_loss, killed_run,
                               straight_run)

WORLD = 4


class HeldWriter(dcp.FileSystemWriter):
    """DCP's file writer whose thread waits for ``release`` before it writes any data."""

    def __init__(self, path: str, release: threading.Event) -> None:
        super().__init__(path)
        self.release = release

    def write_data(self, *args: Any, **kwargs: Any) -> Any:
        self.release.wait()
        return super().write_data(*args, **kwargs)


def _async_config(root: str):
    cfg = config(**layout(tp=2, zero_stage=1))
    cfg.checkpoint.format, cfg.checkpoint.async_save, cfg.checkpoint.dir = "dcp", True, root
    return cfg


def _held(root: str) -> dict:
    """Saves at 2 and at 4 (held during steps 5 and 6): what the checkpoint root shows then."""
    cfg = _async_config(root)
    pgm = pg_manager_for(cfg)
    par, trainer = build(cfg, pgm)
    release = threading.Event()
    trainer.async_saver.writer = lambda path: HeldWriter(path, release)
    release.set()
    for _ in range(2):
        trainer.train_step()
    trainer.save()
    for _ in range(2):
        trainer.train_step()
    at_4 = consolidated_state(trainer, par)
    trainer.async_saver.finish()  # step 2's write, released: it counts before the hold
    release.clear()
    step_4 = trainer.save()
    for _ in range(2):  # training goes on while step 4's write waits
        trainer.train_step()
    held = {
        "latest": ckpt.latest_valid_checkpoint(root)[0],
        "files": sorted(os.listdir(step_4)) if os.path.isdir(step_4) else []
    }
    comm.barrier()  # every rank looked before any write goes on
    release.set()
    finished = trainer.async_saver.finish()
    out = {
        "held": held,
        "finished": finished,
        "step_4": step_4,
        "at_4": at_4,
        "latest": ckpt.latest_valid_checkpoint(root)[0],
        "step": trainer.step
    }
    destroy_pg_manager()
    return out


def _through_train(root: str) -> dict:
    """Trainer.train, async saves every 2 of 5 steps: the last (step 4) waited for at the end."""
    cfg = _async_config(root)
    cfg.checkpoint.every = 2
    pgm = pg_manager_for(cfg)
    _, trainer = build(cfg, pgm)
    trainer.train()
    out = {"latest": ckpt.latest_valid_checkpoint(root)[0]}
    destroy_pg_manager()
    return out


def _world(rank: int, world: int, root: str) -> dict:
    return {
        "held": _held(os.path.join(root, "held")),
        "train": _through_train(os.path.join(root, "train")),
    }


class AsyncSaveCountsOnlyOnceComplete(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.results = run_distributed(_world, WORLD, cls.tmp.name, timeout=600)
        cls.root = os.path.join(cls.tmp.name, "held")
        cls.saved_4 = {  # offline, one process: the step 4 checkpoints as consolidated files
            run:
            to_consolidated(ckpt.step_dir(os.path.join(cls.tmp.name, run), 4),
                            os.path.join(cls.tmp.name, f"{run}.pt"))
            for run in ("held", "train")
        }

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_while_the_write_is_held_the_latest_checkpoint_is_the_previous_one(self):
        for rank, res in enumerate(self.results):
            held = res["held"]
            self.assertEqual(held["held"]["latest"], ckpt.step_dir(self.root, 2), f"rank {rank}")
            # nothing of step 4 that marks it complete: no metadata, checksum or manifest
            self.assertEqual(held["held"]["files"], [], f"rank {rank}")
            self.assertEqual(held["step"], 6)  # two steps trained while the write was held

    def test_once_released_it_counts_and_holds_the_state_of_its_step_bit_for_bit(self):
        for rank, res in enumerate(self.results):
            self.assertEqual(res["held"]["finished"], res["held"]["step_4"])
            self.assertEqual(res["held"]["latest"], ckpt.step_dir(self.root, 4), f"rank {rank}")
        held = self.results[0]["held"]
        self.assertEqual(self.saved_4["held"]["step"], 4)
        self.assertEqual(_differences(held["at_4"], self.saved_4["held"]), [])

    @bit_exact  # the same layout and steps: the held run's step 4 and train()'s
    def test_train_waits_for_its_last_async_checkpoint(self):
        root = os.path.join(self.tmp.name, "train")
        for rank, res in enumerate(self.results):
            self.assertEqual(res["train"]["latest"], ckpt.step_dir(root, 4), f"rank {rank}")
        self.assertEqual(_differences(self.results[0]["held"]["at_4"], self.saved_4["train"]), [])


class AsyncSaveNeedsDcp(unittest.TestCase):

    def test_async_save_with_per_rank_checkpoints_is_refused(self):
        with self.assertRaises(InputError) as err:
            parse_args(["--checkpoint.async_save", "true"])
        self.assertIn("checkpoint.async_save", str(err.exception))
        self.assertIn("format", str(err.exception))
        cfg = parse_args(["--checkpoint.format", "dcp", "--checkpoint.async_save", "true"])
        self.assertTrue(cfg.checkpoint.async_save)


# test_resume's kill test of chapter 07 (DCP checkpoints at 2, 4, 6, 8), its checkpoints
# async: rank 1 is killed at step 7, after step 6's write began and before it is committed (at
# step 8's save), and torchrun restarts every rank once. The launch is test_resume's
# ``killed_run`` (KilledRankResumes and test_fault_tolerance's kill test read the same one); the
# uninterrupted run is its blocking one, shared: a save, async or not, changes no weight.


class KilledDuringAsyncWriteResumesThePrevious(unittest.TestCase):

    @bit_exact
    @under_torchrun
    def test_kill_before_the_commit_resumes_step_4_and_ends_as_the_uninterrupted_run(self):
        out_a, want = straight_run(ASYNC_KILLED)
        out_b, got = killed_run(ASYNC_KILLED, async_save=True)
        self.assertIn(f"injected failure at step {FAIL_AT}", out_b)
        # step 6 uncommitted: the one before it, not step 6 (nor the older step 2)
        self.assertRegex(out_b, r"resumed from \S+step_0000004 at step 4")
        self.assertEqual(_differences(want, got), [])
        self.assertEqual(_last_logged_loss(out_a), _last_logged_loss(out_b))


if __name__ == "__main__":
    unittest.main()
