"""Every pipeline schedule by name (chapter 04's classic ones and 04b's zero-bubble ones):
validation, per-rank units and actions, the point-to-point plan. What the planner, the
simulators and the zero-bubble runtime look schedules up in."""

from typing import List

from scaletorch.schedule.orders import Action, Step, classic_units, comm_plan, validate_classic
from scaletorch.schedule.placement import SCHEDULES, V_SHAPED, ZERO_BUBBLE
from scaletorch.schedule.zero_bubble_orders import validate_zero_bubble, zero_bubble_units


def validate_schedule(schedule: str, stages: int, micro_batches: int,
                      virtual_stages: int = 1) -> None:
    """Raise ValueError for a schedule that cannot run with these numbers."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {', '.join(SCHEDULES)}, "
                         f"got {schedule!r}")
    if schedule in ZERO_BUBBLE:
        validate_zero_bubble(schedule, stages, micro_batches, virtual_stages)
    else:
        validate_classic(schedule, stages, micro_batches, virtual_stages)


def schedule_units(schedule: str, stages: int, micro_batches: int, rank: int,
                   virtual_stages: int = 1) -> List[List[Action]]:
    """The work of pipeline rank ``rank`` for one step, in units whose p2p is batched."""
    validate_schedule(schedule, stages, micro_batches, virtual_stages)
    if schedule in ZERO_BUBBLE:
        return zero_bubble_units(schedule, stages, micro_batches, rank)
    return classic_units(schedule, stages, micro_batches, rank, virtual_stages)


def schedule_actions(schedule: str, stages: int, micro_batches: int, rank: int,
                     virtual_stages: int = 1) -> List[Action]:
    """The ordered work of pipeline rank ``rank`` for one optimizer step."""
    units = schedule_units(schedule, stages, micro_batches, rank, virtual_stages)
    return [action for unit in units for action in unit]


def schedule_plan(schedule: str, stages: int, micro_batches: int, rank: int,
                  virtual_stages: int = 1) -> List[Step]:
    """``comm_plan`` of ``schedule_units``: what a rendezvous executor of rank ``rank`` runs."""
    units = schedule_units(schedule, stages, micro_batches, rank, virtual_stages)
    return comm_plan(units, rank, stages, virtual_stages, schedule in V_SHAPED)
