"""Chapter 08's fp16 loss scale, one function each: ``DynamicLossScaler`` (mixed_precision.py)
calls them; examples/exercises/08_mixed_precision.py holds them for the learner to write."""

from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from scaletorch.dist import comm


# [core: loss-scale]
@torch.no_grad()
def unscale_and_check(grads: Sequence[torch.Tensor], scale: float,
                      group: Optional[dist.ProcessGroup], agree: bool = True) -> bool:
    """Divide this rank's gradients (fp32, any shapes) by ``scale`` in place; return True if
    any rank's hold an inf or a NaN. The ranks agree by one all-reduce (MAX) of a single flag
    over ``group`` (the world: every rank holding gradients), so all skip or all step;
    ``agree`` False: one process alone, no collective."""
    found = torch.zeros((), dtype=torch.float32, device=grads[0].device)  # NCCL: on the GPU
    for g in grads:
        g.mul_(1.0 / scale)
        found = torch.maximum(found, (~torch.isfinite(g)).any().float())
    if agree:
        comm.all_reduce(found, group, op=dist.ReduceOp.MAX)
    return bool(found.item())


def update_scale(scale: float, clean_steps: int, found_inf: bool,
                 growth_interval: int) -> Tuple[float, int]:
    """After a step (skipped if ``found_inf``): halve the scale after an overflow and count the
    clean steps from 0 again; double it after ``growth_interval`` clean steps in a row, and
    count from 0 again. Returns (the new scale, the clean steps since the last change)."""
    if found_inf:
        return scale / 2.0, 0
    clean_steps += 1
    if clean_steps == growth_interval:
        return scale * 2.0, 0
    return scale, clean_steps
    # [end: loss-scale]
