"""Pipeline arithmetic: which layers each stage holds, the bubble, the micro-batches in flight.

p = pipeline ranks, m = micro-batches, v = model chunks (virtual stages) per rank; rank r holds
the global stages r, r + p, ..., r + (v - 1) p (Megatron's interleaved assignment). The
schedules themselves (scaletorch/parallel/pipeline_schedules.py) are checked against these.
"""

from typing import List, Optional, Sequence


def split_layers(num_layers: int, num_stages: int,
                 layer_split: Optional[Sequence[int]] = None) -> List[List[int]]:
    """Layer indices of each stage: an even split, or ``layer_split[s]`` layers on stage s
    (``parallel.layer_split``, one entry per global stage: p x v of them)."""
    stages = f"{num_stages} = pipeline_model_parallel_size x virtual_pipeline_stages"
    if layer_split is None:
        if num_layers % num_stages != 0:
            base, extra = divmod(num_layers, num_stages)
            example = ",".join(str(base + (s < extra)) for s in range(num_stages))
            fix = f"set parallel.layer_split, e.g. --layer-split {example}" if base > 0 else \
                "use fewer stages"
            raise ValueError(f"model.num_layers ({num_layers}) is not divisible by the number "
                             f"of pipeline stages ({stages}): {fix}")
        layer_split = [num_layers // num_stages] * num_stages
    if len(layer_split) != num_stages or sum(layer_split) != num_layers \
            or min(layer_split) < 1:
        raise ValueError(f"parallel.layer_split {list(layer_split)} must have one entry per "
                         f"pipeline stage ({stages}), each >= 1, summing to model.num_layers "
                         f"({num_layers})")
    bounds = [sum(layer_split[:s]) for s in range(num_stages + 1)]
    return [list(range(bounds[s], bounds[s + 1])) for s in range(num_stages)]


def rank_layers(num_layers: int, pp: int, virtual_stages: int = 1,
                layer_split: Optional[Sequence[int]] = None) -> List[List[List[int]]]:
    """For each pipeline rank, the layers of each of its chunks (global stage r + c p)."""
    stages = split_layers(num_layers, pp * virtual_stages, layer_split)
    return [[stages[r + c * pp] for c in range(virtual_stages)] for r in range(pp)]


def theoretical_bubble(stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a step with equal-cost stages: (p-1)/(v m + p - 1)."""
    return (stages - 1) / (virtual_stages * micro_batches + stages - 1)


def in_flight(schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1,
              rank: int = 0) -> float:
    """Micro-batches of activations pipeline rank ``rank`` holds at its peak, in units of one
    micro-batch through all of its layers.

    AFAB (GPipe) keeps all m; 1F1B keeps min(m, p - r); the interleaved schedule warms up with
    2 (p - r - 1) + (v - 1) p + 1 chunk forwards of 1/v each (Megatron's schedule), on the first
    rank p + (p - 1)/v: Korthikanti et al.'s 1 + (p - 1)/(p v) times the L layers of 1F1B.
    """
    if pp == 1:  # no pipeline: each micro-batch's backward runs before the next forward
        return 1.0
    if schedule == "afab":
        return float(micro_batches)
    if schedule == "interleaved" and virtual_stages > 1:
        warmup = 2 * (pp - rank - 1) + (virtual_stages - 1) * pp + 1
        return min(float(micro_batches), warmup / virtual_stages)
    return float(min(micro_batches, pp - rank))
