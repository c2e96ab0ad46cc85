"""The grader's catalogue of planted bugs: the reference solutions, each with one learner's mistake.

Each variant stands in for an exercise (examples/exercises/) and must get its own diagnosis from
scripts/grade.py, not a generic failure: ``CATALOGUE`` maps (chapter, exercise, variant) to
the words its diagnosis must contain. tests/test_grade.py runs them all, one world per chapter;
this module is importable by the spawned ranks (``Source`` = (this module, the variant's name)).
"""

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from scaletorch.dist import comm
from scaletorch.dist.comm import Group
from scaletorch.dist.functional import all_to_all
from scaletorch.parallel.expert_parallel import by_local_expert

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


# ---- chapter 02: reduce_scatter_mean ---------------------------------------------------------


def reduce_scatter_sum(full: torch.Tensor, out: torch.Tensor, group: Group) -> Optional[comm.Work]:
    sent = full if full.dtype == out.dtype else full.to(out.dtype)
    return comm.reduce_scatter_tensor(out, sent, group, async_op=True)  # the sum, never / N


def reduce_scatter_divided_twice(full: torch.Tensor, out: torch.Tensor,
                                 group: Group) -> Optional[comm.Work]:
    full.div_(comm.group_size(group))
    comm.reduce_scatter_tensor(out, full, group)
    out.div_(comm.group_size(group))  # the mean's 1/N a second time
    return None


def reduce_scatter_by_all_reduce(full: torch.Tensor, out: torch.Tensor,
                                 group: Group) -> Optional[comm.Work]:
    full.div_(comm.group_size(group))
    comm.all_reduce(full, group)  # every rank receives every shard's mean
    rank, size = comm.group_rank(group), out.numel()
    out.copy_(full[rank * size:(rank + 1) * size])
    return None


def reduce_scatter_own_only(full: torch.Tensor, out: torch.Tensor,
                            group: Group) -> Optional[comm.Work]:
    rank, size = comm.group_rank(group), out.numel()
    out.copy_(full[rank * size:(rank + 1) * size])  # this rank's gradients, never combined
    return None


# ---- chapter 02: gather_unit ------------------------------------------------------------------


def gather_without_storage(flat: torch.Tensor, shard: torch.Tensor, group: Group,
                           async_op: bool = False) -> Optional[comm.Work]:
    # a released flat has 0 bytes: the all-gather would write into freed memory
    return comm.all_gather_into_tensor(flat, shard, group, async_op=async_op)


def gather_own_shard_only(flat: torch.Tensor, shard: torch.Tensor, group: Group,
                          async_op: bool = False) -> Optional[comm.Work]:
    if flat.untyped_storage().nbytes() == 0:
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
    rank, size = comm.group_rank(group), shard.numel()
    flat[rank * size:(rank + 1) * size].copy_(shard)  # the other ranks' shards never come
    return None


def gather_reversed(flat: torch.Tensor, shard: torch.Tensor, group: Group,
                    async_op: bool = False) -> Optional[comm.Work]:
    if flat.untyped_storage().nbytes() == 0:
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
    shards = flat.new_empty(flat.numel())
    comm.all_gather_into_tensor(shards, shard, group)
    # the shards placed last rank first: rank r's at (N - 1 - r) S
    flat.copy_(shards.view(comm.group_size(group), -1).flip(0).reshape(-1))
    return None


# ---- chapter 02: release_unit -----------------------------------------------------------------


def release_never(flat: torch.Tensor) -> None:
    pass  # every unit stays gathered: the whole model on every rank


def release_by_zeroing(flat: torch.Tensor) -> None:
    flat.zero_()  # the values go, the memory stays


def release_by_resizing_the_tensor(flat: torch.Tensor) -> None:
    flat.resize_(0)  # the tensor's shape, not its storage


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


# ---- chapter 05: chunk_ids -----------------------------------------------------------------


def chunk_ids_contiguous(cp_rank: int, cp_size: int, order: str = "zigzag") -> Tuple[int, int]:
    return 2 * cp_rank, 2 * cp_rank + 1  # the last rank gets every query's full causal work


def chunk_ids_past_the_end(cp_rank: int, cp_size: int, order: str = "zigzag") -> Tuple[int, int]:
    if order == "zigzag":
        return cp_rank, 2 * cp_size - cp_rank  # the mirror off by one
    return 2 * cp_rank, 2 * cp_rank + 1


def chunk_ids_unsorted(cp_rank: int, cp_size: int, order: str = "zigzag") -> Tuple[int, int]:
    if order == "zigzag":
        return 2 * cp_size - 1 - cp_rank, cp_rank  # the late chunk first
    return 2 * cp_rank, 2 * cp_rank + 1


# ---- chapter 05: merge ---------------------------------------------------------------------


def merge_without_max_shift(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                            block_lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    a, b = torch.exp(lse), torch.exp(block_lse)  # e^lse overflows for large scores
    merged = (a.unsqueeze(-1) * out + b.unsqueeze(-1) * block_out) / (a + b).unsqueeze(-1)
    return merged, torch.log(a + b)


def merge_lse_kept(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                   block_lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    new_lse = torch.logaddexp(lse, block_lse)
    merged = torch.exp(lse - new_lse).unsqueeze(-1) * out + \
        torch.exp(block_lse - new_lse).unsqueeze(-1) * block_out
    return merged, lse  # the next block merges with the first block's statistics


def merge_plain_average(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                        block_lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return (out + block_out) / 2, torch.logaddexp(lse, block_lse)  # blocks weigh the same


# ---- chapter 06: dispatch_tokens -----------------------------------------------------------


def dispatch_not_regrouped(routed: torch.Tensor, send_table: List[List[int]],
                           recv_table: List[List[int]], group: Group) -> torch.Tensor:
    send_splits, recv_splits = [sum(r) for r in send_table], [sum(r) for r in recv_table]
    return all_to_all(routed, recv_splits, send_splits, group, "ep")  # still by source rank


def dispatch_not_differentiable(routed: torch.Tensor, send_table: List[List[int]],
                                recv_table: List[List[int]], group: Group) -> torch.Tensor:
    send_splits, recv_splits = [sum(r) for r in send_table], [sum(r) for r in recv_table]
    received = routed.new_empty((sum(recv_splits), routed.shape[1]))
    comm.all_to_all_single(received, routed.detach(), recv_splits, send_splits, group,
                           name="ep")  # torch.distributed's: autograd does not see it
    return received[by_local_expert(recv_table, routed.device)]


def dispatch_without_exchange(routed: torch.Tensor, send_table: List[List[int]],
                              recv_table: List[List[int]], group: Group) -> torch.Tensor:
    return routed  # every token stays on its rank, whoever holds its expert


class _AllToAllSplitsKept(torch.autograd.Function):
    """An all-to-all whose backward sends the gradients with the forward's splits."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, output_splits: List[int], input_splits: List[int],
                group: Group) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits), x.shape[1]))
        comm.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group, name="ep")
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits
        out = grad.new_empty((sum(output_splits), grad.shape[1]))
        comm.all_to_all_single(out, grad.contiguous(), output_splits, input_splits, ctx.group,
                               name="ep")  # the splits not swapped
        return out, None, None, None


def dispatch_backward_not_swapped(routed: torch.Tensor, send_table: List[List[int]],
                                  recv_table: List[List[int]], group: Group) -> torch.Tensor:
    send_splits, recv_splits = [sum(r) for r in send_table], [sum(r) for r in recv_table]
    received = _AllToAllSplitsKept.apply(routed, recv_splits, send_splits, group)
    return received[by_local_expert(recv_table, routed.device)]


# ---- chapter 06: combine_tokens ------------------------------------------------------------


def combine_not_put_back(out: torch.Tensor, send_table: List[List[int]],
                         recv_table: List[List[int]], group: Group) -> torch.Tensor:
    send_splits, recv_splits = [sum(r) for r in send_table], [sum(r) for r in recv_table]
    return all_to_all(out, send_splits, recv_splits, group, "ep")  # rows still by expert


def combine_not_differentiable(out: torch.Tensor, send_table: List[List[int]],
                               recv_table: List[List[int]], group: Group) -> torch.Tensor:
    send_splits, recv_splits = [sum(r) for r in send_table], [sum(r) for r in recv_table]
    by_rank = out[torch.argsort(by_local_expert(recv_table, out.device))].detach()
    combined = out.new_empty((sum(send_splits), out.shape[1]))
    comm.all_to_all_single(combined, by_rank, send_splits, recv_splits, group, name="ep")
    return combined


def combine_without_exchange(out: torch.Tensor, send_table: List[List[int]],
                             recv_table: List[List[int]], group: Group) -> torch.Tensor:
    return out[torch.argsort(by_local_expert(recv_table, out.device))]  # never sent home


class _AllToAllAveragedBack(torch.autograd.Function):
    """An all-to-all whose backward sends the gradients back, then averages them over the group
    as if they were data-parallel gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, output_splits: List[int], input_splits: List[int],
                group: Group) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return all_to_all(x, output_splits, input_splits, group, "ep").detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits
        back = all_to_all(grad, input_splits, output_splits, ctx.group, "ep")
        return back / comm.group_size(ctx.group), None, None, None  # not a mean: a route


def combine_backward_averaged(out: torch.Tensor, send_table: List[List[int]],
                              recv_table: List[List[int]], group: Group) -> torch.Tensor:
    send_splits, recv_splits = [sum(r) for r in send_table], [sum(r) for r in recv_table]
    by_rank = out[torch.argsort(by_local_expert(recv_table, out.device))]
    return _AllToAllAveragedBack.apply(by_rank, send_splits, recv_splits, group)


# (chapter, exercise, variant) -> words its diagnosis must contain
CATALOGUE: Dict[Tuple[str, str, str], str] = {
    ("01", "average_gradients", "average_sum_not_mean"):
    "gradients are 2.00x the reference on every rank: did you average over the data-parallel",
    ("01", "average_gradients", "average_divided_twice"):
    "gradients are 0.50x the reference on every rank: divided by N = 2 twice",
    ("01", "average_gradients", "average_without_all_reduce"):
    "gradients differ in all 21 parameters after the sync: each rank kept its own",
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
    "rank 1 waited for no bucket, the others for all",
    ("01", "wait_for_buckets", "wait_all_but_the_last"):
    "was never waited for (rank 0): wait for every bucket, the last one launched too",
    ("02", "reduce_scatter_mean", "reduce_scatter_sum"):
    "the shards' gradients are 2.00x the reference: the reduce-scatter sums over the N = 2 ranks",
    ("02", "reduce_scatter_mean", "reduce_scatter_divided_twice"):
    "the shards' gradients are 0.50x the reference: divided by N = 2 twice?",
    ("02", "reduce_scatter_mean", "reduce_scatter_by_all_reduce"):
    "crossed as an all-reduce of its P' elements",
    ("02", "reduce_scatter_mean", "reduce_scatter_own_only"):
    "step 0 held 0 reduce-scatters over dp_cp for 4 units",
    ("02", "gather_unit", "gather_without_storage"):
    "gather_unit all-gathered into a released flat (0 of its",
    ("02", "gather_unit", "gather_own_shard_only"):
    "holding values no rank sent: all-gather every rank's shard into flat",
    ("02", "gather_unit", "gather_reversed"):
    "on rank 0 with rank 1's shard at offset 0 S: rank r's shard belongs at r S",
    ("02", "release_unit", "release_never"):
    "the whole model",
    ("02", "release_unit", "release_by_zeroing"):
    "release_unit zeroed flat but left its",
    ("02", "release_unit", "release_by_resizing_the_tensor"):
    "release_unit changed flat's shape from",
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
    ("05", "chunk_ids", "chunk_ids_contiguous"):
    "chunk_ids(0, 2) returned (0, 1), the contiguous split: zigzag pairs",
    ("05", "chunk_ids", "chunk_ids_past_the_end"):
    "returned (0, 2): there are 2 x 1 = 2 chunks, numbered 0 to 1",
    ("05", "chunk_ids", "chunk_ids_unsorted"):
    "returned (1, 0): give the two chunks in sequence order, (0, 1)",
    ("05", "merge", "merge_without_max_shift"):
    "merging blocks with lse 100 and 90 gave nan",
    ("05", "merge", "merge_lse_kept"):
    "merge's output matches, its lse does not: return the merged",
    ("05", "merge", "merge_plain_average"):
    "merge averaged the two blocks' outputs: weight each",
    ("06", "dispatch_tokens", "dispatch_not_regrouped"):
    "rank 0's experts got the right 450 tokens in step 0, but not grouped by local expert",
    ("06", "dispatch_tokens", "dispatch_not_differentiable"):
    "the dispatched tokens carry no gradient back",
    ("06", "dispatch_tokens", "dispatch_backward_not_swapped"):
    "the backward's all-to-all raised \"Split sizes doesn't match total dim 0 size\" in step 0: "
    "the gradients of the rows received from rank i go back to rank i",
    ("06", "dispatch_tokens", "dispatch_without_exchange"):
    "rank 0's experts got 512 rows in step 0, the ranks routed 450 to them",
    ("06", "combine_tokens", "combine_not_put_back"):
    "got back outputs of other tokens in step 0: undo the regrouping by local expert",
    ("06", "combine_tokens", "combine_not_differentiable"):
    "the combined outputs carry no gradient back to the experts",
    ("06", "combine_tokens", "combine_backward_averaged"):
    "returns the library's rows, but step 0's gradient norm is 0.999",
    ("06", "combine_tokens", "combine_without_exchange"):
    "returned 450 rows on rank 0 in step 0, for its 512 routed rows: send each output back",
}
# Variants that stop the world (gloo aborts a rank on mismatched collectives): one world each,
# after the catalogue's; the diagnosis names the collective, its group and the line issuing it.
STOPPING: Dict[Tuple[str, str, str], str] = {
    ("01", "average_gradients", "average_on_rank_0_only"):
    "rank 0: all_reduce #1 of group 'dp_cp' [[64, 64]] Float, issued at "
    "scripts/grading/variants.py",
}
PLANTED = [*CATALOGUE, *STOPPING]  # (chapter, exercise, variant) of every variant
