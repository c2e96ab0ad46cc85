"""Collectives that scaletorch calls, each written down in the communication ledger.

Thin wrappers over ``torch.distributed`` with the same arguments. Each one is a no-op on a
group of one rank (or when no process group exists), so single-device code takes the same
path without special cases. None of these are differentiable: see ``functional.py``.

``name`` is the ledger's label for a call ("cp", "ep", "edp", "embd"): the process-group manager
creates one group per distinct set of ranks, so a group can serve several roles (with cp = 1,
"dp" and "dp_cp" are one group) and is known to the ledger by its first; a call made for
another role names it. Without ``name`` the ledger uses the group's own name.

``waited()`` is the time this process has spent blocked in collectives: inside a synchronous
call, or in ``wait()`` on what an async call returned (the Trainer's straggler line subtracts it
from each step's time). On a GPU neither blocks the host (NCCL queues the work on a stream), so
there it stays near 0.
"""

import time
import zlib
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from scaletorch.dist import device_check, p2p_order
from scaletorch.dist.ledger import get_ledger, group_name

Group = Optional[dist.ProcessGroup]
_waited = [0.0]  # seconds this process spent blocked in collectives (waited())


def waited() -> float:
    """Seconds this process has spent blocked in collectives so far (host clock)."""
    return _waited[0]


class Work:
    """What an async collective returns: torch's work, whose ``wait()`` adds the time it blocked
    to ``waited()`` and, while a profiler runs, shows in the profile as "<label> wait"."""

    def __init__(self, work: Any, label: str) -> None:
        self.work, self.label = work, label

    def wait(self, *args: Any) -> bool:
        start = time.perf_counter()
        with _label(f"{self.label} wait"):
            done = self.work.wait(*args)
        _waited[0] += time.perf_counter() - start
        return done

    def __getattr__(self, name: str) -> Any:  # is_completed, get_future, ...: torch's own
        return getattr(self.work, name)


def _label(text: str) -> ContextManager:
    """``text`` as a span of a profile while a profiler runs (record_function); else nothing."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return nullcontext()
    return torch.profiler.record_function(text)


def _issue(label: str, call: Callable[..., Any], *args: Any, async_op: bool = False,
           **kwargs: Any) -> Optional[Work]:
    """Run torch's collective ``call`` labelled ``label``; an async one's work is wrapped in
    ``Work``, a synchronous one's time is added to ``waited()``."""
    start = time.perf_counter()
    with _label(label):
        work = call(*args, async_op=async_op, **kwargs)
    if async_op:
        return Work(work, label)
    _waited[0] += time.perf_counter() - start
    return None


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
            name: Optional[str] = None, others: Tuple[torch.Tensor, ...] = ()) -> str:
    """Write the call in the ledger; return its label in a profile ("dp all_reduce", shown
    through torch.profiler.record_function while a profiler runs: chapter 11). In
    ``device_check``'s test mode, ``tensor`` and ``others`` made on the host raise."""
    for t in (tensor, *others):
        device_check.check(t, op)
    elements = tensor.numel() if numel is None else numel
    get_ledger().record(op, group, group_size(group), elements, tensor.element_size(), name)
    return f"{name or group_name(group)} {op}"


def all_reduce(tensor: torch.Tensor, group: Group = None, op: Any = dist.ReduceOp.SUM,
               async_op: bool = False, name: Optional[str] = None) -> Optional[Work]:
    """In-place all-reduce of ``tensor`` over ``group``; returns a work handle if async."""
    if group_size(group) == 1:
        return None
    label = _record("all_reduce", group, tensor, name=name)
    return _issue(label, dist.all_reduce, tensor, op=op, group=group, async_op=async_op)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group: Group = None,
                           async_op: bool = False, name: Optional[str] = None) -> Optional[Work]:
    """``output`` (N * n, ...) = concatenation over dim 0 of every rank's ``input`` (n, ...)."""
    if group_size(group) == 1:
        output.copy_(input)
        return None
    label = _record("all_gather", group, output, name=name, others=(input, ))
    return _issue(label, torch_all_gather, output, input.contiguous(), group=group,
                  async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group: Group = None,
                          op: Any = dist.ReduceOp.SUM, async_op: bool = False,
                          name: Optional[str] = None) -> Optional[Work]:
    """``output`` (n, ...) = this rank's dim-0 chunk of the sum over ranks of ``input``."""
    if group_size(group) == 1:
        output.copy_(input)
        return None
    label = _record("reduce_scatter", group, input, name=name, others=(output, ))
    return _issue(label, torch_reduce_scatter, output, input.contiguous(), op=op, group=group,
                  async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Group = None, async_op: bool = False,
              name: Optional[str] = None) -> Optional[Work]:
    """Copy ``tensor`` from global rank ``src`` to every rank of ``group``."""
    if group_size(group) == 1:
        return None
    label = _record("broadcast", group, tensor, name=name)
    return _issue(label, dist.broadcast, tensor, src=src, group=group, async_op=async_op)


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
    label = _record("all_to_all", group, input, numel=input.numel() - kept * row, name=name,
                    others=(output, ))
    return _issue(label, dist.all_to_all_single, output, input.contiguous(), output_split_sizes,
                  input_split_sizes, group=group, async_op=async_op)


def batch_isend_irecv(ops: List[dist.P2POp], group: Group = None,
                      name: Optional[str] = None) -> list:
    """Post a batch of point-to-point sends and receives; returns their work handles.

    Sends are recorded as "send", receives as "recv", with the element count of the tensor; a
    message's wire bytes are its sender's (a recv sends nothing), so summed over ranks each
    message counts once. With ``p2p_order.in_order()`` (a test mode) the batch runs in NCCL's
    order: after every batch this rank posted on the group before it. In a profile the batch
    is labelled by its ops ("pp send/recv", "pp send", "pp recv"), as are its waits.
    """
    kinds = []
    for p2p in ops:
        kind = "send" if p2p.op is dist.isend else "recv"
        label = _record(kind, group, p2p.tensor, name=name)
        kinds.append(kind)
    if not ops:
        return []
    label = label.rsplit(" ", 1)[0] + " " + "/".join(k for k in ("send", "recv") if k in kinds)
    with _label(label):
        works: List[Any] = (p2p_order.post_in_order(ops)
                            if p2p_order.in_order() else dist.batch_isend_irecv(ops))
    return [Work(w, label) for w in works]


def barrier(group: Group = None) -> None:
    if group_size(group) > 1:
        start = time.perf_counter()
        dist.barrier(group=group)
        _waited[0] += time.perf_counter() - start


def gather_objects(obj: Any, group: Group = None) -> List[Any]:
    """Every rank's picklable ``obj``, in group-rank order, on the group's first rank; [] on the
    others. For checks and reports (a timeline, full weights): not in the ledger, as not
    training traffic. On NCCL the pickles travel through the current CUDA device."""
    if not dist.is_initialized():
        return [obj]
    out: Optional[List[Any]] = [None] * group_size(group) if group_rank(group) == 0 else None
    first = 0 if group is None else dist.get_global_rank(group, 0)
    dist.gather_object(obj, out, dst=first, group=group)
    return out or []


def all_gather_objects(obj: Any, group: Group = None) -> List[Any]:
    """Every rank's picklable ``obj``, in group-rank order, on every rank of the group (for
    checks that every rank must agree on, such as a checkpoint's checksums): not in the
    ledger, as not training traffic."""
    if not dist.is_initialized():
        return [obj]
    out: List[Any] = [None] * group_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def average_over_group(value: torch.Tensor, group: Group) -> torch.Tensor:
    """Mean of a scalar over ``group`` (for reporting the global loss; not differentiable)."""
    out = value.detach().clone()
    all_reduce(out, group)
    return out / group_size(group)


def reduce(tensor: torch.Tensor, dst: int, group: Group = None) -> None:
    """In-place sum of ``tensor`` over ``group`` onto global rank ``dst`` (the others' copies
    are left undefined, as torch's)."""
    if group_size(group) == 1:
        return
    label = _record("reduce", group, tensor)
    _issue(label, dist.reduce, tensor, dst=dst, group=group)


def broadcast_tensors(tensors: List[torch.Tensor], src: int, group: Group = None) -> None:
    """Every rank's ``tensors`` become in place global rank ``src``'s: one broadcast over
    ``group`` per dtype, of their concatenation."""
    if group_size(group) == 1 or not tensors:
        return
    with torch.no_grad():
        for dtype in sorted({t.dtype for t in tensors}, key=str):  # the same order everywhere
            same = [t for t in tensors if t.dtype == dtype]
            flat = torch.cat([t.detach().reshape(-1) for t in same])
            broadcast(flat, src, group)
            for t, piece in zip(same, flat.split([t.numel() for t in same])):
                t.copy_(piece.view_as(t))


def broadcast_from_first(tensors: List[torch.Tensor], group: Group = None) -> None:
    """``broadcast_tensors`` from the group's first rank: how torch's DDP makes the replicas'
    parameters and buffers equal at wrap."""
    if group_size(group) > 1:
        broadcast_tensors(tensors, 0 if group is None else dist.get_global_rank(group, 0), group)


def _layout(named: Sequence[Tuple[str, torch.Tensor]]) -> List[Tuple[str, str]]:
    """(name, "shape dtype [frozen]") of each tensor: what the ranks must agree on."""
    return [(name, f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" +
             ("" if t.requires_grad or not isinstance(t, torch.nn.Parameter) else " frozen"))
            for name, t in named]


def check_same_layout(named: Sequence[Tuple[str, torch.Tensor]], who: str, group: Group = None,
                      fix: str = "build the same model on every rank") -> None:
    """Raise on every rank of ``group`` when the ranks' ``named`` tensors differ in count,
    shape, dtype or (parameters) requires_grad, before a wrap's broadcast or partition would
    die inside the backend. One all-gather of 2 int64 per rank (count, crc32 of the layout): a
    check, not training traffic, so not in the ledger (a wrap's records land in the ledger's
    current step, which its readers count). On a mismatch the layouts (``all_gather_objects``)
    name the first difference in one line: ``who`` (the wrapper) and ``fix`` say what to do."""
    world = group_size(group)
    if world == 1:
        return
    layout = _layout(named)
    device = named[0][1].device if named else torch.device("cpu")
    crc = zlib.crc32(repr([kind for _, kind in layout]).encode())  # names may differ: not hashed
    mine = torch.tensor([len(layout), crc], dtype=torch.int64, device=device)
    every = torch.empty(2 * world, dtype=torch.int64, device=device)
    with get_ledger().paused():
        all_gather_into_tensor(every, mine, group)
    if every.is_meta:  # a dry run (fake tensors, fake collectives): nothing to compare
        return
    rows = every.view(world, 2).tolist()
    other = next((r for r in range(world) if rows[r] != rows[0]), None)
    if other is None:
        return
    layouts = all_gather_objects(layout, group)
    first, theirs = dict(enumerate(layouts[0])), dict(enumerate(layouts[other]))
    absent = ("none", "")
    where = next((i for i in range(max(len(first), len(theirs)))
                  if first.get(i, absent)[1] != theirs.get(i, absent)[1]), 0)
    raise ValueError(f"{who}: the ranks differ at tensor {where}: rank {other} has "
                     f"{' '.join(theirs.get(where, absent)).strip()}, rank 0 has "
                     f"{' '.join(first.get(where, absent)).strip()} ({len(theirs)} vs "
                     f"{len(first)} tensors): {fix}")
