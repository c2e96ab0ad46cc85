"""ZeRO-3 on any module: before each collective of a unit, the ranks check it is the same one.

zero_any_module.py gathers units in one order on every rank: a unit a rank skips is gathered at
its turn all the same. What no order covers is a rank that calls a unit twice where another
calls it once, or calls units in another order than another rank. Its all-gathers would then
pair with other units' on the other ranks: gloo aborts on the size, NCCL waits forever, and two
units of one size would mix silently. So before each all-gather and reduce-scatter of a unit,
the ranks all-gather (which collective, which unit): two integers per rank, in the ledger as
"zero-3 order check". A difference raises one line on every rank, naming what each was to do.
A unit called again after the forward passed it (out of the units' order, or a second call) is
gathered again: correct, but more traffic, which one warning says.
"""

import warnings
from typing import Any, Sequence

import torch
from torch.utils._pytree import tree_map

from scaletorch.dist import comm
from scaletorch.dist.comm import Group

COLLECTIVES = ("all-gather", "reduce-scatter")


def check_same_collective(collective: int, unit: int, names: Sequence[str], group: Group,
                          device: torch.device) -> None:
    """Collective over ``group``: every rank is about to run ``COLLECTIVES[collective]`` of unit
    ``unit`` (``names[unit]``), or all raise one line saying what each rank was about to do."""
    mine = torch.tensor([collective, unit], dtype=torch.int64, device=device)
    every = mine.new_empty(2 * comm.group_size(group))
    comm.all_gather_into_tensor(every, mine, group, name="zero-3 order check")
    pairs = every.view(-1, 2).tolist()  # a host sync: the price of an error instead of a hang
    if any(pair != pairs[0] for pair in pairs):
        said = ", ".join(f"rank {r}: {COLLECTIVES[c]} of unit {names[u]!r}"
                         for r, (c, u) in enumerate(pairs))
        raise RuntimeError(
            f"ZeRO-3: the ranks are about to run different collectives ({said}); every rank "
            f"must reach the units in one order, each as often as the others (a unit that a rank "
            f"skips is fine when the units are listed in the order the forward calls them: "
            f"units=[...]; one called twice on one rank only, or units called in another order "
            f"per rank, is not)")


def copy_views_of(flat: torch.Tensor, output: Any) -> Any:
    """``output`` with a copy of each tensor that is a view of ``flat``'s storage (a module that
    returns its own parameter, or a view of it): the unit is freed after its forward, so such a
    view would read freed memory. The copy keeps the gradient path to the parameter."""
    storage = flat.untyped_storage().data_ptr()

    def copied(value: Any) -> Any:
        on_flat = torch.is_tensor(value) and value.untyped_storage().data_ptr() == storage
        return value.clone() if on_flat else value

    return tree_map(copied, output)


def warn_called_again(name: str, names: Sequence[str]) -> None:
    """Once (Python's warnings): unit ``name`` ran after the forward had passed it, so it was
    gathered once more (and the units between, passed on the way, once each)."""
    warnings.warn(
        f"ZeRO-3: unit {name!r} ran after the forward had passed it (called a second time, or "
        f"before a unit listed ahead of it; units in order: {list(names)}): it is all-gathered "
        f"again. List the units in the order the forward calls them (units=[...]) to gather each "
        f"once", stacklevel=2)
