"""scripts/plot.py's planner pictures: the memory stack per layout and predicted vs measured.

Each subcommand prints its data as a table and, with matplotlib (the optional ``plot`` extra),
writes a PNG; without it, it says so and prints the same table. Bad input (a missing file, no
layouts, no runs, a bad plan.py argument) is one "error:" line and exit status 2. In this
process, no ranks: about 3 s, most of it importing plan.py and matplotlib.
"""

import importlib.util
import json
import os
import sys
import tempfile
import unittest
from contextlib import redirect_stdout
from unittest import mock

from scripts.plot import main
from tests.harness import run_main

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
PNG = b"\x89PNG\r\n\x1a\n"
# Three of the tour's runs as scripts/plan_vs_tour.py reports them (seconds per step).
ROWS = (
    ("00_single_device", 1, "", 0.0119, 0.0109),
    ("02_fsdp", 2, "--zero-stage 3", 0.0165, 0.0172),
    ("07_nd_parallel", 4, "--tp 2 --pp 2", 0.116, 0.0516),
)
RUNS = [dict(zip(("script", "ranks", "arguments", "measured_s", "predicted_s"), r)) for r in ROWS]
RUNS[1]["ratio"] = 1.04  # other keys are ignored
EIGHT_B = "--preset llama3-8b --gpus 8 --tp 8 --global-batch-tokens 65536 --micro-batches 1"


def _plot(*argv: str):
    """scripts/plot.py in this process: (exit status, stdout, stderr)."""
    return run_main(main, *argv)


class PlotPlannerPictures(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.runs = cls.path("runs.json")
        with open(cls.runs, "w") as f:
            json.dump(RUNS, f)
        cls.plans = cls.path("plans.json")  # two plan.py --json outputs, one after the other
        from scripts.plan import main as plan
        with open(cls.plans, "w") as f, redirect_stdout(f):
            for args in (EIGHT_B, EIGHT_B.replace("--tp 8", "--zero-stage 3")):
                assert plan(args.split() + ["--json"]) == 0

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    @classmethod
    def path(cls, name: str) -> str:
        return os.path.join(cls.tmp.name, name)

    def assert_png(self, path: str) -> None:
        with open(path, "rb") as f:
            self.assertEqual(f.read(8), PNG)

    @unittest.skipUnless(HAVE_MATPLOTLIB, "matplotlib (the plot extra) is not installed")
    def test_plan_memory_draws_every_layout_of_the_files_and_of_plan_arguments(self):
        out_png = self.path("memory.png")
        status, out, err = _plot("plan-memory", self.plans, "--plan", EIGHT_B + " --zero-stage 1",
                                 "--cluster", "a100", "--out", out_png)
        self.assertEqual((status, err), (0, ""))
        self.assert_png(out_png)
        rows = [line for line in out.splitlines() if line.startswith("tp")]
        self.assertEqual(len(rows), 3)  # two from the file, one from --plan
        self.assertIn("a100: 80 GB of HBM", out)
        self.assertIn("buffers", out)  # ZeRO-3 keeps gather buffers: the column appears
        self.assertIn(f"wrote {out_png}", out)

    @unittest.skipUnless(HAVE_MATPLOTLIB, "matplotlib (the plot extra) is not installed")
    def test_plan_vs_measured_draws_the_runs_and_counts_those_within_the_band(self):
        out_png = self.path("scatter.png")
        status, out, err = _plot("plan-vs-measured", self.runs, "--out", out_png)
        self.assertEqual((status, err), (0, ""))
        self.assert_png(out_png)
        self.assertIn("within 30%: 2 of 3", out)  # 0.92 and 1.04 inside, 0.44 outside

    def test_without_matplotlib_both_print_the_data_as_text_and_write_no_png(self):
        out_png = self.path("none.png")
        with mock.patch.dict(sys.modules, {"matplotlib": None}):  # import matplotlib fails
            memory = _plot("plan-memory", self.plans, "--out", out_png)
            scatter = _plot("plan-vs-measured", self.runs, "--tolerance", "0.1", "--out", out_png)
        self.assertFalse(os.path.exists(out_png))
        for status, _, err in (memory, scatter):
            self.assertEqual(status, 0)
            self.assertIn("matplotlib is not installed", err)
        # 8e9 parameters over tp 8 at 2 + 4 + 12 bytes each (bf16, fp32 grads, fp32 Adam)
        self.assertRegex(memory[1], r"\ntp8 cp1 pp1 dp1 m1 b8 +0 +2\.0 +4\.0 +12\.0 ")
        self.assertIn("02_fsdp                   2  --zero-stage 3", scatter[1])
        self.assertIn("within 10%: 2 of 3", scatter[1])  # 1 / 1.1 = 0.909 <= 0.92

    def test_a_plan_written_before_bucket_size_mb_was_a_field_reads_with_its_default(self):
        from scripts.plot import layout_name, read_plans
        result = read_plans([self.plans])[0]
        old = {k: v for k, v in result.items() if k != "bucket_size_mb"}
        self.assertEqual(layout_name(old, True), layout_name(result, True))

    def test_bad_input_is_one_error_line_and_exit_status_2(self):
        empty_plan, empty_runs, bad_run = (self.path(n) for n in ("e.json", "r.json", "b.json"))
        no_layouts = {"layouts": [], "rejected": {}}  # what a search that finds none prints
        bad = [dict(RUNS[0], ranks=0)]
        for path, data in ((empty_plan, no_layouts), (empty_runs, []), (bad_run, bad)):
            with open(path, "w") as f:
                json.dump(data, f)
        cases = {
            ("plan-memory", "missing.json"): "plan file 'missing.json' does not exist",
            ("plan-memory", ): "needs plan.py --json files or --plan",
            ("plan-memory", empty_plan): "no layouts",
            ("plan-memory", self.runs): "no list 'layouts'",
            ("plan-memory", "--plan", "--preset llama3-9b"): "unknown model preset 'llama3-9b'",
            ("plan-memory", self.plans, "--cluster", "tpu"): "unknown cluster 'tpu'",
            ("plan-vs-measured", "missing.json"): "runs file 'missing.json' does not exist",
            ("plan-vs-measured", empty_runs): "no runs",
            ("plan-vs-measured", bad_run): "run 0 'ranks' is 0: it must be positive",
            ("plan-vs-measured", self.runs, "--tolerance", "0"): "--tolerance must be positive",
        }
        for argv, message in cases.items():
            with self.subTest(argv=argv):
                status, out, err = _plot(*argv, "--out", self.path("bad.png"))
                self.assertEqual((status, out), (2, ""))
                self.assertEqual(len(err.splitlines()), 1, err)
                self.assertTrue(err.startswith("error: "), err)
                self.assertIn(message, err)
        self.assertFalse(os.path.exists(self.path("bad.png")))


if __name__ == "__main__":
    unittest.main()
