"""Run ScaleTorch's test suite: ``python run_tests.py [-k PATTERN] [-v] [--failfast]``.

Discovers every ``tests/test_*.py`` with unittest and closes with one line
``N passed, N failed`` (plus ``, N skipped`` when any were skipped). Exits 1 on failure.
"""

import argparse
import sys
import time
import unittest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", dest="patterns", action="append", default=[],
                        help="only run tests whose name contains this substring")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per test")
    parser.add_argument("--failfast", action="store_true", help="stop at the first failure")
    args = parser.parse_args()

    loader = unittest.TestLoader()
    if args.patterns:
        loader.testNamePatterns = [f"*{p}*" for p in args.patterns]
    suite = loader.discover("tests", top_level_dir=".")
    runner = unittest.TextTestRunner(verbosity=2 if args.verbose else 1, failfast=args.failfast)
    start = time.time()
    result = runner.run(suite)
    failed = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
    skipped = len(result.skipped)
    passed = result.testsRun - failed - skipped
    line = f"{passed} passed, {failed} failed"
    if skipped:
        line += f", {skipped} skipped"
    print(f"({time.time() - start:.0f} s)")
    print(line)
    return 0 if failed == 0 and result.testsRun > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
