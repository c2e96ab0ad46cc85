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

    def test_one_line_of_modules_runs_them_in_one_process_so_that_they_share_a_run(self):
        # SHARED_RUNS: the second module reuses the first one's module-level run
        first = "import unittest\nRUNS = []\n\n\nclass Makes(unittest.TestCase):\n\n" \
                "    def test_makes(self):\n        RUNS.append(1)\n"
        second = "import unittest\nimport first_tests\n\n\nclass Reuses(unittest.TestCase):\n\n" \
                 "    def test_reuses(self):\n        self.assertEqual(first_tests.RUNS, [1])\n"
        with tempfile.TemporaryDirectory() as tmp:
            for name, text in (("first_tests", first), ("second_tests", second)):
                with open(os.path.join(tmp, name + ".py"), "w") as f:
                    f.write(text)
            run = subprocess.run([sys.executable, "run_tests.py", "--worker"], cwd=ROOT,
                                 timeout=300, input="first_tests second_tests\n",
                                 capture_output=True, text=True, env={
                                     **os.environ, "PYTHONPATH": os.pathsep.join([ROOT, tmp])
                                 })
        (out, ) = [json.loads(line) for line in run.stdout.splitlines()]
        self.assertEqual((out["run"], out["failed"], out["errors"]), (2, [], []), run.stderr)


UNDER_TORCHRUN = """
import unittest

from tests.harness import under_torchrun


class Launches(unittest.TestCase):

    def test_in_process(self):
        pass

    @under_torchrun
    def test_restarted_by_torchrun(self):
        pass
"""


class TestsUnderTorchrunHaveTheirOwnRun(unittest.TestCase):
    """The suite leaves the @under_torchrun tests out and counts them; ``--torchrun`` runs them
    alone; ``-k`` naming one runs it. (In this process: a worker's Python would cost 5 s.)"""

    def test_left_out_counted_run_alone_or_named(self):
        import argparse

        import run_tests
        namespace: dict = {}
        exec(compile(UNDER_TORCHRUN, "torchrun_tests", "exec"), namespace)
        loaded = unittest.defaultTestLoader.loadTestsFromTestCase(namespace["Launches"])

        def selected(*patterns: str, torchrun: bool = False) -> list:
            args = argparse.Namespace(bit_exact=False, torchrun=torchrun, patterns=list(patterns))
            names = [t._testMethodName for t in run_tests._tests(run_tests._selected(loaded, args))]
            return [names, run_tests._left_out(loaded, args)]

        self.assertEqual(selected(), [["test_in_process"], 1])
        self.assertEqual(selected(torchrun=True), [["test_restarted_by_torchrun"], 0])
        self.assertEqual(selected("restarted"),
                         [["test_in_process", "test_restarted_by_torchrun"], 0])


class SharedRunsGoToOneWorker(unittest.TestCase):

    def test_a_group_is_one_item_in_its_first_members_place_and_the_rest_stay_alone(self):
        sys.path.insert(0, ROOT)
        import run_tests
        group = run_tests.SHARED_RUNS[0]
        modules = ["tests.test_a", *reversed(group), "tests.test_z"]
        items = run_tests._work(modules)
        self.assertEqual(items, ["tests.test_a", " ".join(group), "tests.test_z"])
        self.assertEqual(run_tests._work(["tests.test_a", group[1]]), ["tests.test_a", group[1]])
        # every group's modules exist: a renamed module would silently leave its group
        for group in run_tests.SHARED_RUNS:
            for module in group:
                self.assertTrue(os.path.exists(os.path.join(ROOT, *module.split(".")) + ".py"),
                                module)


class JobsFollowTheCores(unittest.TestCase):

    def test_one_worker_per_usable_core_at_most_two_and_workers_run_one_thread(self):
        from unittest import mock
        sys.path.insert(0, ROOT)
        import run_tests
        for cores, jobs in ((1, 1), (2, 2), (16, 2)):
            with mock.patch("os.sched_getaffinity", lambda _: set(range(cores)), create=True):
                self.assertEqual(run_tests.default_jobs(), jobs, cores)
        # --threads N: the cores divided by N (two-thread ranks of two workers would share two
        # cores four ways)
        for cores, threads, jobs in ((2, 2, 1), (4, 2, 2), (2, 1, 2), (1, 3, 1), (16, 4, 2)):
            with mock.patch("os.sched_getaffinity", lambda _: set(range(cores)), create=True):
                self.assertEqual(run_tests.default_jobs(threads), jobs, (cores, threads))
        # several workers share the cores: one thread each, unless --threads says otherwise
        self.assertEqual(
            [run_tests.test_threads(j, t) for j, t in ((1, None), (2, None), (2, 2), (1, 3))],
            [None, 1, 2, 3])


def _wait_policy(rank: int, world_size: int) -> str:
    return os.environ.get("OMP_WAIT_POLICY", "")


class IdleThreadsSleep(unittest.TestCase):
    """tests/__init__.py: OpenMP threads wait without spinning, in the test process and in every
    rank (two-thread ranks spinning on two cores made an 8-rank world 4x slower)."""

    def test_the_test_process_and_its_ranks_wait_passively(self):
        from tests.harness import run_distributed
        self.assertEqual(os.environ.get("OMP_WAIT_POLICY"), "PASSIVE")
        self.assertEqual(run_distributed(_wait_policy, 2), ["PASSIVE", "PASSIVE"])


class PortsComeFromOutsideTheEphemeralRange(unittest.TestCase):
    """scaletorch.dist.spawn.free_port: two workers start worlds side by side; a port the OS
    could hand to the other world's gloo connections in the meantime failed a world once with
    "address already in use"."""

    def test_ports_are_below_the_ephemeral_range_and_never_one_in_use(self):
        import socket
        from unittest import mock

        from scaletorch.dist import spawn
        start = spawn._ephemeral_start()
        ports = [spawn.free_port() for _ in range(200)]
        self.assertTrue(all(20000 <= p < start for p in ports), (min(ports), max(ports), start))
        self.assertGreater(len(set(ports)), 150)  # drawn, not one port for everyone
        with socket.socket() as held:
            held.bind(("127.0.0.1", ports[0]))
            held.listen()
            draws = iter([ports[0], ports[0], ports[1]])
            with mock.patch.object(spawn._DRAW, "randrange", lambda a, b: next(draws)):
                self.assertEqual(spawn.free_port(), ports[1])  # the held one is drawn again


if __name__ == "__main__":
    unittest.main()
