"""Pipeline schedules simulated: every rank's plan run with fixed costs, no process group.

``simulate`` runs the classic schedules' rendezvous plans (a send completes only when its peer
posted the matching receive) and proves them deadlock-free; ``simulate_async`` runs any
schedule as the zero-bubble runtime does, with sends that never block. Both return a
``Timeline`` in slots: its chart, its bubble, its peak of live activations.
"""

from typing import Dict, List, Optional, Sequence, Tuple

from scaletorch.schedule.catalog import schedule_actions, schedule_plan
from scaletorch.schedule.orders import Action
from scaletorch.schedule.placement import V_SHAPED, ZERO_BUBBLE, rank_of_stage, stage_index
from scaletorch.schedule.plans import P2P, Step
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


def simulate(schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1,
             forward_cost: float = 1.0, backward_cost: float = 2.0,
             weight_cost: Optional[float] = None) -> Timeline:
    """The slot timeline of ``schedule`` with equal-cost stages (see ``simulate_plans``). The
    zero-bubble schedules' runtime sends asynchronously: ``simulate_async`` (W costs
    ``weight_cost``, default as much as B)."""
    if schedule in ZERO_BUBBLE:
        weight = backward_cost if weight_cost is None else weight_cost
        return simulate_async(schedule, pp, micro_batches, virtual_stages, forward_cost,
                              backward_cost, weight)
    plans = [schedule_plan(schedule, pp, micro_batches, r, virtual_stages) for r in range(pp)]
    return simulate_plans(plans, micro_batches, virtual_stages, forward_cost, backward_cost)


def simulate_plans(plans: Sequence[List[Step]], micro_batches: int, virtual_stages: int = 1,
                   forward_cost: float = 1.0, backward_cost: float = 2.0) -> Timeline:
    """Run every rank's plan (``plans[r]``) with instant messages and fixed compute costs.

    A send completes only when its peer has posted the matching recv (and vice versa) - the
    strictest semantics (NCCL's), so a plan that finishes here cannot deadlock on gloo or
    NCCL. Messages on each (src, dst) pair are matched in posting order, and both sides must
    name the same (kind, micro-batch, stages), or ValueError. Raises PipelineDeadlock when
    ranks wait for each other in a cycle. Returns the timeline in slots.
    """
    p = len(plans)
    timeline = Timeline(p, micro_batches, virtual_stages)
    pos, clock = [0] * p, [0.0] * p
    # (src, dst, "send" | "recv") -> [(op, post time)] in posting order: the k-th send on a
    # channel meets the k-th recv
    channels: Dict[Tuple[int, int, str], List[Tuple[P2P, float]]] = {}
    posted: Dict[int, List[Tuple[Tuple[int, int, str], int]]] = {}  # rank -> its open ops

    def post(r: int, batch: Sequence[P2P]) -> None:
        posted[r] = []
        for op in batch:
            key = (r, op.peer, "send") if op.op == "send" else (op.peer, r, "recv")
            channels.setdefault(key, []).append((op, clock[r]))
            posted[r].append((key, len(channels[key]) - 1))

    def completion(r: int) -> Optional[float]:
        """When rank r's posted batch completes, or None if a peer has not posted yet."""
        done = clock[r]
        for (src, dst, side), k in posted[r]:
            other = channels.get((src, dst, "recv" if side == "send" else "send"), [])
            if k >= len(other):
                return None
            mine, theirs = channels[(src, dst, side)][k][0], other[k][0]
            if (mine.kind, mine.micro_batch, mine.src, mine.dst) != \
                    (theirs.kind, theirs.micro_batch, theirs.src, theirs.dst):
                raise ValueError(f"message {k} from rank {src} to rank {dst} is {mine} on one "
                                 f"side and {theirs} on the other")
            done = max(done, other[k][1])
        return done

    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(plans[r]):
                batch, action = plans[r][pos[r]]
                if r not in posted:
                    post(r, batch)
                done = completion(r)
                if done is None:
                    break
                del posted[r]
                clock[r] = done
                if action is not None:
                    cost = forward_cost if action.kind == "F" else backward_cost
                    timeline.record(r, action, done, done + cost)
                    clock[r] = done + cost
                pos[r] += 1
                progress = True
    stuck = {r: str(plans[r][pos[r]][1]) for r in range(p) if pos[r] < len(plans[r])}
    if stuck:
        raise PipelineDeadlock(f"p={p} m={micro_batches} v={virtual_stages}: ranks wait for "
                               f"each other at {stuck}")
    return timeline


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
