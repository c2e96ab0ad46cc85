"""Chapter 08 attached to chapter 01's data parallel: gradients cross the wire in reduce_dtype.

Chapter 01's wrappers reduce in fp32 and name no dtype. Here each becomes its subclass (a class
swap, as FSDP2's ``fully_shard`` does; buckets, hooks and state stay), whose all-reduce sends a
copy cast to ``reduce_dtype`` and casts the average back into the fp32 gradient or bucket:

    fp32 bucket / N --cast--> bf16 copy --all-reduce (SUM) over dp--> bf16 average --> fp32 bucket

so a ring moves 2 (N-1)/N x 2 Psi bytes per rank instead of x 4 Psi. Gradients are still
accumulated in fp32 (micro-batches add up there); only the wire is low precision. torch's DDP
takes ``reduce_dtype_hook`` as its comm hook instead.
"""

from typing import Any, List, Optional, Tuple, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from scaletorch.dist import ProcessGroupManager, comm
from scaletorch.dist.comm import Work
from scaletorch.parallel.data_parallel import (BucketedDataParallel, NaiveDataParallel,
                                               apply_data_parallel)


class _CastBackOnWait:
    """A bucket's all-reduce in ``reduce_dtype``: ``wait()`` waits, then casts the average back
    into the fp32 bucket. Anything else (``get_future``, ...) is the work's own."""

    def __init__(self, work: Work, bucket: torch.Tensor, sent: torch.Tensor) -> None:
        self.work, self.bucket, self.sent = work, bucket, sent

    def wait(self, *args: Any) -> bool:
        done = self.work.wait(*args)
        self.bucket.copy_(self.sent)  # accumulated in fp32, averaged in reduce_dtype
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


class NaiveReducedIn(NaiveDataParallel):
    """Chapter 01's naive wrapper whose gradients cross the wire in ``reduce_dtype``: a copy of
    each, cast to it, is averaged, and the average cast back into the gradient."""
    reduce_dtype: torch.dtype

    def _average(self, grads: List[torch.Tensor]) -> None:
        dtype = self.reduce_dtype
        sent = [g if self.world == 1 or g.dtype == dtype else g.to(dtype) for g in grads]
        super()._average(sent)
        for grad, low in zip(grads, sent):
            if low is not grad:
                grad.copy_(low)  # the average back into the fp32 gradient


class BucketedReducedIn(BucketedDataParallel):
    """Chapter 01's bucketed DDP whose buckets (fp32, already / N) cross the wire in
    ``reduce_dtype``; the wait casts the average back into the bucket."""
    reduce_dtype: torch.dtype

    def _all_reduce(self, buffer: torch.Tensor) -> Optional[Work]:
        if self.world == 1 or buffer.dtype == self.reduce_dtype:
            return super()._all_reduce(buffer)
        sent = buffer.to(self.reduce_dtype)
        work = super()._all_reduce(sent)
        return None if work is None else cast(Work, _CastBackOnWait(work, buffer, sent))


# [core: wire-cast]
def reduce_dtype_hook(state: Tuple[Optional[dist.ProcessGroup], torch.dtype],
                      bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch DDP's comm hook for ``reduce_dtype`` (``state`` = (group, dtype)): torch's
    ``bf16_compress_hook``, on any backend (torch's needs NCCL). The fp32 bucket is cast to the
    dtype and divided by N, all-reduced (in our ledger), and the average cast back into it."""
    group, dtype = state
    grad = bucket.buffer()
    wire = grad.to(dtype).div_(comm.group_size(group))
    work = comm.all_reduce(wire, group, async_op=True)

    def back(fut: torch.futures.Future) -> torch.Tensor:
        return grad.copy_(wire)

    if work is None:  # one rank: nothing to wait for
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(grad.copy_(wire))
        return done
    return work.get_future().then(back)


# [end: wire-cast]
def apply_data_parallel_in(reduce_dtype: torch.dtype, model: nn.Module, pgm: ProcessGroupManager,
                           impl: str, bucket_size_mb: float) -> nn.Module:
    """Chapter 01's ``apply_data_parallel`` reducing gradients in ``reduce_dtype``: our wrappers
    become their subclass above, torch's DDP takes ``reduce_dtype_hook`` as its comm hook. In
    fp32 the wrapper is chapter 01's as it is."""
    wrapped = apply_data_parallel(model, pgm, impl, bucket_size_mb)
    if reduce_dtype == torch.float32:
        return wrapped
    if impl == "torch":
        cast(DistributedDataParallel, wrapped).register_comm_hook(
            (pgm.gradient_sync_group, reduce_dtype), reduce_dtype_hook)
        return wrapped
    subclass = {NaiveDataParallel: NaiveReducedIn, BucketedDataParallel: BucketedReducedIn}
    wrapped.__class__ = subclass[type(wrapped)]
    setattr(wrapped, "reduce_dtype", reduce_dtype)
    return wrapped
