"""The simulator's NCCL mode: every rank's posting program (``posting.posting_program``, or any
other, such as a test's) run with NCCL's point-to-point semantics or gloo's, no process group.

NCCL: a rank's batches on the pipeline group run one after the other (one stream), and a
batch completes once its peers' matching operations run. Gloo: each batch runs from its
posting. A program that finishes in NCCL's order cannot hang on either backend.
"""

from typing import Dict, List, Optional, Sequence, Tuple

from scaletorch.schedule.catalog import P2P
from scaletorch.schedule.simulate import PipelineDeadlock, PostStep, ZeroBubbleTimeline


def simulate_posted(programs: Sequence[List[PostStep]], micro_batches: int, virtual_stages: int = 1,
                    forward: float = 1.0, backward: float = 1.0, weight: float = 1.0,
                    in_order: bool = True, schedule: str = "") -> "ZeroBubbleTimeline":
    """The timeline of every rank's ``programs[r]`` (``posting.posting_program``), instant
    messages. A rank posts a step's batches, waits for the batch holding the action's receive
    (waiting for a batch is waiting for all of it, as for NCCL's one work per batch), runs the
    action; at the end it waits for everything it posted.

    ``in_order`` (NCCL): a rank's batches run one after the other, a batch starts once the one
    before it completed; else (gloo) each runs from its posting. An operation completes once
    its batch and its peer's matching one (the k-th on the channel) both run. Raises
    PipelineDeadlock when no rank can go on, ValueError when the k-th send and the k-th
    receive of a channel are different messages (NCCL has no tags to tell them apart).
    """
    p = len(programs)
    split = [{(a.micro_batch, a.chunk)
              for _, a, _ in prog if a and a.kind == "W"} for prog in programs]
    timeline = ZeroBubbleTimeline(p, micro_batches, virtual_stages, schedule=schedule)
    posted: List[List[Tuple[float, List[Tuple[int, int, str, int]]]]] = [[] for _ in range(p)]
    channel: Dict[Tuple[int, int, str], List[Tuple[P2P, int, int]]] = {}  # -> (op, rank, batch)
    holds: Dict[Tuple[int, P2P], int] = {}  # (rank, a receive) -> its rank's batch that holds it
    known: Dict[Tuple[int, int], float] = {}
    visiting: set = set()

    def start(r: int, j: int) -> Optional[float]:
        if not in_order or j == 0:
            return posted[r][j][0]
        before = done(r, j - 1)
        return None if before is None else max(posted[r][j][0], before)

    def done(r: int, j: int) -> Optional[float]:
        """When batch j of rank r completes; None while a peer has not posted (or in a cycle
        of waits: a deadlock)."""
        if (r, j) in known or (r, j) in visiting:
            return known.get((r, j))
        visiting.add((r, j))
        end = start(r, j)
        for src, dst, side, k in posted[r][j][1]:
            other = channel.get((src, dst, "recv" if side == "send" else "send"), [])
            if end is None or k >= len(other):
                end = None
                break
            mine, theirs = channel[(src, dst, side)][k][0], other[k][0]
            if (mine.kind, mine.micro_batch, mine.src, mine.dst) != \
                    (theirs.kind, theirs.micro_batch, theirs.src, theirs.dst):
                raise ValueError(f"message {k} from rank {src} to rank {dst} is {mine} on one "
                                 f"side and {theirs} on the other")
            peer_start = start(other[k][1], other[k][2])
            end = None if peer_start is None else max(end, peer_start)
        visiting.discard((r, j))
        if end is not None:
            known[(r, j)] = end
        return end

    pos, clock, entered = [0] * p, [0.0] * p, [-1] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(programs[r]):
                batches, action, recv = programs[r][pos[r]]
                if entered[r] < pos[r]:  # post this step's batches once
                    entered[r] = pos[r]
                    for batch in batches:
                        keys = []
                        for op in batch:
                            src, dst = (r, op.peer) if op.op == "send" else (op.peer, r)
                            ops = channel.setdefault((src, dst, op.op), [])
                            ops.append((op, r, len(posted[r])))
                            keys.append((src, dst, op.op, len(ops) - 1))
                            if op.op == "recv":
                                holds[(r, op)] = len(posted[r])
                        posted[r].append((clock[r], keys))
                waits = range(len(posted[r])) if action is None else \
                    [holds[(r, recv)]] if recv is not None else []
                ends = [done(r, j) for j in waits]
                if any(end is None for end in ends):
                    break
                clock[r] = max([clock[r]] + [end for end in ends if end is not None])
                if action is not None:
                    cost = {"F": forward, "W": weight}.get(action.kind, backward)
                    if action.kind == "B" and (action.micro_batch, action.chunk) not in split[r]:
                        cost += weight  # a full backward
                    timeline.record(r, action, clock[r], clock[r] + cost)
                    clock[r] += cost
                pos[r] += 1
                progress = True
    stuck = {r: str(programs[r][pos[r]][1]) for r in range(p) if pos[r] < len(programs[r])}
    if stuck:
        mode = "in NCCL's order" if in_order else "as gloo runs them"
        raise PipelineDeadlock(f"{schedule} p={p} m={micro_batches} v={virtual_stages}, batches "
                               f"{mode}: ranks wait at {stuck}")
    return timeline
