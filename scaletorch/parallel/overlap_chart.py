"""The bucketed DDP's overlap, recorded from outside (one synced step).

``record_overlap(model)``, from chapter 01's script: the bucketed DDP also marks when each step
of its sync happens (``model.timeline``, a ``SyncTimeline``); dist/overlap_text.py draws it.
"""

from typing import Any, List, cast

import torch

from scaletorch.dist.overlap_text import BucketLaunch, SyncTimeline
from scaletorch.dist.timer import Timer
from scaletorch.parallel.data_parallel import Bucket, BucketedDataParallel


class OverlapRecorder(BucketedDataParallel):
    """``BucketedDataParallel`` that marks when each step of its sync happens (``record_overlap``
    swaps it in). It computes and communicates exactly as the wrapper it extends."""
    _marks: List[torch.futures.Future]  # the completion marks' callbacks, until the sync ends

    def _start(self) -> None:  # CPU: perf_counter at each mark; CUDA: events (dist/timer.py)
        self._timer = Timer(self.buckets[0].buffer.device if self.buckets else torch.device("cpu"))
        self._synced, self._recording, self._marks = SyncTimeline(), SyncTimeline(), []

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
            # The completion mark, taken in the future's callback: gloo runs it in its own thread
            # when the all-reduce has finished; NCCL as soon as it is queued, on a stream that
            # waits for its kernel (Future.then), so the CUDA event recorded there fires when the
            # all-reduce has finished on the GPU (a clock there would read the launch time).
            self._marks.append(bucket.work.get_future().then(
                lambda _: setattr(launch, "t_done", self._timer.mark())))
        self._recording.launches.append(launch)

    def _sync(self) -> None:
        self._recording.t_backward_end = self._timer.mark()
        super()._sync()
        self._recording.t_wait_end = self._timer.mark()  # CUDA: the wait()s joined the stream
        torch.futures.wait_all(self._marks)  # no mark still running when the group is destroyed
        self._synced, self._recording, self._marks = self._recording, SyncTimeline(), []


def record_overlap(model: BucketedDataParallel) -> OverlapRecorder:
    """``model`` (in place, its class swapped as FSDP2's ``fully_shard`` does) recording each
    synced backward's ``timeline``; its buckets, hooks and state stay. Returns it."""
    if type(model) is not BucketedDataParallel:
        raise ValueError(f"record_overlap takes a BucketedDataParallel, got {type(model).__name__}")
    model.__class__ = OverlapRecorder
    cast(OverlapRecorder, model)._start()
    return cast(OverlapRecorder, model)
