"""The timer behind the DDP and pipeline timelines: the clock on CPU, CUDA events on a GPU."""

import math
import time
import unittest

import torch

from scaletorch.dist.overlap_text import BucketLaunch, SyncTimeline
from scaletorch.dist.timer import Spans, Timer, seconds


class _FakeClock:
    """0.0, 1.0, 2.0, ...: one tick per reading."""

    def __init__(self):
        self.now = -1.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


class CpuTimerReadsTheClockAtEachMark(unittest.TestCase):

    def test_marks_are_the_clock_readings_in_order(self):
        timer = Timer(torch.device("cpu"), _FakeClock())  # reading 0 is the origin
        marks = [timer.mark() for _ in range(3)]
        self.assertEqual(marks, [1.0, 2.0, 3.0])
        self.assertEqual([seconds(m) for m in marks], [1.0, 2.0, 3.0])
        self.assertTrue(math.isnan(seconds(float("nan"))))  # "not recorded" stays so

    def test_default_clock_is_perf_counter(self):
        timer = Timer(torch.device("cpu"))
        before = time.perf_counter()
        mark = timer.mark()
        after = time.perf_counter()
        self.assertIsInstance(mark, float)
        self.assertTrue(before <= seconds(mark) <= after)

    def test_spans_time_each_labelled_piece_of_work_with_the_timer(self):
        spans = Spans(torch.device("cpu"), _FakeClock())  # what the pipeline times its actions by
        for label in ("F0", "F1", "B0"):
            with spans.time(label):
                pass
        self.assertEqual(spans.seconds(), [("F0", 1, 2), ("F1", 3, 4), ("B0", 5, 6)])

    def test_ddp_sync_timeline_reads_cpu_marks_unchanged(self):
        recorded = SyncTimeline(1.0, 2.0, 5.0, 6.0, [BucketLaunch(0, 8, True, 3, 2.5, 4.0)])
        self.assertEqual(recorded.in_seconds(), recorded)


@unittest.skipUnless(torch.cuda.is_available(), "needs a GPU: the CUDA branch of the timer")
class CudaTimerMarksWhenTheDeviceRuns(unittest.TestCase):

    def test_a_mark_after_queued_work_is_when_the_work_ran_not_when_it_was_queued(self):
        timer = Timer(torch.device("cuda", torch.cuda.current_device()))
        start = timer.mark()
        torch.cuda._sleep(200_000_000)  # a kernel that spins for ~0.1 s (cycles; GPU-dependent)
        end = timer.mark()
        queued = time.perf_counter()  # the host is back at once: the kernel is only queued
        self.assertGreater(seconds(end), queued)
        self.assertGreater(seconds(end) - seconds(start), 0.01)


if __name__ == "__main__":
    unittest.main()
