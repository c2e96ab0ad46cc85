"""ZeRO on any ``nn.Module``, as PyTorch's FSDP takes one: chapter 02's wrapper, from outside.

Chapter 02's script shards a Llama in units it knows (zero.py's ``llama_units``) and reads none
of this. A model nobody here wrote (examples/own_model.py, tests/test_own_model.py) needs more,
added by a subclass of zero.py's ``ShardedDataParallel``:

- a unit rule for any module (``child_units``, ``as_units``: a policy, submodules or units);
- under stage 3 a unit is gathered before whichever of its modules runs first, and a released
  unit's modules hold placeholders (``ReleasedParameter``): a parent that reads
  ``self.layers[1].weight`` without calling ``layers[1]`` stops with one line naming the unit;
- ``named_parameters()`` under the model's own names, in its order, each this rank's piece of
  its shard (``ShardView``: it refuses ``requires_grad_``; the sharded optimizer refuses it);
- ``full_state_dict()`` with every key ``module.state_dict()`` has (a shared module's too);
- a unit holds one dtype (one flat vector): a unit mixing dtypes is refused at the wrap.

The optimizer is zero.py's (``ZeroAdamW``), or sharded_optimizer.py's with an elementwise class.
"""

from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union, cast

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from scaletorch.dist.comm import Group
from scaletorch.models.llama import Llama
from scaletorch.parallel.flat_unit import FlatUnit, put_tensor
from scaletorch.parallel.zero import MakeUnit, ShardedDataParallel, Units, llama_units

UnitRule = Union[Units, Sequence[nn.Module], Callable[[nn.Module], Units]]


def child_units(model: nn.Module) -> Units:
    """The unit rule for any module: one unit per direct child holding trainable parameters
    (per item of a ModuleList or ModuleDict), in registration order. Parameters of the model
    itself make the whole model one unit (correct, but no memory saved in forward)."""
    if any(p.requires_grad for p in model.parameters(recurse=False)):
        return [("model", [("", model)])]
    units: Units = []
    for name, child in model.named_children():
        listed = isinstance(child, (nn.ModuleList, nn.ModuleDict))
        for sub, module in child.named_children() if listed else [("", child)]:
            full = f"{name}.{sub}" if sub else name
            units += [(full, [(full, module)])] if any(p.requires_grad
                                                       for p in module.parameters()) else []
    return units


def as_units(model: nn.Module, rule: Optional[UnitRule]) -> Units:
    """ZeRO's units from ``rule``: None (a Llama: ``llama_units``, the chapters' choice; any
    other model: ``child_units``), a policy ``model -> Units``, submodules (one unit each, in
    forward order) or Units."""
    if rule is None:
        return llama_units(model) if isinstance(model, Llama) else child_units(model)
    if callable(rule):
        return rule(model)
    if all(isinstance(m, nn.Module) for m in rule):
        names = {id(m): n for n, m in model.named_modules()}
        unknown = [type(m).__name__ for m in rule if id(m) not in names]
        if unknown:
            raise ValueError(f"ZeRO units must be submodules of the model; not in it: {unknown}")
        return [(names[id(m)] or "model", [(names[id(m)], m)]) for m in cast(List[nn.Module], rule)]
    return cast(Units, rule)


class ReleasedParameter(torch.Tensor):
    """What a released ZeRO-3 unit's modules hold in place of each parameter: any use of it
    raises one line naming the unit and the parameter, instead of reading freed memory."""
    message = ""

    @staticmethod
    def saying(message: str) -> "ReleasedParameter":
        released = torch.Tensor._make_subclass(ReleasedParameter, torch.empty(0))
        released.message = message
        return released

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        found = [a for a in tree_leaves((args, kwargs)) if isinstance(a, ReleasedParameter)]
        raise RuntimeError(found[0].message if found else "a released ZeRO-3 parameter was used")


class ShardView(nn.Parameter):
    """A piece of a ZeRO unit's shard under a parameter's name (``named_parameters()``)."""

    def requires_grad_(self, requires_grad: bool = True) -> "ShardView":
        raise RuntimeError("requires_grad_ on a ZeRO view does nothing to the shard it shows: "
                           "freeze the parameter before apply_zero_any")


def check_unit_dtypes(units: Units) -> None:
    """One flat vector per unit holds one dtype: refuse a unit whose parameters mix them."""
    for name, modules in units:
        dtypes: Dict[str, List[str]] = {}
        for m_name, module in modules:
            for n, p in module.named_parameters():
                if p.requires_grad:
                    dtypes.setdefault(str(p.dtype), []).append(f"{m_name}.{n}".strip("."))
        if len(dtypes) > 1:
            raise ValueError(f"ZeRO unit {name!r} mixes dtypes {dtypes}: a unit is one flat "
                             f"vector of one dtype; cast the model, or give each dtype its units")


class AnyShardedDataParallel(ShardedDataParallel):
    """``ShardedDataParallel`` for a module nobody here wrote (see the module docstring)."""

    def __init__(self, module: nn.Module, units: Units, *args: Any, **kwargs: Any) -> None:
        check_unit_dtypes(units)
        first: Dict[int, str] = {}  # each tensor's first name: its other names are aliases
        names = {
            n: first.setdefault(id(t), n)
            for n, t in module.state_dict(keep_vars=True).items()
        }
        super().__init__(module, units, *args, **kwargs)
        self.names_at_wrap = names  # {every state_dict key: the first key of its tensor}
        if self.zero_stage == 3:
            for i, unit in enumerate(self.units):
                # the first module has its hook (zero.py); every other one holding a parameter
                held = {id(sub): sub for slots in unit.slots for sub, _, _ in slots}
                for module in held.values():
                    if module is not unit.modules[0]:
                        module.register_forward_pre_hook(partial(self._pre_forward, i))
                self._hold(unit, False)

    @staticmethod
    def _hold(unit: FlatUnit, gathered: bool) -> None:
        """The unit's modules hold its full tensors (``gathered``) or a placeholder each."""
        where = ", ".join(sorted({type(m).__name__ for m in unit.modules}))
        for tensor, slots in zip(unit.tensors, unit.slots):
            for sub, attr, fqn in slots:
                put_tensor(
                    sub, attr, tensor if gathered else ReleasedParameter.saying(
                        f"ZeRO-3 unit {unit.name!r} ({where}) is released, but {fqn} was used: "
                        f"a unit is gathered only when one of its modules is called; call the "
                        f"module, or give the code that reads {fqn} a unit holding it (units=)"))

    def _gather(self, i: int, async_op: bool = False) -> None:
        super()._gather(i, async_op)
        if i not in self._gathering:  # complete: its modules hold the full tensors again
            self._hold(self.units[i], True)

    def _free(self, i: int) -> None:
        super()._free(i)
        self._hold(self.units[i], False)  # a use outside the hooks now raises, naming the unit

    def finish_grad_sync(self) -> None:
        """zero.py's, after checking that no parameter left whole (frozen at the wrap) was
        unfrozen since: its gradient would be each rank's own, never reduced."""
        unfrozen = [n for n, p in self.module.named_parameters() if p.requires_grad]
        if unfrozen:
            raise RuntimeError(f"ZeRO: {unfrozen} were frozen at the wrap and are in no unit; "
                               f"unfreeze before apply_zero_any")
        super().finish_grad_sync()

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """What an optimizer steps: this rank's (S,) shards (and frozen parameters, whole)."""
        for _, param in super().named_parameters(recurse=recurse):
            yield param

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        """Every parameter of the model under its own name (``layers.0.weight``), as a view:
        this rank's piece of it, a 1-D view of its unit's shard (0 elements when the
        parameter lies in other ranks' shards), ``.grad`` the same piece of the shard's
        gradient once reduced; frozen ones whole. Pieces of all ranks make the parameter
        (``full_state_dict`` gathers them); ``parameters()`` stays the shards."""
        lead = prefix + "." if prefix else ""
        found: List[Tuple[str, nn.Parameter]] = []
        for unit in self.units:
            lo, hi = unit.rank * unit.shard_numel, (unit.rank + 1) * unit.shard_numel
            for names, begin, end in zip(unit.names, unit.offsets, unit.offsets[1:]):
                a, b = min(max(begin, lo), hi) - lo, min(max(end, lo), hi) - lo
                piece = ShardView(unit.shard.detach()[a:b])
                if unit.shard.grad is not None:
                    piece.grad = unit.shard.grad[a:b]
                found += [(name, piece) for name in (names[:1] if remove_duplicate else names)]
        # frozen ones: in no unit, whole on every rank; all in the model's order
        found += self.module.named_parameters(remove_duplicate=remove_duplicate)
        order = {n: i for i, n in enumerate(self.names_at_wrap)}
        for name, param in sorted(found, key=lambda item: order.get(item[0], len(order))):
            yield lead + name, param

    def full_state_dict(
        self, value_of: Optional[Callable[[torch.Tensor],
                                          torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
        """zero.py's, with every key of ``module.state_dict()``: a module registered under two
        names (``self.mid2 = self.mid``) gives both, one tensor."""
        full = super().full_state_dict(value_of)
        return {name: full[first] for name, first in self.names_at_wrap.items() if first in full}


def apply_zero_any(model: nn.Module, group: Group = None, zero_stage: int = 3,
                   prefetch: bool = True, units: Optional[UnitRule] = None,
                   make_unit: MakeUnit = FlatUnit) -> AnyShardedDataParallel:
    """Shard any ``model`` over ``group`` (the world when None) in ``units`` (``as_units``),
    ZeRO ``zero_stage``; the first rank's weights are broadcast. Pair it with ``ZeroAdamW``
    or ``ShardedOptimizer(model, optimizer_class, ...)``."""
    return AnyShardedDataParallel(model, as_units(model, units), group, zero_stage, prefetch,
                                  make_unit)
