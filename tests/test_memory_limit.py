"""A run that cannot fit is refused before anything is allocated (memory_limit.py).

The planner's estimate for the layout against the device's memory, in ``load_config``: a model
far too large ends in one line naming both numbers, exit 2, and the model is never built; the
chapters' own configs are far below any machine's memory.
"""

import contextlib
import glob
import io
import os
import re
import runpy
import sys
import unittest
from unittest import mock

import scaletorch.models
from scaletorch.plan.report import human
from scaletorch.trainer import parse_args
from scaletorch.trainer.memory_limit import available, rank_need
from tests.test_bad_inputs import run_in_process
from tests.test_examples import ROOT
from tests.test_run_dirs import C00

# hidden 16384, 200 layers: 0.6 T parameters, ~10 TB of fp32 states; no machine here has it
HUGE = [
    "--model.hidden_size", "16384", "--model.intermediate_size", "65536", "--model.num_layers",
    "200", "--model.num_attention_heads", "128", "--model.num_key_value_heads", "8"
]
LINE = re.compile(r"^error: the run needs (\S+ \S+) of memory \((\S+ \S+) per rank: the planner's "
                  r"estimate of parameters, gradients, optimizer state and activations for this "
                  r"layout\), and there are (\S+ \S+) of RAM available on this host: give a "
                  r"smaller model, a shorter data.seq_len or batch, or more ranks to share it\n$")
CI_MEMORY = 4e9  # the smallest machine the suite runs on: 2 cores, 4 GB or more


class AModelTooLargeIsRefusedBeforeItIsBuilt(unittest.TestCase):

    def test_one_line_with_both_numbers_and_no_model_built(self):
        # the script itself, not its pre-flight: load_config refuses before build_model runs
        out = io.StringIO()
        built = mock.Mock(side_effect=AssertionError("the model was built"))
        saved = sys.argv, sys.excepthook, os.getcwd()
        sys.argv = [C00, "--logging.run_dir", "/nonexistent/never-written", *HUGE]
        os.chdir(ROOT)
        try:
            with mock.patch.object(scaletorch.models, "build_model", built), \
                    contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), \
                    self.assertRaises(SystemExit) as done:
                runpy.run_path(C00, run_name="__main__")
        finally:
            sys.argv, sys.excepthook = saved[0], saved[1]
            os.chdir(saved[2])
        self.assertEqual(done.exception.code, 2)
        built.assert_not_called()
        match = LINE.match(out.getvalue())
        self.assertIsNotNone(match, out.getvalue())
        cfg = parse_args(["--config", "examples/configs/00_single_device.yaml", *HUGE])
        self.assertEqual(match[1], human(rank_need(cfg, 1, "cpu")))
        have = float(match[3].split()[0]) * {"GB": 1e9, "TB": 1e12, "MB": 1e6}[match[3].split()[1]]
        self.assertAlmostEqual(have / available("cpu")[0], 1, delta=0.2)  # RAM moves a little

    def test_ranks_sharing_the_host_multiply_the_need(self):
        # a model that fits once but not 8 times over: one rank runs, eight on this host do not
        cfg = parse_args(["--config", "examples/configs/00_single_device.yaml"])
        have = available("cpu")[0]
        layers = 2
        while rank_need(cfg, 1, "cpu") < have / 4:  # a model a quarter of the RAM
            layers *= 2
            cfg.model.num_layers = layers
            cfg.model.hidden_size = cfg.model.intermediate_size = 2048
        args = [
            "--model.num_layers",
            str(layers), "--model.hidden_size", "2048", "--model.intermediate_size", "2048"
        ]
        self.assertEqual(run_in_process(C00, args)[0], 0)
        with mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": "8"}):
            code, out = run_in_process(C00, args)
        self.assertEqual(code, 2, out)
        self.assertIn("per rank x 8 ranks on this host", out)


class TheChaptersAreFarBelowTheLimit(unittest.TestCase):

    def test_every_chapter_config_at_every_world_it_runs_needs_under_100_mb(self):
        for path in sorted(glob.glob(os.path.join(ROOT, "examples", "configs", "*.yaml"))):
            if os.path.basename(path).startswith("12_"):  # a ResNet: the planner models the Llama
                continue
            cfg = parse_args(["--config", path])
            needs = {w: rank_need(cfg, w, "cpu") for w in (1, 2, 4, 8)}
            needs = {w: n * w for w, n in needs.items() if n is not None}
            with self.subTest(config=os.path.basename(path)):
                self.assertTrue(needs)  # the planner models it at some world
                self.assertLess(max(needs.values()), 100e6, needs)  # 2.5% of CI_MEMORY
                self.assertLess(max(needs.values()), CI_MEMORY / 40)


if __name__ == "__main__":
    unittest.main()
