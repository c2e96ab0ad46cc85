"""The bucketed DDP's overlap, recorded from outside and drawn as text (one synced step).

``record_overlap(model)``, from chapter 01's script: the bucketed DDP also marks when each step
of its sync happens (``model.timeline``). ``format_overlap``: every rank on one axis, two rows
a rank: compute (``=``) then the wait (``.``), and how many all-reduces are in flight (1-9,
a-z for 10-35). An all-reduce ends when every rank has launched it: a rank done early waits for
the slow one. ``format_timeline`` (``--verbose``): a row per bucket. Times: ms from the forward
of the micro-batch that synced.
"""

import math
from dataclasses import dataclass, field, replace
from typing import Any, List, Sequence, Tuple, cast

import torch

from scaletorch.dist.timer import Mark, Timer, seconds
from scaletorch.parallel.data_parallel import Bucket, BucketedDataParallel

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


class OverlapRecorder(BucketedDataParallel):
    """``BucketedDataParallel`` that marks when each step of its sync happens (``record_overlap``
    swaps it in). It computes and communicates exactly as the wrapper it extends."""

    def _start(self) -> None:  # CPU: perf_counter at each mark; CUDA: events (dist/timer.py)
        self._timer = Timer(self.buckets[0].buffer.device if self.buckets else torch.device("cpu"))
        self._synced, self._recording = SyncTimeline(), SyncTimeline()

    @property
    def timeline(self) -> SyncTimeline:
        """The last synced backward, in seconds (on CUDA reading it waits for the events, so
        read it after the step, not inside it)."""
        return self._synced.in_seconds()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._sync_enabled and torch.is_grad_enabled():
            self._recording.t_forward = self._timer.mark()
        return super().forward(*args, **kwargs)

    def _grad_ready(self, i: int) -> None:
        if self._sync_enabled and self._grads_ready == 0:
            self._recording.t_first_grad = self._timer.mark()
        super()._grad_ready(i)

    def _launch(self, bucket: Bucket, in_backward: bool) -> None:
        super()._launch(bucket, in_backward)
        launch = BucketLaunch(bucket.index, bucket.buffer.numel(), in_backward,
                              len(self.params) - self._grads_ready, self._timer.mark())
        if bucket.work is None:  # a group of one rank: nothing to wait for
            launch.t_done = launch.t_launch
        else:
            # The completion mark, taken in the future's callback. gloo (CPU) runs it when the
            # all-reduce has finished: the clock then is the completion time. NCCL runs it as
            # soon as the all-reduce is queued, but with a current stream that waits for the
            # all-reduce's kernel (torch.futures.Future.then), so the CUDA event recorded
            # there fires when the all-reduce has finished on the GPU. (A clock reading there
            # would be the launch time, and work.wait() does not block the host on NCCL.)
            bucket.work.get_future().then(lambda _: setattr(launch, "t_done", self._timer.mark()))
        self._recording.launches.append(launch)

    def _sync(self) -> None:
        self._recording.t_backward_end = self._timer.mark()
        super()._sync()
        self._recording.t_wait_end = self._timer.mark()  # CUDA: the wait()s joined the stream
        self._synced, self._recording = self._recording, SyncTimeline()


def record_overlap(model: BucketedDataParallel) -> OverlapRecorder:
    """``model`` (in place, its class swapped as FSDP2's ``fully_shard`` does) recording each
    synced backward's ``timeline``; its buckets, hooks and state stay. Returns it."""
    if type(model) is not BucketedDataParallel:
        raise ValueError(f"record_overlap takes a BucketedDataParallel, got {type(model).__name__}")
    model.__class__ = OverlapRecorder
    cast(OverlapRecorder, model)._start()
    return cast(OverlapRecorder, model)


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
