"""The Trainer's straggler line, in every run: a rank that sleeps in each step is named (in the
run directory's log.txt, and on stdout under --verbose only), and a run whose ranks are equal
prints none, even under --verbose.

One world of 2 ranks, chapter 01's data parallel step behind a sleep per step (so the steps'
times are the sleeps', well above a loaded CPU's noise), 5 steps logged once: the line compares
the median busy time of steps 1-4 (step 0 warms up).
"""

import io
import os
import tempfile
import time
import unittest
from contextlib import redirect_stdout
from typing import Dict, List

import torch

from scaletorch.dist import comm, destroy_pg_manager, init_pg_manager
from scaletorch.models import build_model
from scaletorch.parallel.data_parallel import apply_data_parallel
from scaletorch.parallel.step import make_data_parallel_step
from scaletorch.trainer import Trainer
from tests.harness import run_distributed
from tests.layouts import make_config

# seconds a step, rank 0 first: 10% of 0.2 s is well above a loaded CPU's noise on a tiny step
RUNS = {"equal": (0.2, 0.2), "rank 1 sleeps": (0.2, 0.5)}


def _train_each(rank: int, world: int, run_dir: str) -> Dict[str, List]:
    pgm = init_pg_manager()
    out: Dict[str, List] = {}
    for name, sleeps in RUNS.items():
        cfg = make_config(micro_batches=1)
        cfg.logging.run_dir, cfg.logging.log_every = run_dir, 5
        cfg.logging.name, cfg.logging.verbose = name.replace(" ", "_"), name == "equal"
        model = build_model(cfg.model, seed=cfg.training.model_seed)
        model = apply_data_parallel(model, pgm, "ours", cfg.parallel.bucket_size_mb)
        ddp = make_data_parallel_step(model, 1, pgm.data_parallel_rank,
                                      pgm.data_parallel_world_size, pgm.gradient_sync_group)

        def step(inputs: torch.Tensor, targets: torch.Tensor, sleep: float = sleeps[rank]):
            time.sleep(sleep)  # before the all-reduces: the other rank waits in them
            return ddp(inputs, targets)

        text = io.StringIO()
        waited = comm.waited()
        with redirect_stdout(text):
            result = Trainer(cfg, model, pgm, device=torch.device("cpu"),
                             forward_backward=step).train()
        held = ""  # what rank 0 wrote to the run directory's log.txt
        if rank == 0:
            with open(os.path.join(cfg.run_path, "log.txt")) as f:
                held = f.read()
        out[name] = [text.getvalue(), result.busy_seconds, comm.waited() - waited, held]
    destroy_pg_manager()
    return out


class StragglerLine(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        with tempfile.TemporaryDirectory() as run_dir:
            cls.ranks = run_distributed(_train_each, 2, run_dir, timeout=60)

    def test_a_sleeping_rank_is_named_with_every_ranks_busy_time(self):
        printed, _, _, text = self.ranks[0]["rank 1 sleeps"]
        self.assertIn("step     5 | loss", printed)
        self.assertNotIn("straggler", printed)  # a run without --verbose keeps it in log.txt
        lines = [line for line in text.splitlines() if line.startswith("straggler:")]
        self.assertEqual(len(lines), 1, text)  # one log line (step 5), one straggler line
        self.assertRegex(
            lines[0], r"^straggler: rank 1 is busy [56]\d\d\.\d ms a step, "
            r"[12]\.\dx the median of the other ranks \([23]\d\d\.\d ms\); busy ms a "
            r"step, rank 0 first: [23]\d\d\.\d, [56]\d\d\.\d$")

    def test_ranks_that_are_equal_print_no_line(self):
        text, _, _, held = self.ranks[0]["equal"]
        self.assertIn("step     5 | loss", text)  # --verbose: a straggler line would show
        self.assertNotIn("straggler", text + held)

    def test_busy_time_is_the_step_less_its_waits_in_collectives(self):
        # rank 0 sleeps 0.2 s and waits about 0.3 s a step for rank 1: busy about 0.2 s
        busy0, waited0 = self.ranks[0]["rank 1 sleeps"][1:3]
        busy1, waited1 = self.ranks[1]["rank 1 sleeps"][1:3]
        self.assertGreater(waited0, 4 * 0.3)  # 5 steps of a 0.3 s wait, less start-up skew
        self.assertLess(waited1, waited0 / 2)
        self.assertTrue(all(0.2 <= b < 0.35 for b in busy0[1:]), busy0)
        self.assertTrue(all(b >= 0.5 for b in busy1[1:]), busy1)
        self.assertEqual(self.ranks[1]["rank 1 sleeps"][0], "")  # only rank 0 prints


if __name__ == "__main__":
    unittest.main()
