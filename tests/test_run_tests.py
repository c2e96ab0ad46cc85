"""run_tests.py's workers: each module handed to one reports every test's outcome, and a failure
keeps its traceback (the parent prints it at the end, as unittest would)."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PLANTED = """
import unittest


class Planted(unittest.TestCase):

    def test_passes(self):
        print("a test's own print")  # must not break the worker's report

    def test_fails(self):
        self.assertEqual(1, 2)

    def test_raises(self):
        raise KeyError("planted")

    @unittest.skip("planted")
    def test_skipped(self):
        pass
"""


class AWorkerReportsEachModule(unittest.TestCase):

    def test_outcomes_tracebacks_and_times_of_two_modules_in_one_worker(self):
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "planted_tests.py"), "w") as f:
                f.write(PLANTED)
            run = subprocess.run([sys.executable, "run_tests.py", "--worker"], cwd=ROOT,
                                 timeout=300, input="planted_tests\nplanted_tests\n",
                                 capture_output=True, text=True, env={
                                     **os.environ, "PYTHONPATH": os.pathsep.join([ROOT, tmp])
                                 })
        self.assertEqual(run.returncode, 0, run.stderr)
        reports = [json.loads(line) for line in run.stdout.splitlines()]
        self.assertEqual(len(reports), 2)  # one line per module handed over, nothing else
        for out in reports:
            self.assertEqual((out["module"], out["run"], out["skipped"]), ("planted_tests", 4, 1))
            (failed, traceback), = out["failed"]
            self.assertIn("test_fails", failed)
            self.assertIn("AssertionError: 1 != 2", traceback)
            (errored, traceback), = out["errors"]
            self.assertIn("test_raises", errored)
            self.assertIn("KeyError: 'planted'", traceback)
            self.assertEqual(set(out["seconds"]), {"planted_tests.Planted"})
            self.assertEqual(set(out["cpu"]), {"planted_tests.Planted"})
        self.assertIn("a test's own print", run.stderr)


if __name__ == "__main__":
    unittest.main()
