"""The schedules analysed without running them, for the tests, scripts/plot.py and the
planner's checks (chapter 04b; the runtime reads none of it).

``simulate`` runs the classic schedules' rendezvous plans (``comm_plan``: each step one batch
that pairs a send with the receive it must not block, waited for at once; a send completes
only when its peer posted the matching receive) and proves them deadlock-free;
``zero_bubble_theory`` is ZB-H1's closed-form bubble, against which the asynchronous
simulator (simulate.py) is checked.
"""

from typing import Dict, List, Optional, Sequence, Tuple

from scaletorch.schedule.catalog import P2P, action_p2p, schedule_bundles
from scaletorch.schedule.orders import Action
from scaletorch.schedule.placement import V_SHAPED, ZERO_BUBBLE
from scaletorch.schedule.simulate import PipelineDeadlock, simulate_async
from scaletorch.schedule.timeline import Timeline

Step = Tuple[Tuple[P2P, ...], Optional[Action]]


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


def zero_bubble_theory(schedule: str, pp: int, micro_batches: int, forward: float = 1.0,
                       backward: float = 1.0, weight: float = 1.0) -> Optional[float]:
    """Idle fraction of ZB-H1 with per-stage costs F, B, W (W <= F + B): each rank idles
    (p-1)(F+B-W) of a step that works m (F+B+W). None for the V schedules (the simulator
    gives theirs)."""
    if schedule != "zb-h1":
        return None
    p, m = pp, micro_batches
    idle = (p - 1) * max(forward + backward - weight, 0.0)
    return idle / (m * (forward + backward + weight) + idle)


def comm_plan(bundles: Sequence[Sequence[Action]], rank: int, pp: int, virtual_stages: int = 1,
              v_shape: bool = False) -> List[Step]:
    """Steps of (p2p batch, action): post the batch, wait for it, run the action. The batch
    before a bundle pairs the previous bundle's sends with the bundle's recvs, as 1F1B's
    send_forward_recv_backward does; on interleaving's ring, up to four ops (Megatron's
    send_forward_backward_recv_forward_backward)."""
    steps: List[Step] = []
    pending: List[P2P] = []
    for bundle in bundles:
        ops = [action_p2p(a, rank, pp, virtual_stages, v_shape) for a in bundle]
        steps.append((tuple(pending + [recv for recv, _ in ops if recv]), bundle[0]))
        steps += [((), a) for a in bundle[1:]]
        pending = [send for _, send in ops if send]
    steps.append((tuple(pending), None))
    return steps


def schedule_plan(schedule: str, pp: int, micro_batches: int, rank: int,
                  virtual_stages: int = 1) -> List[Step]:
    """``comm_plan`` of ``schedule_bundles``: rank ``rank``'s steps with rendezvous batches."""
    bundles = schedule_bundles(schedule, pp, micro_batches, rank, virtual_stages)
    return comm_plan(bundles, rank, pp, virtual_stages, schedule in V_SHAPED)
