"""Learners' functions for the grader's tests (tests/test_grade.py), none from the catalogue.

``ALTERNATIVES``: correct solutions written another way than the library's (torch.distributed
directly, in place, another order, another API, a batch of point-to-point ops); each must pass.
``BROKEN``: functions that crash, hang or raise on one rank; each must be attributed to its own
exercise and rank, and the exercises after it keep their verdicts.
"""

import os
import signal

import torch
import torch.distributed as dist

from scaletorch.dist import comm
from scaletorch.dist.all_to_all import all_to_all
from scaletorch.parallel.ring_attention import merge as library_merge
from scaletorch.parallel.ring_attention import ring_schedule

# ---- crashes, hangs, errors (chapter 01's average_gradients) -------------------------------


def segfault_on_rank_1(grads, group):
    """Rank 1 dies of a segfault in its first call."""
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    for g in grads:
        comm.all_reduce(g, group)
        g /= comm.group_size(group)


def hang_on_rank_1(grads, group):
    """Rank 1 waits for a message rank 0 never sends."""
    if dist.get_rank() == 1:
        dist.recv(grads[0].clone(), src=0)
    for g in grads:
        comm.all_reduce(g, group)
        g /= comm.group_size(group)


def raise_on_rank_1(grads, group):
    """Rank 1 raises in its first call."""
    if dist.get_rank() == 1:
        raise ValueError("the learner's own error")
    for g in grads:
        comm.all_reduce(g, group)
        g /= comm.group_size(group)


# ---- correct solutions written another way -------------------------------------------------
# chapter 01


def average_gradients_async_direct(grads, group):
    """torch.distributed directly, every all-reduce in flight at once, then x (1 / N)."""
    works = [dist.all_reduce(g, group=group, async_op=True) for g in grads]
    for work, g in zip(works, grads):
        work.wait()
        g.mul_(1.0 / dist.get_world_size(group))


def launch_full_buckets_for_break(ready, sizes, next_bucket, launch):
    """A for loop that breaks at the first bucket not full."""
    for k in range(next_bucket, len(sizes)):
        if ready[k] < sizes[k]:
            return k
        launch(k)
    return len(sizes)


def wait_for_buckets_reversed(works):
    """The last bucket first: waiting in any order waits for all."""
    for work in reversed([w for w in works if w is not None]):
        work.wait()


# chapter 02


def reduce_scatter_mean_direct(full, out, group):
    """torch.distributed.reduce_scatter_tensor directly, x (1 / N) after the cast."""
    sent = full.to(out.dtype) if full.dtype != out.dtype else full
    sent.mul_(1.0 / dist.get_world_size(group))
    return dist.reduce_scatter_tensor(out, sent, group=group, async_op=True)


def gather_unit_direct(flat, shard, group, async_op=False):
    """torch.distributed.all_gather_into_tensor directly; the storage sized by its bytes."""
    need = flat.numel() * flat.element_size()
    if flat.untyped_storage().nbytes() < need:
        flat.untyped_storage().resize_(need)
    return dist.all_gather_into_tensor(flat, shard, group=group, async_op=async_op)


def release_unit_checked(flat):
    """Resize the storage only when it holds something."""
    storage = flat.untyped_storage()
    if storage.nbytes() > 0:
        storage.resize_(0)


# chapter 03: Megatron's own region operators, written with torch.distributed in place


class _Copy(torch.autograd.Function):
    """f: forward identity, backward all-reduce in place."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Reduce(torch.autograd.Function):
    """f-bar: Megatron's in-place forward all-reduce (``all_reduce(x); return x``)."""

    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Gather(torch.autograd.Function):
    """g: forward all-gather along dim 1 (a list of chunks), backward all-reduce then keep mine."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        chunks = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(chunks, x.contiguous(), group=group)
        return torch.cat(chunks, dim=1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        n, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(n, dim=1)[r].contiguous(), None


class _ReduceScatter(torch.autograd.Function):
    """g-bar: forward all-reduce in place then keep mine, backward all-gather of chunks."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        n, r = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(n, dim=1)[r].contiguous()

    @staticmethod
    def backward(ctx, grad):
        chunks = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(chunks, grad.contiguous(), group=ctx.group)
        return torch.cat(chunks, dim=1), None


def enter_region_megatron(x, group, sequence_parallel):
    return _Gather.apply(x, group) if sequence_parallel else _Copy.apply(x, group)


def exit_region_megatron(x, group, sequence_parallel):
    return _ReduceScatter.apply(x, group) if sequence_parallel else _Reduce.apply(x, group)


class _CrossEntropy(torch.autograd.Function):
    """Megatron's vocab-parallel cross-entropy: the max subtracted from the logits in place."""

    @staticmethod
    def forward(ctx, logits, targets, group):
        logits = logits.float()  # fp32 logits: in place on the input itself, as Megatron does
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        logits.sub_(top.unsqueeze(-1))
        width, rank = logits.size(-1), dist.get_rank(group)
        outside = (targets < rank * width) | (targets >= (rank + 1) * width)
        local = (targets - rank * width).masked_fill(outside, 0)
        rows = torch.arange(logits.size(0))
        target_logit = logits[rows, local].masked_fill(outside, 0.0)
        exp = logits.exp_()
        total = torch.stack([exp.sum(dim=-1), target_logit])
        dist.all_reduce(total, group=group)
        loss = total[0].log() - total[1]
        exp.div_(total[0].unsqueeze(-1))  # the softmax, in place
        ctx.save_for_backward(exp, local, outside)
        return loss.mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.size(0))
        g[rows, local] -= (~outside).float()
        return g * (grad / g.size(0)), None, None


def vocab_parallel_cross_entropy_megatron(logits, targets, group):
    return _CrossEntropy.apply(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), group)


# chapter 04


def one_f_one_b_counters(stage, m):
    """1F1B with two counters and while loops instead of index arithmetic."""
    warmup = min(stage.p - stage.rank - 1, m)
    for mb in range(warmup):
        stage.send_forward(mb, stage.forward(mb, stage.recv_forward(mb)))
    f, b = warmup, 0
    x = stage.recv_forward(f) if f < m else None
    while f < m:
        dy = stage.send_forward_recv_backward(f, stage.forward(f, x), b)
        dx = stage.backward(b, dy)
        f += 1
        if f < m:
            x = stage.send_backward_recv_forward(b, dx, f)
        else:
            stage.send_backward(b, dx)
        b += 1
    while b < m:
        stage.send_backward(b, stage.backward(b, stage.recv_backward(b)))
        b += 1


def micro_batch_loss_times(loss, m):
    """x (1 / m) instead of / m."""
    return loss * (1.0 / m)


# chapter 05


def slice_ids_sorted(cp_rank, cp_size, order="zigzag"):
    """The pair computed from both ends and sorted."""
    if order == "zigzag":
        pair = {cp_rank, 2 * cp_size - 1 - cp_rank}
    elif order == "contiguous":
        pair = {2 * cp_rank, 2 * cp_rank + 1}
    else:
        raise ValueError(f"unknown order {order!r}")
    low, high = sorted(pair)
    return low, high


def merge_in_place(out, lse, tile_out, tile_lse):
    """The running (out, lse) updated in place, the exponents shifted by the larger lse."""
    top = torch.maximum(lse, tile_lse)
    a, b = torch.exp(lse - top), torch.exp(tile_lse - top)
    total = a + b
    out.mul_((a / total).unsqueeze(-1)).add_((b / total).unsqueeze(-1) * tile_out)
    lse.copy_(top + torch.log(total))
    return out, lse


def ring_forward_batched(q, kv, group, order, tile):
    """dist.batch_isend_irecv directly, K and V as two messages, the receives posted first."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    nxt = dist.get_global_rank(group, (rank + 1) % cp)
    prev = dist.get_global_rank(group, (rank - 1) % cp)
    qs = q.chunk(2, dim=2)
    merged = {}
    for t, tiles in enumerate(ring_schedule(rank, cp, order)):
        if t + 1 < cp:
            k_next, v_next = torch.empty_like(kv[0]), torch.empty_like(kv[1])
            works = dist.batch_isend_irecv([
                dist.P2POp(dist.irecv, k_next, prev, group),
                dist.P2POp(dist.irecv, v_next, prev, group),
                dist.P2POp(dist.isend, kv[0].contiguous(), nxt, group),
                dist.P2POp(dist.isend, kv[1].contiguous(), nxt, group),
            ])
        ks, vs = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
        for a, b, kind in tiles:
            if kind != "skipped":
                o, lse = tile(qs[a], ks[b], vs[b], kind == "diagonal")
                o = o.float()
                merged[a] = library_merge(*merged[a], o, lse) if a in merged else (o, lse)
        if t + 1 < cp:
            for work in works:
                work.wait()
            kv = torch.stack([k_next, v_next])
    return (torch.cat([merged[0][0], merged[1][0]],
                      dim=2), torch.cat([merged[0][1], merged[1][1]], dim=2))


# chapter 06


def _by_expert(recv_table):
    """Received rows (by source rank, then local expert) regrouped by local expert, built row
    by row from running offsets."""
    starts, at = {}, 0
    for i, row in enumerate(recv_table):
        for e, n in enumerate(row):
            starts[(i, e)] = at
            at += n
    order = [
        starts[(i, e)] + k for e in range(len(recv_table[0])) for i in range(len(recv_table))
        for k in range(recv_table[i][e])
    ]
    return torch.tensor(order, dtype=torch.long)


def dispatch_tokens_offsets(routed, send_table, recv_table, group):
    received = all_to_all(routed, [sum(r) for r in recv_table], [sum(r) for r in send_table], group,
                          "ep")
    return received.index_select(0, _by_expert(recv_table))


def combine_tokens_index_copy(out, send_table, recv_table, group):
    by_rank = torch.zeros_like(out).index_copy(0, _by_expert(recv_table), out)
    return all_to_all(by_rank, [sum(r) for r in send_table], [sum(r) for r in recv_table], group,
                      "ep")


# chapter 08


@torch.no_grad()
def unscale_and_check_direct(grads, scale, group, agree=True):
    """The flag first, from the unscaled gradients; torch.distributed directly."""
    bad = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any().float()
    for g in grads:
        g.div_(scale)
    if agree:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    return bool(bad.item())


def update_scale_early_return(scale, clean_steps, found_inf, growth_interval):
    if not found_inf and clean_steps + 1 < growth_interval:
        return scale, clean_steps + 1
    return (scale * 0.5 if found_inf else scale + scale), 0


# chapter 06b


def biased_top_k_argsort(probs, bias, k):
    """The k largest scores by a sort, lowest expert first; the weights by index. At the
    grader's probe's tie (token 3) it keeps expert 0 where topk keeps expert 1: both right."""
    chosen = (probs + bias).argsort(dim=-1, descending=True)[:, :k].sort(dim=-1).values
    return torch.take_along_dim(probs, chosen, dim=-1), chosen


@torch.no_grad()
def update_bias_where(bias, load, rate):
    """Each expert's step by comparison, no sign()."""
    mean = load.mean()
    bias += torch.where(load > mean, -rate, torch.where(load < mean, rate, 0.0))


# (chapter, exercise, function in this module): each must pass
ALTERNATIVES = [
    ("01", "average_gradients", "average_gradients_async_direct"),
    ("01", "launch_full_buckets", "launch_full_buckets_for_break"),
    ("01", "wait_for_buckets", "wait_for_buckets_reversed"),
    ("02", "reduce_scatter_mean", "reduce_scatter_mean_direct"),
    ("02", "gather_unit", "gather_unit_direct"),
    ("02", "release_unit", "release_unit_checked"),
    ("03", "enter_region", "enter_region_megatron"),
    ("03", "exit_region", "exit_region_megatron"),
    ("03", "vocab_parallel_cross_entropy", "vocab_parallel_cross_entropy_megatron"),
    ("04", "one_f_one_b", "one_f_one_b_counters"),
    ("04", "micro_batch_loss", "micro_batch_loss_times"),
    ("05", "slice_ids", "slice_ids_sorted"),
    ("05", "merge", "merge_in_place"),
    ("05", "ring_forward", "ring_forward_batched"),
    ("06", "dispatch_tokens", "dispatch_tokens_offsets"),
    ("06", "combine_tokens", "combine_tokens_index_copy"),
    ("08", "unscale_and_check", "unscale_and_check_direct"),
    ("08", "update_scale", "update_scale_early_return"),
    ("06b", "biased_top_k", "biased_top_k_argsort"),
    ("06b", "update_bias", "update_bias_where"),
]

# ---- mistakes that nobody planted: each must fail with a diagnosis that says what was measured


def average_divided_on_rank_0_only(grads, group):
    """Only rank 0 divides the sum by N."""
    for g in grads:
        comm.all_reduce(g, group)
        if dist.get_rank(group) == 0:
            g /= comm.group_size(group)


# (chapter, exercise, function in this module, words its diagnosis must hold)
MISTAKES = [
    ("01", "average_gradients", "average_divided_on_rank_0_only",
     "multiples of the reference (rank 0's 1.00x, rank 1's 1.00x, rank 2's 2.00x"),
]
