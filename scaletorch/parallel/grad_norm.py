"""Global gradient-norm clipping, one rule for every layout.

The global norm is sqrt(sum of every *distinct* gradient element squared): a replicated element
(every rank of a group holds the same gradient, e.g. after data-parallel averaging, or an
RMSNorm weight under tensor parallel) counts once, a sharded one (each rank holds a piece)
counts on the rank that holds it. Let replicas(x) be the number of ranks of the world that hold
an identical copy of gradient element x. Then

    norm^2 = all_reduce_sum over the world of  sum_{x on this rank} g_x^2 / replicas(x)

counts every distinct element exactly once: a replicated element is added replicas(x) times,
each time divided by replicas(x); a shard is held once. For the rank grid (pg_manager):

    dense parameter (attention, norms, embeddings, router)   dp_cp x (tp if not tp-sharded)
    expert parameter (split over "ep")                       edp   x (tp: experts are whole
                                                                       on every tp rank)
    ZeRO shard (split over "dp_cp")                          1 or tp, per element
    pipeline                                                 each stage holds its own layers:
                                                             no factor, the world sum adds them

(A tied embedding's two copies under a pipeline add a factor of 2: param_map.py, chapter 07.)
One all-reduce of one number over the world, whatever the layout (``replica_count``,
``world_grad_norm``); none when every rank holds every gradient (pure data parallel). Every
rank ends with the same norm and scales its own gradients by min(1, max_norm / norm)
(``clip_grads_``).
"""

import math
from typing import Iterable, Optional, Tuple, Union, cast

import torch
import torch.distributed as dist

from scaletorch.dist import ProcessGroupManager, comm
from scaletorch.dist.dtensor import is_dtensor


def local_grad(param: torch.Tensor) -> torch.Tensor:
    """The gradient elements this rank holds (a DTensor gradient's local shard)."""
    grad = cast(torch.Tensor, param.grad)  # callers skip parameters without a gradient
    return grad.to_local() if is_dtensor(grad) else grad


def _squared_norm(params: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """(1,) tensor: sum of squares of the gradients of ``params`` on this rank."""
    total = torch.zeros(1, device=device)
    for p in params:
        if p.grad is not None:
            total += local_grad(p).detach().float().pow(2).sum()
    return total


def clip_grads_(params: Iterable[torch.Tensor], max_norm: float,
                total_norm: torch.Tensor) -> torch.Tensor:
    """Scale the gradients of ``params`` (this rank's) in place so the global norm <= max_norm."""
    with_grad = [p for p in params if p.grad is not None]
    if math.isfinite(max_norm):
        scale = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        for p in with_grad:
            grad = local_grad(p)
            grad.mul_(scale.to(grad.device))
    return total_norm


def clip_replicated(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Data parallel's clip (chapter 01): every rank holds every gradient, averaged, so its
    local norm is the global one and no rank communicates; returns the norm."""
    params = [p for p in params if p.grad is not None]
    norm = _squared_norm(params, params[0].device if params else torch.device("cpu")).sqrt()[0]
    return clip_grads_(params, max_norm, norm)


# [core: world-grad-norm]
def replica_count(param: torch.Tensor, pgm: ProcessGroupManager) -> int:
    """Ranks of the world holding an identical copy of ``param``'s gradient (see above).

    Reads the tags the strategies put on parameters: ``tensor_model_parallel`` (chapter 03)
    and ``expert_parallel`` (chapter 06). Pipeline stages hold different parameters, so "pp"
    adds no factor; a parameter sharded by ZeRO needs per-element counts (``world_grad_norm``
    accepts a tensor of them).
    """
    tp = 1 if getattr(param, "tensor_model_parallel", False) \
        else pgm.tensor_model_parallel_world_size
    if getattr(param, "expert_parallel", False):
        return tp * pgm.expert_data_parallel_world_size
    return tp * pgm.gradient_sync_world_size


ParamReplicas = Tuple[torch.Tensor, Union[int, float, torch.Tensor]]


def world_grad_norm(params: Iterable[ParamReplicas], device: torch.device,
                    group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """sqrt(all_reduce_sum over ``group`` (default the world) of sum g^2 / replicas).

    ``params``: (parameter, replicas) pairs, replicas an int or a tensor shaped like the
    gradient (per element). Parameters without a gradient count zero. Returns a 0-dim tensor,
    the same on every rank.
    """
    params = list(params)
    world = comm.group_size(group)
    if all(isinstance(r, int) and r == world for _, r in params):
        # every rank holds every gradient (pure data parallel): the local norm is the world's
        return _squared_norm([p for p, _ in params], device).sqrt()[0]
    total = torch.zeros(1, device=device)
    for p, replicas in params:
        if p.grad is not None:
            total += (local_grad(p).detach().float().pow(2) / replicas).sum()
    comm.all_reduce(total, group)
    return total.sqrt()[0]
    # [end: world-grad-norm]
