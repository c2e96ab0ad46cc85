"""What every rank sent and received, observed at the process group, whatever API issued it.

scaletorch.dist.comm's ledger sees only the calls made through comm; a learner may call
``torch.distributed`` directly, or batch point-to-point ops with ``dist.batch_isend_irecv``.
Every one of them ends in a method of the C++ ``ProcessGroup`` (``allreduce``, ``send``,
``reduce_scatter_single``, ...), so ``observed()`` wraps those methods on the class for the
block and writes down each call: the operation, the group's name (pg_manager's ``group_desc``:
"dp", "cp", ...), the elements of its tensors and, for a send or a receive, the peer.
"""

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional

import torch
import torch.distributed as dist

# ProcessGroup's methods that move data, by the name the observer records them under
OPS = {
    "allreduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_single_coalesced": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_gather_single": "all_gather",
    "all_gather_single_coalesced": "all_gather",
    "allgather": "all_gather",
    "_allgather_base": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "allgather_coalesced": "all_gather",
    "all_to_all_single": "all_to_all",
    "alltoall_base": "all_to_all",
    "alltoall": "all_to_all",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "send": "send",
    "recv": "recv",
    "recv_anysource": "recv",
}


@dataclass
class Call:
    """One call that reached a process group on this rank."""
    op: str  # "all_reduce", "reduce_scatter", "send", "recv", ...
    group: str  # the group's description ("dp", "cp", "tp", ...), or its name
    elements: int  # elements of its largest tensor (the full one of a reduce-scatter, a gather)
    peer: Optional[int]  # a send's destination, a receive's source (group ranks), else None
    step: int  # the training step it was issued in (``observed``'s clock), else 0


def _elements(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (list, tuple)) and value:
        if isinstance(value[0], (list, tuple)):  # a list API's chunks of one tensor: all of it
            return max(sum(_elements(t) for t in chunks) for chunks in value)
        return _elements(value[0])
    return 0


class Traffic(list):
    """The calls observed, in order (a list of ``Call``)."""

    def select(self, op: str, group: Optional[str] = None,
               step: Optional[int] = None) -> List[Call]:
        return [
            c for c in self if c.op == op and group in (None, c.group) and step in (None, c.step)
        ]


@contextmanager
def observed(clock: Callable[[], int] = lambda: 0) -> Iterator[Traffic]:
    """Every call to a ProcessGroup method that moves data, for the block (this rank's), each
    with ``clock()`` as its step (the ledger's step: ``lambda: get_ledger().step``)."""
    traffic = Traffic()
    cls = dist.ProcessGroup
    # the class's own entries (pybind's instancemethod descriptors) to put back; getattr's
    # result to call (set back itself, it would no longer bind ``self``)
    originals = {name: cls.__dict__[name] for name in OPS if name in cls.__dict__}

    def wrap(name: str, method: Callable) -> Callable:

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            peer = args[1] if OPS[name] in ("send", "recv") and len(args) > 1 else None
            group = getattr(self, "group_desc", "") or getattr(self, "group_name", "")
            elements = max([_elements(a) for a in args[:2]] or [0])
            traffic.append(
                Call(OPS[name], group, elements, peer if isinstance(peer, int) else None, clock()))
            return method(self, *args, **kwargs)

        return call

    for name in originals:
        setattr(cls, name, wrap(name, getattr(cls, name)))
    try:
        yield traffic
    finally:
        for name, method in originals.items():
            setattr(cls, name, method)
