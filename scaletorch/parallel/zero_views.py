"""What a ZeRO-3 unit's modules and a ZeRO wrapper's ``named_parameters()`` hold, for any module.

zero_any_module.py wraps a model nobody here wrote. A released unit's modules hold a
``ReleasedParameter`` in place of each parameter (``hold``: a use raises one line naming the
unit); the wrapper names each parameter by a ``ShardView``, this rank's piece of its unit's (S,)
shard, [a, b) of it by ``pieces_of``; ``unflatten`` cuts a gathered unit into its tensors.
"""

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from scaletorch.parallel.flat_unit import FlatUnit, put_tensor

FREEZE_BEFORE = "freeze or unfreeze the parameter before apply_zero_any"


class ReleasedParameter(torch.Tensor):
    """What a released ZeRO-3 unit's modules hold in place of each parameter: any use of it
    raises one line naming the unit and the parameter, instead of reading freed memory;
    ``requires_grad_`` says what to do instead, as ``ShardView``'s."""
    message = ""

    @staticmethod
    def saying(message: str) -> "ReleasedParameter":
        released = torch.Tensor._make_subclass(ReleasedParameter, torch.empty(0))
        released.message = message
        return released

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        found = [a for a in tree_leaves((args, kwargs)) if isinstance(a, ReleasedParameter)]
        if func is torch.Tensor.requires_grad_:  # freezing through the model, after the wrap
            raise RuntimeError(f"requires_grad_ on a released ZeRO-3 parameter does nothing to "
                               f"its unit's shard: {FREEZE_BEFORE}")
        raise RuntimeError(found[0].message if found else "a released ZeRO-3 parameter was used")


class ShardView(nn.Parameter):
    """A piece of a ZeRO unit's shard under a parameter's name (``named_parameters()``)."""

    def requires_grad_(self, requires_grad: bool = True) -> "ShardView":
        raise RuntimeError(f"requires_grad_ on a ZeRO view does nothing to the shard it shows: "
                           f"{FREEZE_BEFORE}")


def pieces_of(unit: FlatUnit) -> List[Tuple[int, int]]:
    """Where each of the unit's parameters lies in this rank's shard: [a, b) (a == b: none)."""
    lo, hi = unit.rank * unit.shard_numel, (unit.rank + 1) * unit.shard_numel
    return [(min(max(begin, lo), hi) - lo, min(max(end, lo), hi) - lo)
            for begin, end in zip(unit.offsets, unit.offsets[1:])]


def hold(unit: FlatUnit, gathered: bool, when: str) -> None:
    """The unit's modules hold its full tensors (``gathered``) or a ``ReleasedParameter`` each,
    whose use names the unit and ``when`` it is gathered."""
    where = ", ".join(sorted({type(m).__name__ for m in unit.modules}))
    for tensor, slots in zip(unit.tensors, unit.slots):
        for sub, attr, fqn in slots:
            put_tensor(
                sub, attr, tensor if gathered else ReleasedParameter.saying(
                    f"ZeRO-3 unit {unit.name!r} ({where}) is released, but {fqn} was used: "
                    f"a unit is gathered only while {when} runs (from its call to its "
                    f"return), and {fqn} was read outside such a call: give the module "
                    f"whose forward reads it a unit holding {fqn} too (units=)"))


def unflatten(unit: FlatUnit, flat: torch.Tensor) -> Dict[str, torch.Tensor]:
    """{every name of each of the unit's parameters: its full tensor, on the CPU} from the
    unit's (P',) ``flat`` vector (a name sharing a tensor gets the same one)."""
    full: Dict[str, torch.Tensor] = {}
    for names, shape, start in zip(unit.names, unit.shapes, unit.offsets):
        tensor = flat[start:start + shape.numel()].view(shape).cpu().clone()
        full.update({name: tensor for name in names})
    return full


def named_views(units: Sequence[FlatUnit], pieces: Sequence[Optional[List[ShardView]]],
                rest: Iterable[Tuple[str, nn.Parameter]], order_of: Dict[str, str],
                remove_duplicate: bool) -> List[Tuple[str, nn.Parameter]]:
    """(name, view) of every parameter of ``units``, in the model's order (``order_of``: its
    state_dict keys), and ``rest`` (parameters in no unit, whole). A unit's trainable
    parameters are the optimizer's ``pieces`` (grad None where no rank had one); a frozen
    unit's (pieces None) get views of its shard without gradient."""
    found: List[Tuple[str, nn.Parameter]] = []
    for unit, own in zip(units, pieces):
        for k, (names, (a, b)) in enumerate(zip(unit.names, pieces_of(unit))):
            piece = own[k] if own is not None else ShardView(unit.shard.detach()[a:b], False)
            found += [(name, piece) for name in (names[:1] if remove_duplicate else names)]
    order = {n: i for i, n in enumerate(order_of)}
    return sorted([*found, *rest], key=lambda item: order.get(item[0], len(order)))
