"""ZeRO's units of any ``nn.Module``: the rules that choose them and what each one holds.

zero.py's chapter shards a Llama in the units it knows (``llama_units``). A model nobody here
wrote (zero_any_module.py) takes a rule: a policy, submodules, or units; by default
``child_units``, one unit per child holding trainable parameters and the model's own ones in a
unit of their own. Units may nest, as FSDP2's ``fully_shard`` calls do: a unit that lists a
module holds its parameters except those of a submodule another unit lists
(``nested_parameters``); zero_any_module.py builds the inner units first, so that the outer one
takes what its modules still hold.
"""

from collections import Counter
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Union, cast

from torch import nn

from scaletorch.dist.comm import Group
from scaletorch.models.llama import Llama
from scaletorch.parallel.flat_unit import FlatUnit, NamedModules
from scaletorch.parallel.zero import Units, llama_units

UnitRule = Union[Units, Sequence[nn.Module], Callable[[nn.Module], Units]]


def child_units(model: nn.Module) -> Units:
    """The unit rule for any module: one unit per direct child holding trainable parameters
    (per item of a ModuleList or ModuleDict), in registration order. The model's own trainable
    parameters come first, in a unit "model" of their own: it lists the model, and a unit
    nested in another keeps its parameters (``nested_parameters``), as in FSDP2."""
    own = any(p.requires_grad for p in model.parameters(recurse=False))
    units: Units = [("model", [("", model)])] if own else []
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
        made = rule(model)
        if not isinstance(made, (list, tuple)):
            name = getattr(rule, "__name__", type(rule).__name__)
            what = f"a {type(made).__name__}" if isinstance(made, nn.Module) else repr(made)[:60]
            raise ValueError(f"units policy {name} returned {what}: return a list of "
                             f"submodules or of (name, [(name, module)]) units")
        return as_units(model, made)  # checked as given directly
    if all(isinstance(m, nn.Module) for m in rule):
        names = {id(m): n for n, m in model.named_modules()}
        unknown = [type(m).__name__ for m in rule if id(m) not in names]
        if unknown:
            raise ValueError(f"ZeRO units must be submodules of the model; not in it: {unknown}")
        seen: Set[int] = set()
        for m in rule:
            if id(m) in seen:
                raise ValueError(f"units= lists {names[id(m)] or 'the model'} twice")
            seen.add(id(m))
        return [(names[id(m)] or "model", [(names[id(m)], m)]) for m in cast(List[nn.Module], rule)]
    return cast(Units, rule)


def check_coverage(model: nn.Module, units: Units) -> None:
    """Every trainable parameter of ``model`` in exactly one of ``units``, or one line naming
    those that are not; zero_tied.py only for a Parameter two modules hold (tied weights)."""
    listed = Counter(id(p) for params in nested_parameters(units) for p in params)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    missing, twice = [n for n, p in named
                      if not listed[id(p)]], [n for n, p in named if listed[id(p)] > 1]
    holders = Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
    tied = [n for n in twice if holders[id(model.get_parameter(n))] > 1]
    if missing or twice:
        raise ValueError(f"each parameter must be in one unit; parameters in no unit: {missing}"
                         f", in two: {twice}" +
                         (f" ({tied}: tied weights, zero_tied.py)" * bool(tied)))


def _held(module: nn.Module, skip: Set[int]) -> Iterator[nn.Parameter]:
    """The parameters of ``module`` and its submodules, except in the ones in ``skip`` (ids)."""
    yield from module.parameters(recurse=False)
    for child in module.children():
        if id(child) not in skip:
            yield from _held(child, skip)


def nested_parameters(units: Units) -> List[Set[nn.Parameter]]:
    """Each unit's trainable parameters: those its modules hold, except those of a submodule
    that another unit lists (a unit nested in it keeps its own: FSDP2's rule)."""
    lists = [{id(m) for _, m in modules} for _, modules in units]
    listed = set().union(*lists)
    return [{p
             for _, m in modules
             for p in _held(m, listed - own) if p.requires_grad}
            for (_, modules), own in zip(units, lists)]


def nests(units: Units) -> List[int]:
    """For each unit, how many modules of other units lie inside its modules (0: none)."""
    inside = [{id(sub) for _, m in modules for sub in m.modules()} for _, modules in units]
    return [
        sum(id(m) in inside[j] for k, (_, mods) in enumerate(units) if k != j for _, m in mods)
        for j in range(len(units))
    ]


def check_unit_dtypes(units: Units, trainable: bool = True) -> None:
    """One flat vector per unit holds one dtype: refuse a unit whose ``trainable`` parameters
    (or, with False, its frozen ones: a flat vector of their own) mix them."""
    for name, modules in units:
        dtypes: Dict[str, List[str]] = {}
        for m_name, module in modules:
            for n, p in module.named_parameters():
                if p.requires_grad == trainable:
                    dtypes.setdefault(str(p.dtype), []).append(f"{m_name}.{n}".strip("."))
        if len(dtypes) > 1:
            raise ValueError(f"ZeRO unit {name!r} mixes dtypes {dtypes}: a unit is one flat "
                             f"vector of one dtype; cast the model, or give each dtype its units")


@contextmanager
def shown_as_trainable(params: List[nn.Parameter]) -> Iterator[None]:
    """FlatUnit lays out the trainable parameters it finds (flat_unit.py's ``holders_of``):
    frozen ``params`` are shown to it as trainable while it builds their unit, then frozen again."""
    for param in params:
        param.requires_grad_(True)
    try:
        yield
    finally:
        for param in params:
            param.requires_grad_(False)


def frozen_unit(new_unit: Callable[..., FlatUnit], name: str, modules: NamedModules,
                group: Group) -> Optional[FlatUnit]:
    """Stage 3's flat vector of the frozen parameters still held by ``modules`` (a unit's,
    built after its trainable ones took theirs), cut into N shards like any unit's: each rank
    keeps ceil(P / N) elements. Its shard has no gradient and no optimizer state. None: none."""
    frozen = list({
        id(p): p
        for _, m in modules
        for p in m.parameters() if not p.requires_grad
    }.values())  # once each, a shared one too
    if not frozen:
        return None
    check_unit_dtypes([(name, modules)], trainable=False)
    with shown_as_trainable(frozen):
        unit = new_unit(name, modules, group, 3)
    for tensor in unit.tensors:
        tensor.requires_grad_(False)
    unit.shard.requires_grad_(False)
    unit.trainable = 0
    return unit


def refuse_changed_since_wrap(model: nn.Module, frozen_at_wrap: List[Tuple[str, nn.Parameter]],
                              frozen_units: List[FlatUnit]) -> None:
    """Before a ZeRO step's reductions (``AnyShardedDataParallel.finish_grad_sync``): a
    parameter frozen at the wrap and unfrozen since (its gradient would be each rank's own,
    never reduced), or one registered after the wrap (in no unit): one line naming them."""
    unfrozen = [n for n, p in frozen_at_wrap if p.requires_grad]  # stages 1, 2: held
    unfrozen += [  # stage 3: the tensors on a frozen unit's flat vector the modules hold
        n for u in frozen_units for t, names in zip(u.tensors, u.names) if t.requires_grad
        for n in names[:1]
    ]
    if unfrozen:
        raise RuntimeError(f"ZeRO: {unfrozen} were frozen at the wrap, so no gradient of "
                           f"theirs is reduced; unfreeze before apply_zero_any")
    known = {n for n, _ in frozen_at_wrap}  # the only Parameters the model still holds
    added = [n for n, p in model.named_parameters() if p.requires_grad and n not in known]
    if added:
        raise RuntimeError(f"ZeRO: {added} registered after the wrap, so in no unit and never "
                           f"reduced: register it before apply_zero_any")
