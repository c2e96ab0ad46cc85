"""Collectives in flight beside compute, as text: one synced backward of each rank.

A ``SyncTimeline`` records one backward that ended in a gradient sync: when it ran, and when
each bucket's all-reduce was launched and completed (``Timer`` marks, dist/timer.py). Chapter
01's recorder fills it (parallel/overlap_chart.py); here it is drawn. ``format_overlap``: every
rank on one axis, two rows a rank: compute (``=``) then the wait (``.``), and how many
all-reduces are in flight (1-9, a-z for 10-35). An all-reduce ends when every rank has launched
it: a rank done early waits for the slow one. ``format_timeline`` (``--verbose``): a row per
bucket. Times: ms from the forward of the micro-batch that synced. The drawing is the
chapter's output, not its strategy: it lives here, beside the timer and the ledger's table.
"""

import math
from dataclasses import dataclass, field, replace
from typing import List, Sequence, Tuple

from scaletorch.dist.timer import Mark, seconds

COUNTS = "123456789abcdefghijklmnopqrstuvwxyz"  # all-reduces in flight: 1..35


@dataclass
class BucketLaunch:
    """One bucket's all-reduce in the recorded timeline (times: ``Timer`` marks, seconds once
    read through ``OverlapRecorder.timeline``)."""
    index: int
    numel: int
    in_backward: bool  # launched by a gradient hook, i.e. while backward was still running
    grads_pending: int  # parameters whose gradient backward had not yet produced
    t_launch: Mark
    t_done: Mark = float("nan")  # when the all-reduce completed


@dataclass
class SyncTimeline:
    """The last synced backward: when it ran, when each bucket went out and came back."""
    t_forward: Mark = float("nan")  # forward start of the micro-batch that synced
    t_first_grad: Mark = float("nan")
    t_backward_end: Mark = float("nan")  # all gradients produced; the wait starts
    t_wait_end: Mark = float("nan")
    launches: List[BucketLaunch] = field(default_factory=list)

    def in_seconds(self) -> "SyncTimeline":
        """A copy with every mark read in seconds (on CUDA: waits for those events)."""
        launches = [
            replace(x, t_launch=seconds(x.t_launch), t_done=seconds(x.t_done))
            for x in self.launches
        ]
        return SyncTimeline(seconds(self.t_forward), seconds(self.t_first_grad),
                            seconds(self.t_backward_end), seconds(self.t_wait_end), launches)


def _spans(timeline: SyncTimeline) -> Tuple[float, float, List[Tuple[float, float]]]:
    """(end of backward, end of the wait, [(launch, done)] of each bucket), in seconds from the
    start (a mark already read in seconds passes ``seconds`` unchanged); a bucket never marked
    done ends with the wait."""
    forward, first_grad = seconds(timeline.t_forward), seconds(timeline.t_first_grad)
    t0 = first_grad if math.isnan(forward) else forward
    wait_end = seconds(timeline.t_wait_end) - t0
    buckets = [(seconds(x.t_launch) - t0, seconds(x.t_done) - t0) for x in timeline.launches]
    done = [(a, wait_end if math.isnan(b) else b) for a, b in buckets]
    return seconds(timeline.t_backward_end) - t0, wait_end, done


def format_overlap(timelines: Sequence[SyncTimeline], width: int = 60) -> str:
    """Every rank's synced step (``timelines`` in rank order) on one axis: per rank a row of
    compute (=) and waiting (.), and a row of the all-reduces in flight (1-9, a-z)."""
    spans = [_spans(t) for t in timelines]
    scale = width / max([max([w] + [d for _, d in b]) for _, w, b in spans] + [1e-9])
    lines = []
    for rank, (backward_end, wait_end, buckets) in enumerate(spans):
        times = [(col + 0.5) / scale for col in range(width)]  # each column's middle
        compute = ["=" if t < backward_end else "." if t < wait_end else " " for t in times]
        counts = [sum(1 for a, b in buckets if a <= t < b) for t in times]
        flight = [" " if n == 0 else COUNTS[min(n, len(COUNTS)) - 1] for n in counts]
        early = sum(1 for _, done in buckets if done <= backward_end)
        lines.append(
            f"rank {rank} compute   |{''.join(compute)}| backward {backward_end * 1e3:.1f} "
            f"ms, waited {(wait_end - backward_end) * 1e3:.1f} ms")
        lines.append(f"rank {rank} in flight |{''.join(flight)}| {len(buckets)} buckets, "
                     f"{early} done before backward ended")
    return "\n".join(lines)


def format_timeline(timeline: SyncTimeline, width: int = 60) -> str:
    """One rank's synced step: compute (=), each bucket's all-reduce from launch to completion
    (#), the wait (.)."""
    backward_end, wait_end, buckets = _spans(timeline)
    scale = width / max([wait_end] + [done for _, done in buckets] + [1e-9])

    def row(label: str, start: float, end: float, char: str, note: str = "") -> str:
        a = min(width - 1, int(start * scale))
        b = max(a + 1, min(width, round(end * scale)))
        bar = " " * a + char * (b - a) + " " * (width - b)
        return f"{label:<17}|{bar}| {start * 1e3:7.1f} -{end * 1e3:7.1f} ms{note}"

    lines = [row("forward+backward", 0.0, backward_end, "=")]
    for x, (launch, done) in zip(timeline.launches, buckets):
        lines.append(row(f"bucket {x.index}", launch, done, "#", f"  {x.numel * 4 / 1e6:.3f} MB"))
    lines.append(row("wait", backward_end, wait_end, "."))
    return "\n".join(lines)
