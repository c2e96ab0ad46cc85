"""The runtime simulated, and the order in which it posts its messages (chapter 04b; no
process group). ``simulate_async``: every rank's actions with fixed costs and sends that never
block; its chart and bubble are the theory of the runtime's (analysis.py holds the rendezvous
simulator of the classic plans). ``posting_program``: every rank's messages in the order they
happen in that simulation, safe on NCCL (doc/04b_zero_bubble.md, "Posting order on NCCL"). A
send goes out once its action ran, a receive as early as that order allows; a batch ends at a
receive, so waiting for it waits for nothing later.
"""

from typing import Dict, List, Optional, Sequence, Tuple

from scaletorch.schedule.catalog import P2P, action_p2p, schedule_actions
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
    """The timeline of any schedule when sends never block (the runtime's).

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


Batch = Tuple[P2P, ...]  # one batch_isend_irecv
# per action: the batches posted first, the action (None: the end), the receive it waits for
PostStep = Tuple[Tuple[Batch, ...], Optional[Action], Optional[P2P]]


# [core: posting-order]
def posting_program(schedule: str, pp: int, micro_batches: int, rank: int,
                    virtual_stages: int = 1) -> List[PostStep]:
    """Rank ``rank``'s steps; the last one posts what is left and runs no action."""
    p, v = pp, virtual_stages
    order = {}  # message -> its place: (simulated end of the action that makes it, src, dst, ...)
    for e in simulate_async(schedule, p, micro_batches, v).events:
        send = action_p2p(e.action, e.rank, p, v, schedule in V_SHAPED)[1]
        if send is not None:
            key = (send.kind, send.micro_batch, send.src, send.dst)
            order[key] = (e.end, send.src, send.dst, send.kind, send.micro_batch)
    actions = schedule_actions(schedule, p, micro_batches, rank, v)
    ops = []  # (place, op, the action that makes it: -1 for a receive)
    needs: List[Optional[P2P]] = []
    for i, action in enumerate(actions):
        recv, send = action_p2p(action, rank, p, v, schedule in V_SHAPED)
        needs.append(recv)
        for op, made in ((recv, -1), (send, i)):
            if op is not None:
                ops.append((order[(op.kind, op.micro_batch, op.src, op.dst)], op, made))
    batches: List[Tuple[Batch, int]] = []  # (batch, the action after which it can go)
    current: List[P2P] = []
    ready = -1
    for _, op, made in sorted(ops, key=lambda entry: entry[0]):
        if current and made > ready:  # a send made later goes in a batch of its own
            batches.append((tuple(current), ready))
            current, ready = [], -1
        current.append(op)
        ready = max(ready, made)
        if op.op == "recv":
            batches.append((tuple(current), ready))
            current, ready = [], -1
    if current:
        batches.append((tuple(current), ready))
    program: List[PostStep] = []
    done = 0
    steps: List[Optional[Action]] = [*actions, None]
    for i, step in enumerate(steps):
        first = done
        while done < len(batches) and (step is None or batches[done][1] < i):
            done += 1
        recv = needs[i] if step is not None else None  # posted by now (in_order.py's tests)
        program.append((tuple(b for b, _ in batches[first:done]), step, recv))
    return program
    # [end: posting-order]
