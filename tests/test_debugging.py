"""Chapter 11: each injected fault ends as doc/11_debugging.md shows, and the tools find it.

One launch per fault (examples/11_debugging.py, 2 ranks, 5 steps, timeout 3 s), two at a time,
without launch.sh's pre-flight (these faults come after the start); the checks read their
output, the flight-recorder dumps and the profiles. The suite's launches fork their ranks from
the suite's forkserver (tests/harness.py's ``launch_forked``: torchrun's variables, no new
Pythons): the skip, the kill, the straggler (its run ends well) and the shape (its claims are
torch's DETAIL check and the script's fault: each rank raises naming both shapes). The raise
goes through torchrun (scripts/torchrun.py, the agent forked from the suite's forkserver, its
ranks new Pythons), whose error report is what it shows: one traceback, the first failure
named, one line for the other rank, which torchrun ended. Its two new Pythons (about 5 s of a
core each) put it under ``python run_tests.py --torchrun`` (``TorchrunReportsARaise``); the
suite holds what it proves in parts: that report read from ProcessFailures of each kind
(``TorchrunReportsTheFirstFailure``: a raise's error files, a SIGKILL's status), the ranks'
error files (``ErrorFile``), and torchrun.py started by launch.sh with ranks that fail
(tests/test_layout_errors.py's BadLayoutsReachTheUserOnce). Torchrun seeing a killed rank is
test_resume's KilledRankResumes (it restarts it)."""

import io
import json
import os
import pickle
import re
import shutil
import signal
import tempfile
import time
import unittest
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stdout
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.flight_recorder.components.fr_logger import FlightRecorderLogger

from scaletorch.dist import flight_recorder, meet_before_first_step
from scaletorch.trainer.config import one_traceback, write_error_file
from scripts import fr_analyze
from scripts import torchrun as torchrun_script
from tests.harness import NCCL_CHECKS, launch_forked, run_distributed, run_forked, under_torchrun
from tests.test_examples import ROOT

SCRIPT = "examples/11_debugging.py"
FAST = ("--steps", "5", "--training.timeout_seconds", "3", "--logging.progress", "false")
RUNS = {  # name: (arguments, environment)
    "skip": (("--fault", "skip", "--fault-rank", "1", "--fault-step", "2"), {}),
    "raise": (("--fault", "raise", "--fault-rank", "0", "--fault-step", "2"), {}),
    "kill": (("--fault", "kill", "--fault-rank", "1", "--fault-step", "2"), {}),
    "shape": (("--fault", "shape", "--fault-rank", "1", "--fault-step", "2"), {
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL"
    }),
    # a straggler that sleeps 500 ms a step (a step is about 10 ms here, 50 ms when another test
    # module runs beside this one on 2 cores; at 200 ms, rank 0 was once named instead under a
    # full suite's load), profiled for 2 steps
    "straggler": (("--fault", "straggler", "--fault-rank", "1", "--fault-step", "1",
                   "--fault-seconds", "0.5", "--profile", "2"), {}),
}
FORKED = ("skip", "kill", "straggler", "shape")  # all but the raise (the docstring)
TRACEBACK = "Traceback (most recent call last)"


def _launch(name: str, tmp: str) -> tuple:
    """RUNS[name] in a run directory under ``tmp``: (its output, its status, its run's files)."""
    args, env = RUNS[name]
    run_dir = os.path.join(tmp, name)
    if name in FORKED:
        out, code = launch_forked(SCRIPT, 2, *FAST, *args, "--logging.run_dir", run_dir, env=env,
                                  timeout=120)
        return out, code, os.path.join(run_dir, "11_debugging")
    # torchrun (scripts/torchrun.py, as launch.sh runs it) forked from the forkserver: its
    # ranks are new Pythons as under launch.sh, the agent does not import torch again (about
    # 2.5 s of a core a launch; launch.sh's own steps: test_launch.py)
    done = run_forked("scripts/torchrun.py", "--nproc-per-node", "2", "--max-restarts", "0",
                      "--standalone", SCRIPT, *FAST, *args, "--logging.run_dir", run_dir, env={
                          **os.environ, "PYTHONPATH": ROOT,
                          **NCCL_CHECKS,
                          **env
                      }, timeout=120)
    return done.stdout + done.stderr, done.returncode, os.path.join(run_dir, "11_debugging")


class InjectedFaultsEndAsDocumented(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp()
        with ThreadPoolExecutor(max_workers=2) as pool:  # 4 ranks at a time
            cls.runs = dict(zip(FORKED, pool.map(lambda name: _launch(name, cls.tmp), FORKED)))

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_a_skipped_collective_hangs_until_the_timeout_and_the_dumps_name_rank_op_and_group(
            self):
        out, code, run = self.runs["skip"]
        self.assertEqual(code, 1, out[-3000:])
        self.assertIn("Timed out waiting 3000ms", out)  # torchrun's report of it: below
        traces = flight_recorder.load(os.path.join(run, "flight_recorder"))
        self.assertEqual(sorted(traces), [0, 1])  # every rank wrote its trace
        first = flight_recorder.disagreements(traces)[0]
        call, there, ranks = first
        # rank 1 stopped after step 1: rank 0's first gradient all-reduce of step 2 over the
        # dp group has no partner. dp's first collectives are the wrap's: the all-gather that
        # checks the ranks hold the same model, the broadcast that makes the replicas equal;
        # then 8 buckets (chapter 01's 0.05 MB) + 1 loss all-reduce per step: step 2's first
        # bucket is dp's collective 2 + 2 * 9 + 1 = 21.
        self.assertEqual((call.group, call.op, call.seq, ranks), ("dp", "all_reduce", 21, [0, 1]))
        self.assertEqual(sorted(there), [0])
        with open(os.path.join(ROOT, "scaletorch", "parallel", "data_parallel.py")) as f:
            line = next(i for i, text in enumerate(f, 1) if "comm.all_reduce(buffer" in text)
        self.assertEqual(call.where, f"scaletorch/parallel/data_parallel.py:{line} _all_reduce")
        lines = flight_recorder.analyze(traces)
        self.assertIn("  rank 1: never issued it", lines)
        self.assertIn("  rank 1: all_gather #1 of group 'world' [[1]] Float, issued at "
                      "scaletorch/dist/straggler.py:30 straggler_report",
                      lines)  # the Trainer's log line

    def test_the_analyzer_script_and_torchfrtrace_read_the_dumps(self):
        _, _, run = self.runs["skip"]
        directory = os.path.join(run, "flight_recorder")
        out = io.StringIO()
        with redirect_stdout(out):
            self.assertEqual(fr_analyze.main([directory]), 0)
        self.assertIn("first disagreement: collective #21 of group 'dp' (ranks [0, 1])",
                      out.getvalue())
        # torch's analyzer (torchfrtrace) reads them too: dump() fills the group table that
        # gloo leaves empty
        # The analyzer logs through one logger that adds its own stderr handler when first
        # made; made here, assertLogs then swaps that handler out, and the analyzer's report and
        # its import's "tabulate is not installed" warning stay off the suite's output.
        FlightRecorderLogger()
        # torchfrtrace reads pickles only: the test pickles our JSON dumps' content itself (our
        # own values, in a temporary directory), since fr_analyze.py never reads a pickle
        pickled = os.path.join(self.tmp, "fr_pickled")
        os.makedirs(pickled, exist_ok=True)
        for rank, trace in flight_recorder.load(directory).items():
            with open(os.path.join(pickled, f"rank_{rank}"), "wb") as f:
                pickle.dump(trace, f)
        with self.assertLogs("Flight Recorder", "INFO") as logs:
            from torch.distributed.flight_recorder import fr_trace
            fr_trace.main([pickled, "--prefix", "rank_"])
        text = "\n".join(r.getMessage() for r in logs.records)
        self.assertRegex(
            text, r"group info: \d+:dp\ncollective: gloo:all_reduce\n"
            r"missing ranks: \{1\}")

    def test_a_killed_rank_says_so_and_ends_the_run(self):
        out, code, _ = self.runs["kill"]
        self.assertNotEqual(code, 0, out[-3000:])
        # its last words; torchrun's report of the kill: TorchrunReportsTheFirstFailure
        self.assertIn("rank 1: injected kill (SIGKILL) at step 2", out)

    def test_another_shape_is_named_with_both_shapes_under_distributed_debug_detail(self):
        out, code, _ = self.runs["shape"]
        self.assertNotEqual(code, 0)
        self.assertIn("Detected mismatch between collectives on ranks", out)
        # the first bucket of chapter 01's model holds 12,352 elements; rank 1 sent one more
        self.assertIn("TensorShape=[12352]", out)
        self.assertIn("TensorShape=[12353]", out)
        # each rank raises a Python error naming the mismatch, no abort (forked ranks print
        # their own; torchrun's one report of two raising ranks is the skip's)
        for rank in (0, 1):
            self.assertRegex(
                out, rf"\nRuntimeError: rank {rank}: step 2 failed; the last collective issued "
                r"was all_reduce over group 'dp' \(2 ranks\): Detected mismatch between "
                rf"collectives on ranks. Rank {rank} ")

    def test_a_straggler_is_named_and_the_profiles_hold_the_labelled_collectives(self):
        out, code, run = self.runs["straggler"]
        self.assertEqual(code, 0, out[-3000:])
        match = re.search(r"straggler: rank (\d) is busy ([\d.]+) ms a step, ([\d.]+)x the median",
                          out)
        self.assertIsNotNone(match, out[-2000:])
        self.assertEqual(match.group(1), "1")
        self.assertGreaterEqual(float(match.group(2)), 500.0)  # its sleep alone is 500 ms
        for rank in (0, 1):
            with open(os.path.join(run, "profile", f"rank_{rank}.json")) as f:
                events = json.load(f)["traceEvents"]
            names = [e.get("name", "") for e in events]
            # 2 profiled steps x (8 buckets + 1 loss) all-reduces over dp, each labelled
            self.assertEqual(names.count("dp all_reduce"), 18)
            self.assertIn("ProfilerStep#1", names)
        # the line doc/11_debugging.md's profiled run shows (its block is not re-run in CI)
        self.assertIn("profile: 2 steps per rank in ", out)


class TorchrunReportsARaise(unittest.TestCase):
    """The raise of RUNS under torchrun, end to end (the module's docstring)."""

    @under_torchrun
    def test_a_raising_rank_gives_one_traceback_and_one_line_per_other_rank(self):
        with tempfile.TemporaryDirectory() as tmp:
            out, code, _ = _launch("raise", tmp)
        self.assertEqual(code, 1, out[-3000:])
        self.assertEqual(out.count(TRACEBACK), 1, out[-3000:])
        self.assertIn("error: rank 0 failed first:", out)
        self.assertIn("RuntimeError: injected error on rank 0 at step 2", out)
        self.assertEqual(len(re.findall(r"^rank 1: stopped because rank 0 failed", out, re.M)), 1)


LATE = 2.5  # seconds a rank ends its setup after the other: more than SHORT
SHORT = 2.0  # the collectives' timeout


def _late_ranks(rank: int, world: int) -> list:
    """Two first steps in one world under a SHORT timeout, rank 1 LATE to the first, rank 0 to
    the second: each step's all-reduce result (2.0 when both took part, None when it failed)."""
    import datetime
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=SHORT))
    out: list = []
    for late in (1, 0):
        if rank == late:
            time.sleep(LATE)  # its setup: rank 0 writes the run directory, say
        meet_before_first_step(SHORT)  # what Run.batches does before a run's first step
        total = torch.ones(1)
        try:
            dist.all_reduce(total)
            out.append(total.item())
        except RuntimeError:
            out.append(None)
    return out


class RanksMeetBeforeTheFirstStep(unittest.TestCase):
    """A rank that ends its setup later than the collectives' timeout (the first optimizer
    imports torch._dynamo: seconds apart on a busy host) is waited for before step 0. The
    short timeout still ends a collective whose partner never comes: the skip run above."""

    def test_a_rank_later_than_the_timeout_to_its_first_step_is_waited_for(self):
        self.assertEqual(run_distributed(_late_ranks, 2, timeout=60), [[2.0, 2.0]] * 2)


class OneTraceback(unittest.TestCase):

    def test_a_chain_of_raise_from_is_one_stack_and_every_message(self):

        def inner():
            raise KeyError("a bug")

        try:
            try:
                inner()
            except KeyError as err:
                raise RuntimeError("step 3 failed") from err
        except RuntimeError as err:
            text = one_traceback(err)
        self.assertEqual(text.count(TRACEBACK), 1)
        self.assertRegex(
            text, r"in inner\n\s+raise KeyError\(\"a bug\"\)\nKeyError: 'a bug'\n"
            r"\(raised again as RuntimeError: step 3 failed\)\n$")


def _raised(path: str, rank: int, what: str) -> ProcessFailure:
    """The ProcessFailure torchrun hands over for a rank that raised RuntimeError(what): its
    error file written by the ranks' own writer (exit status 1)."""
    try:
        raise RuntimeError(what)
    except RuntimeError as err:
        with mock.patch.dict(os.environ, {"RANK": str(rank)}):
            write_error_file(path, err, err.__traceback__)
    return ProcessFailure(local_rank=rank, pid=1, exitcode=1, error_file=path)


class TorchrunReportsTheFirstFailure(unittest.TestCase):
    """scripts/torchrun.py's report of the skip's and the kill's failures, from the
    ProcessFailures torchrun hands over (TorchrunReportsARaise shows it end to end, under
    ``python run_tests.py --torchrun``)."""

    def test_two_raising_ranks_are_the_first_ones_traceback_and_one_line(self):
        # the skip: rank 0's all-reduce timed out, then rank 1's next collective failed
        with tempfile.TemporaryDirectory() as tmp:
            timed_out = _raised(
                os.path.join(tmp, "0.json"), 0, "rank 0: step 2 failed; the "
                "last collective issued was all_reduce over group 'dp' (2 "
                "ranks): Timed out waiting 3000ms")
            closed = _raised(os.path.join(tmp, "1.json"), 1,
                             "rank 1: step 2 failed; Connection closed by peer")
            text = torchrun_script.report({0: timed_out, 1: closed})
        self.assertEqual(text.count(TRACEBACK), 1, text)
        self.assertTrue(text.startswith("error: rank 0 failed first:\n"), text)
        self.assertIn("Timed out waiting 3000ms", text)
        self.assertEqual(re.findall(r"^rank \d: stopped because rank \d failed.*", text, re.M), [
            "rank 1: stopped because rank 0 failed (RuntimeError: rank 1: step 2 "
            "failed; Connection closed by peer)"
        ])

    def test_a_killed_rank_is_named_as_the_first_failure(self):
        # the kill: rank 1 SIGKILLed (no error file); rank 0 then ended by torchrun, or failed
        # on its own first (its error file earlier than torchrun saw the kill): the kill wins
        with tempfile.TemporaryDirectory() as tmp:
            killed = ProcessFailure(local_rank=1, pid=1, exitcode=-int(signal.SIGKILL),
                                    error_file=os.path.join(tmp, "none.json"))
            ended = ProcessFailure(local_rank=0, pid=1, exitcode=-int(signal.SIGTERM),
                                   error_file=os.path.join(tmp, "none.json"))
            raised = _raised(os.path.join(tmp, "0.json"), 0, "rank 0: step 2 failed")
            for rank0, line in ((ended, "torchrun ended it: SIGTERM"),
                                (raised, "RuntimeError: rank 0: step 2 failed")):
                text = torchrun_script.report({0: rank0, 1: killed})
                self.assertEqual(text.count(TRACEBACK), 0, text)
                self.assertTrue(text.startswith("error: rank 1 failed first: killed by SIGKILL"),
                                text)
                self.assertEqual(text.splitlines()[1:],
                                 [f"rank 0: stopped because rank 1 failed ({line})"])


class ErrorFile(unittest.TestCase):
    """The error file a failing rank writes for torchrun (scaletorch/trainer/config.py)."""

    def test_torchrun_reads_it_and_a_rank_stopped_while_writing_leaves_none(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "error.json")
            try:
                raise RuntimeError("step 3 failed")
            except RuntimeError as err:
                failed = err
            with mock.patch.dict(os.environ, {"RANK": "1"}):
                write_error_file(path, failed, failed.__traceback__)
            # torchrun's own reader: the message, the traceback, and which rank at what time
            failure = ProcessFailure(local_rank=1, pid=1, exitcode=1, error_file=path)
            self.assertEqual(failure.message["message"], "RuntimeError: step 3 failed")
            self.assertIn(TRACEBACK, failure.message["extraInfo"]["py_callstack"])
            self.assertEqual(failure.error_file_data["scaletorch"]["rank"], 1)
            os.remove(path)

            # a rank stopped half-way through writing (torchrun's SIGTERM, once a peer has
            # failed): torchrun reads every stopped rank's file, and half a file would make
            # it fail with a JSONDecodeError instead of restarting the ranks
            def half(data, f):
                f.write(json.dumps(data)[:20])
                raise KeyboardInterrupt  # where the process would die

            with mock.patch("scaletorch.trainer.config.json.dump", half):
                with self.assertRaises(KeyboardInterrupt):
                    write_error_file(path, failed, failed.__traceback__)
            self.assertFalse(os.path.exists(path))
            failure = ProcessFailure(local_rank=1, pid=1, exitcode=-15, error_file=path)
            self.assertEqual(failure.signal_name(), "SIGTERM")


if __name__ == "__main__":
    unittest.main()
