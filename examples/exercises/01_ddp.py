"""Exercises of chapter 01 (doc/01_ddp.md): write the three functions that make data parallel.

Each is scaletorch/parallel/gradient_sync.py's function with its body removed. Write one, then

    python scripts/grade.py 01

runs chapter 01 on 2 gloo ranks with your functions in place of the library's, compares it with
one device and says "passed" or what is wrong; it names the function to write next. The
collectives are scaletorch.dist.comm's: ``comm.all_reduce(tensor, group)`` sums in place,
``comm.all_reduce(tensor, group, async_op=True)`` returns a work to ``wait()`` for.
"""

from typing import Callable, Optional, Sequence

import torch.distributed as dist

from scaletorch.dist import comm
from scaletorch.parallel.gradient_sync import Gradient  # a gradient's shape (jaxtyping)


def average_gradients(grads: Sequence[Gradient], group: Optional[dist.ProcessGroup]) -> None:
    """Naive data parallel: each gradient (its parameter's shape, fp32 or the dtype it is
    reduced in, the same order on every rank) becomes in place its mean over ``group`` (the
    data-parallel group "dp", N ranks): one blocking all-reduce (SUM) over ``group`` per
    gradient, then / N."""
    raise NotImplementedError


def launch_full_buckets(ready: Sequence[int], sizes: Sequence[int], next_bucket: int,
                        launch: Callable[[int], None]) -> int:
    """Bucketed data parallel, from each gradient hook: ``launch(k)`` (bucket k's async
    all-reduce over "dp") for every full bucket (ready[k] gradients of sizes[k] arrived) from
    ``next_bucket`` on, strictly in index order, stopping at the first that is not full (every
    rank must issue the same sequence). Returns the first bucket not launched yet."""
    raise NotImplementedError


def wait_for_buckets(works: Sequence[Optional[comm.Work]]) -> None:
    """Before the optimizer step, wait for every bucket's all-reduce over "dp": ``works`` in
    launch order (None on a group of one rank, where nothing is in flight)."""
    raise NotImplementedError
