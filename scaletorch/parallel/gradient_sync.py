"""Chapter 01's core, called by data_parallel.py (examples/exercises/01_ddp.py: the learner's).

Shapes are jaxtyping annotations (tests/test_ddp_and_expert_shapes.py checks them): a
gradient has its parameter's shape, any number of dimensions ("..."), in any float dtype.
"""

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from jaxtyping import Float

from scaletorch.dist import comm

Gradient = Float[torch.Tensor, "..."]  # one parameter's gradient, its shape


# [core: gradient-sync]
def average_gradients(grads: Sequence[Gradient], group: Optional[dist.ProcessGroup]) -> None:
    """Naive data parallel: each gradient (its parameter's shape, fp32 or the dtype it is
    reduced in, the same order on every rank) becomes in place its mean over ``group`` (the
    data-parallel group "dp", N ranks): one blocking all-reduce (SUM) over ``group`` per
    gradient, then / N."""
    for grad in grads:
        comm.all_reduce(grad, group)  # SUM over the data-parallel group
        grad.div_(comm.group_size(group))


def launch_full_buckets(ready: Sequence[int], sizes: Sequence[int], next_bucket: int,
                        launch: Callable[[int], None]) -> int:
    """Bucketed data parallel, from each gradient hook: ``launch(k)`` (bucket k's async
    all-reduce over "dp") for every full bucket (ready[k] gradients of sizes[k] arrived) from
    ``next_bucket`` on, strictly in index order, stopping at the first that is not full (every
    rank must issue the same sequence). Returns the first bucket not launched yet."""
    while next_bucket < len(sizes) and ready[next_bucket] == sizes[next_bucket]:
        launch(next_bucket)
        next_bucket += 1
    return next_bucket


def wait_for_buckets(works: Sequence[Optional[comm.Work]]) -> None:
    """Before the optimizer step, wait for every bucket's all-reduce over "dp": ``works`` in
    launch order (None on a group of one rank, where nothing is in flight)."""
    for work in works:
        if work is not None:
            work.wait()


# [end: gradient-sync]
