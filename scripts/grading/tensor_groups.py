"""Chapter 03's regions over a group whose ranks are not a block of the world: its group rank is
not the world rank modulo the group's size.

The run's tp groups ([0, 1] and [2, 3] at tp 2 x dp 2) are blocks of consecutive ranks, where
``dist.get_rank() % n`` is the tp rank: a region that takes its chunk by the world rank passes
there. ``probe_strided`` calls the learner's region and the library's with sequence parallel
(the chunk of a reduce-scatter is the rank's own) over the dp group ([0, 2] and [1, 3]: world
ranks 1 and 2 are group ranks 0 and 1) on the same random input and output gradient, and says
which ranks' forward or backward differ and, when the result is exactly another rank's chunk,
whose.
"""

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from scaletorch.dist import comm

SHAPE = (2, 4, 3)  # (b, s, h): s splits into 2 chunks along dim 1


def _chunk_of(got: torch.Tensor, full: torch.Tensor, n: int) -> int:
    """The chunk of ``full`` along dim 1 that ``got`` equals, -1 if none."""
    if got.shape != full.chunk(n, dim=1)[0].shape:
        return -1
    return next((k for k, c in enumerate(full.chunk(n, dim=1)) if torch.allclose(got, c)), -1)


def probe_strided(fn: Callable, library: Callable, exercise: str, group: Any) -> Optional[str]:
    """The diagnosis of ``fn`` (enter_region or exit_region) over ``group`` with sequence
    parallel, against ``library``'s, else None. Every rank of the world calls it (each over its
    own ``group``); each decides alike whether to run the backward (shapes agree on all)."""
    n, rank, me = comm.group_size(group), comm.group_rank(group), dist.get_rank()
    gen = torch.Generator().manual_seed(300 + me)
    gathers = exercise == "enter_region"  # g: all-gather forward, reduce-scatter backward
    shape = (SHAPE[0], SHAPE[1] // n, SHAPE[2]) if gathers else SHAPE
    x, dy_full = torch.randn(shape, generator=gen), torch.randn(SHAPE, generator=gen)
    mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = fn(mine, group, True), library(theirs, group, True)
    dy = dy_full if gathers else dy_full.chunk(n, dim=1)[0].contiguous()
    ok_forward = got.shape == want.shape and torch.allclose(got.detach(), want.detach())
    dx_got = None
    if got.shape == want.shape and got.requires_grad:
        dx_got, = torch.autograd.grad(got, mine, dy.clone(), allow_unused=True)
    dx_want, = torch.autograd.grad(want, theirs, dy.clone())
    # what a sum over the group gives, whole: the reduce-scatter's chunks are its slices
    summed = (x if not gathers else dy).clone()
    dist.all_reduce(summed, group=group)
    found = []
    if not ok_forward and not gathers:
        found.append(("forward", _chunk_of(got.detach(), summed, n)))
    elif dx_got is not None and not torch.allclose(dx_got, dx_want) and gathers:
        found.append(("backward", _chunk_of(dx_got, summed, n)))
    elif not ok_forward or (dx_got is not None and not torch.allclose(dx_got, dx_want)):
        found.append(("forward" if not ok_forward else "backward", -1))
    # (world rank, [off, chunk, its group rank, world rank of its group's rank 0])
    flags = torch.zeros(dist.get_world_size(), 4)
    flags[me, 2:] = torch.tensor([rank, dist.get_global_rank(group, 0)])
    if found:  # 1: the forward off, 2: only the backward
        flags[me, :2] = torch.tensor([1.0 if found[0][0] == "forward" else 2.0, found[0][1]])
    dist.all_reduce(flags)  # every rank says the same: which world ranks were off
    off = [r for r in range(len(flags)) if flags[r, 0] > 0]  # world ranks
    if not off:
        return None
    first, k, mine_in = off[0], int(flags[off[0], 1]), int(flags[off[0], 2])
    where = "forward" if flags[first, 0] == 1 else "backward"
    leads = [int(v) for v in flags[:, 3].tolist()]
    groups = [[r for r in range(len(leads)) if leads[r] == lead] for lead in sorted(set(leads))]
    text = (f"{exercise} with sequence parallel over groups whose ranks are not blocks of the "
            f"world (the dp groups {' and '.join(map(str, groups))}): its {where} differs from "
            f"the library's on world ranks {off}")
    if k >= 0 and k == first % n != mine_in:
        text += (f"; world rank {first}, rank {mine_in} of its group, kept chunk {k} of the "
                 f"sum: the chunk of its world rank modulo the group's size ({first} % {n}), "
                 f"not of its rank in the group (dist.get_rank(group))")
    return text
