"""Schedules as plans (chapter 04b's runtime): each rank's bundles of actions and the
point-to-point messages that go with them, as data.

Chapter 04's loops name their messages in code (send_forward_recv_backward, ...). Here they
are derived from the actions: ``action_p2p`` gives the receive an action needs and the send it
makes, ``comm_plan`` batches them so that a send goes out with the receive it must not block.
One executor (scaletorch/parallel/pipeline_runtime.py) then runs any order, interleaved
included. No process group here: ``simulate.py`` proves every plan deadlock-free.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from scaletorch.schedule.orders import Action, afab_actions, one_f_one_b_actions
from scaletorch.schedule.placement import rank_of_stage, stage_index


def interleaved_bundles(pp: int, micro_batches: int, rank: int,
                        virtual_stages: int) -> List[List[Action]]:
    """Interleaved 1F1B (Megatron): the k-th forward runs micro-batch group k // (p v) in
    chunk (k // p) % v, p micro-batches per chunk before moving on; backwards visit the
    chunks in reverse. Warm-up is 2 (p - rank - 1) + (v - 1) p forwards; in the steady state
    each bundle is a forward and a backward (their p2p goes out together, see comm_plan)."""
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
    """The work of pipeline rank ``rank`` for one step, in bundles whose p2p is batched (for
    numbers that ``catalog.validate_schedule`` accepts)."""
    if schedule == "afab":
        return [[a] for a in afab_actions(pp, micro_batches, rank)]
    if schedule == "1f1b":
        return [[a] for a in one_f_one_b_actions(pp, micro_batches, rank)]
    return interleaved_bundles(pp, micro_batches, rank, virtual_stages)


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


def action_p2p(action: Action, rank: int, pp: int, virtual_stages: int,
               v_shape: bool = False) -> Tuple[Optional[P2P], Optional[P2P]]:
    """(the recv the action needs before it runs, the send it makes after), or None.

    F receives the previous stage's output and sends its own; B receives its output's gradient
    and sends its input's; W talks to nobody; a neighbour stage on this rank (the turn of a V)
    is no message.
    """
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
    """Steps of (p2p batch, action): post the batch, wait for it, then run the action.

    The batch before a bundle pairs the sends of the previous bundle with the recvs the bundle
    needs: the 1F1B steady state sends an activation and receives a gradient together,
    meeting the neighbour's opposite pair. Interleaving makes the p2p a ring, so its
    steady-state bundles are a forward and a backward, up to four ops a batch (Megatron's
    send_forward_backward_recv_forward_backward). ``simulate.simulate`` proves each plan
    deadlock-free.
    """
    steps: List[Step] = []
    pending: List[P2P] = []
    for bundle in bundles:
        ops = [action_p2p(a, rank, pp, virtual_stages, v_shape) for a in bundle]
        steps.append((tuple(pending + [recv for recv, _ in ops if recv]), bundle[0]))
        steps += [((), a) for a in bundle[1:]]
        pending = [send for _, send in ops if send]
    steps.append((tuple(pending), None))
    return steps
