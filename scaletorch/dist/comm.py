"""Collectives that scaletorch calls, each written down in the communication ledger.

Thin wrappers over ``torch.distributed`` with the same arguments. Each one is a no-op on a
group of one rank (or when no process group exists), so single-device code takes the same
path without special cases. None of these are differentiable: see ``functional.py``.

``name`` is the ledger's label for a call ("cp", "ep", "edp", "embd"): the process-group manager
creates one group per distinct set of ranks, so a group can serve several roles (with cp = 1,
"dp" and "dp_cp" are one group) and is known to the ledger by its first; a call made for
another role names it. Without ``name`` the ledger uses the group's own name.
"""

from contextlib import nullcontext
from typing import Any, ContextManager, List, Optional, Tuple

import torch
import torch.distributed as dist

from scaletorch.dist import device_check, p2p_order
from scaletorch.dist.ledger import get_ledger, group_name

Group = Optional[dist.ProcessGroup]
Work = dist.Work  # what an async collective returns: wait() on it

# torch 2.13 renamed the dim-0 gather/scatter collectives (*_into_tensor / *_tensor -> *_single)
# and deprecated the old names; older torch 2.x only has the old ones. These two are torch's own
# calls under whichever name this torch has: no ledger record, no shortcut for one rank.
torch_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
torch_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def group_size(group: Group = None) -> int:
    """Ranks in ``group``; 1 when torch.distributed is not initialized."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group: Group = None) -> int:
    """This process's rank inside ``group``; 0 when torch.distributed is not initialized."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def _record(op: str, group: Group, tensor: torch.Tensor, numel: Optional[int] = None,
            name: Optional[str] = None, others: Tuple[torch.Tensor, ...] = ()) -> ContextManager:
    """Write the call in the ledger; the returned context labels it in a profile ("dp_cp
    all_reduce": torch.profiler.record_function) while a profiler runs (chapter 11). In
    ``device_check``'s test mode, ``tensor`` and ``others`` made on the host raise."""
    for t in (tensor, *others):
        device_check.check(t, op)
    elements = tensor.numel() if numel is None else numel
    get_ledger().record(op, group, group_size(group), elements, tensor.element_size(), name)
    if not torch.autograd.profiler._is_profiler_enabled:
        return nullcontext()
    return torch.profiler.record_function(f"{name or group_name(group)} {op}")


def all_reduce(tensor: torch.Tensor, group: Group = None, op: Any = dist.ReduceOp.SUM,
               async_op: bool = False, name: Optional[str] = None) -> Optional[Work]:
    """In-place all-reduce of ``tensor`` over ``group``; returns a work handle if async."""
    if group_size(group) == 1:
        return None
    with _record("all_reduce", group, tensor, name=name):
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: Group = None,
                           async_op: bool = False, name: Optional[str] = None) -> Optional[Work]:
    """``output`` (N * n, ...) = concatenation over dim 0 of every rank's ``input`` (n, ...)."""
    if group_size(group) == 1:
        output.copy_(input)
        return None
    with _record("all_gather", group, output, name=name, others=(input, )):
        return torch_all_gather(output, input.contiguous(), group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group: Group = None,
                          op: Any = dist.ReduceOp.SUM, async_op: bool = False,
                          name: Optional[str] = None) -> Optional[Work]:
    """``output`` (n, ...) = this rank's dim-0 chunk of the sum over ranks of ``input``."""
    if group_size(group) == 1:
        output.copy_(input)
        return None
    with _record("reduce_scatter", group, input, name=name, others=(output, )):
        return torch_reduce_scatter(output, input.contiguous(), op=op, group=group,
                                    async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Group = None, async_op: bool = False,
              name: Optional[str] = None) -> Optional[Work]:
    """Copy ``tensor`` from global rank ``src`` to every rank of ``group``."""
    if group_size(group) == 1:
        return None
    with _record("broadcast", group, tensor, name=name):
        return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: Optional[List[int]] = None,
                      input_split_sizes: Optional[List[int]] = None, group: Group = None,
                      async_op: bool = False, name: Optional[str] = None) -> Optional[Work]:
    """Send dim-0 slices of ``input`` to every rank and receive theirs into ``output``.

    The ledger counts only the elements sent to other ranks (the slice kept is not moved).
    """
    n = group_size(group)
    if n == 1:
        output.copy_(input)
        return None
    rank = group_rank(group)
    row = input[0].numel() if input.dim() > 0 and input.shape[0] > 0 else 1
    if input_split_sizes is None:
        kept = input.shape[0] // n
    else:
        kept = input_split_sizes[rank]
    with _record("all_to_all", group, input, numel=input.numel() - kept * row, name=name,
                 others=(output, )):
        return dist.all_to_all_single(output, input.contiguous(), output_split_sizes,
                                      input_split_sizes, group=group, async_op=async_op)


def batch_isend_irecv(ops: List[dist.P2POp], group: Group = None,
                      name: Optional[str] = None) -> list:
    """Post a batch of point-to-point sends and receives; returns their work handles.

    Sends are recorded as "send", receives as "recv", with the element count of the tensor; a
    message's wire bytes are its sender's (a recv sends nothing), so summed over ranks each
    message counts once. With ``p2p_order.in_order()`` (a test mode) the batch runs in NCCL's
    order: after every batch this rank posted on the group before it.
    """
    for p2p in ops:
        _record("send" if p2p.op is dist.isend else "recv", group, p2p.tensor, name=name)
    if not ops:
        return []
    return p2p_order.post_in_order(ops) if p2p_order.in_order() else dist.batch_isend_irecv(ops)


def barrier(group: Group = None) -> None:
    if group_size(group) > 1:
        dist.barrier(group=group)


def average_over_group(value: torch.Tensor, group: Group) -> torch.Tensor:
    """Mean of a scalar over ``group`` (for reporting the global loss; not differentiable)."""
    out = value.detach().clone()
    all_reduce(out, group)
    return out / group_size(group)
