"""Surviving failures: corrupt checkpoints, peers that vanish, killed ranks, several nodes."""

import contextlib
import io
import json
import os
import tempfile
import time
import unittest

import torch

from scaletorch.dist import destroy_pg_manager, init_pg_manager
from scaletorch.models import build_model
from scaletorch.trainer import Trainer
from scaletorch.trainer import checkpoint as ckpt
from scaletorch.trainer import parse_args
from scaletorch.trainer.dcp_checkpoint import to_consolidated
from tests.harness import bit_exact, free_port, run_distributed, under_torchrun
from tests.test_examples import NO_PREFLIGHT, launch
from tests.test_resume import (ASYNC_KILLED, FAIL_AT, KILL_LAYOUTS, RUN_FLAGS, RUN_STEPS,
                               _differences, killed_run, straight_run)


def _config(tmp: str, *overrides: str):
    return parse_args([
        "--config", "examples/configs/00_single_device.yaml", "--logging.run_dir", tmp,
        "--logging.progress", "false", *overrides
    ])


class CorruptCheckpointFallsBackToThePreviousOne(unittest.TestCase):

    def test_truncated_latest_is_detected_and_the_one_before_is_used(self):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = _config(tmp, "--steps", "6", "--checkpoint.every", "2", "--checkpoint.keep_last",
                          "3")
            Trainer(cfg, build_model(cfg.model, 42), verbose=False).train()
            latest = ckpt.step_dir(cfg.checkpoint_path, 6)
            with open(ckpt.rank_file(latest, 0), "r+b") as f:  # a crash of the disk, say
                f.truncate(100)
            with self.assertRaisesRegex(ckpt.CorruptCheckpointError, "does not match its sha256"):
                ckpt.verify_checkpoint(latest)
            path, skipped = ckpt.latest_valid_checkpoint(cfg.checkpoint_path)
            self.assertTrue(path.endswith("step_0000004"))
            self.assertEqual(len(skipped), 1)

            resume = _config(tmp, "--steps", "6", "--checkpoint.resume", "latest")
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                result = Trainer(resume, build_model(cfg.model, 42), verbose=True).train()
            self.assertEqual(result.start_step, 4)
            self.assertIn("skipping corrupt checkpoint", out.getvalue())

    def test_manifest_names_format_version_and_checksums(self):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = _config(tmp, "--steps", "2", "--checkpoint.every", "2")
            Trainer(cfg, build_model(cfg.model, 42), verbose=False).train()
            with open(os.path.join(ckpt.step_dir(cfg.checkpoint_path, 2), ckpt.MANIFEST)) as f:
                manifest = json.load(f)
        self.assertEqual(manifest["format_version"], ckpt.FORMAT_VERSION)
        self.assertEqual(list(manifest["sha256"]), ["rank_00000.pt"])
        self.assertEqual(len(manifest["sha256"]["rank_00000.pt"]), 64)


TIMEOUT = 4.0


def _peer_leaves_early(rank: int, world: int, tmp: str) -> dict:
    """Rank 1 leaves before the first step; rank 0 must fail fast and say where."""
    pgm = init_pg_manager()  # creating groups needs every rank: rank 1 leaves right after
    if rank == 1:
        destroy_pg_manager()
        return {}
    cfg = _config(tmp, "--steps", "3")
    start = time.perf_counter()
    try:
        Trainer(cfg, build_model(cfg.model, 42), pgm, verbose=False).train()
        message = None
    except RuntimeError as err:
        message = str(err)
    destroy_pg_manager()
    return {"message": message, "seconds": time.perf_counter() - start}


class PeerThatNeverArrivesFailsFast(unittest.TestCase):

    def test_others_raise_within_the_timeout_naming_step_and_group(self):
        with tempfile.TemporaryDirectory() as tmp:
            results = run_distributed(_peer_leaves_early, 2, tmp, timeout=TIMEOUT)
        message = results[0]["message"]
        self.assertIsNotNone(message, "rank 0 trained although its peer was gone")
        self.assertIn("rank 0: step 0 failed", message)
        self.assertIn("all_reduce over group 'dp' (2 ranks)", message)
        self.assertLess(results[0]["seconds"], TIMEOUT + 5)


class KilledRankIsRestartedAndResumesExactly(unittest.TestCase):
    """torchrun --max-restarts 1: rank 1 is killed at step FAIL_AT, every rank restarts, resumes
    at the latest checkpoint, and ends with the weights of the run that never failed.

    The kill is test_resume's (``killed_run``: chapter 07, a two-stage pipeline on 2 ranks,
    async DCP saves every 2 of 8 steps), launched once for this test, KilledRankResumes and
    test_dcp_async: one torchrun restart serves the three. A restarted rank finds the latest
    checkpoint by itself whatever its format (Trainer.maybe_resume); loading a per-rank one in
    a rebuilt model is test_resume's InWorldResume."""

    @bit_exact  # the restarted ranks resume the same steps of the same code
    @under_torchrun
    def test_kill_restart_resume_is_bit_identical(self):
        _, want = straight_run(ASYNC_KILLED)
        out, got = killed_run(ASYNC_KILLED, async_save=True)
        self.assertIn(f"rank 1: injected failure at step {FAIL_AT}", out)
        # the restarted ranks were not told to resume: they look for the latest by themselves
        self.assertIn("torchrun restart 1: resuming from the latest checkpoint", out)
        self.assertRegex(out, r"resumed from \S+step_0000004 at step 4")  # step 6: uncommitted
        for key in ("model", "optimizer"):
            self.assertEqual(sorted(got[key]), sorted(want[key]))
        self.assertEqual(_differences(want, got), [])


def _two_nodes(script: str, per_node: int, args: list, tmp: str) -> str:
    """Train ``script`` with two launchers of per_node ranks each on 127.0.0.1 as node 0 and
    node 1; return the checkpoint root. Node 0's launcher runs the pre-flight for the world of
    both (per_node x 2 ranks); node 1's would run the same check again."""
    multi = os.path.join(tmp, "multi")
    port = str(free_port())
    nodes = [
        launch(
            script, per_node, *args, "--checkpoint.dir", multi, background=True, launcher=[
                "--nnodes", "2", "--node-rank",
                str(node), "--master-addr", "127.0.0.1", "--master-port", port
            ], env=NO_PREFLIGHT if node else None) for node in (0, 1)
    ]
    for node in nodes:
        node.result()
    return multi


class TwoLaunchersAsTwoNodesEqualOneLauncher(unittest.TestCase):
    """Bit for bit: two launchers on one host run the same world, ranks and collectives as one.

    One two-node launch proves it for every chapter: what a node changes is the launcher's
    (torchrun's c10d rendezvous, RANK / GROUP_RANK / LOCAL_WORLD_SIZE, the pre-flight's world)
    and what the shared start reads from it (scaletorch/dist/init.py, the run directory's node
    marker, the memory check), the same for chapter 01 as for 07; gloo's collectives do not
    know which launcher a peer came from. Chapter 07's pp 2, one stage per "node", crosses the
    launchers both ways: every activation and gradient between the stages (point to point, as
    Megatron places the pipeline across nodes) and all-reduces (the loss over pp, the gradient
    norm over the world), where chapter 01's two-node run (dropped: its launch proved the same
    road again) all-reduced only. Node 0's pre-flight checks the world of both: at 1 rank per
    launcher, a pre-flight of one node's ranks would refuse pp 2."""

    def assertStatesEqual(self, expected: dict, actual: dict) -> None:
        self.assertEqual(sorted(expected), sorted(actual))
        for name in expected:
            self.assertTrue(torch.equal(expected[name], actual[name]), name)

    @bit_exact
    @under_torchrun
    def test_nd_parallel_two_node_run_matches_single_node(self):
        # The one-launcher run is test_resume's uninterrupted run of the layout it kills, shared.
        nproc, args = KILL_LAYOUTS[ASYNC_KILLED]
        _, want = straight_run(ASYNC_KILLED)
        with tempfile.TemporaryDirectory() as tmp:
            multi = _two_nodes("examples/07_nd_parallel.py", nproc // 2, [*args, *RUN_FLAGS], tmp)
            # 07's last checkpoint (sharded) as one consolidated state, converted offline
            got = to_consolidated(ckpt.step_dir(multi, RUN_STEPS), os.path.join(tmp, "last.pt"))
        self.assertStatesEqual(want["model"], got["model"])


if __name__ == "__main__":
    unittest.main()
