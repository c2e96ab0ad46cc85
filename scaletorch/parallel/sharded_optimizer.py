"""A sharded optimizer over any parameters and any optimizer class: ZeRO-1 and ZeRO-2.

Shaped like torch's ``ZeroRedundancyOptimizer(params, optimizer_class, **defaults)``: the
trainable parameters are split whole over the N ranks of ``group`` (largest first, each to the
rank with the fewest elements so far, so each owns about Psi/N); rank r's ``optimizer_class``
holds the state of its own parameters only (1/N of it). ``step()``:

    ZeRO-1   the gradients are already the group's mean (our DDP or torch's): each owner
             steps its parameters, then broadcasts them (one broadcast per owner).
    ZeRO-2   the gradients are each rank's own: each owner receives the sum of its
             parameters' gradients (one reduce per owner) and divides by N; the other ranks
             drop theirs (grad None); the owner steps; the owners broadcast.

Frozen parameters (``requires_grad=False``) are in no shard and never move. A parameter whose
gradient is None is skipped as the optimizer skips it on one device; ZeRO-2 first all-reduces
one 0/1 flag per parameter so that every rank agrees which ones (ZeRO-1 relies on the data
parallel wrapper's ``find_unused_parameters`` for that). Any optimizer class that steps each
parameter alone works (Adafactor too: each is stepped whole by its owner); LBFGS, which couples
them all, is refused. ZeRO-2 here drops the full gradients at the step; zero.py's wrapper drops
each unit's during backward. ``step(closure)`` runs the closure with gradients on, as torch's.

Given chapter 02's ZeRO wrapper instead of parameters (zero.py: any stage, flat shards that
are already each rank's), it is zero.py's ``ZeroOptimizer``, whose step it inherits: the
wrapper's shards stepped with ``optimizer_class``, then all-gathered back (stages 1, 2).
``ZeroAdamW`` is that with AdamW. A flat shard mixes pieces of many parameters, so only an
elementwise class (``ELEMENTWISE``) is right on it: Adafactor's factored moments are refused.
Views of a wrapper (``named_parameters()``: ``ShardView``) are refused as parameters.
"""

from typing import Any, Callable, Dict, Iterable, List, Optional, Type, Union

import torch
import torch.distributed as dist

from scaletorch.dist import comm
from scaletorch.dist.comm import Group
from scaletorch.dist.wrap_checks import refuse_lazy
from scaletorch.parallel.grad_norm import clip_grads_, world_grad_norm
from scaletorch.parallel.zero import ShardedDataParallel, ZeroOptimizer
from scaletorch.parallel.zero_views import ShardView

Params = Union[Iterable[torch.Tensor], Iterable[Dict[str, Any]]]
# each element of a parameter updated from that element's gradient and state alone
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop,
               torch.optim.Adagrad, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
               torch.optim.ASGD, torch.optim.Rprop, torch.optim.Adadelta)


def partition(numels: List[int], world: int) -> List[int]:
    """The owner of each parameter: largest first, each to the least loaded rank (ties: the
    lower rank). The same on every rank, since it depends on the sizes only."""
    load, owner = [0] * world, [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        owner[i] = min(range(world), key=lambda r: load[r])
        load[owner[i]] += numels[i]
    return owner


def zero_wrapper(params: Any) -> Optional[ShardedDataParallel]:
    """Chapter 02's ZeRO wrapper when ``params`` is one, None when they are parameters."""
    if isinstance(params, torch.nn.Module):
        if not isinstance(params, ShardedDataParallel):
            raise ValueError(f"ShardedOptimizer takes parameters or a ZeRO wrapper (apply_zero), "
                             f"got a {type(params).__name__}: pass its .parameters()")
        return params
    return None


class ShardedOptimizer(ZeroOptimizer):
    """ZeRO over ``group`` (the world when None) of ``optimizer_class``: one class, two inputs.

    Parameters: ZeRO-1 or 2 as above; ``param_groups`` are the full groups (an LR scheduler
    edits them; ``step`` copies their hyperparameters to this rank's optimizer, ``self.local``).
    A ZeRO wrapper (zero.py, its stage): ``ZeroOptimizer`` over it. ``state_dict`` is this
    rank's either way.
    """

    def __init__(self, params: Any, optimizer_class: Type[torch.optim.Optimizer],
                 group: Group = None, zero_stage: Optional[int] = None, **defaults: Any) -> None:
        if not (isinstance(optimizer_class, type)
                and issubclass(optimizer_class, torch.optim.Optimizer)):
            given = f"an instance of {type(optimizer_class).__name__}"  # an optimizer, a string
            raise ValueError(f"ShardedOptimizer's optimizer_class must be a torch.optim.Optimizer "
                             f"class (e.g. torch.optim.AdamW), got {given}: pass the class, "
                             f"and its arguments as keywords")
        if issubclass(optimizer_class, torch.optim.LBFGS):
            raise ValueError("ShardedOptimizer cannot shard LBFGS: its step couples every "
                             "parameter (a line search over all of them); use it unsharded")
        self.zero = zero_wrapper(params)
        if self.zero is not None:
            if not issubclass(optimizer_class, ELEMENTWISE):
                raise ValueError(f"ShardedOptimizer over a ZeRO wrapper's flat shards needs an "
                                 f"elementwise optimizer, got {optimizer_class.__name__} (it sees "
                                 f"pieces of parameters as 1-D vectors); use one of "
                                 f"{', '.join(c.__name__ for c in ELEMENTWISE)}")
            if zero_stage is not None and zero_stage != self.zero.zero_stage:
                raise ValueError(f"zero_stage {zero_stage} for a wrapper of stage "
                                 f"{self.zero.zero_stage}: the wrapper's stage is the "
                                 f"optimizer's, leave it out")
            super().__init__(self.zero, optimizer_class, **defaults)
            return
        zero_stage = 1 if zero_stage is None else zero_stage
        if zero_stage not in (1, 2):
            raise ValueError(f"zero_stage must be 1 or 2 (ZeRO-3 shards the model: apply_zero, "
                             f"or apply_zero_any for any module), got {zero_stage}")
        torch.optim.Optimizer.__init__(self, params, defaults)  # the full groups
        views = [p for g in self.param_groups for p in g["params"] if isinstance(p, ShardView)]
        if views:
            raise ValueError(f"ShardedOptimizer got {len(views)} views of a ZeRO wrapper's "
                             f"shards (its named_parameters()): pass the wrapper itself, "
                             f"ShardedOptimizer(model, {optimizer_class.__name__}, ...)")
        self.group, self.zero_stage = group, zero_stage
        self.world, self.rank = comm.group_size(group), comm.group_rank(group)
        self._check_ranks_agree(self.param_groups)
        self.trainable: List[torch.Tensor] = []
        self.owner: Dict[int, int] = {}
        self._own(self.param_groups)
        local = [{
            **{
                k: v
                for k, v in g.items() if k != "params"
            }, "params": [p for p in g["params"] if self.owner.get(id(p)) == self.rank]
        } for g in self.param_groups]
        self.local = optimizer_class(local, **defaults)
        # the class's own defaults in the full groups too (betas, eps, ...), as torch's
        # ZeroRedundancyOptimizer shows them: code and schedulers read them from param_groups
        self.defaults = dict(self.local.defaults)
        for g in self.param_groups:
            for k, v in self.defaults.items():
                g.setdefault(k, v)
        # ZeRO-2: the gradients are the owners' means already (clip_grad_norm, or a step since
        # the last backward): a second step() after one backward must not reduce them again
        self._reduced = False
        # the replicas start equal, as under DDP: the group's first rank's values (one broadcast)
        comm.broadcast_from_first([p for g in self.param_groups for p in g["params"]], group)
        self._built = True

    def _check_ranks_agree(self, groups: List[Dict[str, Any]]) -> None:
        """Every rank of the group must pass the same parameters (one small all-gather), or
        the partition and the broadcasts differ and the backend aborts."""
        named = [(f"param group {g} parameter {i}", p)
                 for g, group in enumerate(groups,
                                           len(self.param_groups) - len(groups))
                 for i, p in enumerate(group["params"])]
        refuse_lazy(named, "ShardedOptimizer")  # no shape to check yet: before the all-gather
        comm.check_same_layout(named, "ShardedOptimizer", self.group,
                               "give every rank the same parameters, in the same order")

    def _own(self, groups: List[Dict[str, Any]]) -> None:
        """Assign the trainable parameters of ``groups`` to owners (``partition``)."""
        trainable = [p for g in groups for p in g["params"] if p.requires_grad]
        owners = partition([p.numel() for p in trainable], self.world)
        if self.zero_stage == 2:  # a new backward: the gradients are each rank's own again
            for p in trainable:
                p.register_post_accumulate_grad_hook(self._new_gradient)
        self.trainable += trainable
        self.owner.update({id(p): r for p, r in zip(trainable, owners)})

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """torch's, then (after construction) as torch's ZeroRedundancyOptimizer: the group's
        trainable parameters are given owners, this rank's go to ``self.local`` in a group of
        the same hyperparameters, and every rank takes the first rank's values (a broadcast)."""
        if getattr(self, "zero", None) is not None:  # a ZeRO wrapper's shards: zero.py's refusal
            return super().add_param_group(param_group)
        torch.optim.Optimizer.add_param_group(self, param_group)
        if not getattr(self, "_built", False):  # torch's __init__ adds the first groups
            return
        added = self.param_groups[-1]
        self._check_ranks_agree([added])
        self._own([added])
        self.local.add_param_group({
            **{
                k: v
                for k, v in added.items() if k != "params"
            }, "params": [p for p in added["params"] if self.owner.get(id(p)) == self.rank]
        })
        comm.broadcast_from_first(list(added["params"]), self.group)

    def _owned_by(self, rank: int, params: List[torch.Tensor]) -> List[torch.Tensor]:
        return [p for p in params if self.owner[id(p)] == rank]

    def _src(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _reduce_to_owners(self) -> None:
        """ZeRO-2: agree on the parameters with a gradient, reduce each owner's to it (/ N)."""
        has = torch.tensor([float(p.grad is not None) for p in self.trainable],
                           device=self.trainable[0].device)
        comm.all_reduce(has, self.group)  # how many ranks have each gradient
        with_grad = [p for p, n in zip(self.trainable, has.tolist()) if n > 0]
        for p in with_grad:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        dtypes = sorted({p.dtype for p in with_grad}, key=str)  # the same order everywhere
        for rank in range(self.world):
            for mine in [[p for p in self._owned_by(rank, with_grad) if p.dtype == d]
                         for d in dtypes]:
                if not mine:
                    continue
                flat = torch.cat([p.grad.reshape(-1) for p in mine])  # type: ignore[union-attr]
                comm.reduce(flat, self._src(rank), self.group)  # SUM on the owner
                for p, piece in zip(mine, flat.div_(self.world).split([p.numel() for p in mine])):
                    p.grad = piece.view_as(p) if rank == self.rank else None
        for p in self.trainable:
            if self.owner[id(p)] != self.rank:
                p.grad = None  # not this rank's to step

    @torch.no_grad()
    def step(  # type: ignore[override]  # torch's stub: overloads on closure
            self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        with torch.enable_grad():  # the closure's backward needs it, as in torch's optimizers
            loss = closure() if closure is not None else None
        if self.zero is not None:  # zero.py's step: the wrapper's shards (after the closure)
            super().step()
            return loss
        for full, local in zip(self.param_groups, self.local.param_groups):
            local.update({k: v for k, v in full.items() if k != "params"})  # the scheduler's lr
        if self.zero_stage == 2 and self.trainable and self.world > 1 and not self._reduced:
            self._reduce_to_owners()
        self._reduced = True  # until the next backward (``_new_gradient``)
        self.local.step()  # this rank's parameters only
        for rank in range(self.world):  # each owner's parameters, to every rank
            comm.broadcast_tensors(self._owned_by(rank, self.trainable), self._src(rank),
                                   self.group)
        return loss

    def _new_gradient(self, param: torch.Tensor) -> None:
        """ZeRO-2's post-accumulate-grad hook: a backward added a rank's own gradient."""
        self._reduced = False

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Scale the model's gradient so its norm is at most ``max_norm``; return the norm
        before (0-dim, the same on every rank), as torch's ``clip_grad_norm_`` on one device.

        ZeRO-2's gradients before ``step()`` are each rank's own: this reduces them to their
        owners first (the reduce ``step()`` would do; it then does none). Each gradient counts
        once, on its owner: one all-reduce of one number over the group. A ZeRO wrapper: the
        sum over its shards, as its own ``clip_grad_norm``."""
        if self.zero is not None:
            self.zero.finish_grad_sync()
            shards = list(self.zero.shards.values())
            norm = world_grad_norm([(s, 1) for s in shards], shards[0].device, self.zero.group)
            return clip_grads_(shards, max_norm, norm)
        if self.zero_stage == 2 and self.trainable and self.world > 1 and not self._reduced:
            self._reduce_to_owners()
            self._reduced = True
        mine = self._owned_by(self.rank, self.trainable)
        device = self.trainable[0].device if self.trainable else torch.device("cpu")
        norm = world_grad_norm([(p, 1) for p in mine], device, self.group)
        return clip_grads_(self.trainable, max_norm, norm)  # ZeRO-1: every rank's copy too

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._reduced = False
        if self.zero is not None:  # zero.py's: the wrapper's full gradients too
            return super().zero_grad(set_to_none)
        torch.optim.Optimizer.zero_grad(self, set_to_none)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if self.zero is not None:
            return super().load_state_dict(state_dict)
        self.local.load_state_dict(state_dict)  # the full groups stay this optimizer's
