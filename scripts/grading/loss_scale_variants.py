"""Chapter 08's planted mistakes (scripts/grading/loss_scale.py grades them): the library's
unscale_and_check and update_scale, each with one learner's mistake. scripts/grading/variants.py
names them all (``PLANTED``) and gives each one's ``Source``."""

from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from scaletorch.dist import comm

# ---- chapter 08: unscale_and_check ---------------------------------------------------------


@torch.no_grad()
def unscale_never_divides(grads: Sequence[torch.Tensor], scale: float,
                          group: Optional[dist.ProcessGroup], agree: bool = True) -> bool:
    found = torch.zeros(())
    for g in grads:  # checked, but never divided by the scale
        found = torch.maximum(found, (~torch.isfinite(g)).any().float())
    if agree:
        comm.all_reduce(found, group, op=dist.ReduceOp.MAX)
    return bool(found.item())


@torch.no_grad()
def unscale_without_agreement(grads: Sequence[torch.Tensor], scale: float,
                              group: Optional[dist.ProcessGroup], agree: bool = True) -> bool:
    found = torch.zeros(())
    for g in grads:
        g.mul_(1.0 / scale)
        found = torch.maximum(found, (~torch.isfinite(g)).any().float())
    return bool(found.item())  # this rank's flag only


@torch.no_grad()
def unscale_misses_nan(grads: Sequence[torch.Tensor], scale: float,
                       group: Optional[dist.ProcessGroup], agree: bool = True) -> bool:
    found = torch.zeros(())
    for g in grads:
        g.mul_(1.0 / scale)
        found = torch.maximum(found, torch.isinf(g).any().float())  # NaN is not inf
    if agree:
        comm.all_reduce(found, group, op=dist.ReduceOp.MAX)
    return bool(found.item())


# ---- chapter 08: update_scale --------------------------------------------------------------


def update_never_halves(scale: float, clean_steps: int, found_inf: bool,
                        growth_interval: int) -> Tuple[float, int]:
    if found_inf:
        return scale, 0  # skipped, but the next step overflows again
    clean_steps += 1
    if clean_steps == growth_interval:
        return scale * 2.0, 0
    return scale, clean_steps


def update_never_grows(scale: float, clean_steps: int, found_inf: bool,
                       growth_interval: int) -> Tuple[float, int]:
    if found_inf:
        return scale / 2.0, 0
    return scale, clean_steps + 1  # a scale that only shrinks flushes small gradients to 0


def update_halves_without_reset(scale: float, clean_steps: int, found_inf: bool,
                                growth_interval: int) -> Tuple[float, int]:
    if found_inf:
        return scale / 2.0, clean_steps  # the count goes on across the overflow
    clean_steps += 1
    if clean_steps == growth_interval:
        return scale * 2.0, 0
    return scale, clean_steps


# (chapter, exercise, variant) -> words its diagnosis must contain
CATALOGUE: Dict[Tuple[str, str, str], str] = {
    ("08", "unscale_and_check", "unscale_never_divides"):
    "gradients are 1024x the reference after unscale_and_check",
    ("08", "unscale_and_check", "unscale_without_agreement"):
    "in step 3 rank 1 found an overflow and rank 0 did not, so rank 0 stepped alone",
    ("08", "unscale_and_check", "unscale_misses_nan"):
    "step 5's gradients held a NaN on rank 0, and unscale_and_check returned False",
    ("08", "update_scale", "update_never_halves"):
    "the scale stayed 2048 after the overflow in step 3: halve it",
    ("08", "update_scale", "update_never_grows"):
    "the scale did not double after 2 clean steps (step 1)",
    ("08", "update_scale", "update_halves_without_reset"):
    "after the overflow in step 3 the clean-step count is 1, not 0: count the clean steps from 0",
}
