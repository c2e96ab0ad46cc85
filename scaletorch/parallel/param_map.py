"""Where every reference tensor lives on this rank, for any layout ``parallelize`` builds.

A param map maps each tensor of chapter 00's state dict to the optimizer parameter that holds it
here and how it is split: a tp dimension, an ep shard of the experts, a piece of a ZeRO
unit's flat shard over dp_cp, a pipeline stage (``ParamMap``, for ours), or a DTensor's
placements (``DTensorParamMap``, for PyTorch's FSDP2 and DTensor tensor parallel).

Both answer the same three questions: ``params()`` (what AdamW keeps state for),
``gather(value_of)`` (collective: the full reference-keyed tensors of the parameters, or of
an AdamW state shaped like them, on global rank 0) and ``scatter(full)`` (this rank's part of
full tensors, no communication): what consolidated checkpoints need to move a run from any
layout to any other (consolidated.py).
"""

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from scaletorch.dist import ProcessGroupManager, get_ledger
from scaletorch.dist.functional import gather_along_dim, split_along_dim
from scaletorch.parallel.grad_norm import ParamReplicas, replica_count
from scaletorch.parallel.pipeline_parallel import PipelineModel, gather_pipeline_state_dict
from scaletorch.parallel.zero import ShardedDataParallel

State = Dict[str, torch.Tensor]
# (tp partition dim, expert-parallel, (vocabulary, padded rows) of a padded vocabulary split)
Split = Tuple[Optional[int], bool, Optional[Tuple[int, int]]]


def tied_copies(param: torch.Tensor) -> int:
    """2 for a tied embedding under a pipeline (a copy on the first and on the last stage,
    equal gradients after the embedding group's all-reduce), else 1: a factor on top of
    ``grad_norm.replica_count``. In a V one shared parameter: 1."""
    return 2 if getattr(param, "shared_embedding", False) else 1


class ParamMap:
    """Where every reference tensor lives on this rank: which optimizer parameter holds it and
    how it is split (tp dim, ep, a ZeRO unit's flat shard over dp_cp, a pipeline stage).

    ``gather(value_of)`` builds full reference-keyed tensors from one local tensor per optimizer
    parameter (the parameter, or an AdamW state of its shape); ``scatter(full)`` is the inverse,
    used to load a full optimizer state at any layout.
    """

    def __init__(self, pgm: ProcessGroupManager, splits: Dict[str, Split], entries: List[Any],
                 pipe: Optional[PipelineModel] = None) -> None:
        self.pgm, self.splits, self.pipe = pgm, splits, pipe
        # each entry: (optimizer parameter, [(names, shape, offset)], ZeRO unit or None)
        self.entries = entries
        # a tied embedding's copy under a pipeline (tied_embeddings.py), on the first stage
        self.tied = pipe is not None and any(
            getattr(param, "shared_embedding", False) for param, _, _ in entries)

    @classmethod
    def record_splits(cls, model: nn.Module) -> Dict[str, Split]:
        """{reference name: (tp partition dim or None, is expert, (vocabulary, padded rows) or
        None)}, read from the tags the strategies put on parameters, before wrappers and ZeRO
        hide them."""
        splits = {}
        for name, t in model.state_dict(keep_vars=True).items():
            tp_dim = t.partition_dim if getattr(t, "tensor_model_parallel", False) else None
            splits[name] = (tp_dim, bool(getattr(t, "expert_parallel",
                                                 False)), getattr(t, "vocab_padding", None))
        return splits

    def params(self) -> List[torch.Tensor]:
        """The optimizer's parameters, one per entry (what AdamW keeps state for)."""
        return [param for param, _, _ in self.entries]

    @staticmethod
    def plain_entries(modules: List[nn.Module]) -> List[Any]:
        """One entry per parameter of ``modules``, with every name it has (tied weights)."""
        by_param: Dict[int, Tuple[torch.Tensor, List[str]]] = {}
        for module in modules:
            for name, t in module.state_dict(keep_vars=True).items():
                by_param.setdefault(id(t), (t, []))[1].append(name)
        return [(t, [(names, t.shape, 0)], None) for t, names in by_param.values()]

    @staticmethod
    def zero_entries(wrappers: List[ShardedDataParallel]) -> List[Any]:
        """One entry per ZeRO unit: its flat shard and the (names, shape, offset) of its pieces."""
        return [(u.shard, list(zip(u.names, u.shapes, u.offsets)), u) for w in wrappers
                for u in w.units]

    # ---- full <-> local, one tensor at a time ----------------------------------------------

    def _resplit(self, name: str, t: torch.Tensor, along: Callable) -> torch.Tensor:
        """``along`` = gather_along_dim (this rank's piece -> full, collective) or
        split_along_dim (full -> this rank's piece) over each split the tags recorded: experts
        over "ep" on dim 0, tensor-parallel shards over "tp" on their partition dim."""
        split = self.splits[name]
        tp_dim, expert = split[0], split[1]
        padding = split[2] if len(split) > 2 else None  # maps built by hand may give 2 entries
        if expert:
            t = along(t, 0, self.pgm.expert_model_parallel_group)
        if padding is not None and along is split_along_dim:  # the reference has no padding rows
            t = torch.cat((t, t.new_zeros(padding[1] - padding[0], *t.shape[1:])))
        if tp_dim is not None:
            t = along(t, tp_dim, self.pgm.tensor_model_parallel_group)
        if padding is not None and along is gather_along_dim:
            t = t[:padding[0]]
        return t

    def gather(self, value_of: Callable[[torch.Tensor], torch.Tensor]) -> Optional[State]:
        """Collective over the world. {reference name: full fp32 tensor} on global rank 0.

        The one consolidation every layout goes through; each strategy un-shards its piece:
        a ZeRO unit's flat vector all-gathered over dp_cp, then each tensor over ep and tp,
        then the pipeline stages' tensors sent to pipeline rank 0.
        """
        with get_ledger().paused():  # a check, not training traffic
            local: State = {}
            for param, pieces, unit in self.entries:
                value = value_of(param).detach()
                if unit is not None:
                    value = unit.all_gather_flat(value)  # (S,) -> (P',) over dp_cp
                for names, shape, offset in pieces:
                    t = value if unit is None else value[offset:offset + shape.numel()].view(shape)
                    full = self._resplit(names[0], t, gather_along_dim).cpu().float().clone()
                    local.update({n: full for n in names})
            gathered: Optional[State] = local
            if self.pipe is not None:
                gathered = gather_pipeline_state_dict(self.pipe, self.pgm, local)
            if gathered is not None and self.tied:  # two equal copies: one tensor, both names
                gathered["lm_head.weight"] = gathered["embed_tokens.weight"]
        return gathered if self.pgm.rank == 0 else None

    def scatter(self, full: State) -> Dict[torch.Tensor, torch.Tensor]:
        """{optimizer parameter: this rank's part of ``full``} (no communication)."""
        out = {}
        for param, pieces, unit in self.entries:
            if unit is None:
                name = pieces[0][0][0]
                out[param] = self._resplit(name, full[name], split_along_dim).clone()
                continue
            flat = torch.zeros(unit.padded_numel, dtype=param.dtype)
            for names, shape, offset in pieces:
                piece = self._resplit(names[0], full[names[0]], split_along_dim)
                flat[offset:offset + shape.numel()] = piece.flatten()
            out[param] = flat[unit.rank * unit.shard_numel:][:unit.shard_numel].clone()
        return {p: t.to(p.device, p.dtype) for p, t in out.items()}

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


class DTensorParamMap:
    """Where every reference tensor lives under PyTorch's FSDP2 or DTensor tensor parallel:
    each parameter keeps its reference name and is a DTensor (its placements say how it is
    split) or a plain tensor replicated on every rank. Same contract as ``ParamMap``. With a
    pipeline (``pipe``) this rank's chunks hold its stages, and gathering adds the other
    stages' tensors (pipeline rank 0 receives them)."""

    def __init__(self, pgm: ProcessGroupManager, model: nn.Module,
                 pipe: Optional[PipelineModel] = None) -> None:
        self.pgm, self.pipe = pgm, pipe
        by_param: Dict[int, Tuple[torch.Tensor, List[str]]] = {}
        for module in [model] if pipe is None else pipe.chunks:
            for name, t in module.state_dict(keep_vars=True).items():
                by_param.setdefault(id(t), (t, []))[1].append(name)
        self.entries = list(by_param.values())  # (parameter, its names: tied weights)

    def params(self) -> List[torch.Tensor]:
        return [param for param, _ in self.entries]

    def gather(self, value_of: Callable[[torch.Tensor], torch.Tensor]) -> Optional[State]:
        """Collective (DTensor's own all-gathers). {reference name: full fp32 tensor} on rank 0."""
        full_state: State = {}
        # A 2-D (dp, tp) parameter of FSDP2 + tensor parallel gathers in two all-gathers, and
        # DTensor logs a warning per parameter saying so: right, and not the learner's concern.
        quiet = logging.getLogger("torch.distributed.tensor._redistribute")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        for param, names in self.entries:
            value = value_of(param).detach()
            full = value.full_tensor() if isinstance(value, DTensor) else value
            full_state.update({n: full.cpu().float().clone() for n in names})
        quiet.setLevel(level)
        gathered: Optional[State] = full_state
        if self.pipe is not None:  # and the other stages' tensors, on pipeline rank 0
            gathered = gather_pipeline_state_dict(self.pipe, self.pgm, full_state)
        return gathered if self.pgm.rank == 0 else None

    def scatter(self, full: State) -> Dict[torch.Tensor, torch.Tensor]:
        """{parameter: this rank's part of ``full``}, as DTensors placed like the parameter."""
        out = {}
        for param, names in self.entries:
            t = full[names[0]].to(param.device, param.dtype)
            out[param] = distribute_tensor(t, param.device_mesh, param.placements) \
                if isinstance(param, DTensor) else t.clone()
        return out
