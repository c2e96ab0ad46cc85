"""Every pipeline schedule by name (04's classic ones, 04b's interleaved and zero-bubble ones):
its checks, each rank's actions in bundles, the point-to-point messages of any action
(``action_p2p``), and ``--show-schedule``'s listing. No process group."""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from scaletorch.schedule.orders import Action, afab_actions, message, one_f_one_b_actions
from scaletorch.schedule.placement import SCHEDULES, V_SHAPED, rank_of_stage, stage_index
from scaletorch.schedule.zero_bubble_orders import dualpipev_bundles, zb_h1_actions, zbv_actions


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


# the schedules that are one list of actions per rank (pp, micro_batches, rank) -> actions
ORDERS: Dict[str, Callable[[int, int, int], List[Action]]] = {
    "afab": afab_actions,
    "1f1b": one_f_one_b_actions,
    "zb-h1": zb_h1_actions,
    "zbv": zbv_actions
}


def validate_schedule(schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1) -> None:
    """Raise ValueError, naming the numbers, for a schedule that cannot run with them (the
    config has checked that each is positive)."""
    p, m, v = pp, micro_batches, virtual_stages
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {', '.join(SCHEDULES)}, "
                         f"got {schedule!r}")
    if v > 1 and p == 1:
        raise ValueError(f"virtual_pipeline_stages ({v}) needs a pipeline: "
                         f"pipeline_model_parallel_size is 1 (set --pp)")
    if schedule in V_SHAPED and v != 2:
        raise ValueError(f"{schedule} places two chunks per rank in a V: set "
                         f"--virtual-stages 2 (virtual_pipeline_stages is {v})")
    if schedule == "zb-h1" and v != 1:
        raise ValueError(f"zb-h1 runs one chunk per rank: virtual_pipeline_stages must be 1, "
                         f"got {v} (use --schedule zbv for two chunks per rank)")
    if v > 1 and schedule in ("afab", "1f1b"):
        raise ValueError(f"virtual_pipeline_stages ({v}) > 1 needs the interleaved schedule, "
                         f"got {schedule!r} (set --schedule interleaved)")
    if schedule in ("1f1b", "zb-h1") and m < p:
        raise ValueError(f"{'1F1B' if schedule == '1f1b' else schedule} needs num_micro_batches "
                         f"({m}) >= pipeline_model_parallel_size ({p}) to fill the pipeline: "
                         f"set --micro-batches {p} or more" +
                         (", or --schedule afab" if schedule == "1f1b" else ""))
    if schedule == "interleaved" and m % p != 0:
        raise ValueError(f"interleaved 1F1B needs num_micro_batches ({m}) divisible by "
                         f"pipeline_model_parallel_size ({p}): set --micro-batches to a "
                         f"multiple of {p}")
    # DualPipe's order is built for m >= 2p (its main phase runs m - 2p + rank + 1 times; torch's
    # ScheduleDualPipeV and DeepSeek's own code refuse fewer); zbv runs any m (see zbv_actions)
    if schedule == "dualpipev" and m < 2 * p:
        raise ValueError(f"{schedule} needs num_micro_batches ({m}) >= 2 x "
                         f"pipeline_model_parallel_size ({p}) = {2 * p} stages: set "
                         f"--micro-batches {2 * p} or more (or --schedule zbv, which runs any "
                         f"number)")


def schedule_bundles(schedule: str, pp: int, micro_batches: int, rank: int,
                     virtual_stages: int = 1) -> List[List[Action]]:
    """The work of pipeline rank ``rank`` for one step, in bundles (an interleaved or a
    DualPipeV steady-state pair is one bundle: its messages go together)."""
    validate_schedule(schedule, pp, micro_batches, virtual_stages)
    if schedule == "interleaved":
        return interleaved_bundles(pp, micro_batches, rank, virtual_stages)
    if schedule == "dualpipev":
        return dualpipev_bundles(pp, micro_batches, rank)
    return [[a] for a in ORDERS[schedule](pp, micro_batches, rank)]


def schedule_actions(schedule: str, pp: int, micro_batches: int, rank: int,
                     virtual_stages: int = 1) -> List[Action]:
    """The ordered work of pipeline rank ``rank`` for one optimizer step."""
    bundles = schedule_bundles(schedule, pp, micro_batches, rank, virtual_stages)
    return [action for bundle in bundles for action in bundle]


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


def action_p2p(action: Action, rank: int, pp: int, virtual_stages: int,
               v_shape: bool = False) -> Tuple[Optional[P2P], Optional[P2P]]:
    """(the recv the action needs before it runs, the send it makes after), or None: F
    receives the previous stage's output and sends its own, B the gradients the other way; W,
    or a neighbour stage on this rank (the turn of a V), has no message."""
    p, mb, last = pp, action.micro_batch, pp * virtual_stages - 1  # last: the loss's stage
    s = stage_index(rank, action.chunk, p, v_shape)

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


def show_plan(schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1) -> str:
    """Every rank's actions, each between the message it waits for and the one it sends:
    "rank 1: recv_forward(mb 0 <- rank 0) F0 send_forward(mb 0 -> rank 2)"."""
    names = {"act": ("recv_forward", "send_forward"), "grad": ("recv_backward", "send_backward")}
    lines = []
    for rank in range(pp):
        for action in schedule_actions(schedule, pp, micro_batches, rank, virtual_stages):
            recv, send = action_p2p(action, rank, pp, virtual_stages, schedule in V_SHAPED)
            words = [f"rank {rank}:"]
            if recv is not None:
                words.append(
                    f"{names[recv.kind][0]}({message(recv.micro_batch, recv.peer, False)})")
            words.append(str(action))
            if send is not None:
                words.append(f"{names[send.kind][1]}({message(send.micro_batch, send.peer, True)})")
            lines.append(" ".join(words))
    return "\n".join(lines)
