"""Differentiable collectives: the f, f-bar, g and g-bar operators and their relatives.

``torch.distributed`` collectives are invisible to autograd. Each parallel strategy needs a
collective in forward *and its conjugate in backward*, so each pair is one small
``torch.autograd.Function`` here. The group is always an argument: the same operator serves
tensor parallel ("tp"), sequence parallel and context parallel (the all-to-all of context and
expert parallel is all_to_all.py's).

    operator                              forward          backward
    copy_to_parallel_region      (f)      identity         all-reduce
    reduce_from_parallel_region  (f-bar)  all-reduce       identity
    gather_from_sequence_parallel_region  all-gather dim   reduce-scatter dim   (g)
    reduce_scatter_to_sequence_parallel   reduce-scatter   all-gather dim       (g-bar)

The names are Korthikanti et al. 2022's: f and g enter a tensor-parallel region, f-bar and
g-bar leave it; g and g-bar are f and f-bar under sequence parallel. (Shoeybi et al. 2019,
without sequence parallel, call f-bar "g".)
"""

from typing import Any, Tuple

import torch

from scaletorch.dist import comm
from scaletorch.dist.comm import Group


def gather_along_dim(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``: (.., n, ..) -> (.., N * n, ..)."""
    n = comm.group_size(group)
    if n == 1:
        return x
    # all_gather_into_tensor concatenates along dim 0 only (on gloo too), so move dim first.
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((n * moved.shape[0], *moved.shape[1:]))
    comm.all_gather_into_tensor(out, moved, group)
    return out.movedim(0, dim).contiguous()


def reduce_scatter_along_dim(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Sum ``x`` over ranks, keep this rank's chunk along ``dim``: (.., N n, ..) -> (.., n, ..)."""
    n = comm.group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n != 0:
        raise ValueError(f"dimension {dim} of size {x.shape[dim]} is not divisible by the "
                         f"group size {n}")
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // n, *moved.shape[1:]))
    comm.reduce_scatter_tensor(out, moved, group)
    return out.movedim(0, dim).contiguous()


def all_reduce_sum(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Out-of-place sum over ``group`` (the input is left untouched)."""
    out = x.clone()
    comm.all_reduce(out, group)
    return out


# [core: f-and-f-bar]
class _CopyToParallelRegion(torch.autograd.Function):
    """f: forward identity, backward all-reduce (a replicated input used by every shard)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return all_reduce_sum(grad, ctx.group), None


class _ReduceFromParallelRegion(torch.autograd.Function):
    """f-bar: forward all-reduce (sum the partial results of the shards), backward identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group) -> torch.Tensor:
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return grad, None


# [end: f-and-f-bar]
class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """g: forward all-gather along ``dim``, backward reduce-scatter along ``dim``.

    Used before a column-parallel matmul under sequence parallel: every rank needs the whole
    sequence, and each rank's gradient w.r.t. it is partial, so the backward sums and splits.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return gather_along_dim(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None, None]:
        return reduce_scatter_along_dim(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """g-bar: forward reduce-scatter along ``dim``, backward all-gather along ``dim``.

    Used after a row-parallel matmul under sequence parallel: sum the partial outputs and keep
    this rank's piece of the sequence.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return reduce_scatter_along_dim(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None, None]:
        return gather_along_dim(grad, ctx.dim, ctx.group), None, None


def copy_to_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _CopyToParallelRegion.apply(x, group)


def reduce_from_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    return _ReduceFromParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Group,
                                         dim: int = 1) -> torch.Tensor:
    return _GatherFromSequenceParallelRegion.apply(x, group, dim)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group,
                                               dim: int = 1) -> torch.Tensor:
    return _ReduceScatterToSequenceParallelRegion.apply(x, group, dim)
