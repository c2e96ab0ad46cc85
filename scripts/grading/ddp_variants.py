"""Chapter 01's planted mistakes (scripts/grading/ddp.py grades them): the library's
average_gradients, launch_full_buckets and wait_for_buckets, each with one learner's mistake.
scripts/grading/variants.py names them all (``PLANTED``) and gives each one's ``Source``."""

from typing import Callable, Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from scaletorch.dist import comm

# ---- chapter 01: average_gradients ---------------------------------------------------------


def average_sum_not_mean(grads: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup]) -> None:
    for grad in grads:
        comm.all_reduce(grad, group)  # the sum: never divided by N


def average_divided_twice(grads: Sequence[torch.Tensor],
                          group: Optional[dist.ProcessGroup]) -> None:
    for grad in grads:
        grad.div_(comm.group_size(group))  # divided before the sum...
        comm.all_reduce(grad, group)
        grad.div_(comm.group_size(group))  # ...and after it


def average_without_all_reduce(grads: Sequence[torch.Tensor],
                               group: Optional[dist.ProcessGroup]) -> None:
    for grad in grads:
        grad.div_(1)  # each rank keeps its own gradient


def average_first_only(grads: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup]) -> None:
    for grad in grads:
        comm.all_reduce(grad, group)
        grad.div_(comm.group_size(group))
        return  # a return inside the loop: only the first gradient is averaged


def average_on_rank_0_only(grads: Sequence[torch.Tensor],
                           group: Optional[dist.ProcessGroup]) -> None:
    if comm.group_rank(group) != 0:
        return  # rank 1 skips the all-reduces that rank 0 waits in
    for grad in grads:
        comm.all_reduce(grad, group)
        grad.div_(comm.group_size(group))


# ---- chapter 01: launch_full_buckets -------------------------------------------------------


def launch_before_full(ready: Sequence[int], sizes: Sequence[int], next_bucket: int,
                       launch: Callable[[int], None]) -> int:
    while next_bucket < len(sizes) and ready[next_bucket] > 0:  # one gradient is not all
        launch(next_bucket)
        next_bucket += 1
    return next_bucket


def launch_without_advancing(ready: Sequence[int], sizes: Sequence[int], next_bucket: int,
                             launch: Callable[[int], None]) -> int:
    k = next_bucket
    while k < len(sizes) and ready[k] == sizes[k]:
        launch(k)
        k += 1
    return next_bucket  # the caller starts again from the buckets already launched


def launch_never(ready: Sequence[int], sizes: Sequence[int], next_bucket: int,
                 launch: Callable[[int], None]) -> int:
    return next_bucket  # every bucket waits for the end of backward


# ---- chapter 01: wait_for_buckets ----------------------------------------------------------


def wait_never(works: Sequence[Optional[comm.Work]]) -> None:
    pass  # the step reads the buckets while their all-reduces are in flight


def wait_on_rank_0_only(works: Sequence[Optional[comm.Work]]) -> None:
    if comm.group_rank() == 0:
        for work in works:
            if work is not None:
                work.wait()


def wait_all_but_the_last(works: Sequence[Optional[comm.Work]]) -> None:
    for work in works[:-1]:  # off by one: the last bucket launched is the likeliest in flight
        if work is not None:
            work.wait()


# (chapter, exercise, variant) -> words its diagnosis must contain
CATALOGUE: Dict[Tuple[str, str, str], str] = {
    ("01", "average_gradients", "average_sum_not_mean"):
    "gradients are 2.00x the reference on every rank: the sum over the 2 data-parallel ranks, "
    "not divided by N = 2",
    ("01", "average_gradients", "average_divided_twice"):
    "gradients are 0.50x the reference on every rank: divided by N = 2 twice",
    ("01", "average_gradients", "average_without_all_reduce"):
    "gradients (one data-parallel group) differ in all 21 parameters after the sync, and their "
    "mean is the reference: each rank kept its own",
    ("01", "average_gradients", "average_first_only"):
    "20 of 21 gradients differ between the ranks",
    ("01", "launch_full_buckets", "launch_before_full"):
    "all-reduce started with 1 of its",
    ("01", "launch_full_buckets", "launch_without_advancing"):
    "times in step 0: return the index of the next bucket",
    ("01", "launch_full_buckets", "launch_never"):
    "started its all-reduce during backward",
    ("01", "wait_for_buckets", "wait_never"):
    "no rank waited for any bucket's all-reduce",
    ("01", "wait_for_buckets", "wait_on_rank_0_only"):
    "ranks 1, 2, 3 waited for no bucket, rank 0 for all",
    ("01", "wait_for_buckets", "wait_all_but_the_last"):
    "was never waited for (rank 0): wait for every bucket, the last one launched too",
}
# Variants that stop the world (gloo aborts a rank on mismatched collectives): one world each,
# after the catalogue's; the diagnosis names the collective, its group and the line issuing it
# (a pattern: the collective's number counts what the world ran before the variant).
STOPPING: Dict[Tuple[str, str, str], str] = {
    ("01", "average_gradients", "average_on_rank_0_only"):
    r"rank 0: all_reduce #\d+ of group 'dp' \[\[\d+, 64\]\] Float, issued at "
    r"scripts/grading/ddp_variants\.py",
}
