"""Global gradient-norm clipping when parameters are split over process groups.

The global norm is sqrt(sum of every *distinct* gradient element squared). A replicated
parameter (every rank holds the same gradient, e.g. after data-parallel averaging or an RMSNorm
weight under tensor parallel) is counted once; a sharded parameter (each rank holds a piece)
is summed over the group that holds the pieces:

    norm^2 = sum_replicated |g|^2  +  sum_groups all_reduce_sum(sum_local_shards |g|^2, group)

Every rank ends with the same norm and scales its own gradients by min(1, max_norm / norm).
"""

import math
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from scaletorch.dist import comm

ParamsOverGroup = Tuple[Iterable[torch.nn.Parameter], Optional[dist.ProcessGroup]]


def _squared_norm(params: Iterable[torch.nn.Parameter], device: torch.device) -> torch.Tensor:
    """(1,) tensor: sum of squares of the gradients of ``params`` on this rank."""
    total = torch.zeros(1, device=device)
    for p in params:
        if p.grad is not None:
            total += p.grad.detach().float().pow(2).sum()
    return total


def global_grad_norm(
    replicated: Iterable[torch.nn.Parameter], sharded: Sequence[ParamsOverGroup] = (),
    device: torch.device = torch.device("cpu")
) -> torch.Tensor:
    """The norm of all gradients: ``replicated`` counted once, each ``sharded`` set summed over
    its group (one all-reduce of a scalar per group). Returns a 0-dim tensor on ``device``."""
    total = _squared_norm(replicated, device)
    for params, group in sharded:
        partial = _squared_norm(params, device)
        comm.all_reduce(partial, group)
        total += partial
    return total.sqrt()[0]


def clip_grads_(params: Iterable[torch.nn.Parameter], max_norm: float,
                total_norm: torch.Tensor) -> torch.Tensor:
    """Scale the gradients of ``params`` (this rank's) in place so the global norm <= max_norm."""
    params: List[torch.nn.Parameter] = [p for p in params if p.grad is not None]
    if math.isfinite(max_norm):
        scale = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(scale.to(p.grad.device))
    return total_norm
