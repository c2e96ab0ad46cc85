"""Run ScaleTorch's test suite: ``python run_tests.py [-k PATTERN] [-v] [--failfast]``.

``--durations N`` also lists the N slowest test classes (their tests' times summed, setUpClass
included: a class that spawns one world for all its tests pays it there).

Discovers every ``tests/test_*.py`` with unittest and closes with one line
``N passed, N failed`` (plus ``, N skipped`` when any were skipped). Exits 1 on failure.
"""

import argparse
import collections
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", dest="patterns", action="append", default=[],
                        help="only run tests whose name contains this substring")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per test")
    parser.add_argument("--failfast", action="store_true", help="stop at the first failure")
    parser.add_argument("--durations", type=int, default=0, metavar="N",
                        help="list the N slowest test classes")
    args = parser.parse_args()

    loader = unittest.TestLoader()
    if args.patterns:
        loader.testNamePatterns = [f"*{p}*" for p in args.patterns]
    suite = loader.discover("tests", top_level_dir=".")
    runner = unittest.TextTestRunner(verbosity=2 if args.verbose else 1, failfast=args.failfast,
                                     resultclass=TimedResult)
    start = time.time()
    result = runner.run(suite)
    failed = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
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
