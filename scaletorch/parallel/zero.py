"""ZeRO stages 1, 2 and 3 by hand: the sharded data-parallel wrapper and its AdamW.

ZeRO (Rajbhandari et al., 2020) removes the redundancy of data parallel over the N ranks of
``pgm.gradient_sync_group`` (same global batch as chapter 01: each rank takes 1/N
of it). Each unit's parameters are one flat vector cut into N shards (flat_unit.py); rank r
owns shard r. What else a rank keeps is the stage (fp32, 4 bytes per element, Psi parameters):

    stage     params       grads          Adam state     bytes per rank
    0 (DDP)   full         full           full           4Psi + 4Psi + 8Psi      = 16 Psi
    1         full         full           shard          4Psi + 4Psi + 8Psi/N
    2         full         shard          shard          4Psi + (4Psi + 8Psi)/N
    3         shard        shard          shard          16 Psi/N  (+ gathered units in flight)

Stage 3, units U0 (embedding), U1..UL (blocks), UL+1 (head = norm + lm_head), by hooks:

    forward    gather U0, run U0, free U0 | gather U1, run U1, free U1 | ...
    backward   ... | gather U1, grads of U1, reduce-scatter + free U1 | gather U0, ...

Every stage reduce-scatters a unit's gradients once its last one is in (post-accumulate-grad
hooks; inside ``no_sync()`` nothing is reduced). ``ZeroAdamW.step`` updates the shards, then
stages 1 and 2 all-gather them. Stages 1, 2 move 2 Psi per step as DDP, stage 3 3 Psi
(zero_report.py). Chapter 10's tied weights (zero_tied.py) and chapter 08's dtypes
(zero_mixed_precision.py) attach from outside, as subclasses, chapter 07's chunks as one wrapper.
"""

from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Protocol, Tuple, Type, Union, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from scaletorch.dist import ProcessGroupManager, comm, get_ledger
from scaletorch.dist.comm import Work
from scaletorch.dist.wrap_checks import (RefuseAddedGroups, check_zero_layout, refuse_partition,
                                         refuse_unwrappable)
from scaletorch.parallel.flat_unit import (FlatUnit, Group, NamedModules, gather_unit,
                                           reduce_scatter_mean, release_unit)
from scaletorch.parallel.grad_norm import clip_grads_, world_grad_norm

Units = List[Tuple[str, NamedModules]]  # (unit name, [(module name, module), ...])
State = Dict[str, torch.Tensor]


class ShardedDataParallel(nn.Module):
    """ZeRO stage 1, 2 or 3 of ``module`` over ``group`` (see the module docstring).

    ``units`` lists (name, [(name of the module in ``module``, module), ...]) in forward order;
    every parameter must be in exactly one unit. The wrapper's parameters (``self.shards``, one
    flat (S,) shard per unit) are all that the optimizer and ``state_dict`` see: this rank's
    shards. ``full_state_dict`` gathers the full tensors under the original names;
    ``clip_grad_norm`` counts each shard element once.
    """
    shares_parameters = False  # chapter 10's subclass shares a weight (zero_tied.py)
    data_parallel_wrapper = True  # wrapper.py's refuse_wrapped: wrapping this again is refused
    # (name, modules, group, stage) -> one unit; chapter 08's subclass builds its own kind
    new_unit: Callable[[str, NamedModules, Group, int], FlatUnit] = FlatUnit

    def __init__(self, module: nn.Module, units: Units, group: Optional[dist.ProcessGroup],
                 zero_stage: int, prefetch: bool = True) -> None:
        super().__init__()
        if zero_stage not in (1, 2, 3):
            raise ValueError(f"zero_stage must be 1, 2 or 3, got {zero_stage}")
        refuse_unwrappable(module, "ZeRO", group)  # every rank alike (wrap_checks.py)
        per_unit = self._unit_parameters(units)  # frozen ones stay whole, in no unit
        units = [unit for unit, params in zip(units, per_unit) if params]
        refuse_partition(module, per_unit, "ZeRO", self.shares_parameters)
        self.module, self.group, self.zero_stage = module, group, zero_stage
        self.prefetch = prefetch
        # torch DDP's rule, as in data_parallel.py: every rank starts from the first rank's model
        comm.broadcast_from_first([*module.parameters(), *module.buffers()], group)
        self.units = self._build_units(units)
        # Parameter names may not contain dots: "layers.0" -> "layers_0".
        self.shards = nn.ParameterDict({u.name.replace(".", "_"): u.shard for u in self.units})
        self._sync = True
        self._ready = [0] * len(self.units)  # gradients received in this backward, per unit
        self._dirty = [False] * len(self.units)  # unit holds gradients not yet reduced
        # (work, its full input, finish) of the reduce-scatter in flight
        self._pending: Optional[Tuple[Optional[Work], torch.Tensor, Callable[[], None]]] = None
        self._gathering: Dict[int, Work] = {}  # unit -> work of an async all-gather (prefetch)
        self.peak_gathered_units = 0  # stage 3: most units full at the same time
        self.peak_gathered_bytes = 0
        self.register_state_dict_post_hook(self._copy_shards)
        self.register_load_state_dict_post_hook(self._gather_after_load)
        for i, unit in enumerate(self.units):
            for tensor in unit.tensors:
                if tensor.requires_grad:
                    tensor.register_post_accumulate_grad_hook(partial(self._on_grad, i))
            if zero_stage == 3:
                unit.modules[0].register_forward_pre_hook(partial(self._pre_forward, i))
                unit.modules[-1].register_forward_hook(partial(self._post_forward, i))

    def _unit_parameters(self, units: Units) -> List[set]:  # trainable; unit_rules.py nests
        return [{p for _, m in ms for p in m.parameters() if p.requires_grad} for _, ms in units]

    def _build_units(self, units: Units) -> List[FlatUnit]:
        """One FlatUnit per unit (chapter 10's subclass lets units share a parameter)."""
        return [self.new_unit(n, mods, self.group, self.zero_stage) for n, mods in units]

    @property
    def padded_numel(self) -> int:
        """Psi': parameters plus each unit's padding to a multiple of N."""
        return sum(u.padded_numel for u in self.units)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._ready = [0] * len(self.units)  # one forward, one backward: count afresh
        return self.module(*args, **kwargs)

    # ---- stage 3: gather before use, free after -----------------------------------------

    # [core: zero3-hooks]
    def _gather(self, i: int, async_op: bool = False) -> None:
        """Make unit i's full parameters available (with ``async_op``: start to)."""
        if i in self._gathering:
            if not async_op:
                self._gathering.pop(i).wait()
            return
        unit = self.units[i]
        if unit.gathered_bytes:
            return
        work = gather_unit(unit.flat, unit.gather_source(), unit.group, async_op)  # (S,) -> (P',)
        if async_op and work is not None:
            self._gathering[i] = work
        held = [u.gathered_bytes for u in self.units if u.gathered_bytes]
        self.peak_gathered_units = max(self.peak_gathered_units, len(held))
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, sum(held))

    def _free(self, i: int) -> None:
        if i in self._gathering:  # never free a buffer that a transfer is writing
            self._gathering.pop(i).wait()
        release_unit(self.units[i].flat)

    def _pre_forward(self, i: int, module: nn.Module, args: Tuple[Any, ...]) -> None:
        self._gather(i)
        if self.prefetch and i + 1 < len(self.units):
            self._gather(i + 1, async_op=True)

    def _post_forward(self, i: int, module: nn.Module, args: Tuple[Any, ...], output: Any) -> None:
        self._free(i)
        for tensor in tree_leaves(output):  # a tensor, or a tuple or dict of them
            if torch.is_tensor(tensor) and tensor.requires_grad:
                # Fires when the gradient of the unit's output is ready: its backward starts.
                tensor.register_hook(partial(self._pre_backward, i))

    def _pre_backward(self, i: int, grad: torch.Tensor) -> None:
        self._gather(i)
        if self.prefetch and i > 0:
            self._gather(i - 1, async_op=True)  # backward runs the units in reverse

    # [end: zero3-hooks]
    # ---- gradients: one reduce-scatter per unit, once per accumulation --------------------

    def _on_grad(self, i: int, tensor: torch.Tensor) -> None:
        self._ready[i] += 1
        self._dirty[i] = True
        if self._ready[i] == self.units[i].trainable:  # the unit's backward is complete
            # count afresh: several backwards may follow one forward without another between
            # (a pipeline's cool-down: 1F1B's B's, a zero-bubble schedule's W's)
            self._ready[i] = 0
            if self._sync:
                self._reduce(i)
            if self.zero_stage == 3:
                self._free(i)

    def _reduce(self, i: int) -> None:
        # One reduce-scatter in flight at a time: its full-size input is freed sooner.
        self._wait_reduce()
        unit = self.units[i]
        full, out = unit.grads_to_reduce()  # (P',) gradients, an empty (S,) for the mean
        work = reduce_scatter_mean(full, out, unit.group)
        self._pending = (work, full, partial(unit.take_grad, out))  # full lives until done
        self._dirty[i] = False

    def _wait_reduce(self) -> None:
        if self._pending is not None:
            work, _, finish = self._pending
            if work is not None:
                work.wait()
            finish()
            self._pending = None

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward accumulates full gradients and reduces nothing (all but the last
        micro-batch); stage 3 still gathers and frees the parameters around each unit."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def finish_grad_sync(self) -> None:
        """Reduce what the hooks left (units with unused parameters), wait for all of it."""
        for i, dirty in enumerate(self._dirty):
            if dirty:
                self._reduce(i)
        self._wait_reduce()
        if self.zero_stage == 3:
            for i in range(len(self.units)):
                self._free(i)

    # ---- what ZeroAdamW calls -------------------------------------------------------------

    def zero_grad_buffers(self) -> None:
        """Clear the full-size gradients (stage 1 zeroes its flat buffers in place)."""
        for unit in self.units:
            unit.zero_grad()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The clip: each shard element lives on one rank, so it counts once (grad_norm.py's
        rule, replicas 1): one all-reduce of one number over the world."""
        self.finish_grad_sync()
        shards = list(self.shards.values())
        norm = world_grad_norm([(s, 1) for s in shards], shards[0].device)
        return clip_grads_(shards, max_norm, norm)

    # ---- checkpoints ------------------------------------------------------------------------

    def full_state_dict(self, value_of: Optional[Callable[[torch.Tensor],
                                                          torch.Tensor]] = None) -> State:
        """Collective over the group: chapter 00's {name: full tensor} of the shards, or of
        anything shaped like them (``value_of(shard)``: an AdamW state). Each unit's (S,) pieces
        are all-gathered into its (P',) vector and cut at the parameters' offsets, in the shard's
        dtype (the parameters' own: float64 stays float64, bfloat16 stays bfloat16). The weights
        (no ``value_of``) include what no unit holds: frozen parameters, buffers."""
        full: State = {}
        rest = [] if value_of else [*self.module.named_parameters(), *self.module.named_buffers()]
        value_of = value_of or torch.Tensor.detach
        with get_ledger().paused():  # a check, not training traffic
            for unit in self.units:
                flat = unit.all_gather_flat(value_of(unit.shard))
                for names, shape, start in zip(unit.names, unit.shapes, unit.offsets):
                    tensor = flat[start:start + shape.numel()].view(shape).cpu().clone()
                    full.update({name: tensor for name in names})  # tied: one tensor, both names
        return {**full, **{name: t.detach().cpu().clone() for name, t in rest}}  # whole here

    # The state dict is this rank's shards {"shards.<unit>": (S,)}, resumed by the same rank of
    # the same N. Hooks, not overrides: they also run inside a container (a pipeline's chunks).

    @staticmethod
    def _copy_shards(module: nn.Module, state_dict: Dict[str, Any], prefix: str,
                     local_metadata: Any) -> None:
        """state_dict post-hook: copy each shard (stages 1, 2: a view of the full flat vector,
        which torch.save would write whole)."""
        for key in [k for k in state_dict if k.startswith(prefix + "shards.")]:
            if not isinstance(state_dict[key], nn.Parameter):  # keep_vars=True wants the vars
                state_dict[key] = state_dict[key].clone()

    @staticmethod
    def _gather_after_load(module: "ShardedDataParallel", incompatible_keys: Any) -> None:
        """load_state_dict post-hook: stages 1, 2 all-gather the loaded shards (every rank)."""
        if module.zero_stage < 3:  # stage 3 gathers each unit just before it is used
            with torch.no_grad():
                for unit in module.units:
                    unit.gather()


def llama_units(model: nn.Module) -> Units:
    """The sharding units of a Llama, in forward order: embedding, each block, head (or of
    a pipeline chunk, chapter 04: its ``layers`` keyed by index, a missing end None)."""
    # torch types a module's attributes Tensor | Module; these are modules, or None in a chunk
    blocks = cast(Union[nn.ModuleList, nn.ModuleDict], model.layers)
    embed = cast(Optional[nn.Module], model.embed_tokens)
    lm_head = cast(Optional[nn.Module], model.lm_head)
    layers = blocks.items() if isinstance(blocks, nn.ModuleDict) else enumerate(blocks)
    units: Units = [("embed_tokens", [("embed_tokens", embed)])] if embed is not None else []
    units += [(f"layers.{i}", [(f"layers.{i}", layer)]) for i, layer in layers]
    if lm_head is not None:
        units.append(("head", [("norm", cast(nn.Module, model.norm)), ("lm_head", lm_head)]))
    return units


def apply_zero(model: nn.Module, pgm: ProcessGroupManager, zero_stage: int = 3,
               prefetch: bool = True, units: Optional[Units] = None) -> ShardedDataParallel:
    """Shard ``model`` over ``pgm.gradient_sync_group`` in ``units`` (a Llama's by default),
    ZeRO ``zero_stage``; the first rank's weights are broadcast. Pair it with ``ZeroAdamW``;
    the Trainer with ``model.clip_grad_norm``. Any other ``nn.Module``: zero_any_module.py."""
    check_zero_layout(zero_stage, pgm.tensor_model_parallel_world_size,
                      pgm.pipeline_model_parallel_world_size, pgm.expert_model_parallel_world_size)
    return ShardedDataParallel(model, units or llama_units(model), pgm.gradient_sync_group,
                               zero_stage, prefetch)


class Sharded(Protocol):  # what ZeroOptimizer steps: ShardedDataParallel (or zero_chunks.py's)
    zero_stage: int
    units: List[FlatUnit]

    def parameters(self) -> Iterator[nn.Parameter]:
        """The (S,) shards."""

    def finish_grad_sync(self) -> None:
        """Wait for every unit's reduce-scatter."""

    def zero_grad_buffers(self) -> None:
        """Clear the full gradients."""


class ZeroOptimizer(RefuseAddedGroups, torch.optim.Optimizer):
    """``optimizer_class`` over this rank's (S,) shards of ``model``: 1/N of the state.

    ``self.local`` steps the shards; its groups and state are this optimizer's (a scheduler's
    lr, a checkpoint). ``zero_grad()`` also clears the wrapper's full gradients.
    """

    def __init__(self, model: Sharded, optimizer_class: Type[torch.optim.Optimizer],
                 **defaults: Any) -> None:
        self.wrapper, shards = model, list(model.parameters())  # the wrapper, its (S,) shards
        self.local = optimizer_class(shards, **defaults)
        super().__init__(shards, defaults)
        self.param_groups, self.state = self.local.param_groups, self.local.state
        self.defaults = self.local.defaults
        self._built = True  # RefuseAddedGroups (wrap_checks.py): no group added after this

    # [core: zero-step]
    @torch.no_grad()
    def step(  # type: ignore[override]  # torch's stub: overloads on closure
            self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        self.wrapper.finish_grad_sync()  # each unit's reduce_scatter_mean, started in backward
        loss = self.local.step(closure)  # e.g. AdamW on this rank's (S,) shards only
        units = self.wrapper.units if self.wrapper.zero_stage < 3 else []
        # stages 1, 2: gather_unit of every unit, (S,) -> (P',); stage 3 gathers before use
        works = [gather_unit(u.flat, u.gather_source(), u.group, async_op=True) for u in units]
        for work in works:
            if work is not None:
                work.wait()
        return loss

    # [end: zero-step]

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)  # every group's parameters
        self.wrapper.zero_grad_buffers()  # and the full gradients (stage 1's flat buffers)

    def state_dict(self) -> Dict[str, Any]:
        """This rank's optimizer state (resumed by the same rank of the same N)."""
        return self.local.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.local.load_state_dict(state_dict)  # torch's: new groups and state on self.local
        self.param_groups, self.state = self.local.param_groups, self.local.state


class ZeroAdamW(ZeroOptimizer):
    """``ZeroOptimizer`` with torch.optim.AdamW."""

    def __init__(self, model: Sharded, lr: float, betas: Tuple[float, float], weight_decay: float,
                 eps: float = 1e-8) -> None:
        super().__init__(model, torch.optim.AdamW, lr=lr, betas=betas, eps=eps,
                         weight_decay=weight_decay)
