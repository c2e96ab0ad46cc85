"""The bucketed DDP's overlap, recorded from outside (one synced step).

``record_overlap(model)``, from chapter 01's script: the bucketed DDP also marks when each step
of its sync happens (``model.timeline``, a ``SyncTimeline``); dist/overlap_text.py draws it.
"""

from typing import Any, cast

import torch

from scaletorch.dist.overlap_text import BucketLaunch, SyncTimeline
from scaletorch.dist.timer import Timer
from scaletorch.parallel.data_parallel import Bucket, BucketedDataParallel


class OverlapRecorder(BucketedDataParallel):
    """``BucketedDataParallel`` that marks when each step of its sync happens (``record_overlap``
    swaps it in). It computes and communicates exactly as the wrapper it extends."""

    def _start(self) -> None:  # CPU: perf_counter at each mark; CUDA: events (dist/timer.py)
        self._timer = Timer(self.buckets[0].buffer.device if self.buckets else torch.device("cpu"))
        self._synced, self._recording = SyncTimeline(), SyncTimeline()
        self._marking: list = []  # the callbacks' futures: each has run before the step goes on

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
            self._marking.append(bucket.work.get_future().then(
                lambda _: setattr(launch, "t_done", self._timer.mark())))
        self._recording.launches.append(launch)

    def _sync(self) -> None:
        self._recording.t_backward_end = self._timer.mark()
        super()._sync()
        self._recording.t_wait_end = self._timer.mark()  # CUDA: the wait()s joined the stream
        # gloo runs a callback in its own thread, maybe after wait() returned: wait for each, so
        # none is still running when the step reads the marks or the group is destroyed
        for marked in self._marking:
            marked.wait()
        self._marking = []
        self._synced, self._recording = self._recording, SyncTimeline()


def record_overlap(model: BucketedDataParallel) -> OverlapRecorder:
    """``model`` (in place, its class swapped as FSDP2's ``fully_shard`` does) recording each
    synced backward's ``timeline``; its buckets, hooks and state stay. Returns it."""
    if type(model) is not BucketedDataParallel:
        raise ValueError(f"record_overlap takes a BucketedDataParallel, got {type(model).__name__}")
    model.__class__ = OverlapRecorder
    cast(OverlapRecorder, model)._start()
    return cast(OverlapRecorder, model)
