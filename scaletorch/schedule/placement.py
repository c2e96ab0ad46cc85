"""Where the pipeline's stages and layers live: which rank holds which stage, and the bubble.

p = pipeline ranks, v = model chunks (virtual stages) per rank, S = p v global stages. Rank r
holds the stages r, r + p, ..., r + (v - 1) p (Megatron's interleaved assignment), or in a V
(``zbv``, ``dualpipev``: v = 2) the stages r and 2p - 1 - r, so that rank 0 holds the first
and the last stage (the embedding and the head). Pure Python: the runtime (scaletorch/parallel)
and the planner (scaletorch/plan) read the same rules.
"""

import itertools
from typing import List, Optional, Sequence

CLASSIC = ("afab", "1f1b", "interleaved")  # chapter 04
ZERO_BUBBLE = ("zb-h1", "zbv", "dualpipev")  # chapter 04b: backward split into B and W
V_SHAPED = ("zbv", "dualpipev")  # two chunks per rank: stages r and 2p - 1 - r
SCHEDULES = CLASSIC + ZERO_BUBBLE


def stage_index(rank: int, chunk: int, pp: int, v_shape: bool = False) -> int:
    """Global (virtual) stage of ``chunk`` on pipeline rank ``rank``: chunk * p + rank, or in a
    V rank on the way down and 2p - 1 - rank back up."""
    if v_shape and chunk == 1:
        return 2 * pp - 1 - rank
    return chunk * pp + rank


def rank_of_stage(stage: int, pp: int, v_shape: bool = False) -> int:
    """The pipeline rank holding global stage ``stage`` (the inverse of ``stage_index``)."""
    if v_shape and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


def split_layers(num_layers: int, num_stages: int,
                 layer_split: Optional[Sequence[int]] = None) -> List[List[int]]:
    """Layer indices of each stage: an even split, or ``layer_split[s]`` layers on stage s
    (``parallel.layer_split``, one entry per global stage: p x v of them)."""
    return [list(r) for r in stage_ranges(num_layers, num_stages, layer_split)]


def stage_ranges(num_layers: int, num_stages: int,
                 layer_split: Optional[Sequence[int]] = None) -> List[range]:
    """``split_layers`` as ranges, with its checks: a check that needs only counts (the
    planner, the memory pre-flight) costs O(stages), never O(layers)."""
    stages = f"{num_stages} = pipeline_model_parallel_size x virtual_pipeline_stages"
    if layer_split is None:
        if num_layers % num_stages != 0:
            base, extra = divmod(num_layers, num_stages)
            example = ",".join(str(base + (s < extra)) for s in range(num_stages))
            fix = f"set parallel.layer_split, e.g. --layer-split {example}" if base > 0 else \
                f"use fewer stages, or --model.num_layers {num_stages}"
            raise ValueError(f"model.num_layers ({num_layers}) is not divisible by the number "
                             f"of pipeline stages ({stages}): {fix}")
        layer_split = [num_layers // num_stages] * num_stages
    if len(layer_split) != num_stages or sum(layer_split) != num_layers \
            or min(layer_split) < 1:
        raise ValueError(f"parallel.layer_split {list(layer_split)} must have one entry per "
                         f"pipeline stage ({stages}), each >= 1, summing to model.num_layers "
                         f"({num_layers})")
    bounds = [0, *itertools.accumulate(layer_split)]  # not a sum per stage: O(stages)
    return [range(bounds[s], bounds[s + 1]) for s in range(num_stages)]


def theoretical_bubble(pp: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a step with equal-cost stages: (p-1)/(v m + p - 1)."""
    return (pp - 1) / (virtual_stages * micro_batches + pp - 1)
