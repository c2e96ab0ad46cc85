"""What one graded job may leave in a rank is put back before the next (scripts/grading/
job_state.py): torch's default dtype and device, grad mode and inference mode, and a job's
printed lines past the first SHOWN_LINES. In this process, no world (the worlds' cases:
tests/test_grade.py, chapter 06b's biased_top_k_sets_float64 and
biased_top_k_leaves_inference_mode_on)."""

import io
import sys
import unittest

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scripts.grading import job_state
from scripts.grading.verdicts import error_verdict


class _InARank(unittest.TestCase):

    def setUp(self):
        self.streams = sys.stdout, sys.stderr
        self.shown = io.StringIO()
        sys.stdout = self.shown  # what the rank's CappedOutput writes through to
        self.state = job_state.JobState(rank=1)

    def tearDown(self):
        sys.stdout, sys.stderr = self.streams
        torch.set_default_dtype(torch.float32)
        torch.set_default_device(None)
        torch.set_grad_enabled(True)


class SettingsArePutBack(_InARank):

    @given(dtype=st.sampled_from([torch.float64, torch.bfloat16, torch.float16]),
           grad=st.booleans())
    @settings(max_examples=12, deadline=None)
    def test_a_changed_setting_fails_its_job_and_the_next_job_starts_as_the_world_did(
            self, dtype, grad):
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

    @given(inference=st.booleans(), device=st.sampled_from(["cpu", "meta"]),
           dtype=st.sampled_from([torch.float32, torch.float64]))
    @settings(max_examples=12, deadline=None)
    def test_inference_mode_left_on_and_a_default_device_are_put_back(self, inference, device,
                                                                      dtype):
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
