"""scripts/plot.py profile's reading of real traces (no matplotlib needed).

One world of 2 ranks runs 2 steps with ``--profile 1`` (logging.profile_steps) twice: chapter
01's data parallel and chapter 04's 1F1B over 2 stages. The parent reads the traces with
scripts/plot_profile.py: every collective of the profiled step is found under its ledger name,
as many as the ledger recorded; the DDP buckets run while the backward still runs; the
pipeline's point-to-point batches and the waits on them are labelled. torch's own trace reader
(``torch.profiler._trace_validator``) loads each file and finds it valid.
"""

import os
import shutil
import tempfile
import unittest
from typing import Dict, List, Tuple

from torch.profiler._trace_validator import validate_trace

from scaletorch.dist import destroy_pg_manager, get_ledger
from scaletorch.trainer.config import parse_args
from scripts import plot_profile
from tests.harness import run_distributed
from tests.layouts import build, layout, make_config, pg_manager_for

# ddp: 0.01 MB buckets (about 2,600 elements): 22 buckets and the loss per step, the buckets
# issued in the backward of the last of 2 micro-batches
LAYOUTS = {"ddp": layout(bucket_size_mb=0.01), "1f1b": layout(pp=2, schedule="1f1b")}


def _profile_each(rank: int, world: int, run_dir: str) -> Dict[str, List[Tuple[str, str]]]:
    """Per layout: the ledger's (op, group) of each call of step 1, the profiled one."""
    out = {}
    for name, parallel in LAYOUTS.items():
        cfg = make_config(**parallel)
        cfg.training.steps = 2
        cfg.logging.name, cfg.logging.run_dir, cfg.logging.profile_steps = name, run_dir, 1
        pgm = pg_manager_for(cfg)
        get_ledger().clear()
        _, trainer = build(cfg, pgm)
        trainer.train()
        out[name] = [(r.op, r.group) for r in get_ledger().select(step=1)]
        destroy_pg_manager()
    return out


class ProfileTimeline(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp()
        cls.ledgers = run_distributed(_profile_each, 2, cls.tmp, timeout=60)
        cls.steps = {
            name: plot_profile.read_ranks(os.path.join(cls.tmp, name, "profile"))
            for name in LAYOUTS
        }

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def labels_in_ledger(self, name: str, rank: int) -> Dict[str, int]:
        """The ledger's calls as the profile labels them: a p2p batch (one send and one recv
        at most here) is one call."""
        counts: Dict[str, int] = {}
        for op, group in self.ledgers[rank][name]:
            label = f"{group} {op}"
            counts[label] = counts.get(label, 0) + 1
        return counts

    def test_ddp_buckets_are_found_and_run_while_the_backward_runs(self):
        for s in self.steps["ddp"]:
            self.assertEqual(s.step, 1)
            labels = [c.label for c in s.collectives]
            ledger = self.labels_in_ledger("ddp", s.rank)
            self.assertEqual({"dp all_reduce": len(labels)}, ledger)
            self.assertGreater(len(labels), 2)  # buckets and the loss
            for c in s.collectives:  # gloo ran each after it was issued, within the step
                self.assertIsNotNone(c.run, c.label)
                self.assertGreaterEqual(c.run.start, c.issued - 1e-3)
            backward = [b for b in s.compute if b.name == "backward"]
            self.assertTrue(backward and s.total(plot_profile.FORWARD) > 0)
            self.assertGreater(s.total("optimizer"), 0)
            # the buckets are issued inside the backward, the loss's all-reduce after it
            for c in s.collectives[:-1]:
                self.assertTrue(any(b.start <= c.issued <= b.end for b in backward), c.issued)
            self.assertGreater(s.collectives[-1].run.start, backward[-1].end)
            # the buckets' waits, and the loss's all-reduce: synchronous, it waits in its call
            self.assertEqual([w.name for w in s.waits], labels)
        a, b = self.steps["ddp"]  # one clock: the two ranks' steps overlap in time
        self.assertLess(max(a.span.start, b.span.start), min(a.span.end, b.span.end))
        # the overlap: gloo runs buckets while the backward goes on (on a loaded CPU a rank's
        # gloo thread may start late, so on one rank at least)
        self.assertGreater(max(a.overlap("backward"), b.overlap("backward")), 0)

    def test_pipeline_sends_receives_and_their_waits_are_labelled(self):
        for s in self.steps["1f1b"]:
            ledger = self.labels_in_ledger("1f1b", s.rank)
            batches = [
                c.label for c in s.collectives
                if c.label.startswith("pp s") or c.label.startswith("pp r")
            ]
            # each batch holds at most one send and one recv: its label says which
            self.assertEqual(sum("send" in label for label in batches), ledger["pp send"])
            self.assertEqual(sum("recv" in label for label in batches), ledger["pp recv"])
            if s.rank == 0:  # its second send goes with the first gradient's receive, in the
                # posting order (rank 1's at m = 2 has no such pair): the label says both
                self.assertIn("pp send/recv", batches)
            p2p_waits = [
                w for w in s.waits if w.name.startswith("pp s") or w.name.startswith("pp r")
            ]
            self.assertGreaterEqual(len(p2p_waits), len(batches))
            for c in s.collectives:
                self.assertEqual(c.run is None, c.label in batches, c.label)
            self.assertGreaterEqual(len([b for b in s.compute if b.name == "backward"]), 2)

    def test_the_table_says_what_the_picture_draws(self):
        lines = plot_profile.table(self.steps["ddp"])
        self.assertRegex(
            lines[0], r"^rank 0, step 1: [\d.]+ ms to [\d.]+ ms; forward & other "
            r"[\d.]+ ms, backward [\d.]+ ms, optimizer [\d.]+ ms, waiting [\d.]+ ms$")
        n = len(self.steps["ddp"][0].collectives)
        self.assertEqual(lines[1], f"  collectives: {n} x dp all_reduce")
        self.assertRegex(
            lines[2], rf"^  gloo ran {n} of them, busy [\d.]+ ms, [\d.]+ ms of it "
            r"under the backward$")

    def test_torchs_reader_loads_every_rank_s_trace_as_valid(self):
        for name in LAYOUTS:
            for rank in (0, 1):
                path = os.path.join(self.tmp, name, "profile", f"rank_{rank}.json")
                self.assertEqual(validate_trace(path), (True, []), path)

    def test_a_missing_trace_or_step_is_one_clear_error(self):
        with self.assertRaisesRegex(FileNotFoundError, "run with --profile STEPS first"):
            plot_profile.read_ranks(os.path.join(self.tmp, "nowhere"))
        with self.assertRaisesRegex(ValueError, "rank 0's trace has no ProfilerStep#7"):
            plot_profile.read_ranks(os.path.join(self.tmp, "ddp", "profile"), step=7)


class ProfileFlag(unittest.TestCase):

    def test_every_script_takes_profile_steps_and_refuses_a_negative_count(self):
        self.assertEqual(parse_args(["--profile", "2"]).logging.profile_steps, 2)
        with self.assertRaisesRegex(ValueError, "logging.profile_steps must be >= 0, got -1"):
            parse_args(["--profile", "-1"])


if __name__ == "__main__":
    unittest.main()
