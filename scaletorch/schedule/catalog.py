"""Every pipeline schedule by name (04's classic ones, 04b's zero-bubble ones): its checks,
each rank's bundles and actions, its plan, and ``--show-schedule``'s listing."""

from typing import List

from scaletorch.schedule.orders import Action, message
from scaletorch.schedule.placement import SCHEDULES, V_SHAPED, ZERO_BUBBLE
from scaletorch.schedule.plans import Step, action_p2p, classic_bundles, comm_plan
from scaletorch.schedule.zero_bubble_orders import validate_zero_bubble, zero_bubble_bundles


def validate_schedule(schedule: str, pp: int, micro_batches: int, virtual_stages: int = 1) -> None:
    """Raise ValueError, naming the numbers, for a schedule that cannot run with them (the
    config has checked that each is positive)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {', '.join(SCHEDULES)}, "
                         f"got {schedule!r}")
    if virtual_stages > 1 and pp == 1:
        raise ValueError(f"virtual_pipeline_stages ({virtual_stages}) needs a pipeline: "
                         f"pipeline_model_parallel_size is 1 (set --pp)")
    if schedule in ZERO_BUBBLE:
        validate_zero_bubble(schedule, pp, micro_batches, virtual_stages)
    elif virtual_stages > 1 and schedule != "interleaved":
        raise ValueError(f"virtual_pipeline_stages ({virtual_stages}) > 1 needs the "
                         f"interleaved schedule, got {schedule!r} (set --schedule interleaved)")
    elif schedule == "1f1b" and micro_batches < pp:
        raise ValueError(f"1F1B needs num_micro_batches ({micro_batches}) >= "
                         f"pipeline_model_parallel_size ({pp}) to fill the pipeline: set "
                         f"--micro-batches {pp} or more, or --schedule afab")
    elif schedule == "interleaved" and micro_batches % pp != 0:
        raise ValueError(f"interleaved 1F1B needs num_micro_batches ({micro_batches}) "
                         f"divisible by pipeline_model_parallel_size ({pp}): set "
                         f"--micro-batches to a multiple of {pp}")


def schedule_bundles(schedule: str, pp: int, micro_batches: int, rank: int,
                     virtual_stages: int = 1) -> List[List[Action]]:
    """The work of pipeline rank ``rank`` for one step, in bundles whose p2p is batched."""
    validate_schedule(schedule, pp, micro_batches, virtual_stages)
    if schedule in ZERO_BUBBLE:
        return zero_bubble_bundles(schedule, pp, micro_batches, rank)
    return classic_bundles(schedule, pp, micro_batches, rank, virtual_stages)


def schedule_actions(schedule: str, pp: int, micro_batches: int, rank: int,
                     virtual_stages: int = 1) -> List[Action]:
    """The ordered work of pipeline rank ``rank`` for one optimizer step."""
    bundles = schedule_bundles(schedule, pp, micro_batches, rank, virtual_stages)
    return [action for bundle in bundles for action in bundle]


def schedule_plan(schedule: str, pp: int, micro_batches: int, rank: int,
                  virtual_stages: int = 1) -> List[Step]:
    """``comm_plan`` of ``schedule_bundles``: rank ``rank``'s steps in the classic executor."""
    bundles = schedule_bundles(schedule, pp, micro_batches, rank, virtual_stages)
    return comm_plan(bundles, rank, pp, virtual_stages, schedule in V_SHAPED)


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
