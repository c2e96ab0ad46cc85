"""Data parallel: every rank holds the whole model, sees 1/N of the batch, averages gradients.

Over ``pgm.data_parallel_group_with_context`` (N ranks; context-parallel ranks are in it
because they also see different tokens), after backward every rank holds

    grad = (1/N) sum_r grad_r        = the gradient of the global mean loss,

so the optimizer steps are identical everywhere. Cost per step: an all-reduce of Psi gradient
elements, which a ring moves as 2 (N-1)/N x 4 Psi bytes per rank (x 2 Psi with a bf16
``reduce_dtype``, chapter 08: the gradients are cast for the wire, the average back to fp32).

- ``NaiveDataParallel``: when backward has finished, one blocking all-reduce per parameter.
  The network idles during backward and backward idles during the network.
- ``BucketedDataParallel`` (DDP): gradients are accumulated, in fp32, into flat buckets of
  about ``bucket_size_mb`` filled in reverse parameter order, the order backward produces
  them. A full bucket starts an async all-reduce while backward computes the next layers:

      backward   |== layer L ==|== layer L-1 ==|== ... ==|== layer 1 ==|wait|
      all-reduce               |-- bucket 0 --|-- bucket 1 --| ...  |-- k --|

  Buckets are launched strictly in index order (all ranks must issue collectives in the same
  order); one wait at the end of backward.
- ``TorchDataParallel``: torch.nn.parallel.DistributedDataParallel, the reference (its C++
  reducer calls the backend directly, so its all-reduces are not in our ledger).

All three accept ``no_sync()`` (gradient accumulation: only the last micro-batch syncs) and
``finish_grad_sync()``, and their ``state_dict()`` is the wrapped model's: no ``module.``
prefix, so checkpoints and parity checks compare keys one to one.

Read the naive and the bucketed wrapper side by side: the bucketed one is the naive one plus
buckets, hooks and overlap; overlap_chart.py draws the recorded timeline.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.nn.parallel import DistributedDataParallel

from scaletorch.dist import ProcessGroupManager, comm, get_ledger
from scaletorch.dist.comm import Work
from scaletorch.dist.timer import Mark, Timer, seconds
from scaletorch.parallel.gradient_sync import (average_gradients, launch_full_buckets,
                                               wait_for_buckets)
from scaletorch.parallel.wrapper import ModuleWrapper
from scaletorch.rules.buckets import ddp_buckets

IMPLS = ("naive", "ours", "torch")


class _DataParallel(ModuleWrapper, nn.Module):
    """What both hand-written wrappers share: hooks, no_sync, the end-of-backward sync.

    A sync happens once per accumulation: at the end of a backward run outside ``no_sync``
    (an autograd callback, so a plain ``loss.backward(); opt.step()`` loop is synced too), or
    in ``finish_grad_sync()`` if a forward ran since the last sync and none happened.
    """

    def __init__(self, module: nn.Module, group: Optional[dist.ProcessGroup],
                 reduce_dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.module = module
        self.group = group
        self.reduce_dtype = reduce_dtype or torch.float32  # what gradients cross the wire in
        self.world = comm.group_size(group)
        self.params = [p for p in module.parameters() if p.requires_grad]
        self._sync_enabled = True
        self._needs_sync = False
        self._callback_queued = False
        # No broadcast of rank 0's weights (torch DDP does one): one seed already built the
        # same model on every rank (doc/design.md), and the ledger then shows only gradients.
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_ready(i))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            self._needs_sync = True
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside accumulates locally; the first backward outside syncs it all."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def finish_grad_sync(self) -> None:
        """Make ``p.grad`` the group average now (no-op if backward already synced)."""
        if self._needs_sync:
            self._sync()

    def _grad_ready(self, i: int) -> None:
        """Post-accumulate-grad hook of parameter i: runs inside backward."""
        self._needs_sync = True
        if self._sync_enabled and not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if self._sync_enabled:
            self._sync()

    def _wire(self, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` on the wire: a copy in ``reduce_dtype`` (itself if so already, or alone)."""
        return grad if self.world == 1 or grad.dtype == self.reduce_dtype \
            else grad.to(self.reduce_dtype)

    def _sync(self) -> None:
        raise NotImplementedError


class NaiveDataParallel(_DataParallel):
    """After backward, all-reduce each gradient (blocking) and divide by N."""

    def _sync(self) -> None:
        # a parameter unused here may be used elsewhere: every rank must reduce it (zeros)
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]
        for p, grad in zip(self.params, grads):
            p.grad = grad
        wires = [self._wire(grad) for grad in grads]
        average_gradients(wires, self.group)  # gradient_sync.py: all-reduce each over dp_cp, / N
        for grad, wire in zip(grads, wires):
            if wire is not grad:
                grad.copy_(wire)  # the average back into the fp32 gradient
        self._needs_sync = False


@dataclass
class Bucket:
    """A flat fp32 gradient buffer for a run of parameters (in reverse registration order)."""
    index: int
    param_ids: List[int]
    buffer: torch.Tensor  # (numel,) fp32
    ready: int = 0  # parameters whose gradient arrived in this sync's backward
    work: Optional[Work] = None  # the async all-reduce handle, once launched
    wire: Optional[torch.Tensor] = None  # the buffer cast to reduce_dtype, while in flight


@dataclass
class BucketLaunch:
    """One bucket's all-reduce in the recorded timeline (times: ``Timer`` marks, seconds once
    read through ``BucketedDataParallel.timeline``)."""
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


class BucketedDataParallel(_DataParallel):
    """DDP with gradient buckets: all-reduce of bucket k overlaps backward of earlier layers.

    Gradients live in the buckets: after the first micro-batch ``p.grad`` is a view of the
    fp32 bucket buffer (of a copy, for non-fp32 parameters), so later micro-batches accumulate
    in place. ``optimizer.zero_grad()`` works as usual: with set_to_none the next gradient
    overwrites the stale bucket slot instead of adding to it. A parameter that gets no
    gradient is reduced as zeros (ranks must agree on every bucket), so after a sync it has a
    zero gradient, not None.
    """

    def __init__(self, module: nn.Module, group: Optional[dist.ProcessGroup],
                 bucket_size_mb: float = 25.0, reduce_dtype: Optional[torch.dtype] = None) -> None:
        if not bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
        devices = {p.device for p in module.parameters()}
        if len(devices) > 1:
            raise ValueError(f"data parallel wraps a model on one device, got {devices}")
        super().__init__(module, group, reduce_dtype)
        self.bucket_size_mb = bucket_size_mb
        self.buckets: List[Bucket] = []
        self._bucket_of: Dict[int, int] = {}
        # every slot is set by _add_bucket below
        self._views: List[torch.Tensor] = [None] * len(self.params)  # type: ignore[list-item]
        # fp32 elements per bucket, filled in reverse (backward meets the last layers first);
        # like torch DDP, the first bucket holds at most 1 MB, so the first all-reduce starts
        # early in backward
        for ids in ddp_buckets([p.numel() for p in self.params], bucket_size_mb):
            self._add_bucket(ids)
        self._stale = set(range(len(self.params)))  # slots still holding the last sync's grad
        self._next_bucket = 0  # buckets launch in index order, the same on every rank
        self._grads_ready = 0
        # CPU: perf_counter at each mark; CUDA: events in the stream (see scaletorch.dist.timer)
        self._timer = Timer(next(iter(devices), torch.device("cpu")))
        self._synced = SyncTimeline()  # the last sync's marks
        self._recording = SyncTimeline()

    @property
    def timeline(self) -> SyncTimeline:
        """The last synced backward, in seconds (on CUDA reading it waits for the events, so
        read it after the step, not inside it)."""
        return self._synced.in_seconds()

    def _add_bucket(self, ids: List[int]) -> None:
        device = self.params[ids[0]].device
        buffer = torch.zeros(sum(self.params[j].numel() for j in ids), dtype=torch.float32,
                             device=device)
        offset = 0
        for j in ids:
            n = self.params[j].numel()
            self._views[j] = buffer[offset:offset + n].view_as(self.params[j])
            self._bucket_of[j] = len(self.buckets)
            offset += n
        self.buckets.append(Bucket(len(self.buckets), list(ids), buffer))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._sync_enabled and torch.is_grad_enabled():
            self._recording.t_forward = self._timer.mark()
        return super().forward(*args, **kwargs)

    def _take_grad(self, i: int) -> None:
        """Move parameter i's fresh ``p.grad`` into its bucket slot (fp32), if not there yet."""
        p, view = self.params[i], self._views[i]
        grad = p.grad
        if grad is None or grad.data_ptr() == view.data_ptr():
            pass  # nothing new, or autograd already accumulated in place into the slot
        elif i in self._stale:
            view.copy_(grad)  # first gradient since the last sync replaces the old average
        else:
            view.add_(grad)
        if grad is not None:
            p.grad = view if p.dtype == view.dtype else None
        elif i in self._stale:
            view.zero_()  # no gradient at all in this accumulation
        self._stale.discard(i)

    def _grad_ready(self, i: int) -> None:
        super()._grad_ready(i)
        self._take_grad(i)
        if not self._sync_enabled:
            return
        if self._grads_ready == 0:
            self._recording.t_first_grad = self._timer.mark()
        self._grads_ready += 1
        self.buckets[self._bucket_of[i]].ready += 1
        # every full bucket, strictly in index order: every rank issues the same sequence
        self._next_bucket = launch_full_buckets(
            [b.ready for b in self.buckets], [len(b.param_ids) for b in self.buckets],
            self._next_bucket, lambda k: self._launch(self.buckets[k], in_backward=True))

    def _launch(self, bucket: Bucket, in_backward: bool) -> None:
        """Start the async all-reduce (SUM of grad / N over the dp_cp group) of one bucket."""
        for i in bucket.param_ids:
            if i in self._stale:  # no gradient arrived for it on this rank
                self._take_grad(i)
        if self.world > 1:
            bucket.buffer.div_(self.world)  # before the sum, as torch DDP does
        bucket.wire = self._wire(bucket.buffer)
        bucket.work = comm.all_reduce(bucket.wire, self.group, async_op=True)
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
        """Launch what backward did not (unused parameters), wait once, hand out the grads."""
        self._recording.t_backward_end = self._timer.mark()
        while self._next_bucket < len(self.buckets):
            self._launch(self.buckets[self._next_bucket], in_backward=False)
            self._next_bucket += 1
        wait_for_buckets([bucket.work for bucket in self.buckets])
        for bucket in self.buckets:
            if bucket.wire is not None and bucket.wire is not bucket.buffer:
                bucket.buffer.copy_(bucket.wire)  # accumulated in fp32, averaged in reduce_dtype
            bucket.work, bucket.wire, bucket.ready = None, None, 0
        self._recording.t_wait_end = self._timer.mark()  # CUDA: the wait()s joined the stream
        for p, view in zip(self.params, self._views):
            p.grad = view if p.dtype == view.dtype else view.to(p.dtype)
        self._stale = set(range(len(self.params)))
        self._next_bucket = self._grads_ready = 0
        self._needs_sync = False
        self._synced, self._recording = self._recording, SyncTimeline()


class TorchDataParallel(ModuleWrapper, DistributedDataParallel):
    """torch's DDP with ``finish_grad_sync`` (its reducer already waited) and plain keys."""

    def finish_grad_sync(self) -> None:
        pass


def ddp_report(model: nn.Module, pgm: ProcessGroupManager, impl: str, step: int) -> str:
    """What chapter 01 prints after training (rank 0's view, no communication): the ledger's
    table of ``step`` and the gradients' all-reduce next to the ring formula 2 (N-1)/N x 4 Psi
    bytes per rank. (The script adds the overlap chart, overlap_chart.py.)"""
    ledger, n = get_ledger(), pgm.data_parallel_world_size_with_context
    if n == 1:
        return ""
    psi = sum(p.numel() for p in model.parameters())
    lines = [ledger.table(step=step)]
    if impl == "torch":
        lines.append("note: torch DDP all-reduces inside its C++ reducer, which our ledger cannot "
                     "see: the table shows only the loss the trainer averages for its log")
    else:
        grads = ledger.total(op="all_reduce", group="dp_cp", step=step) - 1  # - the loss
        wire = ledger.total(op="all_reduce", group="dp_cp", step=step, field="wire_bytes")
        e = getattr(model, "reduce_dtype", torch.float32).itemsize  # bytes on the wire
        lines.append(f"gradients all-reduced in step {step}: {grads:,.0f} elements (Psi = "
                     f"{psi:,}); ring volume per rank 2(N-1)/N x {e} Psi = "
                     f"{2 * (n - 1) / n * e * psi / 1e6:.3f} MB (ledger: {wire / 1e6:.3f} MB, "
                     f"with the loss)")
    return "\n".join(lines)


def apply_data_parallel(model: nn.Module, pgm: Optional[ProcessGroupManager], impl: str = "ours",
                        bucket_size_mb: float = 25.0,
                        reduce_dtype: Optional[torch.dtype] = None) -> nn.Module:
    """Wrap ``model`` for data parallel over ``pgm.data_parallel_group_with_context``.

    impl: "naive" (all-reduce per parameter after backward), "ours" (bucketed, overlapped)
    or "torch" (torch.nn.parallel.DistributedDataParallel). ``reduce_dtype``: what our wrappers
    reduce gradients in (None: fp32; torch's DDP takes chapter 08's comm hook for it,
    mixed_precision.py). Returns the wrapper.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    if not bucket_size_mb > 0:
        raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
    group = None if pgm is None else pgm.data_parallel_group_with_context
    if impl == "torch" and not dist.is_initialized():
        raise ValueError("impl 'torch' (DistributedDataParallel) needs a process group: "
                         "launch with torchrun, or use impl 'ours' on one process")
    if impl == "naive":
        return NaiveDataParallel(model, group, reduce_dtype)
    if impl == "ours":
        return BucketedDataParallel(model, group, bucket_size_mb, reduce_dtype)
    if reduce_dtype not in (None, torch.float32):  # chapter 08 registers a comm hook for it
        raise ValueError(f"impl 'torch' reduces in fp32 here, got reduce_dtype {reduce_dtype}")
    device = next(model.parameters()).device
    return TorchDataParallel(model, device_ids=None if device.type == "cpu" else [device.index],
                             process_group=group, bucket_cap_mb=bucket_size_mb)
