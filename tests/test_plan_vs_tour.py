"""scripts/plan_vs_tour.py: the tour's measured step times beside the planner's, on made-up runs.

Each run directory holds what the Trainer writes (config.yaml, metrics.jsonl); the cluster
file is a calibrated host's (scaletorch/plan/cluster.py). No ranks are started: the script
only reads files, so the figures here are chosen, not measured.
"""

import json
import os
import tempfile
import unittest
from dataclasses import asdict

from scaletorch.plan.cluster import Cluster, save_cluster
from scaletorch.plan.layout import from_config as layout_of
from scaletorch.plan.model import from_config as model_of
from scaletorch.plan.time import measured_step, step_time
from scaletorch.trainer.config import parse_args, save_config
from scripts.plan_vs_tour import main
from tests.harness import run_main

HOST = Cluster(name="test host", gpus_per_node=4, peak_flops=5e10, hbm_bytes=24e9,
               intra_node_bandwidth=1e9, inter_node_bandwidth=1e9, intra_node_latency=1e-4,
               inter_node_latency=1e-4, compute_efficiency=0.5, comm_efficiency=1.0, cores=2,
               layer_overhead_s=1e-3, micro_batch_overhead_s=2e-3, step_overhead_s=3e-3,
               links={"2": {
                   "2": {
                       "all_reduce": [1e-4, 1e9]
                   }
               }}, issued={"2": {
                   "dp": 5e-4
               }})


def _run(tmp: str, name: str, config: str, step_seconds: list) -> str:
    """A run directory as the Trainer leaves it: config.yaml, one metrics line per step."""
    cfg = parse_args(["--config", config])
    path = os.path.join(tmp, name)
    save_config(cfg, os.path.join(path, "config.yaml"))
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        for step, seconds in enumerate(step_seconds, 1):
            f.write(json.dumps({"step": step, "tokens_per_s": tokens / seconds}) + "\n")
    return path


def _predicted(config: str, world: int) -> float:
    cfg = parse_args(["--config", config])
    return step_time(model_of(cfg.model), layout_of(cfg, world), HOST)["step_time_s"]


class PlanVsTour(unittest.TestCase):

    def test_reads_the_steps_after_the_first_and_writes_the_rows_as_json(self):
        ddp = "examples/configs/01_ddp.yaml"
        predicted = _predicted(ddp, 2)
        with tempfile.TemporaryDirectory() as tmp:
            # the first step is slow (warm-up) and ignored; of 2 steps the 10th percentile is the
            # faster
            run = _run(tmp, "tour_01", ddp, [10 * predicted, 1.25 * predicted, 1.1 * predicted])
            tsv = os.path.join(tmp, "tour_runs.tsv")
            with open(tsv, "w") as f:
                f.write(f"01_ddp\t2\t\t{run}\t3.0\t0\n")
                f.write(f"01_ddp\t2\t--failed\t{run}\t1.0\t1\n")  # a failed run: not compared
            host, rows = os.path.join(tmp, "host.json"), os.path.join(tmp, "rows.json")
            save_cluster(HOST, host)
            status, out, _ = run_main(main, tsv, "--cluster", host, "--json", rows)
            self.assertEqual(status, 0, out)
            self.assertIn("within 30%: all", out)
            with open(rows) as f:
                points = json.load(f)
            self.assertEqual(len(points), 1)
            self.assertEqual((points[0]["script"], points[0]["ranks"], points[0]["arguments"]),
                             ("01_ddp", 2, ""))
            self.assertAlmostEqual(points[0]["measured_s"], 1.1 * predicted, delta=1e-9)
            self.assertAlmostEqual(points[0]["predicted_s"], predicted, delta=1e-12)
            # 1.5 x slower than predicted: outside 30%, named, exit status 1
            _run(tmp, "tour_01", ddp, [10 * predicted, 1.5 * predicted])
            status, out, _ = run_main(main, tsv, "--cluster", host)
            self.assertEqual(status, 1)
            self.assertIn("within 30%: not 01_ddp", out)
            self.assertRegex(out, r"0\.67 .*OUTSIDE")

    def test_a_step_time_is_the_10th_percentile_of_the_steps_after_the_first(self):
        # the convention the tour, the calibration and the trainer's plan line share: one
        # lucky step does not set it, and the runs of a calibration pool their steps
        steps = [0.9] + [0.01 * i for i in range(20, 0, -1)]  # warm-up, then 0.20 .. 0.01
        self.assertEqual(measured_step(steps), 0.03)  # 20 steps: the 3rd fastest
        self.assertEqual(measured_step([0.9, 0.3, 0.2, 0.4]), 0.2)  # few steps: the fastest
        self.assertEqual(measured_step([9.0, 0.5, 0.4], [9.0, 0.1, 0.2]), 0.1)  # pooled
        with self.assertRaisesRegex(ValueError, "at least 2 steps .*got 1"):
            measured_step([0.9])

    def test_a_bad_cluster_file_is_one_error_line_and_exit_status_2(self):
        with tempfile.TemporaryDirectory() as tmp:
            bad = os.path.join(tmp, "host.json")
            with open(bad, "w") as f:
                json.dump({k: v for k, v in asdict(HOST).items() if k != "peak_flops"}, f)
            status, out, err = run_main(main, os.path.join(tmp, "none.tsv"), "--cluster", bad)
        self.assertEqual(status, 2)
        self.assertEqual(out, "")
        self.assertRegex(err, r"^error: cluster file .*missing keys peak_flops\n$")


if __name__ == "__main__":
    unittest.main()
