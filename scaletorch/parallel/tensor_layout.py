"""Where every reference tensor lives on this rank, as ``parallelize`` leaves it.

Each tensor of chapter 00's state dict is held here by one optimizer parameter, split by the
strategies in their own ways: a tp dimension, an ep shard of the experts, a piece of a ZeRO
unit's flat shard over dp_cp, a pipeline stage. ``parallelize`` reads the strategies' tags
before the wrappers hide them (``record_splits``) and keeps one entry per optimizer parameter.
The global clip counts replicas from it (``TensorLayout.replicas``); the trainer's param map
(scaletorch/trainer/param_map.py) gathers full weights and AdamW state from it for checks and
consolidated checkpoints.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from scaletorch.dist import ProcessGroupManager
from scaletorch.parallel.grad_norm import ParamReplicas, replica_count
from scaletorch.parallel.pipeline_parallel import PipelineModel
from scaletorch.parallel.zero import ShardedDataParallel

# (tp partition dim, expert-parallel, (vocabulary, padded rows) of a padded vocabulary split)
Split = Tuple[Optional[int], bool, Optional[Tuple[int, int]]]


def record_splits(model: nn.Module) -> Dict[str, Split]:
    """{reference name: (tp partition dim or None, is expert, (vocabulary, padded rows) or
    None)}, read from the tags the strategies put on parameters, before wrappers and ZeRO hide
    them."""
    splits = {}
    for name, t in model.state_dict(keep_vars=True).items():
        tp_dim = t.partition_dim if getattr(t, "tensor_model_parallel", False) else None
        splits[name] = (tp_dim, bool(getattr(t, "expert_parallel",
                                             False)), getattr(t, "vocab_padding", None))
    return splits


def plain_entries(modules: List[nn.Module]) -> List[Any]:
    """One entry per parameter of ``modules``, with every name it has (tied weights)."""
    by_param: Dict[int, Tuple[torch.Tensor, List[str]]] = {}
    for module in modules:
        for name, t in module.state_dict(keep_vars=True).items():
            by_param.setdefault(id(t), (t, []))[1].append(name)
    return [(t, [(names, t.shape, 0)], None) for t, names in by_param.values()]


def zero_entries(wrappers: List[ShardedDataParallel]) -> List[Any]:
    """One entry per ZeRO unit: its flat shard and the (names, shape, offset) of its pieces."""
    return [(u.shard, list(zip(u.names, u.shapes, u.offsets)), u) for w in wrappers
            for u in w.units]


def tied_copies(param: torch.Tensor) -> int:
    """2 for a tied embedding under a pipeline (a copy on the first and on the last stage,
    equal gradients after the embedding group's all-reduce, chapter 10), else 1: a factor on
    top of ``grad_norm.replica_count``. In a V one shared parameter: 1."""
    return 2 if getattr(param, "shared_embedding", False) else 1


@dataclass
class TensorLayout:
    """This rank's tensors: ``entries`` (optimizer parameter, [(names, shape, offset)], ZeRO
    unit or None), ``splits`` by reference name, the pipeline; for PyTorch's own strategies
    (``--impl torch``) ``dtensor_model``, whose parameters are DTensors that know their split."""
    pgm: ProcessGroupManager
    splits: Dict[str, Split]
    entries: List[Any]
    pipe: Optional[PipelineModel] = None
    dtensor_model: Optional[nn.Module] = None

    def replicas(self) -> List[ParamReplicas]:
        """(optimizer parameter, replicas) for ``world_grad_norm``: a count per parameter, or
        per element of a ZeRO shard (whose pieces are each tp-split or tp-replicated)."""
        tp = self.pgm.tensor_model_parallel_world_size
        out: List[ParamReplicas] = []
        for param, pieces, unit in self.entries:
            if unit is None:
                out.append((param, replica_count(param, self.pgm) * tied_copies(param)))
                continue
            counts = torch.ones(unit.padded_numel, device=param.device)  # padding: zero grads
            for names, shape, offset in pieces:
                counts[offset:offset + shape.numel()] = 1 if self.splits[names[0]][0] is not None \
                    else tp
            counts *= tied_copies(param)  # a tied embedding's copy under a pipeline: x 2
            out.append((param, counts[unit.rank * unit.shard_numel:][:unit.shard_numel]))
        return out
