"""Pipeline parallel: the layers are cut into stages over the "pp" group; micro-batches flow.

Stage s of S = p v holds consecutive layers (embedding on stage 0; norm, head and loss on stage
S - 1); rank r holds stages r, r + p, ... (v chunks per rank when interleaved). A micro-batch's
activation (b, s, h) goes from stage to stage and its gradient comes back, point to point:

    rank 0  [embed, layers 0-1] --act--> rank 1 [layers 2-3, norm, head, loss]
            <---------------- grad of act -------------

Cost per step and rank: m sends of b s h elements per chunk each way, none off the ends (at
most 2 m v; m for rank 0 at p = 2), no collective. The price: the bubble, (p-1)/(v m + p - 1)
of the step idle, and activations held from a micro-batch's forward to its backward (m with
AFAB, at most p - r with 1F1B). This module cuts the model; chapter 04's schedules run it as
plain loops (pipeline_schedules.py), chapter 04b's runtime as plans of data
(pipeline_runtime.py). Micro-batch losses are divided by m; dp wrappers sync in a last backward.
"""

from typing import Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

from scaletorch.dist import ProcessGroupManager, comm
from scaletorch.models import Llama
from scaletorch.schedule.placement import split_layers, stage_index
from scaletorch.schedule.timeline import Timeline

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PipelineChunk(nn.Module):
    """One stage: [embedding] -> its layers -> [final norm -> head]. Parameter names are the
    full model's (``layers`` is keyed by the layer's global index), so state dicts line up.

    forward: token ids (b, s) on stage 0, else hidden (b, s, h) (or (b, s/tp, h) under
    sequence parallel) -> hidden of the same shape, or logits (b, s, V) on the last stage.
    ``position_ids`` (s,): the tokens' true positions for RoPE (context parallel), else 0..s-1.
    """

    # The model's own code, bound to this chunk's modules: embed, rope (the rotary tables),
    # head (norm, lm_head). mypy types their self as a Llama, hence the ignore[misc] below.
    embed, rope, head = Llama.embed, Llama.rope, Llama.head

    def __init__(self, model: Llama, layer_ids: List[int], first: bool, last: bool,
                 sequence_parallel_size: int = 1) -> None:
        super().__init__()
        self.config = model.config
        self.sequence_parallel_size = sequence_parallel_size  # tokens of x = s / this
        self.embed_tokens = model.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        first = self.embed_tokens is not None
        seq_len = x.size(1) * (1 if first else self.sequence_parallel_size)
        if first:
            x = self.embed(x)  # type: ignore[misc]  # (b, s) -> (b, s, h)
        cos, sin = self.rope(position_ids, seq_len, x.device)  # type: ignore[misc]
        for layer in self.layers.values():  # as Llama.forward, on this stage's layers
            x = layer(x, cos, sin)
        if self.lm_head is not None:
            x = self.head(x)  # type: ignore[misc]  # (b, s, V)
        return x


class PipelineModel(nn.Module):
    """This rank's v chunks (``chunks[c]`` is global stage ``stages[c]``) and where every full
    model key lives (``owner[key]`` = global stage)."""

    def __init__(self, chunks: List[PipelineChunk], stages: List[int], num_stages: int,
                 owner: Dict[str, int], hidden_size: int, v_shape: bool = False) -> None:
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.stages, self.num_stages, self.owner = stages, num_stages, owner
        self.v_shape = v_shape
        self.hidden_size = hidden_size
        self.sequence_parallel_size = chunks[0].sequence_parallel_size


def apply_pipeline_parallel(model: Llama, pgm: ProcessGroupManager, virtual_stages: int = 1,
                            layer_split: Optional[Sequence[int]] = None,
                            sequence_parallel: bool = False,
                            v_shape: bool = False) -> PipelineModel:
    """Keep this pipeline rank's stages of ``model`` (already tensor-parallel, if any).

    ``layer_split``: layers per global stage (p v entries), default an even split.
    ``sequence_parallel``: activations between stages are (b, s/tp, h) (chapter 03).
    ``v_shape``: two chunks, stages rank and 2p - 1 - rank (the zbv and dualpipev schedules).
    """
    p, rank = pgm.pipeline_model_parallel_world_size, pgm.pipeline_model_parallel_rank
    if virtual_stages > 1 and p == 1:
        raise ValueError(f"virtual_pipeline_stages ({virtual_stages}) needs a pipeline: "
                         f"pipeline_model_parallel_size is 1")
    if p > 1 and not v_shape and model.lm_head.weight is model.embed_tokens.weight:
        raise ValueError("tied embeddings need a copy on the first and the last stage: call "
                         "tied_embeddings.untie_across_stages(model) first (chapter 07)")
    num_stages = p * virtual_stages
    layers = split_layers(model.config.num_layers, num_stages, layer_split)
    stage_of_layer = {i: s for s, ids in enumerate(layers) for i in ids}
    owner = {}
    for key in model.state_dict():
        if key.startswith("layers."):
            owner[key] = stage_of_layer[int(key.split(".")[1])]
        else:  # embed_tokens on the first stage; norm and lm_head on the last
            owner[key] = 0 if key.startswith("embed_tokens.") else num_stages - 1
    sp = pgm.tensor_model_parallel_world_size if sequence_parallel else 1
    stages = [stage_index(rank, c, p, v_shape) for c in range(virtual_stages)]
    chunks = [PipelineChunk(model, layers[s], s == 0, s == num_stages - 1, sp) for s in stages]
    # NCCL wants the first call on a group to involve all its ranks, and p2p is partial.
    comm.barrier(pgm.pipeline_model_parallel_group)
    return PipelineModel(chunks, stages, num_stages, owner, model.config.hidden_size, v_shape)


# ---- the timeline of every stage on pipeline rank 0, for the chart ----------------------------


def gather_timeline(timeline: Timeline, pgm: ProcessGroupManager) -> Optional[Timeline]:
    """Every stage's events of the last step on pipeline rank 0 (for the chart); None elsewhere."""
    events = [(e.action, e.start, e.end) for e in timeline.events]
    parts = comm.gather_objects(events, pgm.pipeline_model_parallel_group)
    if pgm.pipeline_model_parallel_rank != 0:
        return None
    full = type(timeline)(timeline.pp, timeline.micro_batches, timeline.virtual_stages,
                          schedule=timeline.schedule)
    for rank, part in enumerate(parts):
        for action, start, end in part:
            full.record(rank, action, start, end)
    return full
