"""The order in which the asynchronous runtime (chapter 04b) posts its messages: every rank in
the order they happen in the schedule's simulation, safe on NCCL (doc/04b_zero_bubble.md,
"Posting order on NCCL"). A send goes out once its action ran, a receive as early as that
order allows; a batch ends at a receive, so waiting for it waits for nothing later."""

from typing import List, Optional, Tuple

from scaletorch.schedule.catalog import schedule_actions
from scaletorch.schedule.orders import Action
from scaletorch.schedule.placement import V_SHAPED
from scaletorch.schedule.plans import P2P, action_p2p
from scaletorch.schedule.simulate import simulate_async

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
