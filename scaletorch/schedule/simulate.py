"""The asynchronous runtime simulated: every rank's actions with fixed costs and sends that
never block, no process group. The runtime posts its messages in this timeline's order
(posting.py); its chart and bubble are the theory of the runtime's (analysis.py holds the
rendezvous simulator of the classic plans).
"""

from typing import Dict, Optional, Sequence, Tuple

from scaletorch.schedule.catalog import schedule_actions
from scaletorch.schedule.orders import Action
from scaletorch.schedule.placement import V_SHAPED, rank_of_stage, stage_index
from scaletorch.schedule.timeline import Timeline


class ZeroBubbleTimeline(Timeline):
    """A zero-bubble schedule's timeline: its theory is its own simulation with F = B = W."""

    def theory(self) -> float:
        return simulate_async(self.schedule, self.pp, self.micro_batches, self.virtual_stages, 1.0,
                              1.0, 1.0).bubble_fraction()

    def formula(self) -> str:
        return f"{self.schedule} simulated with F = B = W, p={self.pp}, m={self.micro_batches}"


class PipelineDeadlock(RuntimeError):
    """Ranks wait for each other in a cycle: the plan cannot finish."""


def simulate_async(
        schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1, forward: float = 1.0,
        backward: float = 1.0, weight: float = 1.0, comm: float = 0.0,
        durations: Optional[Dict[Tuple[int, str], float]] = None,
        stage_costs: Optional[Sequence[Tuple[float, float, float]]] = None) -> "ZeroBubbleTimeline":
    """The timeline of any schedule when sends never block (``split_backward``'s runtime).

    Each rank runs its actions in order; an action starts when the rank is free and its input
    exists: F needs the previous stage's F, B the next stage's B (the last stage: its own F),
    W its own B. A message from another rank arrives ``comm`` after its action ended. Costs:
    F ``forward``, B ``backward`` (+ ``weight`` if its W is not split off), W ``weight``;
    or per global stage, ``stage_costs[s]`` = (F, B, W) (the planner's FLOPs of each stage);
    or each action's own, ``durations[(rank, str(action))]`` (to replay a measured step).
    Raises PipelineDeadlock when no rank can go on, ValueError for an input a rank has not
    made yet on itself (an order that cannot run).
    """
    p, m, v = pp, micro_batches, virtual_stages
    v_shape, last = schedule in V_SHAPED, p * v - 1
    plans = [schedule_actions(schedule, p, m, r, v) for r in range(p)]
    split = [{(a.micro_batch, a.chunk) for a in plan if a.kind == "W"} for plan in plans]
    timeline = ZeroBubbleTimeline(p, m, v, schedule=schedule)
    ended: Dict[Tuple[str, int, int], float] = {}  # (kind, micro-batch, stage) -> end time
    clock, pos = [0.0] * p, [0] * p

    def needs(action: Action, s: int) -> Tuple[str, int]:
        if action.kind == "F":
            return "F", s - 1
        if action.kind == "B":
            return ("B", s + 1) if s < last else ("F", s)
        return "B", s

    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(plans[r]):
                action = plans[r][pos[r]]
                s, mb = stage_index(r, action.chunk, p, v_shape), action.micro_batch
                kind, source = needs(action, s)
                ready = clock[r]
                if 0 <= source <= last:
                    local = rank_of_stage(source, p, v_shape) == r
                    if (kind, mb, source) not in ended:
                        if local:
                            raise ValueError(f"rank {r} runs {action} (stage {s}) before "
                                             f"{kind}{mb} of stage {source}, which it needs")
                        break
                    ready = max(ready, ended[(kind, mb, source)] + (0.0 if local else comm))
                f, b, w = (forward, backward, weight) if stage_costs is None else stage_costs[s]
                cost = {"F": f, "W": w}.get(action.kind, b)
                if action.kind == "B" and (mb, action.chunk) not in split[r]:
                    cost += w  # a full backward
                if durations is not None:
                    cost = durations[(r, str(action))]
                timeline.record(r, action, ready, ready + cost)
                ended[(action.kind, mb, s)] = clock[r] = ready + cost
                pos[r] += 1
                progress = True
    stuck = {r: str(plans[r][pos[r]]) for r in range(p) if pos[r] < len(plans[r])}
    if stuck:
        raise PipelineDeadlock(f"{schedule} p={p} m={m} v={v}: ranks wait at {stuck}")
    return timeline
