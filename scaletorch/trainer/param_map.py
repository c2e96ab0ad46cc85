"""Full weights and AdamW state from any layout, and back: the map consolidated checkpoints use.

A param map answers three questions about a layout that ``parallelize`` built (its
``TensorLayout``, scaletorch/parallel/tensor_layout.py): ``params()`` (what AdamW keeps state
for), ``gather(value_of)`` (collective: the full reference-keyed tensors of the parameters, or
of an AdamW state shaped like them, on global rank 0) and ``scatter(full)`` (this rank's part of
full tensors, no communication). ``ParamMap`` reads our strategies' splits (a tp dimension, an
ep shard, a piece of a ZeRO unit, a pipeline stage); ``DTensorParamMap`` PyTorch's DTensors
(FSDP2, DTensor tensor parallel). With them --check compares full weights and a run saved at one
layout resumes at any other (consolidated.py).
"""

import logging
from typing import Callable, Dict, List, Optional, Union

import torch

from scaletorch.dist import get_ledger
from scaletorch.dist.dtensor import is_dtensor
from scaletorch.dist.functional import gather_along_dim
from scaletorch.dist.split_regions import split_along_dim
from scaletorch.parallel.parallelize import Parallelized
from scaletorch.parallel.tensor_layout import TensorLayout, plain_entries
from scaletorch.trainer.pipeline_state import gather_pipeline_state_dict

State = Dict[str, torch.Tensor]


class ParamMap:
    """Where every reference tensor lives on this rank: which optimizer parameter holds it and
    how it is split (tp dim, ep, a ZeRO unit's flat shard over dp_cp, a pipeline stage).

    ``gather(value_of)`` builds full reference-keyed tensors from one local tensor per optimizer
    parameter (the parameter, or an AdamW state of its shape); ``scatter(full)`` is the inverse,
    used to load a full optimizer state at any layout.
    """

    def __init__(self, layout: TensorLayout) -> None:
        self.pgm, self.splits, self.pipe = layout.pgm, layout.splits, layout.pipe
        # each entry: (optimizer parameter, [(names, shape, offset)], ZeRO unit or None)
        self.entries = layout.entries
        # a tied embedding's copy under a pipeline (tied_embeddings.py), on the first stage
        self.tied = self.pipe is not None and any(
            getattr(param, "shared_embedding", False) for param, _, _ in self.entries)

    def params(self) -> List[torch.Tensor]:
        """The optimizer's parameters, one per entry (what AdamW keeps state for)."""
        return [param for param, _, _ in self.entries]

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


class DTensorParamMap:
    """Where every reference tensor lives under PyTorch's FSDP2 or DTensor tensor parallel:
    each parameter keeps its reference name and is a DTensor (its placements say how it is
    split) or a plain tensor replicated on every rank. Same contract as ``ParamMap``. With a
    pipeline (``pipe``) this rank's chunks hold its stages, and gathering adds the other
    stages' tensors (pipeline rank 0 receives them)."""

    def __init__(self, layout: TensorLayout) -> None:
        self.pgm, self.pipe, model = layout.pgm, layout.pipe, layout.dtensor_model
        if model is None:
            raise ValueError("DTensorParamMap reads a layout of PyTorch's own strategies "
                             "(parallel.impl 'torch'), whose dtensor_model is set; this one "
                             "has none: use ParamMap")
        modules = [model] if self.pipe is None else list(self.pipe.chunks)
        # (parameter, its names: a tied weight has two), as ``plain_entries`` finds them
        self.entries = [(t, pieces[0][0]) for t, pieces, _ in plain_entries(modules)]

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
            full = value.full_tensor() if is_dtensor(value) else value
            full_state.update({n: full.cpu().float().clone() for n in names})
        quiet.setLevel(level)
        gathered: Optional[State] = full_state
        if self.pipe is not None:  # and the other stages' tensors, on pipeline rank 0
            gathered = gather_pipeline_state_dict(self.pipe, self.pgm, full_state)
        return gathered if self.pgm.rank == 0 else None

    def scatter(self, full: State) -> Dict[torch.Tensor, torch.Tensor]:
        """{parameter: this rank's part of ``full``}, as DTensors placed like the parameter."""
        from torch.distributed.tensor import distribute_tensor  # DTensors exist: imported
        out = {}
        for param, names in self.entries:
            t = full[names[0]].to(param.device, param.dtype)
            out[param] = distribute_tensor(t, param.device_mesh, param.placements) \
                if is_dtensor(param) else t.clone()
        return out


def param_map(par: Parallelized) -> Union[ParamMap, DTensorParamMap]:
    """The param map of what ``parallelize`` returned: ours, or PyTorch's DTensors'."""
    layout = par.layout
    return ParamMap(layout) if layout.dtensor_model is None else DTensorParamMap(layout)


def full_state_dict(par: Parallelized) -> Optional[State]:
    """Collective over the world: chapter 00's {name: full fp32 tensor} on global rank 0, None
    elsewhere (what --check compares with the reference)."""
    return param_map(par).gather(lambda p: p.detach())
