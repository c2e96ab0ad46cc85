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
from scaletorch.dist.all_to_all import all_to_all
from scaletorch.dist.comm import Group
from scaletorch.dist.functional import (copy_to_parallel_region,
                                        gather_from_sequence_parallel_region,
                                        reduce_from_parallel_region,
                                        reduce_scatter_to_sequence_parallel_region)
from scaletorch.dist.split_regions import gather_from_parallel_region, scatter_to_parallel_region
from scaletorch.parallel.expert_parallel import by_local_expert
from scaletorch.parallel.ring_attention import KV_TAG, _exchange, _wait, merge, ring_schedule
from scripts.grading import balance_variants

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


# ---- chapter 04: one_f_one_b --------------------------------------------------------------


def one_f_one_b_sends_first(stage: Any, m: int) -> None:
    warmup = min(stage.p - stage.rank - 1, m)
    for mb in range(warmup):
        stage.send_forward(mb, stage.forward(mb, stage.recv_forward(mb)))
    x = stage.recv_forward(warmup) if warmup < m else None
    for i in range(m - warmup):
        y = stage.forward(warmup + i, x)
        stage.send_forward(warmup + i, y)  # a send alone: the next rank is sending too
        dx = stage.backward(i, stage.recv_backward(i))
        stage.send_backward(i, dx)  # ...its gradient, before receiving the activation
        x = stage.recv_forward(warmup + i + 1) if warmup + i + 1 < m else None
    for mb in range(m - warmup, m):
        stage.send_backward(mb, stage.backward(mb, stage.recv_backward(mb)))


def _one_f_one_b(stage: Any, m: int, warmup: int, cool_down_receives: bool = True) -> None:
    """The library's loop with the given warm-up (and cool-down without its receives)."""
    for mb in range(warmup):
        stage.send_forward(mb, stage.forward(mb, stage.recv_forward(mb)))
    x = stage.recv_forward(warmup) if warmup < m else None
    for i in range(m - warmup):
        y = stage.forward(warmup + i, x)
        dx = stage.backward(i, stage.send_forward_recv_backward(warmup + i, y, i))
        if warmup + i + 1 < m:
            x = stage.send_backward_recv_forward(i, dx, warmup + i + 1)
        else:
            stage.send_backward(i, dx)
    for mb in range(m - warmup, m):
        dy = stage.recv_backward(mb) if cool_down_receives else None
        stage.send_backward(mb, stage.backward(mb, dy))


def one_f_one_b_warmup_too_long(stage: Any, m: int) -> None:
    _one_f_one_b(stage, m, min(stage.p - stage.rank, m))  # p - r: one forward too many


def one_f_one_b_warmup_too_short(stage: Any, m: int) -> None:
    _one_f_one_b(stage, m, max(stage.p - stage.rank - 2, 0))  # p - r - 2: one too few


def one_f_one_b_cool_down_without_recv(stage: Any, m: int) -> None:
    _one_f_one_b(stage, m, min(stage.p - stage.rank - 1, m), cool_down_receives=False)


# ---- chapter 04: micro_batch_loss ----------------------------------------------------------


def micro_batch_loss_not_divided(loss: torch.Tensor, m: int) -> torch.Tensor:
    return loss  # m micro-batch means add up to m x the batch's mean


def micro_batch_loss_divided_twice(loss: torch.Tensor, m: int) -> torch.Tensor:
    return loss / m / m


def micro_batch_loss_by_ranks(loss: torch.Tensor, m: int) -> torch.Tensor:
    return loss / dist.get_world_size()  # the number of pipeline ranks, not of micro-batches


# ---- chapter 05: slice_ids -----------------------------------------------------------------


def slice_ids_contiguous(cp_rank: int, cp_size: int, order: str = "zigzag") -> Tuple[int, int]:
    return 2 * cp_rank, 2 * cp_rank + 1  # the last rank gets every query's full causal work


def slice_ids_past_the_end(cp_rank: int, cp_size: int, order: str = "zigzag") -> Tuple[int, int]:
    if order == "zigzag":
        return cp_rank, 2 * cp_size - cp_rank  # the mirror off by one
    return 2 * cp_rank, 2 * cp_rank + 1


def slice_ids_unsorted(cp_rank: int, cp_size: int, order: str = "zigzag") -> Tuple[int, int]:
    if order == "zigzag":
        return 2 * cp_size - 1 - cp_rank, cp_rank  # the late slice first
    return 2 * cp_rank, 2 * cp_rank + 1


# ---- chapter 05: merge ---------------------------------------------------------------------


def merge_without_max_shift(out: torch.Tensor, lse: torch.Tensor, tile_out: torch.Tensor,
                            tile_lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    a, b = torch.exp(lse), torch.exp(tile_lse)  # e^lse overflows for large scores
    merged = (a.unsqueeze(-1) * out + b.unsqueeze(-1) * tile_out) / (a + b).unsqueeze(-1)
    return merged, torch.log(a + b)


def merge_lse_kept(out: torch.Tensor, lse: torch.Tensor, tile_out: torch.Tensor,
                   tile_lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    new_lse = torch.logaddexp(lse, tile_lse)
    merged = torch.exp(lse - new_lse).unsqueeze(-1) * out + \
        torch.exp(tile_lse - new_lse).unsqueeze(-1) * tile_out
    return merged, lse  # the next tile merges with the first tile's statistics


def merge_plain_average(out: torch.Tensor, lse: torch.Tensor, tile_out: torch.Tensor,
                        tile_lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return (out + tile_out) / 2, torch.logaddexp(lse, tile_lse)  # blocks weigh the same


# ---- chapter 05: ring_forward --------------------------------------------------------------


def _ring(q: torch.Tensor, kv: torch.Tensor, group: Group, order: str, tile: Callable,
          messages: Callable[[int, int], bool], keep_last: bool = False,
          skip: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """The library's ring with a mistake: ``messages(t, cp)`` says whether step t exchanges,
    ``keep_last`` keeps the last tile instead of merging, ``skip=False`` computes every tile."""
    cp, rank = comm.group_size(group), comm.group_rank(group)
    qs, merged = q.chunk(2, dim=2), {}
    for t, tiles in enumerate(ring_schedule(rank, cp, order)):
        if messages(t, cp):
            next_kv, works = _exchange(kv, group, KV_TAG)
        ks, vs = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
        for a, b, kind in tiles:
            if kind == "skipped" and skip:
                continue
            o, lse = tile(qs[a], ks[b], vs[b], kind == "diagonal")
            o = o.float()
            merged[a] = merge(*merged[a], o, lse) if a in merged and not keep_last else (o, lse)
        if messages(t, cp):
            _wait(works)
            kv = next_kv
    out = torch.cat([merged[0][0], merged[1][0]], dim=2)
    return out, torch.cat([merged[0][1], merged[1][1]], dim=2)


def ring_never_exchanges(q: torch.Tensor, kv: torch.Tensor, group: Group, order: str,
                         tile: Callable) -> Tuple[torch.Tensor, torch.Tensor]:
    return _ring(q, kv, group, order, tile, lambda t, cp: False)  # its own K/V at every step


def ring_exchanges_every_step(q: torch.Tensor, kv: torch.Tensor, group: Group, order: str,
                              tile: Callable) -> Tuple[torch.Tensor, torch.Tensor]:
    return _ring(q, kv, group, order, tile, lambda t, cp: True)  # the last K/V goes unused


def ring_keeps_last_tile(q: torch.Tensor, kv: torch.Tensor, group: Group, order: str,
                         tile: Callable) -> Tuple[torch.Tensor, torch.Tensor]:
    return _ring(q, kv, group, order, tile, lambda t, cp: t + 1 < cp, keep_last=True)


def ring_attends_skipped_tiles(q: torch.Tensor, kv: torch.Tensor, group: Group, order: str,
                               tile: Callable) -> Tuple[torch.Tensor, torch.Tensor]:
    return _ring(q, kv, group, order, tile, lambda t, cp: t + 1 < cp, skip=False)


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


# ---- chapter 03: enter_region (f; g under sequence parallel) -------------------------------


def _g(x: torch.Tensor, group: Group) -> torch.Tensor:
    return gather_from_sequence_parallel_region(x, group, dim=1)  # the library's g


def enter_f_backward_copies(x: torch.Tensor, group: Group, sequence_parallel: bool) -> torch.Tensor:
    return _g(x, group) if sequence_parallel else x  # identity both ways: dx stays partial


def enter_f_all_reduces_forward(x: torch.Tensor, group: Group,
                                sequence_parallel: bool) -> torch.Tensor:
    if sequence_parallel:
        return _g(x, group)
    return copy_to_parallel_region(reduce_from_parallel_region(x, group), group)  # both ways


def enter_g_gathers_hidden(x: torch.Tensor, group: Group, sequence_parallel: bool) -> torch.Tensor:
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, group, dim=-1)  # h, not the sequence
    return copy_to_parallel_region(x, group)


def enter_g_backward_splits(x: torch.Tensor, group: Group, sequence_parallel: bool) -> torch.Tensor:
    if sequence_parallel:
        return gather_from_parallel_region(x, group, dim=1)  # backward: a split, no sum
    return copy_to_parallel_region(x, group)


# ---- chapter 03: exit_region (f-bar; g-bar under sequence parallel) ------------------------


def _g_bar(x: torch.Tensor, group: Group) -> torch.Tensor:
    return reduce_scatter_to_sequence_parallel_region(x, group, dim=1)  # the library's g-bar


def exit_f_bar_missing(x: torch.Tensor, group: Group, sequence_parallel: bool) -> torch.Tensor:
    return _g_bar(x, group) if sequence_parallel else x  # the partial sums never summed


def exit_f_bar_averages(x: torch.Tensor, group: Group, sequence_parallel: bool) -> torch.Tensor:
    if sequence_parallel:
        return _g_bar(x, group)
    return reduce_from_parallel_region(x, group) / comm.group_size(group)  # a mean, not a sum


def exit_f_bar_backward_all_reduces(x: torch.Tensor, group: Group,
                                    sequence_parallel: bool) -> torch.Tensor:
    if sequence_parallel:
        return _g_bar(x, group)
    return copy_to_parallel_region(reduce_from_parallel_region(x, group), group)  # both ways


def exit_g_bar_splits_unsummed(x: torch.Tensor, group: Group,
                               sequence_parallel: bool) -> torch.Tensor:
    if sequence_parallel:
        return scatter_to_parallel_region(x, group, dim=1)  # this rank's chunk, not the sum
    return reduce_from_parallel_region(x, group)


# ---- chapter 03: vocab_parallel_cross_entropy ----------------------------------------------


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: Group, shift: str = "tp",
                   owner_offset: int = 0, mean_gradient: bool = True) -> torch.Tensor:
    """The vocabulary-parallel loss through autograd (f-bar sums the statistics; its identity
    backward leaves each rank its own logits' gradient), with one planted mistake: ``shift``
    "tp" (the max over tp), "rank" (this rank's max) or "none"; the target's owner taken
    ``owner_offset`` shards off; the gradient of a sum instead of a mean."""
    z = logits.reshape(-1, logits.size(-1)).float()  # (n, V/tp)
    n, width = z.shape
    rank, size = comm.group_rank(group), comm.group_size(group)
    top = torch.zeros(n) if shift == "none" else z.max(dim=-1).values.detach()
    if shift == "tp":
        comm.all_reduce(top, group, op=dist.ReduceOp.MAX)
    local = targets.reshape(-1) - (rank + owner_offset) % size * width
    mine = (local >= 0) & (local < width)
    shifted = z - top.unsqueeze(-1)
    picked = shifted.gather(-1, local.clamp(0, width - 1).unsqueeze(-1))[:, 0]
    target = torch.where(mine, picked, 0.0)
    sums = reduce_from_parallel_region(torch.stack((shifted.exp().sum(dim=-1), target)), group)
    losses = sums[0].log() - sums[1]
    if mean_gradient:
        return losses.mean()
    return losses.sum().detach() / n + (losses.sum() - losses.sum().detach())  # the sum's grad


def ce_without_max_shift(logits: torch.Tensor, targets: torch.Tensor, group: Group) -> torch.Tensor:
    return _cross_entropy(logits, targets, group, shift="none")  # exp(100) = inf in fp32


def ce_local_max(logits: torch.Tensor, targets: torch.Tensor, group: Group) -> torch.Tensor:
    return _cross_entropy(logits, targets, group, shift="rank")  # no all-reduce MAX


def ce_target_off_by_one_shard(logits: torch.Tensor, targets: torch.Tensor,
                               group: Group) -> torch.Tensor:
    return _cross_entropy(logits, targets, group, owner_offset=1)  # rank r reads shard r + 1


def ce_gradient_of_the_sum(logits: torch.Tensor, targets: torch.Tensor,
                           group: Group) -> torch.Tensor:
    return _cross_entropy(logits, targets, group, mean_gradient=False)  # not divided by n


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
    ("02", "reduce_scatter_mean", "reduce_scatter_sum"):
    "the shards' gradients are 2.00x the reference on every rank: the sum over the N = 2 ranks, "
    "not divided by N",
    ("02", "reduce_scatter_mean", "reduce_scatter_divided_twice"):
    "the shards' gradients are 0.50x the reference on every rank: divided by N = 2 twice",
    ("02", "reduce_scatter_mean", "reduce_scatter_by_all_reduce"):
    "crossed as an all-reduce of its P' elements",
    ("02", "reduce_scatter_mean", "reduce_scatter_own_only"):
    "step 0 held 0 reduce-scatters over dp for 4 units",
    ("02", "gather_unit", "gather_without_storage"):
    "gather_unit all-gathered into a released flat (0 of its",
    ("02", "gather_unit", "gather_own_shard_only"):
    "holding values no rank sent: all-gather every rank's shard into flat",
    ("02", "gather_unit", "gather_reversed"):
    "on rank 0 with group rank 1's shard (rank 2's) at offset 0 S: group rank r's shard belongs",
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
    ("04", "one_f_one_b", "one_f_one_b_warmup_too_long"):
    "rank 0's warm-up ran 3 forwards before the steady state (F0 F1 F2 F3 B0 B1 ...): 1F1B warms "
    "up with p - r - 1 = 2; one more holds 4 activations at once, not p - r = 3",
    ("04", "one_f_one_b", "one_f_one_b_warmup_too_short"):
    "rank 0's warm-up ran 1 forwards before the steady state (F0 F1 B0 F2 ...): 1F1B warms up with "
    "p - r - 1 = 2; one fewer and the ranks take turns",
    ("04", "one_f_one_b", "one_f_one_b_cool_down_without_recv"):
    "rank 0 ran the backward of micro-batch 2 in step 0 without its gradient: in the cool-down, "
    "recv_backward(2) from rank 1 first",
    ("04", "micro_batch_loss", "micro_batch_loss_not_divided"):
    "gradients are 4x the reference in step 0 (its grad norm): each micro-batch's loss is a mean",
    ("04", "micro_batch_loss", "micro_batch_loss_divided_twice"):
    "gradients are 0.25x the reference in step 0 (its grad norm) = 1/m: divided by m = 4 twice",
    ("04", "micro_batch_loss", "micro_batch_loss_by_ranks"):
    "gradients are 1.33x the reference in step 0 (its grad norm): divided by p = 3, the pipeline",
    ("05", "slice_ids", "slice_ids_contiguous"):
    "slice_ids(0, 2, 'zigzag') returned (0, 1), the contiguous split: zigzag pairs",
    ("05", "slice_ids", "slice_ids_past_the_end"):
    "returned (0, 2): there are 2 x 1 = 2 slices, numbered 0 to 1",
    ("05", "slice_ids", "slice_ids_unsorted"):
    "returned (1, 0): give the two slices in sequence order, (0, 1)",
    ("05", "merge", "merge_without_max_shift"):
    "merging tiles with lse 100 and 90 gave nan",
    ("05", "merge", "merge_lse_kept"):
    "merge's output matches, its lse does not: return the merged",
    ("05", "merge", "merge_plain_average"):
    "merge averaged the two tiles' outputs: weight each",
    ("05", "ring_forward", "ring_never_exchanges"):
    "ring_forward sent no K/V message on rank 0 in step 0",
    ("05", "ring_forward", "ring_exchanges_every_step"):
    "ring_forward sent 3 blocks of K/V on rank 0 in step 0",
    ("05", "ring_forward", "ring_keeps_last_tile"):
    "below the library's",
    ("05", "ring_forward", "ring_attends_skipped_tiles"):
    "above the library's",
    ("06", "dispatch_tokens", "dispatch_not_regrouped"):
    "rank 0's experts got the right 235 tokens in step 0, but not grouped by local expert",
    ("06", "dispatch_tokens", "dispatch_not_differentiable"):
    "the dispatched tokens carry no gradient back",
    ("06", "dispatch_tokens", "dispatch_backward_not_swapped"):
    "the backward's all-to-all raised \"Split sizes doesn't match total dim 0 size\" in step 0: "
    "the gradients of the rows received from rank i go back to rank i",
    ("06", "dispatch_tokens", "dispatch_without_exchange"):
    "rank 0's experts got 256 rows in step 0, the ranks routed 235 to them",
    ("06", "combine_tokens", "combine_not_put_back"):
    "got back outputs of other tokens in step 0: undo the regrouping by local expert",
    ("06", "combine_tokens", "combine_not_differentiable"):
    "the combined outputs carry no gradient back to the experts",
    ("06", "combine_tokens", "combine_backward_averaged"):
    "returns the library's rows, but step 0's gradient norm is 0.999",
    ("06", "combine_tokens", "combine_without_exchange"):
    "returned 235 rows on rank 0 in step 0, for its 256 routed rows: send each output back",
    ("03", "enter_region", "enter_f_backward_copies"):
    "loss matches, gradients do not: f's backward must all-reduce, not copy",
    ("03", "enter_region", "enter_f_all_reduces_forward"):
    "f's forward returned 2.00x its input: f is the identity in forward",
    ("03", "enter_region", "enter_g_gathers_hidden"):
    "g returned (16, 16, 128) for an input (16, 16, 64), the library (16, 32, 64)",
    ("03", "enter_region", "enter_g_backward_splits"):
    "g's backward kept this rank's chunk of the gradient without summing it",
    ("03", "exit_region", "exit_f_bar_missing"):
    "f-bar returned this rank's own partial output: sum the row-parallel shards' outputs over tp "
    "(all-reduce)",
    ("03", "exit_region", "exit_f_bar_averages"):
    "f-bar's forward is 0.50x the library's: sum the partial outputs over tp, do not average",
    ("03", "exit_region", "exit_f_bar_backward_all_reduces"):
    "f-bar's forward matches, its backward returned 2.00x the gradient",
    ("03", "exit_region", "exit_g_bar_splits_unsummed"):
    "g-bar returned this rank's own partial output: sum the row-parallel shards' outputs over tp "
    "(reduce-scatter)",
    ("03", "vocab_parallel_cross_entropy", "ce_without_max_shift"):
    "the loss of logits near 100 is inf",
    ("03", "vocab_parallel_cross_entropy", "ce_local_max"):
    "the loss is right when every rank's largest logit is the same",
    ("03", "vocab_parallel_cross_entropy", "ce_target_off_by_one_shard"):
    "the loss is wrong when the targets are in rank 0's (ids 0-31) and rank 1's (ids 32-63) shard",
    ("03", "vocab_parallel_cross_entropy", "ce_gradient_of_the_sum"):
    "its gradient is 8.00x the library's: the loss is the mean over the 8 tokens",
}
# Variants that stop the world (gloo aborts a rank on mismatched collectives): one world each,
# after the catalogue's; the diagnosis names the collective, its group and the line issuing it
# (a pattern: the collective's number counts what the world ran before the variant).
STOPPING: Dict[Tuple[str, str, str], str] = {
    ("01", "average_gradients", "average_on_rank_0_only"):
    r"rank 0: all_reduce #\d+ of group 'dp' \[\[\d+, 64\]\] Float, issued at "
    r"scripts/grading/variants\.py",
}
# Variants that deadlock: one world each; the phrases their diagnosis must contain (the ranks,
# the operations they wait in, their peers, why).
HANGS: Dict[Tuple[str, str, str], Tuple[str, ...]] = {
    ("04", "one_f_one_b", "one_f_one_b_sends_first"):
    ("hang in step 0: rank 0 waits in send_forward(mb 2 -> rank 1) at variants.py:",
     "rank 1 waits in send_forward(mb 1 -> rank 2) at variants.py:",
     "rank 2 waits in send_backward(mb 0 -> rank 1) at variants.py:", "(all send first)"),
}
# chapter 06b's, in a file of their own: its functions are this module's too (a Source's name)
globals().update(balance_variants.FUNCTIONS)
CATALOGUE.update(balance_variants.CATALOGUE)
PLANTED = [*CATALOGUE, *STOPPING, *HANGS]  # (chapter, exercise, variant) of every variant
