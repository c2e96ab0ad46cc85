"""The straggler line: which rank is slow, read from every rank's busy time per step.

In synchronous training every rank's step takes as long as the slowest rank's: the others wait
for it in the collectives. So step times cannot name the slow rank, but busy time can: a
step's time minus the time the rank spent blocked in collectives (``comm.waited()``). The
Trainer calls ``straggler_report`` at each log line; one all-gather of one float over the world.
"""

import statistics
from typing import Optional

import torch

from scaletorch.dist import comm
from scaletorch.dist.ledger import get_ledger

STRAGGLER = 0.10  # a rank whose busy time is this much over the median is reported


def straggler_report(busy: float, device: torch.device,
                     threshold: float = STRAGGLER) -> Optional[str]:
    """Every rank of the world calls this with its busy seconds a step (an all-gather over the
    world, on ``device``). Rank 0 gets a line naming the slowest rank when its busy time is more
    than ``threshold`` over the median of the other ranks, with every rank's; None otherwise."""
    world_size = comm.group_size()
    if world_size < 2:
        return None
    everyone = torch.zeros(world_size, dtype=torch.float32, device=device)  # NCCL: the GPU's
    with get_ledger().paused():  # a report, not training traffic
        comm.all_gather_into_tensor(everyone, everyone.new_tensor([busy]))
    times = everyone.tolist()  # the one host sync, at log time
    slowest = max(range(world_size), key=lambda r: times[r])
    others = statistics.median(t for r, t in enumerate(times) if r != slowest)
    if comm.group_rank() != 0 or times[slowest] <= (1 + threshold) * others:
        return None
    spread = ", ".join(f"{t * 1e3:.1f}" for t in times)
    return (f"straggler: rank {slowest} is busy {times[slowest] * 1e3:.1f} ms a step, "
            f"{times[slowest] / others:.1f}x the median of the other ranks "
            f"({others * 1e3:.1f} ms); busy ms a step, rank 0 first: {spread}")
