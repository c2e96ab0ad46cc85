"""The bucketed DDP's overlap, drawn as text: what chapter 01 prints after training.

``BucketedDataParallel.timeline`` records one synced step of a rank: its forward and backward,
each bucket's all-reduce from launch to completion, and the wait at the end of backward.

- ``format_overlap``: every rank's step on one time axis, two rows a rank. The first shows
  compute (``=``) and the wait (``.``); the second, how many buckets' all-reduces are in flight
  (``1``-``9``, then ``a``-``z`` for 10-35). An all-reduce ends only when every rank has
  launched it, so a rank that finished backward early waits with the slower rank's buckets.
- ``format_timeline``: one rank's step, one row per bucket (``--verbose``, and the picture
  that scripts/plot.py draws).

Times are ms from the forward of the micro-batch that synced, on each rank's own clock.
"""

import math
from typing import List, Sequence, Tuple

from scaletorch.dist.timer import seconds
from scaletorch.parallel.data_parallel import SyncTimeline

COUNTS = "123456789abcdefghijklmnopqrstuvwxyz"  # all-reduces in flight: 1..35


def _spans(timeline: SyncTimeline) -> Tuple[float, float, float, List[Tuple[float, float]]]:
    """(start, end of backward, end of the wait, [(launch, done)] of each bucket), in seconds
    from the start; a bucket never marked done ends with the wait."""
    # as floats (``BucketedDataParallel.timeline`` already read them: seconds() passes them on)
    forward, first_grad = seconds(timeline.t_forward), seconds(timeline.t_first_grad)
    t0 = first_grad if math.isnan(forward) else forward
    backward_end = seconds(timeline.t_backward_end) - t0
    wait_end = seconds(timeline.t_wait_end) - t0
    buckets = []
    for x in timeline.launches:
        done = seconds(x.t_done)
        buckets.append((seconds(x.t_launch) - t0, wait_end if math.isnan(done) else done - t0))
    return 0.0, backward_end, wait_end, buckets


def format_overlap(timelines: Sequence[SyncTimeline], width: int = 60) -> str:
    """Every rank's synced step (``timelines`` in rank order) on one axis: per rank a row of
    compute (=) and waiting (.), and a row of the all-reduces in flight (1-9, a-z)."""
    spans = [_spans(t) for t in timelines]
    end = max([wait_end for _, _, wait_end, b in spans] + [d for s in spans for _, d in s[3]])
    scale = width / max(end, 1e-9)  # columns per second
    lines = []
    for rank, (_, backward_end, wait_end, buckets) in enumerate(spans):
        compute, flight = [], []
        for col in range(width):
            t = (col + 0.5) / scale  # the middle of the column
            compute.append("=" if t < backward_end else "." if t < wait_end else " ")
            n = sum(1 for launch, done in buckets if launch <= t < done)
            flight.append(" " if n == 0 else COUNTS[min(n, len(COUNTS)) - 1])
        early = sum(1 for _, done in buckets if done <= backward_end)
        lines.append(
            f"rank {rank} compute   |{''.join(compute)}| backward {backward_end * 1e3:.1f} "
            f"ms, waited {(wait_end - backward_end) * 1e3:.1f} ms")
        lines.append(f"rank {rank} in flight |{''.join(flight)}| {len(buckets)} buckets, "
                     f"{early} done before backward ended")
    return "\n".join(lines)


def format_timeline(timeline: SyncTimeline, width: int = 60) -> str:
    """ASCII picture of one synced step: compute (=), each bucket's all-reduce (#), wait (.).

    Times are ms from the forward of the micro-batch that synced; a bucket's bar runs from
    its launch to the completion of its all-reduce.
    """
    _, backward_end, wait_end, buckets = _spans(timeline)
    scale = width / max(max([wait_end] + [done for _, done in buckets]), 1e-9)

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
