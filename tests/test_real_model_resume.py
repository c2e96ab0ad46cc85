"""Chapter 10's default text resumes: the run trained on the docs joined into its run directory
(``text.txt``), so its resume reads that copy and compares its contents with the checkpoint's
record (trainer/resume_check.py), whatever the docs hold by then.

One rank, 2 steps, a checkpoint at step 2; then the pre-flight of ``--resume`` (the same check
a run makes before it starts) in this process: accepted as written, refused naming the file
once the copy is changed.
"""

import contextlib
import importlib.util
import io
import os
import sys
import tempfile
import unittest
from unittest import mock

from scaletorch.trainer import load_config
from tests.harness import launch_forked

SCRIPT = "examples/10_real_model.py"


def _script():
    spec = importlib.util.spec_from_file_location("real_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@unittest.skipUnless(importlib.util.find_spec("safetensors"), "the export needs safetensors")
class TheDefaultTextResumesFromItsRunsCopy(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.flags = ["--steps", "3", "--checkpoint.every", "2", "--logging.run_dir", cls.tmp.name]
        cls.out, cls.status = launch_forked(SCRIPT, 1, "--steps", "2", *cls.flags[2:],
                                            "--max-new-tokens", "1")
        cls.text = os.path.join(cls.tmp.name, "10_real_model", "text.txt")

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def preflight(self) -> tuple:
        """(exit status, stderr) of ``--resume``'s pre-flight, as scripts/launch.sh runs it."""
        module = _script()
        with mock.patch.object(sys, "argv", [SCRIPT]):
            args, _ = module.chapter_args()  # the chapter's own flags, at their defaults
        err = io.StringIO()
        with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as end:
            load_config("examples/configs/10_real_model.yaml", "10", module.limits(args),
                        argv=["--validate-only", "--world-size", "1", *self.flags, "--resume"])
        return end.exception.code, err.getvalue()

    def test_a_resume_is_accepted_and_a_changed_copy_is_refused_naming_it(self):
        self.assertEqual(self.status, 0, self.out)
        self.assertTrue(os.path.isfile(self.text))
        self.assertEqual(self.preflight(), (0, ""))
        with open(self.text, "a") as f:
            f.write("one more line")
        code, err = self.preflight()
        self.assertEqual(code, 2)
        self.assertRegex(
            err, r"^error: --resume .*step_0000002 was written by another run: the "
            r"contents of data.path '.*10_real_model/text.txt' \(sha256 ")
        self.assertEqual(len(err.splitlines()), 1)


if __name__ == "__main__":
    unittest.main()
