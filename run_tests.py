"""Run ScaleTorch's test suite: ``python run_tests.py [-k PATTERN] [-v] [--failfast]``.

``--threads N`` runs the test process and every rank with N intra-op threads (by default 2 and
1, see tests/harness.py); ``--bit-exact`` runs only the tests marked ``@bit_exact``, the ones
that compare results bit for bit. CI runs those at 1 and at 2 threads as well.

``--durations N`` also lists the N slowest test classes (their tests' times summed, setUpClass
included: a class that spawns one world for all its tests pays it there).

Discovers every ``tests/test_*.py`` with unittest and closes with one line
``N passed, N failed`` (plus ``, N skipped`` when any were skipped). Exits 1 on failure, and
when the tests left a ``runs/`` directory in the checkout that was not there before (a test
must write its runs under a temporary directory: the README's first command needs the name).
"""

import argparse
import collections
import os
import sys
import time
import unittest


class TimedResult(unittest.TextTestResult):
    """Seconds per test class, from the end of one test to the end of the next: a class's
    setUpClass (where the multi-rank tests spawn their world) counts towards its first test."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seconds: collections.Counter = collections.Counter()
        self._last = time.time()

    def stopTest(self, test: unittest.TestCase) -> None:
        super().stopTest(test)
        now = time.time()
        self.seconds[type(test).__module__ + "." + type(test).__name__] += now - self._last
        self._last = now


def _tests(suite: unittest.TestSuite) -> list:
    """The test cases of ``suite``, flattened."""
    found = []
    for item in suite:
        found.extend(_tests(item) if isinstance(item, unittest.TestSuite) else [item])
    return found


def _is_bit_exact(test: unittest.TestCase) -> bool:
    if isinstance(test, unittest.loader._FailedTest):  # a module that failed to import
        return True
    method = getattr(test, getattr(test, "_testMethodName", ""), None)
    return bool(getattr(method, "bit_exact", False))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", dest="patterns", action="append", default=[],
                        help="only run tests whose name contains this substring")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per test")
    parser.add_argument("--failfast", action="store_true", help="stop at the first failure")
    parser.add_argument("--durations", type=int, default=0, metavar="N",
                        help="list the N slowest test classes")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="intra-op threads of the test process and of every rank")
    parser.add_argument("--bit-exact", action="store_true",
                        help="only the tests that compare results bit for bit")
    args = parser.parse_args()
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads {args.threads}: expected at least 1")
        os.environ["SCALETORCH_TEST_THREADS"] = str(args.threads)
    from tests import harness  # reads SCALETORCH_TEST_THREADS and sets the threads
    print(f"threads: {harness.PROCESS_THREADS} in the test process, {harness.RANK_THREADS} in "
          "each rank and launched script")

    loader = unittest.TestLoader()
    if args.patterns:
        loader.testNamePatterns = [f"*{p}*" for p in args.patterns]
    suite = loader.discover("tests", top_level_dir=".")
    if args.bit_exact:
        suite = unittest.TestSuite(t for t in _tests(suite) if _is_bit_exact(t))
    runner = unittest.TextTestRunner(verbosity=2 if args.verbose else 1, failfast=args.failfast,
                                     resultclass=TimedResult)
    start = time.time()
    runs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runs")
    had_runs = os.path.exists(runs)
    result = runner.run(suite)
    failed = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
    if not had_runs and os.path.exists(runs):  # tests write under temporary directories only
        left = ", ".join(sorted(os.listdir(runs)))
        print(f"error: the tests left {runs} in the checkout ({left}): a test ran a script "
              f"without --logging.run_dir in a temporary directory")
        failed += 1
    skipped = len(result.skipped)
    passed = result.testsRun - failed - skipped
    line = f"{passed} passed, {failed} failed"
    if skipped:
        line += f", {skipped} skipped"
    for name, seconds in result.seconds.most_common(args.durations):
        print(f"{seconds:7.1f} s  {name}")
    print(f"({time.time() - start:.0f} s)")
    print(line)
    return 0 if failed == 0 and result.testsRun > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
