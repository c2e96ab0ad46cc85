"""Chapter 01's data parallel on a model nobody here wrote: any dtype, and torch DDP's flags.

Chapter 01's script wraps a Llama in fp32 whose every parameter gets a gradient in every step,
and reads none of this. A model of one's own may have parameters in float64 (or bfloat16), a
parameter some steps leave unused, buffers a forward changes (BatchNorm's running
statistics). ``apply_data_parallel_any`` takes them as torch's DDP does, in subclasses of
chapter 01's wrappers:

- any dtype: a bucket is float32, or the widest of its parameters' dtypes (float64 stays
  float64); a parameter of another dtype than its bucket accumulates a copy there and gets its
  average back in its own dtype;
- ``find_unused_parameters``: a parameter no rank's backward reached (a 0/1 flag each,
  all-reduced) keeps the gradient it had before (None, or zero_grad's zeros), as on one device;
- ``broadcast_buffers``: every forward sees the first rank's buffers.
"""

from functools import reduce
from typing import Any, List, Optional, Union

import torch
from torch import nn

from scaletorch.dist import ProcessGroupManager, comm
from scaletorch.parallel.data_parallel import (IMPLS, BucketedDataParallel, NaiveDataParallel,
                                               _DataParallel, apply_data_parallel)


class _TorchFlags(_DataParallel):
    """torch DDP's two flags on one of chapter 01's wrappers (mixed in before it)."""
    broadcast_buffers: bool = True
    find_unused: bool = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers:  # torch DDP's rule: every forward sees the first rank's
            comm.broadcast_from_first(list(self.module.buffers()), self.group)
        return super().forward(*args, **kwargs)

    def _sync(self) -> None:
        self._held = [p.grad is not None for p in self.params]  # an unused one's: the user's
        super()._sync()

    def _drop_unused(self) -> None:
        if not self.find_unused or not self.params:
            return super()._drop_unused()
        self._needs_sync = False
        used = torch.tensor([float(i in self._used) for i in range(len(self.params))],
                            device=self.params[0].device)
        comm.all_reduce(used, self.group)  # how many ranks used each parameter
        for p, n, had in zip(self.params, used.tolist(), self._held):
            p.grad = None if n == 0 and not had else p.grad
        self._used.clear()


class NaiveAnyModule(_TorchFlags, NaiveDataParallel):
    """The naive wrapper with torch's flags (it all-reduces each gradient in its own dtype)."""


class BucketedAnyModule(_TorchFlags, BucketedDataParallel):
    """The bucketed DDP with torch's flags and buckets of any dtype."""

    def _bucket_dtype(self, ids: List[int]) -> torch.dtype:
        return reduce(torch.promote_types, [self.params[j].dtype for j in ids], torch.float32)

    def _take_grad(self, i: int) -> None:
        """A parameter in its bucket's dtype: chapter 01's. Another: a copy accumulates in the
        bucket and ``p.grad`` stays None until the sync hands the average out."""
        p, view = self.params[i], self._views[i]
        if p.dtype == view.dtype:
            return super()._take_grad(i)
        if p.grad is not None:
            view.copy_(p.grad) if i in self._stale else view.add_(p.grad)
            p.grad = None
        elif i in self._stale:
            view.zero_()  # no gradient at all in this accumulation
        self._stale.discard(i)

    def _hand_out(self) -> None:
        for p, view in zip(self.params, self._views):
            p.grad = view if p.dtype == view.dtype else view.to(p.dtype)


def apply_data_parallel_any(model: nn.Module, pgm: Optional[ProcessGroupManager],
                            impl: str = "ours", bucket_size_mb: float = 25.0,
                            broadcast_buffers: bool = True,
                            find_unused_parameters: bool = False) -> nn.Module:
    """Chapter 01's ``apply_data_parallel`` for any ``nn.Module``: parameters of any dtype, and
    torch DDP's ``broadcast_buffers`` and ``find_unused_parameters`` (the module docstring)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    group = None if pgm is None else pgm.gradient_sync_group
    if impl == "torch":
        keep = {} if broadcast_buffers else dict(broadcast_buffers=False)  # torch's default
        return apply_data_parallel(model, pgm, impl, bucket_size_mb,
                                   find_unused_parameters=find_unused_parameters, **keep)
    wrapped: Union[NaiveAnyModule, BucketedAnyModule] = (NaiveAnyModule(
        model, group) if impl == "naive" else BucketedAnyModule(model, group, bucket_size_mb))
    wrapped.broadcast_buffers, wrapped.find_unused = broadcast_buffers, find_unused_parameters
    return wrapped
