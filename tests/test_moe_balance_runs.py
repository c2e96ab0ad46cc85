"""Chapter 06b's run directories: each remedy is a run of its own in ``runs/NAME/<remedy>/``
(config, metrics, log, checkpoints), and ``--resume`` continues each remedy from its own
checkpoint, bit for bit against the uninterrupted run; a resume with one step left prints the
table (no traceback). One forked rank at ep 1: the directories and the resume are the same code
at every ep (tests/test_moe_balance.py's Resume* classes resume the bias and dropping at ep 2)."""

import json
import os
import tempfile
import unittest

import torch

from scaletorch.trainer.checkpoint import rank_file, step_dir
from tests.harness import launch_forked

SCRIPT = "examples/06b_load_balance.py"
# two remedies whose checkpoints differ in a setting (the capacity): one run's files are not
# the other's; the probe's case (a shared directory resumed "none" from capacity 0.5's weights)
REMEDIES = {"none": 0.0, "capacity 0.5": 0.5}
RUN = ("--ep", "1", "--remedies", ",".join(REMEDIES), "--checkpoint.every", "1")


def _model(run_dir: str, name: str, remedy: str, step: int) -> dict:
    """The model state rank 0 saved at ``step`` in ``remedy``'s run of ``name``."""
    path = step_dir(os.path.join(run_dir, name, remedy.replace(" ", "_"), "checkpoints"), step)
    return torch.load(rank_file(path, 0), weights_only=False)["model"]


def _losses(run_dir: str, name: str, remedy: str) -> list:
    path = os.path.join(run_dir, name, remedy.replace(" ", "_"), "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line)["loss"] for line in f]


class EachRemedyIsARunOfItsOwn(unittest.TestCase):

    def test_each_remedy_writes_and_resumes_its_own_directory(self):
        with tempfile.TemporaryDirectory() as tmp:
            where = ("--logging.run_dir", tmp)
            out, code = launch_forked(SCRIPT, 1, *RUN, "--steps", "3", "--name", "whole", *where)
            self.assertEqual(code, 0, out)
            out, code = launch_forked(SCRIPT, 1, *RUN, "--steps", "2", "--name", "cut", *where)
            self.assertEqual(code, 0, out)
            out, code = launch_forked(SCRIPT, 1, *RUN, "--steps", "3", "--name", "cut", *where,
                                      "--resume")
            # one step left of each: the table, a line saying how little was measured
            self.assertEqual(code, 0, out)
            self.assertNotIn("Traceback", out)
            self.assertIn("capacity 0.5       ", out)  # the table's row
            self.assertIn("none: measured over the 1 step this run trained, resumed at step 2", out)
            for remedy, factor in REMEDIES.items():
                with self.subTest(remedy=remedy):
                    mine = os.path.join(tmp, "cut", remedy.replace(" ", "_"))
                    for kept in ("config.yaml", "config.resume_0000002.yaml", "metrics.jsonl"):
                        self.assertTrue(os.path.isfile(os.path.join(mine, kept)), kept)
                    manifest = os.path.join(step_dir(os.path.join(mine, "checkpoints"), 3),
                                            "manifest.json")
                    with open(manifest) as f:
                        saved = json.load(f)["layout"]["config"]
                    self.assertEqual(saved["model.moe_capacity_factor"], factor)
                    # the resumed run continued this remedy's state: bit for bit
                    self.assertEqual(_losses(tmp, "cut", remedy), _losses(tmp, "whole", remedy))
                    whole, cut = _model(tmp, "whole", remedy, 3), _model(tmp, "cut", remedy, 3)
                    self.assertEqual(whole.keys(), cut.keys())
                    for key in whole:
                        self.assertTrue(torch.equal(whole[key], cut[key]), key)


if __name__ == "__main__":
    unittest.main()
