"""Exercises of chapter 08 (doc/08_mixed_precision.md): write fp16's dynamic loss scale.

Each is scaletorch/parallel/loss_scale.py's function with its body removed. Write one, then

    python scripts/grade.py 08

trains chapter 08's run in fp16 on 2 gloo ranks with your functions in place of the library's,
and says "passed" or what is wrong; it names the function to write next. The collectives are
scaletorch.dist.comm's: ``comm.all_reduce(tensor, group, op=dist.ReduceOp.MAX)``.
"""

from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from scaletorch.dist import comm  # noqa: F401 - the collectives to call


@torch.no_grad()
def unscale_and_check(grads: Sequence[torch.Tensor], scale: float,
                      group: Optional[dist.ProcessGroup], agree: bool = True) -> bool:
    """Divide this rank's gradients (fp32, any shapes) by ``scale`` in place; return True if
    any rank's hold an inf or a NaN. The ranks agree by one all-reduce (MAX) of a single flag
    over ``group`` (the world: every rank holding gradients), so all skip or all step;
    ``agree`` False: one process alone, no collective."""
    raise NotImplementedError


def update_scale(scale: float, clean_steps: int, found_inf: bool,
                 growth_interval: int) -> Tuple[float, int]:
    """After a step (skipped if ``found_inf``): halve the scale after an overflow and count the
    clean steps from 0 again; double it after ``growth_interval`` clean steps in a row, and
    count from 0 again. Returns (the new scale, the clean steps since the last change)."""
    raise NotImplementedError
