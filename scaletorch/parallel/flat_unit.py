"""Flat units: some modules' parameters laid end to end in one vector, cut into N shards.

The building block of ZeRO (zero.py): a *unit*'s parameters (the embedding, one block, the
head) in a flat vector of P elements, padded with zeros to P' = N * ceil(P / N), cut into N
shards of S = P' / N elements over the N ranks of the unit's group:

    flat   | shard 0 | shard 1 | ... | shard N-1 |pad|        rank r owns shard r: it keeps
             rank 0    rank 1          rank N-1               the Adam state for it, updates it

The three collectives of ZeRO come first (``reduce_scatter_mean``, ``gather_unit``,
``release_unit``: examples/exercises/02_fsdp.py has them for the learner); zero.py's hooks and
step call them. Then the unit: bookkeeping only (offsets, the shard, what to send, where a
reduced gradient goes).
Later chapters attach from outside: zero_mixed_precision.py's subclass changes the dtypes,
zero_tied.py points a tied weight at a unit's tensor.
Shapes (jaxtyping, checked in tests/test_zero_shapes.py): "P" is P' = N S, "S" a shard.
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from jaxtyping import Float
from torch import nn

from scaletorch.dist import comm
from scaletorch.dist.comm import Group, Work

NamedModules = Sequence[Tuple[str, nn.Module]]  # (name inside the model, module)
Holders = List[Tuple[nn.Module, str, str]]  # (module, attribute, full name) holding a parameter
Flat = Float[torch.Tensor, "P"]  # a unit's full flat vector (parameters or gradients), P' elements
Shard = Float[torch.Tensor, "S"]  # this rank's shard of it: S = P' / N elements

# [core: zero-collectives]


def reduce_scatter_mean(full: Flat, out: Shard, group: Group) -> Optional[Work]:
    """After a unit's backward: start averaging its (P',) gradients ``full`` over ``group``
    (dp, N ranks), async. Rank r's (S,) ``out`` receives the mean over the ranks of
    full[r S:(r + 1) S]: its shard's gradient. ``full`` (fp32) may be overwritten; in out's
    dtype if that differs. Returns the work (None on one rank: out is full)."""
    full.div_(comm.group_size(group))  # the mean: the gradient of the global mean loss
    sent = full if full.dtype == out.dtype else full.to(out.dtype)
    return comm.reduce_scatter_tensor(out, sent, group, async_op=True)


def gather_unit(flat: Flat, shard: Shard, group: Group, async_op: bool = False) -> Optional[Work]:
    """Before a unit computes (ZeRO-3: its forward and its backward; ZeRO-1/2: after the step):
    ``flat`` (P',) becomes every rank's (S,) ``shard`` end to end, rank r's at r S, by one
    all-gather over ``group`` (dp, N ranks). A released ``flat`` gets its P' elements back
    first. ``shard`` is in flat's dtype, not a view of it. Returns the work if ``async_op``."""
    if flat.untyped_storage().nbytes() == 0:  # released: the parameters on it come back
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
    return comm.all_gather_into_tensor(flat, shard, group, async_op=async_op)


def release_unit(flat: Flat) -> None:
    """After a unit computes (ZeRO-3): free its full parameters. Each is a tensor on ``flat``'s
    storage, so a storage of 0 bytes frees them all, the copies autograd saved included."""
    flat.untyped_storage().resize_(0)


# [end: zero-collectives]


def holders_of(modules: NamedModules) -> Dict[int, Tuple[nn.Parameter, Holders]]:
    """Every distinct trainable parameter of ``modules`` once, in order, keyed by id, with every
    (module, attribute, full name) that holds it. Frozen ones stay where they are, whole."""
    found: Dict[int, Tuple[nn.Parameter, Holders]] = {}
    for prefix, module in modules:
        for sub_name, sub in module.named_modules(prefix=prefix):
            for attr, param in sub._parameters.items():
                if param is not None and param.requires_grad:
                    found.setdefault(id(param), (param, []))[1].append(
                        (sub, attr, f"{sub_name}.{attr}" if sub_name else attr))
    return found


def put_tensor(module: nn.Module, attr: str, tensor: torch.Tensor) -> None:
    """``module.attr`` becomes ``tensor`` (on a unit's flat storage) in place of its Parameter."""
    module._parameters.pop(attr, None)
    setattr(module, attr, tensor)


class FlatUnit:
    """Some modules' parameters as one flat vector of P' elements, and this rank's shard.

    Each parameter becomes a plain leaf tensor on the storage of ``self.flat``: writing ``flat``
    sets every parameter, a storage of 0 bytes frees them all, even the views autograd saved.
    ``shard`` (S, a Parameter) is what the optimizer updates: a view of ``flat`` in stages 1, 2,
    its own tensor in stage 3. Stage 1 keeps a flat gradient buffer that the ``.grad``s view.
    """

    def __init__(self, name: str, modules: NamedModules, group: Group, zero_stage: int) -> None:
        self.name, self.group, self.zero_stage = name, group, zero_stage
        self.modules = [module for _, module in modules]
        self.world, self.rank = comm.group_size(group), comm.group_rank(group)
        found = holders_of(modules)
        if not found:
            raise ValueError(f"unit {name!r} has no trainable parameters")
        params = [param for param, _ in found.values()]
        self.index = {key: k for k, key in enumerate(found)}  # id(parameter) -> its position
        self.names = [[fqn for _, _, fqn in holders] for _, holders in found.values()]
        self.slots = [list(holders) for _, holders in found.values()]  # who holds each tensor
        self.shapes = [p.shape for p in params]
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.numel = self.offsets[-1]  # P
        self.shard_numel = -(-self.numel // self.world)  # S = ceil(P / N)
        self.padded_numel = self.shard_numel * self.world  # P'
        first = params[0]
        master = torch.zeros(self.padded_numel, dtype=first.dtype, device=first.device)
        for param, start in zip(params, self.offsets):
            master[start:start + param.numel()].copy_(param.detach().reshape(-1))
        self.flat = master
        self.tensors: List[torch.Tensor] = []
        storage = self.flat.untyped_storage()
        for param, (_, holders), start in zip(params, found.values(), self.offsets):
            # set_ (not a view): the tensor shares flat's storage but not its version counter,
            # so re-gathering flat between forward and backward is not an in-place error.
            tensor = torch.empty(0, dtype=self.flat.dtype, device=first.device)
            # torch's stub wants a stride after (storage, offset, size); none means contiguous
            tensor.set_(storage, start, param.shape)  # type: ignore[call-overload]
            tensor.requires_grad_(param.requires_grad)
            for sub, attr, _ in holders:
                put_tensor(sub, attr, tensor)
            self.tensors.append(tensor)
        self.trainable = sum(t.requires_grad for t in self.tensors)
        own = master[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel]
        self.shard = nn.Parameter(own if zero_stage < 3 else own.clone())
        self.flat_grad: Optional[torch.Tensor] = None
        if zero_stage == 1:
            self.flat_grad = torch.zeros_like(self.flat)
            for tensor, start in zip(self.tensors, self.offsets):
                if tensor.requires_grad:
                    tensor.grad = self.flat_grad[start:start + tensor.numel()].view(tensor.shape)
        if zero_stage == 3:
            release_unit(self.flat)  # stage 3 keeps the shard only until a unit is gathered

    @property
    def gathered_bytes(self) -> int:
        """Bytes of full parameters this unit holds right now (0 when freed)."""
        return self.flat.untyped_storage().nbytes()

    def gather_source(self) -> Shard:
        """What ``gather_unit`` sends for this rank: the (S,) shard, not a view of flat (stages
        1, 2 keep the shard on flat: a copy, so in and out do not alias)."""
        source = self.shard.detach()
        return source.clone() if self.zero_stage < 3 else source

    def gather(self, async_op: bool = False) -> Optional[Work]:
        """``gather_unit`` of this unit, (S,) -> (P',), for code outside training (checkpoint
        loaders); ZeRO's hooks and step call ``gather_unit`` themselves (zero.py)."""
        return gather_unit(self.flat, self.gather_source(), self.group, async_op)

    def grads_to_reduce(self) -> Tuple[Flat, Shard]:
        """(full, out) for ``reduce_scatter_mean``: this unit's (P',) gradients and an empty
        (S,) for this rank's mean. Stages 2, 3 free the parameters' full
        gradients here (they are copied into ``full``); stage 1 keeps its flat buffer."""
        if self.flat_grad is not None:
            full = self.flat_grad
        else:
            pieces = [
                t.grad.reshape(-1) if t.grad is not None else self.flat.new_zeros(t.numel())
                for t in self.tensors
            ]
            pieces.append(self.flat.new_zeros(self.padded_numel - self.numel))
            full = torch.cat(pieces)  # (P',)
            for tensor in self.tensors:
                tensor.grad = None
        return full, full.new_empty(self.shard_numel)

    def take_grad(self, out: Shard) -> None:
        """After ``reduce_scatter_mean`` into ``out`` is done: add it to the shard's gradient
        (stage 1 writes it into its flat buffer)."""
        if self.flat_grad is not None:
            own = self.flat_grad[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel]
            own.copy_(out)
            self.shard.grad = own  # still one full gradient buffer (4 Psi), as stage 1 says
        elif self.shard.grad is None:
            self.shard.grad = out
        else:
            self.shard.grad += out

    def zero_grad(self) -> None:
        """Stage 1: zero the flat gradient buffer in place (the parameters' grads view it)."""
        if self.flat_grad is not None:
            self.flat_grad.zero_()
        else:
            for tensor in self.tensors:
                tensor.grad = None

    def all_gather_flat(self, shard: Shard) -> Flat:
        """A new (P',) vector of every rank's (S,) ``shard`` (the parameters' shard, or an AdamW
        state shaped like it), all-gathered over the group: how ``ParamMap`` un-shards a unit."""
        flat = shard.new_empty(self.padded_numel)
        comm.all_gather_into_tensor(flat, shard.detach().contiguous(), self.group)
        return flat
