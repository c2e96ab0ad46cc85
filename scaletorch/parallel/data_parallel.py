"""Data parallel: every rank holds the whole model, sees 1/N of the batch, averages gradients.

Over the data-parallel group "dp" (N ranks, ``pgm.gradient_sync_group``), after backward every
rank holds

    grad = (1/N) sum_r grad_r        = the gradient of the global mean loss,

so the optimizer steps are identical everywhere. Cost per step: an all-reduce of Psi gradient
elements, which a ring moves as 2 (N-1)/N x 4 Psi bytes per rank.

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
buckets, hooks and overlap. Later chapters attach from their own modules: overlap_chart.py
records when each bucket went out (chapter 01's chart), ddp_reduce_dtype.py reduces in bf16.
"""

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Set

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.nn.parallel import DistributedDataParallel

from scaletorch.dist import ProcessGroupManager, comm, get_ledger
from scaletorch.dist.comm import Work
from scaletorch.dist.wrap_checks import (refuse_changed_since_wrap, refuse_several_devices,
                                         refuse_sparse_grad, refuse_unwrappable)
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
    data_parallel_wrapper = True  # refuse_wrapped: wrapping this again is refused

    def __init__(self, module: nn.Module, group: Optional[dist.ProcessGroup]) -> None:
        super().__init__()
        self.module, self.group, self.world = module, group, comm.group_size(group)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]  # frozen: out
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.names_at_wrap = {n for n, _ in module.named_parameters()}  # frozen ones too
        self._used: Set[int] = set()  # parameters that got a gradient since the last sync
        self._sync_enabled, self._needs_sync, self._callback_queued = True, False, False
        refuse_unwrappable(module, "data parallel", group)  # every rank alike (wrap_checks.py)
        # torch DDP's rule: every rank starts from the first rank's model
        comm.broadcast_from_first([*module.parameters(), *module.buffers()], group)
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_ready(i))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._needs_sync = self._needs_sync or torch.is_grad_enabled()
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
        refuse_sparse_grad(self.params[i].grad, self.names[i], "data parallel")
        self._needs_sync = True
        self._used.add(i)
        if self._sync_enabled and not self._callback_queued:
            self._callback_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if self._sync_enabled:
            self._sync()

    def _average(self, grads: List[torch.Tensor]) -> None:
        """Each of ``grads`` becomes in place its mean over the group (gradient_sync.py)."""
        average_gradients(grads, self.group)

    def _all_reduce(self, buffer: torch.Tensor) -> Optional[Work]:
        """Start the async all-reduce (SUM) of ``buffer`` over the group; None on one rank."""
        return comm.all_reduce(buffer, self.group, async_op=True)

    def _sync(self) -> None:
        raise NotImplementedError

    def _drop_unused(self) -> None:
        """After a sync. A parameter that got no gradient on this rank was reduced as zeros
        (every rank issues the same collectives); a zero gradient is not one (AdamW would decay
        the weight), so it raises, as torch DDP does without find_unused_parameters."""
        self._needs_sync = False
        unused = [n for i, n in enumerate(self.names) if i not in self._used]
        self._used.clear()
        if unused:
            raise RuntimeError(f"data parallel: {unused} got no gradient on this rank: pass "
                               f"find_unused_parameters=True to apply_data_parallel_any "
                               f"(grad None where no rank used one)")


class NaiveDataParallel(_DataParallel):
    """After backward, all-reduce each gradient (blocking) and divide by N."""

    def _sync(self) -> None:
        self._needs_sync = False  # if the check raises, the next backward starts afresh
        refuse_changed_since_wrap(self.module, self.names, self.names_at_wrap, "data parallel")
        for p in self.params:  # unused here, maybe not elsewhere: zeros, as every rank sends
            p.grad = p.grad if p.grad is not None else torch.zeros_like(p)
        self._average([p.grad for p in self.params if p.grad is not None])  # over dp, / N
        self._drop_unused()


@dataclass
class Bucket:
    """A flat fp32 gradient buffer for a run of parameters."""
    index: int
    param_ids: List[int]
    buffer: torch.Tensor  # (numel,)
    ready: int = 0  # parameters whose gradient arrived in this sync's backward
    work: Optional[Work] = None  # the async all-reduce handle, once launched


class BucketedDataParallel(_DataParallel):
    """DDP with gradient buckets: all-reduce of bucket k overlaps backward of earlier layers.

    Gradients live in the buckets: after the first micro-batch ``p.grad`` is a view of the
    fp32 bucket buffer, so later micro-batches accumulate
    in place. ``optimizer.zero_grad()`` works as usual: with set_to_none the next gradient
    overwrites the stale bucket slot instead of adding to it. A parameter that gets no
    gradient is reduced as zeros (ranks must agree on every bucket); ``_drop_unused`` decides.
    """

    def __init__(self, module: nn.Module, group: Optional[dist.ProcessGroup],
                 bucket_size_mb: float = 25.0) -> None:
        if not bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
        refuse_several_devices(module, "data parallel")
        super().__init__(module, group)
        self.buckets: List[Bucket] = []
        self._bucket_of: Dict[int, int] = {}
        self._views: List[torch.Tensor] = [None] * len(self.params)  # type: ignore[list-item]
        for ids in ddp_buckets([p.numel() for p in self.params], bucket_size_mb):
            self._add_bucket(ids)
        self._stale = set(range(len(self.params)))  # slots still holding the last sync's grad
        self._next_bucket = self._grads_ready = 0  # buckets launch in index order everywhere

    def _add_bucket(self, ids: List[int]) -> None:
        device = self.params[ids[0]].device
        buffer = torch.zeros(sum(self.params[j].numel() for j in ids),
                             dtype=self._bucket_dtype(ids), device=device)
        offset = 0
        for j in ids:
            n = self.params[j].numel()
            self._views[j] = buffer[offset:offset + n].view_as(self.params[j])
            self._bucket_of[j] = len(self.buckets)
            offset += n
        self.buckets.append(Bucket(len(self.buckets), list(ids), buffer))

    def _bucket_dtype(self, ids: List[int]) -> torch.dtype:
        other = [self.names[j] for j in ids if self.params[j].dtype != torch.float32]
        if other:  # every rank alike: the wrap checked that their layouts agree
            raise ValueError(f"data parallel: {other} are not float32: apply_data_parallel_any "
                             f"(data_parallel_any_module.py) buckets any dtype")
        return torch.float32

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
            p.grad = view
        elif i in self._stale:
            view.zero_()  # no gradient at all in this accumulation
        self._stale.discard(i)

    def _grad_ready(self, i: int) -> None:
        super()._grad_ready(i)
        self._take_grad(i)
        if not self._sync_enabled:
            return
        self._grads_ready += 1
        self.buckets[self._bucket_of[i]].ready += 1
        # every full bucket, strictly in index order: every rank issues the same sequence
        self._next_bucket = launch_full_buckets(
            [b.ready for b in self.buckets], [len(b.param_ids) for b in self.buckets],
            self._next_bucket, lambda k: self._launch(self.buckets[k], in_backward=True))

    def _hand_out(self) -> None:
        for p, view in zip(self.params, self._views):  # after the wait: the averaged slot
            p.grad = view

    def _launch(self, bucket: Bucket, in_backward: bool) -> None:
        """Start the async all-reduce (SUM of grad / N over the group) of one bucket."""
        for i in bucket.param_ids:
            if i in self._stale:  # no gradient arrived for it on this rank
                self._take_grad(i)
        if self.world > 1:
            bucket.buffer.div_(self.world)  # before the sum, as torch DDP does
        bucket.work = self._all_reduce(bucket.buffer)

    def _sync(self) -> None:
        """Launch what backward did not (unused parameters), wait once, hand out the grads."""
        self._needs_sync = False  # if the check raises, the next backward starts afresh
        # before the launches (backward's, in flight, finish alike); wrap_checks.py
        refuse_changed_since_wrap(self.module, self.names, self.names_at_wrap, "data parallel")
        while self._next_bucket < len(self.buckets):
            self._launch(self.buckets[self._next_bucket], in_backward=False)
            self._next_bucket += 1
        wait_for_buckets([bucket.work for bucket in self.buckets])
        for bucket in self.buckets:
            bucket.work, bucket.ready = None, 0
        self._hand_out()
        self._drop_unused()
        self._stale = set(range(len(self.params)))
        self._next_bucket = self._grads_ready = 0


class TorchDataParallel(ModuleWrapper, DistributedDataParallel):
    """torch's DDP with ``finish_grad_sync`` (its reducer already waited) and plain keys."""
    data_parallel_wrapper = True

    def finish_grad_sync(self) -> None:
        pass


def ddp_report(model: nn.Module, pgm: ProcessGroupManager, impl: str, step: int) -> str:
    """What chapter 01 prints after training (rank 0's view, no communication): the ledger's
    table of ``step`` and the gradients' all-reduce next to the ring formula 2 (N-1)/N x 4 Psi
    bytes per rank. (The script adds the overlap chart, overlap_chart.py.)"""
    ledger, n = get_ledger(), pgm.gradient_sync_world_size
    if n == 1:
        return ""
    group = pgm.name_of(pgm.gradient_sync_group)  # the ledger's name of the group
    psi = sum(p.numel() for p in model.parameters())
    lines = [ledger.table(step=step)]
    if impl == "torch":
        lines.append("note: torch DDP all-reduces inside its C++ reducer, which our ledger cannot "
                     "see: the table shows only the loss the trainer averages for its log")
    else:
        grads = ledger.total(op="all_reduce", group=group, step=step) - 1  # - the loss
        sent = ledger.total(op="all_reduce", group=group, step=step, field="wire_bytes")
        lines.append(f"gradients all-reduced in step {step}: {grads:,.0f} elements (Psi = "
                     f"{psi:,}); ring volume per rank 2(N-1)/N x 4 Psi = "
                     f"{2 * (n - 1) / n * 4 * psi / 1e6:.3f} MB (ledger: {sent / 1e6:.3f} MB, "
                     f"with the loss)")
    return "\n".join(lines)


def apply_data_parallel(model: nn.Module, pgm: Optional[ProcessGroupManager], impl: str = "ours",
                        bucket_size_mb: float = 25.0, **torch_flags: bool) -> nn.Module:
    """Wrap ``model`` for data parallel over ``pgm.gradient_sync_group`` (the data-parallel
    ranks; chapter 05 adds its context-parallel ranks to it).

    impl: "naive" (all-reduce per parameter after backward), "ours" (bucketed, overlapped)
    or "torch" (torch.nn.parallel.DistributedDataParallel, given ``torch_flags``). Returns the
    wrapper, which reduces in fp32 (chapter 08 changes that from mixed_precision.py). Any dtype
    and torch DDP's flags for ours: data_parallel_any_module.py.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    group = None if pgm is None else pgm.gradient_sync_group
    if impl == "naive":
        return NaiveDataParallel(model, group)
    if impl == "ours":
        return BucketedDataParallel(model, group, bucket_size_mb)
    if not dist.is_initialized():
        raise ValueError("impl 'torch' (DistributedDataParallel) needs a process group: "
                         "launch with torchrun, or use impl 'ours' on one process")
    refuse_unwrappable(model, "data parallel", group)  # ours refuse at their wrap
    device = next(model.parameters()).device
    return TorchDataParallel(model, device_ids=None if device.type == "cpu" else [device.index],
                             process_group=group, bucket_cap_mb=bucket_size_mb, **torch_flags)
