"""ZeRO on any ``nn.Module``, as PyTorch's FSDP takes one: chapter 02's wrapper, from outside.

Chapter 02's script shards a Llama in units it knows (zero.py's ``llama_units``) and reads none
of this. A model nobody here wrote (examples/own_model.py, tests/test_own_model.py) needs more,
added by a subclass of zero.py's ``ShardedDataParallel``:

- a unit rule for any module (unit_rules.py: ``child_units``, ``as_units``), units that nest
  (the model's own parameters in a unit of their own, as FSDP2's root);
- under stage 3 a unit is gathered before whichever of its modules runs first; a released
  unit's modules hold placeholders, and ``named_parameters()`` gives this rank's piece of each
  parameter under its own name (zero_views.py); ``full_state_dict()`` has every key;
- a unit holds one dtype (one flat vector): a unit mixing dtypes is refused at the wrap;
- under stage 3 frozen parameters are sharded too (``frozen_unit``): a unit's gathered and
  released with it, those of no unit for the wrapper's forward and backward;
- the optimizer steps each parameter's piece of its unit's shard (``pieces``), and one that no
  rank used in a step has ``grad None`` (``_agree_on_grads``): skipped as on one device;
- under stage 3 ranks may call or use different units: all gather in one order (forward 0..U-1,
  backward U-1..0), a unit this rank skips gathered and freed at its turn all the same
  (``_pass_forward``, ``_pass_backward``): another rank's all-gather needs this rank's part.
  Before each all-gather and reduce-scatter the ranks check it is the same (zero_order_check.py).

The optimizer is zero.py's (``ZeroAdamW``), or sharded_optimizer.py's with an elementwise class.
"""

from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple, cast

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from scaletorch.dist import comm, get_ledger
from scaletorch.dist.comm import Group, Work
from scaletorch.dist.wrap_checks import refuse_wrapped
from scaletorch.parallel.flat_unit import FlatUnit, gather_unit, release_unit
from scaletorch.parallel.unit_rules import (UnitRule, as_units, check_coverage, check_unit_dtypes,
                                            frozen_unit, nested_parameters, nests,
                                            refuse_changed_since_wrap)
from scaletorch.parallel.zero import ShardedDataParallel, Units
from scaletorch.parallel.zero_order_check import (check_same_collective, copy_views_of,
                                                  warn_called_again)
from scaletorch.parallel.zero_views import ShardView, hold, named_views, pieces_of, unflatten


class AnyShardedDataParallel(ShardedDataParallel):
    """``ShardedDataParallel`` for a module nobody here wrote (see the module docstring)."""

    def __init__(self, module: nn.Module, units: Units, *args: Any, **kwargs: Any) -> None:
        first: Dict[int, str] = {}  # each tensor's first name: its other names are aliases
        names = {
            n: first.setdefault(id(t), n)
            for n, t in module.state_dict(keep_vars=True).items()
        }
        frozen_at_wrap = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        check_coverage(module, units)  # zero.py's check, naming the cause (a module listed twice)
        super().__init__(module, units, *args, **kwargs)
        self.names_at_wrap = names  # {every state_dict key: the first key of its tensor}
        self.frozen_at_wrap = frozen_at_wrap  # unfrozen later, one stops the step (by name)
        # stage 3: unit i's frozen parameters (frozen[i]), then those of no unit (``outside``)
        self.frozen: List[Optional[FlatUnit]] = []
        self.outside: Optional[FlatUnit] = None
        self.frozen_shards = nn.Module()  # their (S,) shards: buffers, in no optimizer
        self._frozen_work: Dict[int, Work] = {}  # unit -> async all-gather of its frozen ones
        self._inputs = [0] * len(self.units)  # the unit's inputs needing a gradient, this forward
        self._awaiting = [0] * len(self.units)  # of those, the ones backward has not reached
        if self.zero_stage == 3:
            modules_of = dict(units)
            # an outer unit's frozen ones (the model's own) go with those of no unit: read
            # anywhere in the backward, they stay gathered until finish_grad_sync
            self.frozen = [
                None
                if outer else frozen_unit(self.new_unit, u.name, modules_of[u.name], self.group)
                for u, outer in zip(self.units, self._outer)
            ]
            self.outside = frozen_unit(self.new_unit, "outside", [("", module)], self.group)
            for unit in [*self.frozen, self.outside]:
                if unit is not None:
                    self.frozen_shards.register_buffer(unit.name.replace(".", "_"), unit.shard)
                    self._hold(unit, False)
            for i, unit in enumerate(self.units):
                # the first module has its hook (zero.py); every other one holding a parameter
                held = {id(sub): sub for slots in unit.slots for sub, _, _ in slots}
                for module in held.values():
                    if module is not unit.modules[0]:
                        module.register_forward_pre_hook(partial(self._pre_forward, i))
                # the first one entered counts the unit's inputs, positional or keyword
                for module in {id(unit.modules[0]): unit.modules[0], **held}.values():
                    module.register_forward_pre_hook(partial(self._count_inputs, i),
                                                     with_kwargs=True)
                self._hold(unit, False)
        # the optimizer's parameters: this rank's piece of each parameter (1-D, maybe empty)
        self.pieces = [[ShardView(unit.shard.detach()[a:b], True) for a, b in pieces_of(unit)]
                       for unit in self.units]
        self.has_grad = [[False] * len(u.tensors) for u in self.units]  # agreed, last step
        self._got = [[False] * len(u.tensors) for u in self.units]  # this rank's, this step
        self._slot = [{id(t): k for k, t in enumerate(u.tensors)} for u in self.units]
        self._next = len(self.units) - 1  # the next unit to reduce-scatter: the last first
        self._queued = [False] * len(self.units)  # complete here, waiting for its turn
        self._round = self._outer_gathered = False  # a forward with grad ran since the last sync
        self._forward_next, self._backward_next, self._end_queued = 0, len(self.units) - 1, False

    def _hold(self, unit: FlatUnit, gathered: bool) -> None:
        """The unit's modules hold its full tensors (``gathered``) or a placeholder each."""
        hold(unit, gathered, "the wrapper" if unit is self.outside else "one of its modules")

    def _unit_parameters(self, units: Units) -> List[Set[nn.Parameter]]:
        return nested_parameters(units)

    def _build_units(self, units: Units) -> List[FlatUnit]:
        """zero.py's, after the ranks agreed on the model (a check of one rank only would
        leave the others waiting in that all-gather). Inner units first: a unit takes the
        trainable parameters its modules still hold, so an outer one takes only its own."""
        inside = nests(units)
        self._outer = [n > 0 for n in inside]
        built: Dict[int, FlatUnit] = {}
        for j in sorted(range(len(units)), key=lambda j: inside[j]):
            check_unit_dtypes([units[j]])
            built[j] = self.new_unit(units[j][0], units[j][1], self.group, self.zero_stage)
        return [built[j] for j in range(len(units))]

    # ---- stage 3's frozen parameters: gathered and released with their unit ---------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """zero.py's, with the frozen parameters of no unit gathered for the forward and the
        backward after it (released by ``finish_grad_sync``; at once without grad)."""
        self._inputs = [0] * len(self.units)  # no backward of ours is in flight: count afresh
        self._outer_gathered = False  # ``_gather_outer``: at this forward's first backward hook
        self._awaiting = [0] * len(self.units)
        self._next, self._queued = len(self.units) - 1, [False] * len(self.units)
        self._round = self._round or torch.is_grad_enabled()  # every rank calls forward
        self._forward_next, self._backward_next = 0, len(self.units) - 1
        if self.outside is not None:
            self._gather_frozen(self.outside, None, False)
        output = super().forward(*args, **kwargs)
        if self.zero_stage == 3:
            self._pass_forward(len(self.units))  # the units this rank's forward never called
        if self.outside is not None and not torch.is_grad_enabled():
            self._release_frozen(self.outside, None)
        return output

    def _gather_frozen(self, unit: FlatUnit, i: Optional[int], async_op: bool) -> None:
        """``gather_unit`` of a frozen unit (unit i's, or ``outside`` when i is None)."""
        if i in self._frozen_work:
            if not async_op:
                self._frozen_work.pop(i).wait()
                self._hold(unit, True)
        elif not unit.gathered_bytes:
            work = gather_unit(unit.flat, unit.gather_source(), unit.group, async_op)
            if async_op and work is not None:
                self._frozen_work[cast(int, i)] = work
            else:
                self._hold(unit, True)

    def _release_frozen(self, unit: FlatUnit, i: Optional[int]) -> None:
        if i in self._frozen_work:  # never free a buffer that a transfer is writing
            self._frozen_work.pop(i).wait()
        release_unit(unit.flat)
        self._hold(unit, False)

    def _gather(self, i: int, async_op: bool = False) -> None:
        if i not in self._gathering and not self.units[i].gathered_bytes:  # it will all-gather
            self._check_same(0, i)
        super()._gather(i, async_op)
        if i not in self._gathering:  # complete: its modules hold the full tensors again
            self._hold(self.units[i], True)
        frozen = self.frozen[i] if self.frozen else None
        if frozen is not None:
            self._gather_frozen(frozen, i, async_op)

    def _free(self, i: int) -> None:
        if self._outer[i] and self._outer_gathered:
            return  # gathered for the whole backward (``_gather_outer``)
        super()._free(i)
        self._hold(self.units[i], False)  # a use outside the hooks now raises, naming the unit
        frozen = self.frozen[i] if self.frozen else None
        # in backward, a frozen parameter may still be read after the unit's last gradient
        # (x * frozen before a trainable layer): released once its inputs' gradients are in
        if frozen is not None and not self._awaiting[i]:
            self._release_frozen(frozen, i)

    def _count_inputs(self, i: int, module: nn.Module, args: Tuple[Any, ...],
                      kwargs: Dict[str, Any]) -> None:
        """Unit i's first entry this forward: a hook on each of its inputs (positional or
        keyword) that needs a gradient, so its frozen parameters outlive their last reader."""
        if self.frozen[i] is not None and not self._inputs[i]:
            inputs = [
                t for t in tree_leaves((args, kwargs)) if torch.is_tensor(t) and t.requires_grad
            ]
            self._inputs[i] = len(inputs) or -1  # -1: entered, no input needs a gradient
            for tensor in inputs:
                tensor.register_hook(partial(self._input_grad, i))

    def _pre_forward(self, i: int, module: nn.Module, args: Tuple[Any, ...]) -> None:
        """zero.py's, after passing the units before unit i that this forward did not call."""
        if i + 1 < self._forward_next:  # passed already: gathered once more
            warn_called_again(self.units[i].name, [u.name for u in self.units])
        self._pass_forward(i)
        self._forward_next = max(self._forward_next, i + 1)
        super()._pre_forward(i, module, args)

    def _post_forward(self, i: int, module: nn.Module, args: Tuple[Any, ...], output: Any) -> Any:
        """zero.py's, on a copy of each output that views the unit's parameters (freed now)."""
        output = copy_views_of(self.units[i].flat, output)
        super()._post_forward(i, module, args, output)
        return output  # a forward hook's return value replaces the module's output

    def _pass_forward(self, stop: int) -> None:
        """The units up to ``stop`` (excluded) this forward skipped: gathered and freed, as run."""
        while self._forward_next < stop:
            j, self._forward_next = self._forward_next, self._forward_next + 1
            super()._pre_forward(j, self.units[j].modules[0], ())  # gather j, prefetch j + 1
            self._free(j)

    def _pre_backward(self, i: int, grad: Optional[torch.Tensor]) -> None:
        """zero.py's, after ``_gather_outer`` and the units after i this backward skipped; a unit
        holding others is gathered already (no prefetch at a place that differs between ranks)."""
        self._gather_outer()
        if self._outer[i]:
            return
        if not self._end_queued:  # the units below the last one this backward reaches
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self._pass_backward(i)
        self._enter_backward(i, grad)

    def _enter_backward(self, i: int, grad: Optional[torch.Tensor]) -> None:
        if self._sync:
            self._issue(i + 1)  # the units after it are done: reduced before its gathers
        super()._pre_backward(i, cast(torch.Tensor, grad))  # gather i, prefetch i - 1
        self._awaiting[i] = max(self._inputs[i], 0)
        self._backward_next = min(self._backward_next, i - 1)

    def _pass_backward(self, stop: int) -> None:
        """Each unit from the next one in backward order down to ``stop`` (excluded) that this
        backward skipped: gathered, reduced (zeros from here) and freed, as where it runs."""
        while self._backward_next > stop:
            j, self._backward_next = self._backward_next, self._backward_next - 1
            if not self._outer[j]:
                self._enter_backward(j, None)
                self._awaiting[j] = 0  # no input gradient will come here: frozen ones go too
                self._free(j)

    def _end_backward(self) -> None:
        """At the end of a backward (autograd's callback): the units it never reached."""
        self._end_queued = False
        self._pass_backward(-1)

    def _gather_outer(self) -> None:
        """Stage 3, at the first unit's backward: gather every unit that holds others (the
        root's own parameters), in one order, kept until ``finish_grad_sync``: their hooks fire
        at a place that depends on what a rank used (a root gain on one rank's output only)."""
        if self.zero_stage == 3 and not self._outer_gathered:
            self._outer_gathered = True
            for k in [k for k, outer in enumerate(self._outer) if outer]:
                self._gather(k)

    def _input_grad(self, i: int, grad: torch.Tensor) -> None:
        """A gradient of unit i's input is computed: the unit's backward has read it all."""
        if self._awaiting[i] > 0:
            self._awaiting[i] -= 1
            frozen = self.frozen[i]
            if not self._awaiting[i] and frozen is not None and not self.units[i].gathered_bytes:
                self._release_frozen(frozen, i)  # the unit's own release came first

    # ---- gradients: every unit reduced in one order on every rank, None where no rank had one

    def _on_grad(self, i: int, tensor: torch.Tensor) -> None:
        self._got[i][self._slot[i][id(tensor)]] = True  # a Python flag: no device sync here
        super()._on_grad(i, tensor)

    def _reduce(self, i: int) -> None:
        """zero.py calls this when all of unit i's gradients are in on this rank. A rank where
        one of them never comes (a parameter it did not use) must still reduce-scatter the unit
        at the same place in the group's sequence of collectives: so units go in one order, the
        last first (``_issue``), each when complete, or when backward moved past it (stage 3:
        before the next unit's gathers), or at ``finish_grad_sync``."""
        self._queued[i] = True
        self._issue(len(self.units))

    def _issue(self, stop: int) -> None:
        """Reduce-scatter, in order, every unit from the next one down to ``stop`` (complete
        or not: zeros for what this rank lacks), then each next one that is complete."""
        while self._next >= 0 and (self._next >= stop or self._queued[self._next]):
            self._reduce_unit(self._next)
            self._next -= 1

    def _reduce_unit(self, i: int) -> None:
        if self.zero_stage == 3:
            self._check_same(1, i)
        super()._reduce(i)  # zero.py's reduce-scatter of unit i

    def _check_same(self, collective: int, i: int) -> None:
        check_same_collective(collective, i, [u.name for u in self.units], self.group,
                              self.units[i].shard.device)

    def _agree_on_grads(self) -> None:
        """One all-reduce over the units' group of a 0/1 flag per trainable parameter: did this
        rank get a gradient for it. Those no rank used get ``grad None`` in ``pieces`` (a unit
        with none, on its shard too), skipped by the optimizer as on one device (unless they
        held a gradient before: then they keep one). Once per step, after every reduce-scatter."""
        flags = [float(g) for got in self._got for g in got]
        got = torch.tensor(flags, device=self.units[0].shard.device)
        comm.all_reduce(got, self.group, name="zero got a gradient")
        agreed = iter((got > 0).tolist())  # the step's one host sync, outside backward
        self.has_grad = [[next(agreed) for _ in u.tensors] for u in self.units]
        self._got = [[False] * len(u.tensors) for u in self.units]
        for unit, pieces, flags_of in zip(self.units, self.pieces, self.has_grad):
            # a piece that held a gradient before (zero_grad(set_to_none=False), or one
            # accumulated) keeps one, as on one device; one that held None stays None
            keep = [flag or piece.grad is not None for piece, flag in zip(pieces, flags_of)]
            if not any(keep):
                unit.shard.grad = None  # no rank used the unit: no gradient, as on one device
            grad = unit.shard.grad
            for piece, kept, (a, b) in zip(pieces, keep, pieces_of(unit)):
                piece.grad = grad[a:b] if kept and grad is not None else None

    def zero_grad_buffers(self) -> None:
        """zero.py's, and the shards' gradients (the optimizer's parameters are the pieces)."""
        super().zero_grad_buffers()
        for unit in self.units:
            if unit.flat_grad is None:  # stage 1's shard gradient views its flat buffer
                unit.shard.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)  # the pieces (``parameters()``)
        self.zero_grad_buffers()

    def finish_grad_sync(self) -> None:
        """zero.py's (which releases every unit), after checking that no parameter frozen at
        the wrap was unfrozen since: its gradient would be each rank's own, never reduced.
        After a forward with grad (on every rank alike): every unit not reduced yet is, in
        order; gradients that came after their unit's turn are reduced and added; then the
        ranks agree which parameters have a gradient (``_agree_on_grads``)."""
        refuse_changed_since_wrap(self.module, self.frozen_at_wrap, self.frozen_units())
        if self._round and self.zero_stage == 3:  # a rank whose backward reached no unit
            self._gather_outer()
            self._pass_backward(-1)
        self._awaiting = [0] * len(self.units)
        if self._round and self.units:
            self._issue(0)
            for i in reversed(range(len(self.units))):  # one order on every rank
                if self._dirty[i]:
                    self._reduce_unit(i)  # a unit's gradient after its turn: added to its shard's
            self._wait_reduce()  # the last one in flight: its shard's gradient is in
            self._agree_on_grads()
        self._round = self._outer_gathered = False  # zero.py's frees every unit now
        self._next, self._queued = len(self.units) - 1, [False] * len(self.units)
        super().finish_grad_sync()
        if self.outside is not None:
            self._release_frozen(self.outside, None)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """What an optimizer steps: this rank's piece of each parameter (``pieces``, views of
        its unit's (S,) shard), so that one without a gradient is skipped alone, as FSDP2's
        per-parameter shards are. Stages 1, 2: and frozen parameters, whole; stage 3's frozen
        shards are buffers, ``frozen_shards``. ``state_dict`` keeps the shards."""
        for pieces in self.pieces:
            yield from pieces
        yield from self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[Tuple[str, nn.Parameter]]:
        """Every parameter of the model under its own name (``layers.0.weight``), as a view:
        this rank's piece of it, a 1-D view of its unit's shard (0 elements when the
        parameter lies in other ranks' shards), ``.grad`` the same piece of the shard's
        gradient once reduced. Stage 3's frozen ones are pieces of their shard too (no
        gradient, requires_grad False); stages 1, 2 keep them whole. Pieces of all ranks make
        the parameter (``full_state_dict`` gathers them); ``parameters()`` stays the shards."""
        units = [*self.units, *self.frozen_units()]
        pieces = [*self.pieces, *[None] * len(self.frozen_units())]
        rest = self.module.named_parameters(remove_duplicate=remove_duplicate)  # stages 1, 2
        for name, param in named_views(units, pieces, rest, self.names_at_wrap, remove_duplicate):
            yield (prefix + "." if prefix else "") + name, param

    def frozen_units(self) -> List[FlatUnit]:
        """Stage 3's units of frozen parameters (each unit's, then ``outside``)."""
        return [u for u in [*self.frozen, self.outside] if u is not None]

    def full_state_dict(
        self, value_of: Optional[Callable[[torch.Tensor],
                                          torch.Tensor]] = None) -> Dict[str, torch.Tensor]:
        """zero.py's, with stage 3's frozen parameters gathered whole too (in the weights; with
        ``value_of``, an optimizer state, they have none) and every key of
        ``module.state_dict()``: a module registered under two names gives both, one tensor."""
        full = super().full_state_dict(value_of)
        with get_ledger().paused():  # a check, not training traffic
            for unit in [] if value_of else self.frozen_units():
                full.update(unflatten(unit, unit.all_gather_flat(unit.shard)))  # over the group
        return {name: full[first] for name, first in self.names_at_wrap.items() if first in full}


def apply_zero_any(model: nn.Module, group: Group = None, zero_stage: int = 3,
                   prefetch: bool = True,
                   units: Optional[UnitRule] = None) -> AnyShardedDataParallel:
    """Shard any ``model`` over ``group`` (the world when None) in ``units`` (``as_units``),
    ZeRO ``zero_stage``; the first rank's weights are broadcast. Pair it with ``ZeroAdamW``
    or ``ShardedOptimizer(model, optimizer_class, ...)``."""
    refuse_wrapped(model, "apply_zero_any")  # before the units: a wrapper's rule finds none
    return AnyShardedDataParallel(model, as_units(model, units), group, zero_stage, prefetch)
