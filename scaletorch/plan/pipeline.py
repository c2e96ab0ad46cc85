"""Pipeline arithmetic: which layers each stage holds, the bubble, the micro-batches in flight.

p = pipeline ranks, m = micro-batches, v = model chunks (virtual stages) per rank; rank r holds
the global stages r, r + p, ..., r + (v - 1) p (Megatron's interleaved assignment), or in a V
(``zbv``, ``dualpipev``: v = 2) the stages r and 2p - 1 - r, so that rank 0 holds the first and
the last stage (the embedding and the head): the placement, the orders and the simulators are
the runtime's own (scaletorch/schedule, pure Python).

The zero-bubble schedules have no closed form for every order: their bubble and the
activations they hold come from the schedule's own action lists and ``simulate_async``, fed
with costs proportional to each action's FLOPs (``flops.split_backward_flops``).
"""

from functools import lru_cache
from typing import List, Optional, Sequence, Tuple

from scaletorch.plan.flops import split_backward_flops
from scaletorch.plan.layout import V_SHAPED, ZERO_BUBBLE, PlanLayout
from scaletorch.plan.model import ModelSpec
from scaletorch.schedule.catalog import schedule_actions
from scaletorch.schedule.orders import peak_live_activations
from scaletorch.schedule.placement import stage_index, stage_ranges, theoretical_bubble
from scaletorch.schedule.simulate import simulate_async


def rank_stages(pp: int, virtual_stages: int, pp_rank: int, schedule: str = "1f1b") -> List[int]:
    """The global stages of pipeline rank ``pp_rank``'s chunks, in chunk order."""
    return [stage_index(pp_rank, c, pp, schedule in V_SHAPED) for c in range(virtual_stages)]


def rank_layers(num_layers: int, pp: int, virtual_stages: int = 1,
                layer_split: Optional[Sequence[int]] = None,
                schedule: str = "1f1b") -> List[List[range]]:
    """For each pipeline rank, the layers of each of its chunks (global stage r + c p; in a V
    r and 2p - 1 - r), as ranges: O(stages), whatever the number of layers. Cached (read it,
    never change it): the planner asks once per rank and per estimate."""
    split = None if layer_split is None else tuple(layer_split)
    return _rank_layers(num_layers, pp, virtual_stages, split, schedule)


@lru_cache(maxsize=256)
def _rank_layers(num_layers: int, pp: int, virtual_stages: int,
                 layer_split: Optional[Tuple[int, ...]], schedule: str) -> List[List[range]]:
    stages = stage_ranges(num_layers, pp * virtual_stages, layer_split)
    return [[stages[s] for s in rank_stages(pp, virtual_stages, r, schedule)] for r in range(pp)]


def holds_ends(layout: PlanLayout, pp_rank: int) -> Tuple[bool, bool]:
    """(first, last): whether pipeline rank ``pp_rank`` holds the first stage (the embedding)
    and the last (final norm, head and loss); in a V rank 0 holds both."""
    stages = rank_stages(layout.pp, layout.virtual_stages, pp_rank, layout.schedule)
    return 0 in stages, layout.pp * layout.virtual_stages - 1 in stages


def in_flight(schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1,
              rank: int = 0) -> float:
    """Micro-batches of activations pipeline rank ``rank`` holds at its peak, in units of one
    micro-batch through all of its layers.

    AFAB (GPipe) keeps all m; 1F1B keeps min(m, p - r); the interleaved schedule warms up with
    2 (p - r - 1) + (v - 1) p + 1 chunk forwards of 1/v each (Megatron's schedule), on the first
    rank p + (p - 1)/v: Korthikanti et al.'s 1 + (p - 1)/(p v) times the L layers of 1F1B.
    The zero-bubble schedules hold a micro-batch chunk from its F to its W (``held_peak``, the
    schedule's own count): ZB-H1 min(m, p) on every rank, ZBV 2p chunks of 1/2 (p at m >= 2p),
    DualPipeV 2p + 1 of 1/2.
    """
    if pp == 1:  # no pipeline: each micro-batch's backward runs before the next forward
        return 1.0
    if schedule in ZERO_BUBBLE:
        return held_peak(schedule, pp, micro_batches, virtual_stages, rank) / virtual_stages
    if schedule == "afab":
        return float(micro_batches)
    if schedule == "interleaved" and virtual_stages > 1:
        warmup = 2 * (pp - rank - 1) + (virtual_stages - 1) * pp + 1
        return min(float(micro_batches), warmup / virtual_stages)
    return float(min(micro_batches, pp - rank))


def held_peak(schedule: str, pp: int, micro_batches: int, virtual_stages: int, rank: int,
              chunk_sizes: Optional[Sequence[float]] = None) -> float:
    """The most micro-batch chunks rank ``rank`` holds at once under ``schedule`` (from a
    chunk's F to its last backward: its W, or a B with no W after it), counted on the schedule's
    own action list; with ``chunk_sizes``, the most of their sizes (chunk c weighs
    ``chunk_sizes[c]``: the planner's activation bytes).

    The count stops growing once m >= 2p (the steady state repeats one pattern), so it is
    counted on ``steady_micro_batches(pp, m)`` micro-batches: the same peak (tests/
    test_size_limits.py compares them) at a cost that does not grow with m."""
    m = steady_micro_batches(pp, micro_batches)
    actions = schedule_actions(schedule, pp, m, rank, virtual_stages)
    return peak_live_activations(actions, chunk_sizes)


def steady_micro_batches(pp: int, micro_batches: int) -> int:
    """m, or past 4p (twice the 2p from which the zero-bubble schedules' peak holds) 4p of
    the same parity: the micro-batches ``held_peak`` lists to find the peak of m."""
    return micro_batches if micro_batches <= 4 * pp else 4 * pp + micro_batches % 2


def split_backwards(schedule: str, pp: int, micro_batches: int, virtual_stages: int,
                    rank: int) -> List[int]:
    """Per chunk of rank ``rank``: how many of its backwards are split into B and a later W
    (the rest run whole), from the schedule's action list."""
    actions = schedule_actions(schedule, pp, micro_batches, rank, virtual_stages)
    return [sum(a.kind == "W" and a.chunk == c for a in actions) for c in range(virtual_stages)]


def bubble(model: ModelSpec, layout: PlanLayout) -> float:
    """Idle fraction of a step. AFAB, 1F1B, interleaved: (p-1)/(v m + p - 1) (equal stages);
    zb-h1, zbv, dualpipev: the schedule simulated with asynchronous sends
    (``simulate.simulate_async``, their runtime), each stage's F, B and W costing the FLOPs
    of its blocks (``split_backward_flops``; head and embedding left out, as in the closed
    form)."""
    lay = layout
    if lay.pp == 1:
        return 0.0
    if lay.schedule not in ZERO_BUBBLE:
        return theoretical_bubble(lay.pp, lay.num_micro_batches, lay.virtual_stages)
    stages = stage_ranges(model.num_layers, lay.pp * lay.virtual_stages, lay.layer_split)
    costs = [split_backward_flops(model, lay, layers) for layers in stages]
    unit = sum(sum(c) for c in costs) / len(costs)  # scale-free: a search reuses simulations
    key = tuple(tuple(round(x / unit, 12) for x in c) for c in costs)
    return _simulated_bubble(lay.schedule, lay.pp, lay.num_micro_batches, lay.virtual_stages, key)


@lru_cache(maxsize=4096)
def _simulated_bubble(schedule: str, pp: int, micro_batches: int, virtual_stages: int,
                      stage_costs: Tuple[Tuple[float, float, float], ...]) -> float:
    return simulate_async(schedule, pp, micro_batches, virtual_stages,
                          stage_costs=stage_costs).bubble_fraction()
