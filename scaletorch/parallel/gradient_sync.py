"""Chapter 01's core, called by data_parallel.py (examples/exercises/01_ddp.py: the learner's)."""

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from scaletorch.dist import comm


def average_gradients(grads: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup]) -> None:
    """Naive data parallel: each gradient (any shape, fp32 or the wire's dtype, the same order
    on every rank) becomes in place the mean over ``group`` (dp_cp, N ranks) of its values: one
    blocking all-reduce (SUM) over ``group`` per gradient, then / N."""
    for grad in grads:
        comm.all_reduce(grad, group)  # SUM over the dp_cp group
        grad.div_(comm.group_size(group))


def launch_full_buckets(ready: Sequence[int], sizes: Sequence[int], next_bucket: int,
                        launch: Callable[[int], None]) -> int:
    """Bucketed data parallel, from each gradient hook: ``launch(k)`` (bucket k's async
    all-reduce over dp_cp) for every full bucket (ready[k] gradients of sizes[k] arrived) from
    ``next_bucket`` on, strictly in index order, stopping at the first that is not full (every
    rank must issue the same sequence). Returns the first bucket not launched yet."""
    while next_bucket < len(sizes) and ready[next_bucket] == sizes[next_bucket]:
        launch(next_bucket)
        next_bucket += 1
    return next_bucket


def wait_for_buckets(works: Sequence[Optional[comm.Work]]) -> None:
    """Before the optimizer step, wait for every bucket's all-reduce over dp_cp: ``works`` in
    launch order (None on a group of one rank, where nothing is in flight)."""
    for work in works:
        if work is not None:
            work.wait()
