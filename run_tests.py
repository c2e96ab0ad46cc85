"""Run ScaleTorch's test suite: ``python run_tests.py [-k PATTERN] [-v] [--failfast]``.

``--threads N`` runs the test process and every rank with N intra-op threads (by default 2 and
1, see tests/harness.py); ``--bit-exact`` runs only the tests marked ``@bit_exact``, the ones
that compare results bit for bit. CI runs those at 1 and at 2 threads as well.

``--torchrun`` runs only the tests marked ``@under_torchrun`` (tests/harness.py): torchrun
kills, restarts or signals ranks it started as new Pythons, each about 5 s of a core before its
first step. The suite leaves them out (unless ``-k`` names them) and says how many; CI runs
them in a phase of their own.

``--jobs N`` runs the test modules in N worker processes at once (default: the cores this
process may use, divided by ``--threads`` when given, at most 2; 1 runs all in this process).
Between its worlds a worker waits on a timeout, a launcher or one Python's imports, which a
second worker fills. With more than one
worker, every test process runs one intra-op thread (unless ``--threads`` says otherwise): two
workers of two threads each would share two cores four ways. Modules listed in ``ALONE``
measure time (a schedule's bubble, a straggler's delay): they run after the others, with no
second worker beside them.

``--durations N`` also lists the N slowest test classes (their tests' times summed, setUpClass
included: a class that spawns one world for all its tests pays it there), with the CPU seconds
of every process each one ran: on a shared machine the wall time says little, the CPU is what
the suite costs.

Discovers every ``tests/test_*.py`` with unittest and closes with one line
``N passed, N failed`` (plus ``, N skipped`` when any were skipped, and ``; N under torchrun
left for --torchrun`` when the run left such tests out). Exits 1 on failure, and
when the tests left a ``runs/`` directory in the checkout that was not there before (a test
must write its runs under a temporary directory: the README's first command needs the name).
"""

import argparse
import collections
import json
import multiprocessing.forkserver as forkserver
import os
import resource
import selectors
import subprocess
import sys
import time
import unittest
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.abspath(__file__))

# Modules that assert on measured time: run with no other worker beside them.
ALONE = ("tests.test_zero_bubble_timing", "tests.test_straggler", "tests.test_timer",
         "tests.test_moe_imbalance_timing")
# The slowest modules start first, longest first (their wall seconds in an idle full run), so
# that what is left at the end is short: the worker that finishes first would wait alone for a
# long last module, one core idle, before the ALONE ones start.
SLOW_FIRST = ("tests.test_resume", "tests.test_nd_parallel", "tests.test_debugging",
              "tests.test_dcp", "tests.test_grade", "tests.test_dry_run", "tests.test_stops",
              "tests.test_fault_tolerance", "tests.test_examples", "tests.test_plan",
              "tests.test_vision", "tests.test_native_nd", "tests.test_pipeline_parallel",
              "tests.test_mixed_precision", "tests.test_nccl_order", "tests.test_docs",
              "tests.test_parallelize_chapters", "tests.test_dcp_seed", "tests.test_dcp_async",
              "tests.test_layout_errors", "tests.test_zero_bubble", "tests.test_fsdp",
              "tests.test_own_model", "tests.test_bad_inputs", "tests.test_vocab_padding",
              "tests.test_tensor_parallel", "tests.test_planted_bugs",
              "tests.test_context_parallel", "tests.test_script_parsers",
              "tests.test_check_catches_bugs")


def default_jobs(threads: Optional[int] = None) -> int:
    """The cores this process may run on, divided by ``--threads`` when given, at most 2: two
    workers fill each other's waits; more would run several timed or 8-rank worlds side by side.
    At ``--threads 2`` on two cores, one worker: two workers of 8 two-thread ranks each would put
    32 spinning threads on two cores (CI's 8-rank world then ran past its 360 s)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(2, (cores or 1) // (threads or 1)))


def test_threads(jobs: int, threads: Optional[int]) -> Optional[int]:
    """The intra-op threads of every test process and rank: ``--threads`` if given; one when
    several workers share the cores; else None (tests/harness.py's defaults)."""
    if threads is not None:
        return threads
    return 1 if jobs > 1 else None


def cpu_seconds() -> float:
    """CPU seconds of this process, of the children it waited for (scripts, launchers and
    their ranks) and of the forkserver with the ranks it forked and reaped."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    try:  # utime, stime, cutime, cstime: fields 14-17 of /proc/PID/stat, in clock ticks
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):  # no forkserver yet, or no /proc (macOS)
        pass
    return total


class TimedResult(unittest.TextTestResult):
    """Seconds per test class, wall and CPU (``cpu_seconds``), from the end of one test to the
    end of the next: a class's setUpClass (where the multi-rank tests spawn their world) counts
    towards its first test. A rank is counted once reaped: mostly within its class."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seconds: collections.Counter = collections.Counter()
        self.cpu: collections.Counter = collections.Counter()
        self._last, self._last_cpu = time.time(), cpu_seconds()

    def stopTest(self, test: unittest.TestCase) -> None:
        super().stopTest(test)
        now, cpu = time.time(), cpu_seconds()
        name = type(test).__module__ + "." + type(test).__name__
        self.seconds[name] += now - self._last
        self.cpu[name] += cpu - self._last_cpu
        self._last, self._last_cpu = now, cpu


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


def _is_under_torchrun(test: unittest.TestCase) -> bool:
    method = getattr(test, getattr(test, "_testMethodName", ""), None)
    return bool(getattr(method, "under_torchrun", False))


def _left_out(suite: unittest.TestSuite, args: argparse.Namespace) -> int:
    """The @under_torchrun tests that this run leaves to ``--torchrun``."""
    if args.bit_exact or args.torchrun or args.patterns:
        return 0
    return sum(1 for t in _tests(suite) if _is_under_torchrun(t))


def _loader(patterns: List[str]) -> unittest.TestLoader:
    loader = unittest.TestLoader()
    if patterns:
        loader.testNamePatterns = [f"*{p}*" for p in patterns]
    return loader


def _selected(suite: unittest.TestSuite, args: argparse.Namespace) -> unittest.TestSuite:
    """The tests this run takes: ``--bit-exact`` the @bit_exact ones; ``--torchrun`` the
    @under_torchrun ones; otherwise every test but those, unless ``-k`` names them."""
    tests = _tests(suite)
    if args.bit_exact:
        return unittest.TestSuite(t for t in tests if _is_bit_exact(t))
    if args.torchrun:
        return unittest.TestSuite(t for t in tests if _is_under_torchrun(t))
    return unittest.TestSuite(t for t in tests if args.patterns or not _is_under_torchrun(t))


# Modules that reuse one another's runs (a module-level cache of a launched or spawned run):
# in one worker, in this order, so that the run is made once.
SHARED_RUNS = (("tests.test_resume", "tests.test_nd_parallel", "tests.test_fault_tolerance",
                "tests.test_dcp_async"), ("tests.test_dcp", "tests.test_dcp_layouts"))


def _work(modules: List[str]) -> List[str]:
    """``modules`` as a worker's items: one line each, the SHARED_RUNS ones together."""
    items = []
    for module in modules:
        group = next((g for g in SHARED_RUNS if module in g), (module, ))
        item = " ".join(m for m in group if m in modules)
        if item not in items:
            items.append(item)
    return items


def _modules() -> List[str]:
    """Every tests/test_*.py as a module name: the slow ones first, then in name order."""
    names = sorted(f"tests.{f[:-3]}" for f in os.listdir(os.path.join(ROOT, "tests"))
                   if f.startswith("test_") and f.endswith(".py"))
    return [m for m in SLOW_FIRST if m in names] + [m for m in names if m not in SLOW_FIRST]


def _worker(args: argparse.Namespace) -> int:
    """Run the modules named on stdin, one line each; after each, one JSON line of its results
    on the original stdout (the tests' own prints go to stderr, beside the progress dots)."""
    report = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    loader = _loader(args.patterns)
    for line in sys.stdin:
        module = line.strip()
        loaded = loader.loadTestsFromNames(module.split())
        suite = _selected(loaded, args)
        result = TimedResult(unittest.runner._WritelnDecorator(sys.stderr), True,
                             2 if args.verbose else 1)
        result.failfast = args.failfast
        suite(result)
        report.write(
            json.dumps({
                "module": module,
                "run": result.testsRun,
                "failed": [[result.getDescription(t), text] for t, text in result.failures],
                "errors": [[result.getDescription(t), text] for t, text in result.errors],
                "unexpected": len(result.unexpectedSuccesses),
                "skipped": len(result.skipped),
                "left": _left_out(loaded, args),
                "seconds": dict(result.seconds),
                "cpu": dict(result.cpu),
            }) + "\n")
        report.flush()
    return 0


class _Totals:
    """The workers' results, summed."""

    def __init__(self) -> None:
        self.run = self.skipped = self.unexpected = self.left = 0
        self.problems: List[tuple] = []  # (kind, test, traceback text)
        self.seconds: collections.Counter = collections.Counter()
        self.cpu: collections.Counter = collections.Counter()

    def add(self, out: Dict) -> None:
        self.run += out["run"]
        self.skipped += out["skipped"]
        self.left += out["left"]
        self.unexpected += out["unexpected"]
        self.problems += [("FAIL", *f) for f in out["failed"]]
        self.problems += [("ERROR", *e) for e in out["errors"]]
        self.seconds.update(out["seconds"])
        self.cpu.update(out["cpu"])


def _run_in_workers(args: argparse.Namespace, jobs: int) -> _Totals:
    """Hand the modules to ``jobs`` workers, the next to whichever is free; the ALONE ones
    last, one at a time, when no other worker runs."""
    forwarded = [word for p in args.patterns for word in ("-k", p)]  # threads: by environment
    forwarded += [
        flag for flag, on in (("--verbose", args.verbose), ("--failfast", args.failfast),
                              ("--bit-exact", args.bit_exact), ("--torchrun", args.torchrun)) if on
    ]
    modules = _work(_modules())
    queue = [m for m in modules if m not in ALONE]
    alone = [m for m in modules if m in ALONE]
    totals = _Totals()
    workers = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", *forwarded], cwd=ROOT,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        for _ in range(min(jobs, len(modules)))
    ]
    busy: Dict[subprocess.Popen, str] = {}
    selector = selectors.DefaultSelector()
    for worker in workers:
        selector.register(worker.stdout, selectors.EVENT_READ, worker)

    def give(worker: subprocess.Popen, module: str) -> None:
        busy[worker] = module
        worker.stdin.write(module + "\n")
        worker.stdin.flush()

    for worker in workers:
        if queue:
            give(worker, queue.pop(0))
    while busy:
        for key, _ in selector.select():
            worker = key.data
            line = worker.stdout.readline()
            module = busy.pop(worker)
            if not line:  # the worker died (a segfault in the test process itself)
                totals.problems.append(("ERROR", module, f"the worker running {module} ended "
                                        f"with status {worker.wait()} before reporting"))
                selector.unregister(worker.stdout)
                workers.remove(worker)
                continue
            totals.add(json.loads(line))
            if args.failfast and totals.problems:
                queue.clear()
                alone.clear()
            if queue:
                give(worker, queue.pop(0))
            elif alone and not busy:  # every other worker is idle: the timed modules now
                give(worker, alone.pop(0))
        if not busy and alone and workers:
            give(workers[0], alone.pop(0))
    for worker in workers:
        worker.stdin.close()
        worker.wait()
    return totals


def _run_here(args: argparse.Namespace) -> _Totals:
    """Every module in this process (``--jobs 1``)."""
    loaded = _loader(args.patterns).loadTestsFromNames(_modules())
    suite = _selected(loaded, args)
    runner = unittest.TextTestRunner(verbosity=2 if args.verbose else 1, failfast=args.failfast,
                                     resultclass=TimedResult)
    result = runner.run(suite)
    totals = _Totals()
    totals.run, totals.skipped = result.testsRun, len(result.skipped)
    totals.left = _left_out(loaded, args)
    totals.unexpected = len(result.unexpectedSuccesses)
    totals.problems = [("FAIL", t, "") for t, _ in result.failures]
    totals.problems += [("ERROR", t, "") for t, _ in result.errors]  # printed by the runner
    totals.seconds, totals.cpu = result.seconds, result.cpu
    return totals


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
    parser.add_argument(
        "--torchrun", action="store_true",
        help="only the tests under torchrun (killed, restarted, signalled "
        "ranks: new Pythons), which the suite leaves out; CI runs them")
    parser.add_argument(
        "--jobs", type=int, metavar="N",
        help="test modules run at once, each in a worker process (default: "
        f"{default_jobs()}, the cores this process may use divided by --threads, at most 2)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads {args.threads}: expected at least 1")
    if args.jobs is None:
        args.jobs = default_jobs(args.threads)
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: expected at least 1")
    threads = test_threads(args.jobs, args.threads)
    if threads is not None and not args.worker:  # a worker inherits its parent's
        os.environ["SCALETORCH_TEST_THREADS"] = str(threads)
    os.chdir(ROOT)  # the tests name files relative to the checkout
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from tests import harness  # reads SCALETORCH_TEST_THREADS and sets the threads
    if args.worker:
        return _worker(args)
    print(
        f"threads: {harness.PROCESS_THREADS} in the test process, {harness.RANK_THREADS} in "
        f"each rank and launched script; {args.jobs} worker(s)", flush=True)

    start = time.time()
    runs = os.path.join(ROOT, "runs")
    had_runs = os.path.exists(runs)
    totals = _run_in_workers(args, args.jobs) if args.jobs > 1 else _run_here(args)
    if args.jobs > 1:
        print(file=sys.stderr)  # after the progress dots
        for kind, test, text in totals.problems:
            print(f"\n{'=' * 70}\n{kind}: {test}\n{'-' * 70}\n{text}", file=sys.stderr)
    failed = len(totals.problems) + totals.unexpected
    if not had_runs and os.path.exists(runs):  # tests write under temporary directories only
        left = ", ".join(sorted(os.listdir(runs)))
        print(f"error: the tests left {runs} in the checkout ({left}): a test ran a script "
              f"without --logging.run_dir in a temporary directory")
        failed += 1
    # a class whose setUpClass failed is one error and no test run: never below 0
    passed = max(0, totals.run - len(totals.problems) - totals.unexpected - totals.skipped)
    line = f"{passed} passed, {failed} failed"
    if totals.skipped:
        line += f", {totals.skipped} skipped"
    if totals.left:  # (CI runs them in a phase of their own)
        line += f"; {totals.left} under torchrun left for --torchrun"
    if args.durations:
        print("   wall     CPU  (seconds; CPU counts every process of the class)")
    for name, seconds in totals.seconds.most_common(args.durations):
        print(f"{seconds:7.1f} {totals.cpu[name]:7.1f}  {name}")
    print(f"({time.time() - start:.0f} s; {sum(totals.cpu.values()):.0f} s of CPU)")
    print(line)
    return 0 if failed == 0 and totals.run > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
