"""Tied embeddings under a pipeline (Megatron's way): a copy on the last stage, gradients summed.

A model with ``tie_word_embeddings`` uses one weight for the embedding (first stage) and the
output layer (last stage). Under a pipeline those live on different ranks, so the last stage
gets its own copy (``untie_across_stages``, before the cut), and after backward one all-reduce
over the embedding group (pg_manager: the pipeline's first and last rank) sums the two copies'
gradients (``sync_tied_embedding_grads``), so both stay equal. In a V (zbv, dualpipev) both
stages are rank 0's chunks: they share the one parameter, as on one device, and its two uses
accumulate into its one ``.grad`` (no copy, no embedding group). Chapter 10 (real models tie
them) attaches this to chapter 07's ``parallelize`` from outside: ``tied=TiedEmbeddings()``.
"""

from typing import Callable, List, Sequence, Tuple, Type

import torch
from torch import nn

from scaletorch.dist import ProcessGroupManager, comm
from scaletorch.models import Llama
from scaletorch.parallel.pipeline_runtime import PipelineModel, PipelineSchedule, StageHooks
from scaletorch.parallel.zero import ShardedDataParallel, Units
from scaletorch.parallel.zero_tied import TiedShardedDataParallel, zero_units
from scaletorch.rules.group_names import gradient_group_name


# [core: tied-copy]
def untie_across_stages(model: Llama) -> None:
    """Give the output layer its own copy of the tied weight (before the cut into stages).

    Same init without communication: every rank built the whole model from one seed, so the
    copy is the clone of bit-identical values. Both copies are tagged ``shared_embedding``
    (the sync finds them by it; the clip counts them as 2 replicas; ZeRO gives the copy its own
    unit); the copy keeps the tensor-parallel tags, as the vocabulary rows are split alike.
    """
    weight = model.embed_tokens.weight
    weight.shared_embedding = True  # type: ignore[attr-defined]
    copy = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
    copy.__dict__.update(weight.__dict__)  # tensor_model_parallel, partition_dim, vocab_padding
    model.lm_head.weight = copy


def tied_embedding_params(module: nn.Module) -> List[torch.Tensor]:
    """The copies of a tied embedding that ``module`` holds (after any wrapper: ZeRO tags the
    shard of the unit that holds one)."""
    return [p for p in module.parameters() if getattr(p, "shared_embedding", False)]


def sync_tied_embedding_grads(params: Sequence[torch.Tensor], pgm: ProcessGroupManager) -> None:
    """Sum the gradients of the tied embedding's two copies over the embedding group (first and
    last pipeline rank): one all-reduce of V x h / tp elements (or a ZeRO shard of them) per
    step, after the data-parallel sync. ``params``: this rank's copies, none on a middle
    stage (then nothing to do: it is in no embedding group)."""
    for param in params:
        if param.grad is None:  # a copy with no use this step still joins the sum
            param.grad = torch.zeros_like(param)
        comm.all_reduce(param.grad, pgm.embedding_group, name="embd")


# [end: tied-copy]
class TiedEmbeddingSync(StageHooks):
    """After each step's backward (and data-parallel syncs), sum this rank's copies' gradients."""

    def __init__(self, params: Sequence[torch.Tensor], pgm: ProcessGroupManager) -> None:
        self.params, self.pgm = params, pgm

    def end_step(self, schedule: PipelineSchedule) -> None:
        sync_tied_embedding_grads(self.params, self.pgm)


def attach_tied_embedding_sync(schedule: PipelineSchedule, pgm: ProcessGroupManager) -> None:
    """Register ``TiedEmbeddingSync`` on ``schedule`` for this rank's copies."""
    schedule.hooks.append(TiedEmbeddingSync(tied_embedding_params(schedule.pipe), pgm))


def check_v_shape_wrappers(pipe: PipelineModel, pgm: ProcessGroupManager) -> None:
    """Refuse to wrap a V's chunks one by one for data parallel when they share the tied weight
    (layout_check.py refuses the layout first for ``parallelize``)."""
    if pipe.v_shape and pgm.gradient_sync_world_size > 1 and \
            any(p is q for p in pipe.chunks[0].parameters() for q in pipe.chunks[1].parameters()):
        dp = gradient_group_name(pgm.context_parallel_world_size)  # "dp" at cp 1
        raise ValueError(f"tie_word_embeddings with a V-shaped schedule (zbv, dualpipev) and data "
                         f"parallel over {dp} ({pgm.gradient_sync_world_size}): "
                         f"rank 0's two chunks share the tied weight, and each chunk's wrapper "
                         f"would sync it on its own; run the V with {dp} 1, or use afab, 1f1b, "
                         f"interleaved or zb-h1")


class TiedEmbeddings:
    """The hooks ``parallelize(..., tied=TiedEmbeddings())`` calls for a tied model: the copy
    before the pipeline's cut, ZeRO units that share the weight, the sum after backward."""

    def before_pipeline(self, model: Llama, v_shape: bool) -> None:
        if not v_shape:  # a V keeps the tie: both ends are chunks of rank 0
            untie_across_stages(model)

    def zero(self) -> Tuple[Type[ShardedDataParallel], Callable[[nn.Module], Units]]:
        """ZeRO's wrapper whose units may share the tied weight, and a model's units."""
        return TiedShardedDataParallel, zero_units

    def after_schedule(self, schedule: PipelineSchedule, pgm: ProcessGroupManager) -> None:
        attach_tied_embedding_sync(schedule, pgm)
