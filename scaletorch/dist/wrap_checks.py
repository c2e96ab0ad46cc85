"""What a wrap refuses before its first collective, so that every rank raises alike.

A strategy's wrap (data parallel, ZeRO, the sharded optimizer) and its sync call these by one
line each. They are the checks of a model nobody here wrote (a Lazy module, a sparse embedding,
a second wrap, a parameter registered or frozen after the wrap): no chapter's idea, so they live
beside ``comm.check_same_layout``, the same kind of check, and not in the strategy a learner
reads. Each raises on every rank alike (it reads only this rank's model, which every rank built
the same way), so none is left waiting in a collective.
"""

from typing import Any, Collection, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parameter import is_lazy

from scaletorch.dist import comm


def refuse_wrapped(model: nn.Module, by: str) -> None:
    """Raise if ``model`` is, or holds, a data-parallel or ZeRO wrapper (its class sets
    ``data_parallel_wrapper``): a second wrap would shard or broadcast the first one's state."""
    for name, module in model.named_modules():
        if getattr(type(module), "data_parallel_wrapper", False):
            where = f" (at {name!r})" if name else ""
            raise ValueError(f"{by}: the model is already wrapped by {type(module).__name__}"
                             f"{where}: wrap the bare model once")


def refuse_lazy(named: Iterable[Tuple[str, torch.Tensor]], by: str,
                owner: str = "a Lazy module's") -> None:
    """Raise naming the first of ``named`` not initialised yet (``owner``: a LazyLinear): it
    has no shape to check, broadcast or shard until the module's first forward."""
    for name, tensor in named:
        if is_lazy(tensor):
            raise ValueError(f"{by}: {name} is not initialised yet ({owner}): run one forward "
                             f"before wrapping")


def refuse_unready(model: nn.Module, by: str) -> None:
    """The parameter states a wrap cannot hold. A parameter or buffer not initialised yet
    (``refuse_lazy``, the module's class named); a parameter of a module built with
    ``sparse=True`` (nn.Embedding, nn.EmbeddingBag): its sparse gradient has no flat storage
    to average or shard."""
    for prefix, sub in model.named_modules():
        own = [(f"{prefix}.{n}" if prefix else n, t)
               for n, t in [*sub._parameters.items(), *sub._buffers.items()] if t is not None]
        refuse_lazy(own, by, type(sub).__name__)
        if getattr(sub, "sparse", False) is True and sub._parameters:
            name = next(n for n, t in own if isinstance(t, nn.Parameter))
            raise ValueError(f"{by}: {name} gets sparse gradients ({type(sub).__name__}, "
                             f"sparse=True): not supported; build it with sparse=False")


def refuse_unwrappable(model: nn.Module, by: str, group: Optional[dist.ProcessGroup]) -> None:
    """All of a wrap's refusals, in order: a second wrap, a state it cannot hold (both read
    this rank only), then ranks whose tensors differ (one all-gather of two numbers), before a
    broadcast or a partition would die inside the backend."""
    refuse_wrapped(model, by)
    refuse_unready(model, by)
    comm.check_same_layout([*model.named_parameters(), *model.named_buffers()], by, group)


def refuse_several_devices(model: nn.Module, by: str) -> None:
    """A flat bucket or unit lives on one device."""
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise ValueError(f"{by} wraps a model on one device, got {devices}")


def refuse_sparse_grad(grad: Optional[torch.Tensor], name: str, by: str) -> None:
    """In a gradient hook: a sparse gradient that no module flag announced at the wrap
    (``F.embedding(sparse=True)``)."""
    if grad is not None and grad.layout != torch.strided:
        raise RuntimeError(f"{by}: {name} got a sparse gradient: not supported; use sparse=False")


def refuse_changed_since_wrap(model: nn.Module, trainable_at_wrap: List[str],
                              names_at_wrap: Collection[str], by: str) -> None:
    """At a sync, before its first collective: the trainable parameters are the wrap's. One
    registered since is never averaged; one frozen or unfrozen since has no slot or a stale
    one (the buckets were laid out at the wrap; torch DDP raises too)."""
    now = [n for n, p in model.named_parameters() if p.requires_grad]
    if now == trainable_at_wrap:
        return
    added = [n for n in now if n not in names_at_wrap]
    if added:
        raise RuntimeError(f"{by}: {added} registered after the wrap, so never averaged: "
                           f"register it before apply_data_parallel")
    raise RuntimeError(f"{by}: requires_grad changed since the wrap for "
                       f"{sorted(set(now) ^ set(trainable_at_wrap))}: wrap the model again")


def refuse_partition(model: nn.Module, groups: Sequence[Collection[nn.Parameter]], by: str,
                     shared_ok: bool = False) -> None:
    """Every trainable parameter of ``model`` in one of ``groups`` (ZeRO's units): one in none
    would never be averaged; one in two (unless ``shared_ok``: tied weights, zero_tied.py)
    would be sharded twice."""
    listed = [id(p) for params in groups for p in params]
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in listed]
    twice = [n for n, p in model.named_parameters() if listed.count(id(p)) > 1]
    if missing or (twice and not shared_ok):
        raise ValueError(f"{by}: each parameter must be in one unit; parameters in no unit: "
                         f"{missing}, in two: {twice} (tied weights: zero_tied.py)")


class RefuseAddedGroups:
    """Mixed into an optimizer over a wrapper's flat shards (ZeRO): torch's ``add_param_group``
    while torch's ``__init__`` adds the shards; after it (``_built``), refused: the shards are
    the wrapper's whole model, and a flat shard has one lr and weight decay."""

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if getattr(self, "_built", False):
            raise ValueError("ZeRO over a wrapper's flat shards steps the whole model in one "
                             "group: add_param_group cannot add to it; wrap every parameter "
                             "in the model, and give the optimizer its hyperparameters at once")
        super().add_param_group(param_group)  # type: ignore[misc]


def check_zero_layout(zero_stage: int, tensor_model_parallel_size: int = 1,
                      pipeline_model_parallel_size: int = 1,
                      expert_model_parallel_size: int = 1) -> None:
    """ZeRO on its own (chapter 02) shards over data parallel only; ``parallelize`` (chapter
    07) combines it with the others."""
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"zero_stage must be 1, 2 or 3 (--zero-stage), got {zero_stage}")
    sizes = zip(
        ("tensor", "pipeline", "expert"),
        (tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size))
    unsupported = [f"{name}_model_parallel_size ({n})" for name, n in sizes if n > 1]
    if unsupported:
        raise ValueError(f"zero_stage {zero_stage} on its own shards over data parallel only; got "
                         f"{', '.join(unsupported)}: 07_nd_parallel combines ZeRO with them")
