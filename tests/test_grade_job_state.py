"""What one graded job may leave in a rank is put back before the next (scripts/grading/
job_state.py): torch's default dtype and device, grad and inference mode, threads, anomaly
detection and deterministic algorithms, the working directory, the recursion limit and
sys.stdout, a function of torch or the library replaced, and a job's printed lines past the
first SHOWN_LINES. In this process, no world (the worlds' cases: tests/test_grade.py, chapter
06b's biased_top_k_sets_float64 and biased_top_k_leaves_inference_mode_on)."""

import functools
import io
import os
import sys
import tempfile
import unittest

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from scaletorch.dist import comm
from scaletorch.parallel import moe_balance
from scripts.grading import job_state
from scripts.grading.learner import patched
from scripts.grading.verdicts import error_verdict


class _InARank(unittest.TestCase):

    def setUp(self):
        self.streams = sys.stdout, sys.stderr
        self.start()

    def start(self):
        """A rank's state as its world starts; each hypothesis example starts one (hypothesis
        raises the recursion limit while an example runs)."""
        sys.stdout, sys.stderr = self.streams
        self.shown = io.StringIO()
        sys.stdout = self.shown  # what the rank's CappedOutput writes through to
        self.state = job_state.JobState(rank=1)

    def tearDown(self):
        sys.stdout, sys.stderr = self.streams
        torch.set_default_dtype(torch.float32)
        torch.set_default_device(None)
        torch.set_grad_enabled(True)
        torch.set_anomaly_enabled(False)
        if torch.are_deterministic_algorithms_enabled():  # the setter's first call takes 10 s
            torch.use_deterministic_algorithms(False)


class SettingsArePutBack(_InARank):

    @given(dtype=st.sampled_from([torch.float64, torch.bfloat16, torch.float16]),
           grad=st.booleans())
    @settings(max_examples=12, deadline=None)
    def test_a_changed_setting_fails_its_job_and_the_next_job_starts_as_the_world_did(
            self, dtype, grad):
        self.start()
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        item = self.state.end_job({"exercise": "biased_top_k", "probe": 1})
        self.assertEqual((torch.get_default_dtype(), torch.is_grad_enabled()),
                         (torch.float32, True))
        self.assertEqual(item["probe"], 1)  # what the job measured stays
        self.assertIn(
            f"biased_top_k left torch's default dtype at {dtype} (it was "
            f"torch.float32)", item["settings_left"])
        self.assertEqual("grad mode at False (it was True)" in item["settings_left"], not grad)
        self.assertNotIn("torch.Storage", item["settings_left"])  # set_default_dtype's own

    @given(inference=st.booleans(), device=st.sampled_from(["cpu", "meta"]),
           dtype=st.sampled_from([torch.float32, torch.float64]))
    @settings(max_examples=12, deadline=None)
    def test_inference_mode_left_on_and_a_default_device_are_put_back(self, inference, device,
                                                                      dtype):
        self.start()
        held = []  # a learner's module-level ``ctx = torch.inference_mode(); ctx.__enter__()``
        if inference:
            held.append(torch.inference_mode())
            held[0].__enter__()
        torch.set_default_device(device)
        torch.set_default_dtype(dtype)
        item = self.state.end_job({"exercise": "exit_region"})
        self.assertFalse(torch.is_inference_mode_enabled())
        self.assertEqual(torch.get_default_device(), torch.device("cpu"))
        # the next job builds a graph and runs its backward (an inference tensor would raise)
        x = torch.ones(3, requires_grad=True)
        (x * x).sum().backward()
        self.assertEqual(x.grad.tolist(), [2.0, 2.0, 2.0])
        left = item.get("settings_left", "")
        self.assertEqual("inference mode at True (it was False)" in left, inference)
        self.assertEqual("default device at meta (it was cpu)" in left, device == "meta")
        if inference or device == "meta" or dtype != torch.float32:
            self.assertIn("(put back for them)", left)
        else:
            self.assertNotIn("settings_left", item)

    @given(changes=st.sets(
        st.sampled_from(["threads", "anomaly", "deterministic", "cwd", "recursion", "stdout"]),
        min_size=1))
    @settings(max_examples=15, deadline=None)
    def test_every_process_wide_setting_a_job_left_is_named_and_put_back(self, changes):
        self.start()
        before = (torch.get_num_threads(), os.getcwd(), sys.getrecursionlimit())
        change = {
            "threads": lambda: torch.set_num_threads(before[0] + 1),
            "anomaly": lambda: torch.set_anomaly_enabled(True),
            "deterministic": lambda: torch.use_deterministic_algorithms(True),
            "cwd": lambda: os.chdir(tempfile.gettempdir()),
            "recursion": lambda: sys.setrecursionlimit(before[2] + 7),
            "stdout": lambda: setattr(sys, "stdout", io.StringIO()),
        }
        named = {
            "threads": f"torch's number of threads at {before[0] + 1} (it was {before[0]})",
            "anomaly": "torch's anomaly detection at True (it was False)",
            "deterministic": "torch's deterministic algorithms at True (it was False)",
            "cwd": f"the working directory at {tempfile.gettempdir()} (it was {before[1]})",
            "recursion": f"the recursion limit at {before[2] + 7} (it was {before[2]})",
            "stdout": "sys.stdout replaced by StringIO",
        }
        for name in changes:
            change[name]()
        item = self.state.end_job({"exercise": "wait_for_buckets"})
        self.assertEqual((torch.get_num_threads(), os.getcwd(), sys.getrecursionlimit()), before)
        self.assertFalse(torch.is_anomaly_enabled())
        self.assertFalse(torch.are_deterministic_algorithms_enabled())
        self.assertIs(sys.stdout, self.state.out)
        for name, words in named.items():
            self.assertEqual(words in item["settings_left"], name in changes, name)
        self.assertIn("(put back for them)", item["settings_left"])

    @given(replaced=st.sets(
        st.sampled_from([
            "dist.all_reduce", "F.cross_entropy", "Tensor.backward", "comm.all_reduce",
            "Tensor.my_helper"
        ]), min_size=1))
    @settings(max_examples=12, deadline=None)
    def test_a_function_of_torch_or_the_library_replaced_is_named_and_put_back(self, replaced):
        self.start()  # a rank imported the library before its first job: it is watched
        owners = {"dist": dist, "F": F, "Tensor": torch.Tensor, "comm": comm}
        named = {
            "dist": "torch.distributed",
            "F": "torch.nn.functional",
            "Tensor": "torch.Tensor",
            "comm": "scaletorch.dist.comm"
        }
        before = {n: getattr(owners[n.split(".")[0]], n.split(".")[1], None) for n in replaced}

        def counting(*args, **kwargs):  # the learner's, left in place
            return None

        for name in replaced:
            setattr(owners[name.split(".")[0]], name.split(".")[1], counting)
        # the grader's own patch of the exercise, active while the job's result is written
        with patched([(moe_balance, "update_bias", counting)]):
            item = self.state.end_job({"exercise": "average_gradients"})
            self.assertIs(moe_balance.update_bias, counting)  # the grader's: left as it is
        for name in replaced:
            owner, attr = name.split(".")
            self.assertIs(getattr(owners[owner], attr, None), before[name], name)
            verb = "added" if attr == "my_helper" else "replaced"
            self.assertIn(f"{named[owner]}.{attr} {verb}", item["settings_left"])
        self.assertNotIn("update_bias", item["settings_left"])

    def test_a_wrapper_of_the_function_it_replaced_is_torchs_own_and_stays(self):
        seed = torch.manual_seed
        try:  # what importing torch._dynamo does to torch.manual_seed, in a job's middle
            torch.manual_seed = functools.wraps(seed)(lambda *a, **k: seed(*a, **k))
            wrapped = torch.manual_seed
            self.assertNotIn("settings_left", self.state.end_job({"exercise": "gather_unit"}))
            self.assertIs(torch.manual_seed, wrapped)
            torch.manual_seed = seed  # a later replacement of the wrapper is the learner's
            item = self.state.end_job({"exercise": "release_unit"})
            self.assertIn("torch.manual_seed replaced", item["settings_left"])
            self.assertIs(torch.manual_seed, wrapped)
        finally:
            torch.manual_seed = seed

    def test_a_device_mode_entered_and_never_left_is_said_to_stay(self):
        held = torch.device("meta")
        held.__enter__()  # a mode on torch's stack: set_default_device cannot pop it
        try:
            item = self.state.end_job({"exercise": "ring_forward"})
            self.assertIn("ring_forward left torch's default device at meta (it was cpu)",
                          item["settings_left"])
            self.assertIn("it could not be put back", item["settings_left"])
        finally:
            held.__exit__(None, None, None)

    def test_an_unchanged_job_is_left_as_it_is_and_an_error_says_the_setting_first(self):
        self.assertEqual(self.state.end_job({"exercise": "x", "a": 2}), {"exercise": "x", "a": 2})
        # a chapter's own result may hold any key ("state": 04's, 06's and 08's weights)
        kept = self.state.end_job({"exercise": "x", "state": {"w": torch.ones(2)}})
        self.assertIsNone(error_verdict("x", [kept, kept]))
        torch.set_default_dtype(torch.float64)
        failed = self.state.end_job({"exercise": "x", "error": "ValueError: its own"})
        # the setting first (it may be the error's cause), then the error
        self.assertRegex(
            failed["error"], r"^x left torch's default dtype at torch.float64 .*; "
            r"then: ValueError: its own$")
        self.assertEqual(torch.get_default_dtype(), torch.float32)  # put back all the same


class PrintedLinesAreCapped(_InARank):

    def test_stdout_and_stderr_share_the_cap_and_a_line_without_its_end_is_ended(self):
        sys.stderr = self.state.err  # the rank's stderr, writing where its stdout does
        self.state.err.stream = self.shown
        for i in range(15):
            print(f"out {i}")
            print(f"err {i}", file=sys.stderr)
        print("x" * 10, end="")
        self.state.end_job({"exercise": "j"})
        out = self.shown.getvalue().splitlines()
        self.assertEqual(len(out), job_state.SHOWN_LINES + 1)
        self.assertEqual(out[-1], "(rank 1: 10 more lines printed in j, not shown)")
        self.shown.seek(0)
        self.shown.truncate()
        print("y" * (job_state.SHOWN_CHARS + 1), end="")  # one line of more than is shown
        print("z", end="")
        self.state.end_job({"exercise": "k"})
        self.assertEqual(self.shown.getvalue(),
                         "z\n(rank 1: 4001 more characters printed in k, not shown)\n")

    @given(lines=st.integers(0, 200), jobs=st.integers(1, 3))
    @settings(max_examples=20, deadline=None)
    def test_each_job_shows_its_first_lines_and_counts_the_rest(self, lines, jobs):
        self.start()
        for job in range(jobs):
            self.shown.seek(0)
            self.shown.truncate()
            for i in range(lines):
                print(f"line {i}")
            self.state.end_job({"exercise": f"job{job}"})
            out = self.shown.getvalue().splitlines()
            shown = min(lines, job_state.SHOWN_LINES)
            self.assertEqual(out[:shown], [f"line {i}" for i in range(shown)])
            if lines > shown:
                self.assertEqual(
                    out[shown:],
                    [f"(rank 1: {lines - shown} more lines printed in "
                     f"job{job}, not shown)"])
            else:
                self.assertEqual(len(out), lines)


if __name__ == "__main__":
    unittest.main()
