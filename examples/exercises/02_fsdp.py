"""Exercises of chapter 02 (doc/02_fsdp.md): write the three collectives that make ZeRO.

Each is scaletorch/parallel/flat_unit.py's function with its body removed. ZeRO-1's step is
``reduce_scatter_mean`` after backward, AdamW on the shard, then ``gather_unit``; ZeRO-3 also
runs ``gather_unit`` before a unit computes and ``release_unit`` after. Write one, then

    python scripts/grade.py 02

runs chapter 02 on 2 gloo ranks with your functions in place of the library's (ZeRO-1 for the
first, ZeRO-3 for the others), compares it with one device and says "passed" or what is wrong;
it names the function to write next. The collectives are scaletorch.dist.comm's:
``comm.reduce_scatter_tensor(output, input, group, async_op=True)`` (SUM) and
``comm.all_gather_into_tensor(output, input, group, async_op=...)`` return a work to ``wait()``
for when async; ``comm.group_size(group)`` is N, ``comm.group_rank(group)`` r. A tensor's
storage is ``flat.untyped_storage()``, with ``.nbytes()`` and ``.resize_(nbytes)``.
"""

from typing import Optional

from scaletorch.dist import comm
from scaletorch.parallel.flat_unit import Flat, Shard


def reduce_scatter_mean(full: Flat, out: Shard, group: comm.Group) -> Optional[comm.Work]:
    """After a unit's backward: start averaging its (P',) gradients ``full`` over ``group``
    (dp, N ranks), async. Rank r's (S,) ``out`` receives the mean over the ranks of
    full[r S:(r + 1) S]: its shard's gradient. ``full`` (fp32) may be overwritten; in out's
    dtype if that differs. Returns the work (None on one rank: out is full)."""
    raise NotImplementedError


def gather_unit(flat: Flat, shard: Shard, group: comm.Group,
                async_op: bool = False) -> Optional[comm.Work]:
    """Before a unit computes (ZeRO-3: its forward and its backward; ZeRO-1/2: after the step):
    ``flat`` (P',) becomes every rank's (S,) ``shard`` end to end, rank r's at r S, by one
    all-gather over ``group`` (dp, N ranks). A released ``flat`` gets its P' elements back
    first. ``shard`` is in flat's dtype, not a view of it. Returns the work if ``async_op``."""
    raise NotImplementedError


def release_unit(flat: Flat) -> None:
    """After a unit computes (ZeRO-3): free its full parameters. Each is a tensor on ``flat``'s
    storage, so a storage of 0 bytes frees them all, the copies autograd saved included."""
    raise NotImplementedError
