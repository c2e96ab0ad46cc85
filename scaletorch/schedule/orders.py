"""The classic pipeline schedules as plain data: what each rank computes, in which order, and
which point-to-point messages go with it.

No process group here: every schedule is checked in milliseconds (the order of forwards F
and backwards B, the live activations, that the messages pair up, no deadlock: simulate.py).
p = pipeline ranks, m = micro-batches, v = model chunks per rank (placement.py). Simulated
with F = 1 slot and B = 2 (a, b, ...: forward of micro-batch 0, 1, ...; A, B, ...: its
backward; ".": idle), p = 4, m = 4:

    AFAB (GPipe)                  1F1B
    stage 0 |abcd.........AABBCCDD|   stage 0 |abcd......AA.BB.CC.DD|
    stage 1 |.abcd......AABBCCDD..|   stage 1 |.abc....AAdBB.CC.DD..|
    stage 2 |..abcd...AABBCCDD....|   stage 2 |..ab..AAcBBdCC.DD....|
    stage 3 |...abcdAABBCCDD......|   stage 3 |...aAAbBBcCCdDD......|

Both idle (p-1)/(m+p-1) of the time (the bubble); 1F1B holds at most p - r micro-batches of
activations on rank r instead of m, because each backward frees one as soon as it can.
Interleaving v chunks per rank (each 1/v of the work) shrinks the bubble to
(p-1)/(v m + p - 1) at the price of v times more point-to-point messages.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from scaletorch.schedule.placement import rank_of_stage, stage_index


@dataclass(frozen=True)
class Action:
    """One unit of work on one rank: the forward ("F") or backward ("B") of a micro-batch
    through the rank's model chunk ``chunk`` (0 unless interleaved or V-shaped). In the
    zero-bubble schedules B is the input gradient only and "W" the weight gradient."""
    kind: str
    micro_batch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}" + (f".{self.chunk}" if self.chunk else "")


def afab_actions(stages: int, micro_batches: int, rank: int) -> List[Action]:
    """GPipe: all forwards, then all backwards (in the same micro-batch order)."""
    forwards = [Action("F", i) for i in range(micro_batches)]
    return forwards + [Action("B", i) for i in range(micro_batches)]


def one_f_one_b_actions(stages: int, micro_batches: int, rank: int) -> List[Action]:
    """1F1B: p - rank - 1 warm-up forwards, then alternate F and B, then the last Bs."""
    warmup = min(stages - rank - 1, micro_batches)
    actions = [Action("F", i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        actions += [Action("F", warmup + i), Action("B", i)]
    return actions + [Action("B", i) for i in range(micro_batches - warmup, micro_batches)]


def interleaved_units(stages: int, micro_batches: int, rank: int,
                      virtual_stages: int) -> List[List[Action]]:
    """Interleaved 1F1B (Megatron): the k-th forward runs micro-batch group k // (p v) in
    chunk (k // p) % v, p micro-batches per chunk before moving on; backwards visit the
    chunks in reverse. Warm-up is 2 (p - rank - 1) + (v - 1) p forwards; in the steady state
    each unit is a forward and a backward (their p2p goes out together, see comm_plan)."""
    p, v = stages, virtual_stages
    total = micro_batches * v

    def unit(k: int, forward: bool) -> Action:
        group, j = divmod(k, p * v)
        chunk = j // p
        return Action("F" if forward else "B", group * p + j % p,
                      chunk if forward else v - 1 - chunk)

    warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    units = [[unit(k, True)] for k in range(warmup)]
    units += [[unit(warmup + k, True), unit(k, False)] for k in range(total - warmup)]
    return units + [[unit(k, False)] for k in range(total - warmup, total)]


def classic_units(schedule: str, stages: int, micro_batches: int, rank: int,
                  virtual_stages: int = 1) -> List[List[Action]]:
    """The work of pipeline rank ``rank`` for one step, in units whose p2p is batched (for
    numbers that ``catalog.validate_schedule`` accepts)."""
    if schedule == "afab":
        return [[a] for a in afab_actions(stages, micro_batches, rank)]
    if schedule == "1f1b":
        return [[a] for a in one_f_one_b_actions(stages, micro_batches, rank)]
    return interleaved_units(stages, micro_batches, rank, virtual_stages)


def peak_live_activations(actions: Sequence[Action],
                          chunk_sizes: Optional[Sequence[float]] = None) -> float:
    """Most micro-batch chunks whose forward ran and whose backward has not (held activations).
    A B whose W comes later keeps them (W walks the same graph): they go at the W. With
    ``chunk_sizes`` each live chunk c weighs ``chunk_sizes[c]`` (the planner's bytes)."""
    deferred = {(a.micro_batch, a.chunk) for a in actions if a.kind == "W"}
    live: float = 0
    peak: float = 0
    for action in actions:
        size = 1 if chunk_sizes is None else chunk_sizes[action.chunk]
        if action.kind == "F":
            live += size
        elif action.kind == "W" or (action.micro_batch, action.chunk) not in deferred:
            live -= size
        peak = max(peak, live)
    return peak


# ---- point-to-point plan ------------------------------------------------------------------


@dataclass(frozen=True)
class P2P:
    """A send or recv of an activation ("act") or a gradient ("grad") of ``micro_batch``
    from global stage ``src`` to ``dst``, to/from pipeline rank ``peer``."""
    op: str
    peer: int
    kind: str
    micro_batch: int
    src: int
    dst: int


Step = Tuple[Tuple[P2P, ...], Optional[Action]]


def action_p2p(action: Action, rank: int, stages: int, virtual_stages: int,
               v_shape: bool = False) -> Tuple[Optional[P2P], Optional[P2P]]:
    """(the recv the action needs before it runs, the send it makes after), or None.

    F receives the previous stage's output and sends its own; B receives its output's gradient
    and sends its input's; W talks to nobody; a neighbour stage on this rank (the turn of a V)
    is no message.
    """
    p = stages
    s = stage_index(rank, action.chunk, p, v_shape)
    last = p * virtual_stages - 1
    mb = action.micro_batch

    def op(kind: str, tensor: str, src: int, dst: int) -> Optional[P2P]:
        peer = rank_of_stage(dst if kind == "send" else src, p, v_shape)
        return None if peer == rank else P2P(kind, peer, tensor, mb, src, dst)

    recv = send = None
    if action.kind == "F":
        recv = op("recv", "act", s - 1, s) if s > 0 else None
        send = op("send", "act", s, s + 1) if s < last else None
    elif action.kind == "B":
        recv = op("recv", "grad", s + 1, s) if s < last else None
        send = op("send", "grad", s, s - 1) if s > 0 else None
    return recv, send


def comm_plan(units: Sequence[Sequence[Action]], rank: int, stages: int, virtual_stages: int = 1,
              v_shape: bool = False) -> List[Step]:
    """Steps of (p2p batch, action): post the batch, wait for it, then run the action.

    The batch before a unit pairs the sends of the previous unit with the recvs the unit
    needs: the 1F1B steady state sends an activation and receives a gradient together,
    meeting the neighbour's opposite pair. Interleaving makes the p2p a ring, so its
    steady-state units are a forward and a backward, up to four ops a batch (Megatron's
    send_forward_backward_recv_forward_backward). ``simulate.simulate`` proves each plan
    deadlock-free.
    """
    steps: List[Step] = []
    pending: List[P2P] = []
    for unit in units:
        ops = [action_p2p(a, rank, stages, virtual_stages, v_shape) for a in unit]
        steps.append((tuple(pending + [recv for recv, _ in ops if recv]), unit[0]))
        steps += [((), a) for a in unit[1:]]
        pending = [send for _, send in ops if send]
    steps.append((tuple(pending), None))
    return steps


def message(micro_batch: int, peer: int, outgoing: bool) -> str:
    """A point-to-point message as ``--show-schedule`` prints it: "mb 0 -> rank 1" (sent to
    pipeline rank 1) or "mb 0 <- rank 0" (received from pipeline rank 0)."""
    return f"mb {micro_batch} {'->' if outgoing else '<-'} rank {peer}"
