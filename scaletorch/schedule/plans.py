"""Schedules as plans (chapter 04b): each rank's actions in bundles, and the point-to-point
messages derived from them (``action_p2p``), batched so that a send goes out with the receive
it must not block (``comm_plan``). No process group: analysis.py proves the plans
deadlock-free.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from scaletorch.schedule.orders import Action, afab_actions, one_f_one_b_actions
from scaletorch.schedule.placement import rank_of_stage, stage_index


def interleaved_bundles(pp: int, micro_batches: int, rank: int,
                        virtual_stages: int) -> List[List[Action]]:
    """Interleaved 1F1B (Megatron): the k-th forward runs chunk (k // p) % v, p micro-batches
    per chunk; backwards visit the chunks in reverse. Warm-up: 2 (p - rank - 1) + (v - 1) p
    forwards; then each bundle is a forward and a backward (their messages go together)."""
    p, v = pp, virtual_stages
    total = micro_batches * v

    def action(k: int, forward: bool) -> Action:
        group, j = divmod(k, p * v)
        chunk = j // p
        return Action("F" if forward else "B", group * p + j % p,
                      chunk if forward else v - 1 - chunk)

    warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    bundles = [[action(k, True)] for k in range(warmup)]
    bundles += [[action(warmup + k, True), action(k, False)] for k in range(total - warmup)]
    return bundles + [[action(k, False)] for k in range(total - warmup, total)]


def classic_bundles(schedule: str, pp: int, micro_batches: int, rank: int,
                    virtual_stages: int = 1) -> List[List[Action]]:
    """Rank ``rank``'s bundles of afab, 1f1b or interleaved (numbers ``validate_schedule``
    accepts)."""
    if schedule == "afab":
        return [[a] for a in afab_actions(pp, micro_batches, rank)]
    if schedule == "1f1b":
        return [[a] for a in one_f_one_b_actions(pp, micro_batches, rank)]
    return interleaved_bundles(pp, micro_batches, rank, virtual_stages)


@dataclass(frozen=True)
class P2P:
    """A send or recv of an activation ("act") or a gradient ("grad") of ``micro_batch``
    from global stage ``src`` to ``dst``, to or from pipeline rank ``peer``."""
    op: str
    peer: int
    kind: str
    micro_batch: int
    src: int
    dst: int


Step = Tuple[Tuple[P2P, ...], Optional[Action]]


def action_p2p(action: Action, rank: int, pp: int, virtual_stages: int,
               v_shape: bool = False) -> Tuple[Optional[P2P], Optional[P2P]]:
    """(the recv the action needs before it runs, the send it makes after), or None: F
    receives the previous stage's output and sends its own, B the gradients the other way; W,
    or a neighbour stage on this rank (the turn of a V), has no message."""
    p = pp
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
