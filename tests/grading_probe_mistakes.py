"""Learners' functions a probe of the grader wrote, beside tests/grading_other_ways.py's.

``MISTAKES``: (chapter, exercise, function, words): each must fail, its diagnosis holding the
words: what was measured, and a cause only where the measurement determines it (a release
that rebinds flat: the bytes the parameters still hold; a combine that applies the regrouping
again, not its inverse; a mean load floored; a contiguous slice_ids off by one, which is not
zigzag's rule at 3 ranks; a scale halved by floor division, 0 from a scale of 1).
``ALTERNATIVES``: a correct ring_forward whose file's slice_ids and
merge are wrong: it must pass, each exercise judged on its own; a 1F1B over the default group.
"""

import os
import signal
import time

import torch
import torch.distributed as dist

from scaletorch.dist import comm
from scaletorch.dist.all_to_all import all_to_all
from scaletorch.dist.functional import reduce_from_parallel_region
from scaletorch.parallel.expert_parallel import by_local_expert
from scaletorch.parallel.ring_attention import KV_TAG
from tests.grading_other_ways import _LIBRARY


def release_unit_rebinds(flat):
    """flat.data rebound to an empty tensor: the parameters, views of the old storage, keep
    every byte of it (the grader once said 0 bytes were left)."""
    flat.data = torch.empty(0, dtype=flat.dtype)


def combine_tokens_forward_order_again(out, send_table, recv_table, group):
    """'Undoes' the regrouping with by_local_expert's order itself, not its inverse."""
    back = out[by_local_expert(recv_table, out.device)]
    return all_to_all(back, [sum(s) for s in send_table], [sum(r) for r in recv_table], group, "ep")


@torch.no_grad()
def update_bias_floor_mean(bias, load, rate):
    """The mean load floored: right while the mean is whole, wrong at [3, 2, 2, 3]."""
    mean = load.sum() // load.numel()
    bias += rate * torch.sign(mean - load).to(bias.dtype)


def slice_ids(cp_rank, cp_size, order="zigzag"):
    """Zigzag right; contiguous off by one, (r, r + 1): zigzag's pair at 2 ranks, not at 3."""
    if order == "zigzag":
        return cp_rank, 2 * cp_size - 1 - cp_rank
    return cp_rank, cp_rank + 1


def merge(out, lse, tile_out, tile_lse):
    """Wrong: each tile's output weighted by the other tile's share."""
    new = torch.logaddexp(lse, tile_lse)
    return (torch.exp(tile_lse - new).unsqueeze(-1) * out +
            torch.exp(lse - new).unsqueeze(-1) * tile_out, new)


def ring_forward_own_helpers(q, kv, group, order, tile):
    """Correct ring (batch_isend_irecv, waited at once) that calls this file's wrong slice_ids
    and merge: the grader gives it the library's, and it passes."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    half = q.size(2) // 2
    acc = [None, None]
    cur = kv
    for t in range(n):
        if t < n - 1:
            nxt = torch.empty_like(cur)
            works = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, cur.contiguous(), dist.get_global_rank(group, (r + 1) % n),
                           group, KV_TAG),
                dist.P2POp(dist.irecv, nxt, dist.get_global_rank(group, (r - 1) % n), group, KV_TAG)
            ])
            for work in works:
                work.wait()
        mine, theirs = slice_ids(r, n, order), slice_ids((r - t) % n, n, order)
        for qi in range(2):
            for ki in range(2):
                if theirs[ki] > mine[qi]:
                    continue
                k, v = (cur[i][:, :, ki * half:(ki + 1) * half] for i in range(2))
                o, lse = tile(q[:, :, qi * half:(qi + 1) * half], k, v, theirs[ki] == mine[qi])
                o, lse = o.float(), lse.float()
                acc[qi] = (o, lse) if acc[qi] is None else merge(*acc[qi], o, lse)
        if t < n - 1:
            cur = nxt
    return torch.cat([acc[0][0], acc[1][0]], dim=2), torch.cat([acc[0][1], acc[1][1]], dim=2)


def update_scale_floor_halves(scale, clean_steps, found_inf, growth_interval):
    """Halves by floor division: right from 512, 0 from a scale of 1."""
    if found_inf:
        return scale // 2, 0
    clean_steps += 1
    return (scale * 2.0, 0) if clean_steps == growth_interval else (scale, clean_steps)


ALTERNATIVES = [("05", "ring_forward", "ring_forward_own_helpers")]
MISTAKES = [
    ("02", "release_unit", "release_unit_rebinds",
     "left 8,192 bytes allocated in the storage the parameters view (flat now has a new one "
     "of 0)"),
    ("06", "combine_tokens", "combine_tokens_forward_order_again",
     "the rows went back in by_local_expert's order, the regrouping applied a second time"),
    ("06b", "update_bias", "update_bias_floor_mean",
     "moved the bias by [-0.1, 0.0, 0.0, -0.1] in the probe with load [3.0, 2.0, 2.0, 3.0] "
     "(mean 2.5), the rule by [-0.1, 0.1, 0.1, -0.1]"),
    ("05", "slice_ids", "slice_ids",
     "slice_ids(1, 2, 'contiguous') returned (1, 2), the library (2, 3) (wrong in 6 of the 10"),
    ("08", "update_scale", "update_scale_floor_halves",
     "update_scale(scale=1, clean_steps=0, found_inf=True, growth_interval=2) returned (0, 0), "
     "the library's (0.5, 0)"),
]

# ---- chapter 04 where the pipeline is a subgroup (pp 2 x dp 2: pipelines [0, 2] and [1, 3]) ----


def _exchange_default_group(stage, send=None, to=None, source=None):
    """``send`` to global rank ``to``, a receive from ``source``, over the default group."""
    ops, got = [], None
    if send is not None and to is not None:
        ops.append(dist.P2POp(dist.isend, send, to))
    if source is not None:
        got = torch.empty(stage.shape, dtype=stage.dtype)
        ops.append(dist.P2POp(dist.irecv, got, source))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return got


def _one_f_one_b_between(stage, m, p, prev, nxt):
    """1F1B of p stages whose messages go over the default group to the global ranks given."""
    warmup = min(p - stage.rank - 1, m)
    for mb in range(warmup):
        y = stage.forward(mb, _exchange_default_group(stage, source=prev))
        _exchange_default_group(stage, y, nxt)
    x = _exchange_default_group(stage, source=prev)
    for i in range(m - warmup):
        dy = _exchange_default_group(stage, stage.forward(warmup + i, x), nxt, nxt)
        last = warmup + i + 1 == m
        x = _exchange_default_group(stage, stage.backward(i, dy), prev, None if last else prev)
    for mb in range(m - warmup, m):
        dy = _exchange_default_group(stage, source=nxt)
        _exchange_default_group(stage, stage.backward(mb, dy), prev)


def one_f_one_b_default_group(stage, m):
    """Correct: the default group, to this_rank.next and this_rank.prev (global ranks)."""
    _one_f_one_b_between(stage, m, stage.p, stage.prev, stage.next)


def one_f_one_b_global_rank_plus_one(stage, m):
    """Neighbours computed as the global rank +- 1: right where the pipeline is the world."""
    rank = dist.get_rank()
    _one_f_one_b_between(stage, m, stage.p, None if stage.first else rank - 1,
                         None if stage.last else rank + 1)


def one_f_one_b_world_size(stage, m):
    """Warms up with dist.get_world_size() - r - 1: right where the pipeline is the world."""
    _one_f_one_b_between(stage, m, dist.get_world_size(), stage.prev, stage.next)


ALTERNATIVES.append(("04", "one_f_one_b", "one_f_one_b_default_group"))
MISTAKES += [
    ("04", "one_f_one_b", "one_f_one_b_global_rank_plus_one",
     "in the pp 2 x dp 2 world rank 0 (stage 0 of the pipeline of ranks [0, 2]) sent a message "
     "to rank 1 (stage 0 of the pipeline [1, 3]) over the group 'default_pg' in step 0; its "
     "neighbour stages are rank 2: rank 1 is its global rank + 1"),
    ("04", "one_f_one_b", "one_f_one_b_world_size",
     "pipeline of ranks [0, 2] (its stage s is rank 0 for s = 0, 2 for s = 1): stage 0's "
     "warm-up ran 3 forwards before the steady state (F0 F1 F2 F3 B0 B1 ...): 1F1B warms up "
     "with p - r - 1 = 1; one more holds 4 activations at once, not p - r = 2; each stage s "
     "warmed up with 4 - s - 1 forwards, the world's size (dist.get_world_size()) in place of "
     "p = 2"),
]

# ---- probe 2's findings: what was measured, not a guess (``MUST_NOT``: words a verdict lacks) --


def dispatch_tokens_inverse_order(routed, send_table, recv_table, group):
    """Regroups the received rows by the inverse permutation: neither by source rank nor by
    local expert."""
    send, recv = [sum(r) for r in send_table], [sum(r) for r in recv_table]
    got = all_to_all(routed, recv, send, group, "ep")
    return got[torch.argsort(by_local_expert(recv_table, routed.device))]


def one_f_one_b_rank2_sleeps(stage, m):
    """Rank 2 never reaches its first receive: ranks 0 and 1 wait for it and give up."""
    if dist.get_rank() == 2:
        time.sleep(600)  # the grader stops it once the others have left
    _LIBRARY["one_f_one_b"](stage, m)  # the grader's sends and receives: it sees them wait


def wait_for_buckets_segfault(works):
    """World rank 1 dies of SIGSEGV: the others' broken collectives follow, not a second cause."""
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    for work in works:
        if work is not None:
            work.wait()


def vocab_parallel_cross_entropy_world_offset(logits, targets, group):
    """The target's shard offset from the world rank: right on ranks 0 and 1 of tp 2 x dp 2,
    whose tp rank is their world rank, wrong on ranks 2 and 3."""
    z = logits.reshape(-1, logits.size(-1)).float()
    width = z.size(-1)
    top = z.max(dim=-1).values.detach()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    local = targets.reshape(-1) - dist.get_rank() * width
    mine = (local >= 0) & (local < width)
    shifted = z - top.unsqueeze(-1)
    picked = shifted.gather(-1, local.clamp(0, width - 1).unsqueeze(-1))[:, 0]
    sums = reduce_from_parallel_region(
        torch.stack((shifted.exp().sum(dim=-1), torch.where(mine, picked, 0.0))), group)
    return (sums[0].log() - sums[1]).mean()


def reduce_scatter_mean_divides_in_flight(full, out, group):
    """Divides out before the reduce-scatter finished: its sum overwrites the division."""
    work = comm.reduce_scatter_tensor(out, full.to(out.dtype), group, async_op=True)
    out.div_(comm.group_size(group))
    return work


MISTAKES += [
    ("02", "reduce_scatter_mean", "reduce_scatter_mean_divides_in_flight",
     "reduce_scatter_mean called div_ on out while its reduce-scatter was in flight"),
    ("06", "dispatch_tokens", "dispatch_tokens_inverse_order",
     "but not grouped by local expert: they were regrouped by the inverse of by_local_expert's "
     "order"),
    ("01", "wait_for_buckets", "wait_for_buckets_segfault",
     "rank 1 died of SIGSEGV in wait_for_buckets_segfault (grading_probe_mistakes.py:"),
]
# a hang, graded with the short timeout (tests/test_grade.py's GradeAHang): the cause first,
# then what the others waited in
NEVER_CAME = ("one_f_one_b", "one_f_one_b_rank2_sleeps",
              ("hang in step 0: rank 2 never reached a send or receive: it was still in "
               "one_f_one_b_rank2_sleeps (grading_probe_mistakes.py:", "; rank 0 waits in ",
               "rank 1 waits in"))
# chapter 03 at tp 2 x dp 2 (tests/test_grade.py's GradeOverTheTpGroup): at tp 2 = world the
# world rank is the tp rank
WIDE = [("vocab_parallel_cross_entropy", "vocab_parallel_cross_entropy_world_offset",
         "the loss is off on ranks 2 and 3 (rank 2: tp rank 0 of the tp group [2, 3], rank 3: tp "
         "rank 1 of the tp group [2, 3]) and right on ranks 0 and 1, whose world rank is their tp "
         "rank: it is the loss of shards offset by the world rank")]
MUST_NOT = {
    "dispatch_tokens_inverse_order": ["arrive by source rank", "by source rank; regroup"],
    "one_f_one_b_rank2_sleeps": ["after another rank had left"],
    "wait_for_buckets_segfault": ["disagreement", "never issued", "Connection reset", "GLHF"],
    "vocab_parallel_cross_entropy_world_offset": ["subtract r V/tp"],
    "reduce_scatter_mean_divides_in_flight": ["missing, or of out"],
}

# ---- probe 2, round 2: causes measured where the backend or torch's internals spoke ----


def dispatch_tokens_transposed_splits(routed, send_table, recv_table, group):
    """Receives recv_table's column sums (rows per local expert) as if they were the rows from
    each rank: the ranks' split sizes disagree (gloo said "inLengthPerRank[myRank] == ...")."""
    send = [sum(r) for r in send_table]
    recv = [
        sum(recv_table[i][e] for i in range(len(recv_table))) for e in range(len(recv_table[0]))
    ]
    got = all_to_all(routed, recv, send, group, "ep")
    return got[by_local_expert(recv_table, routed.device)]


def one_f_one_b_backward_next(stage, m):
    """1F1B whose steady phase runs the backward of the next micro-batch (bwd + 1): micro-batch
    2's backward comes twice (a KeyError of the library's dict, once)."""
    warm = min(stage.p - stage.rank - 1, m)
    for i in range(warm):
        stage.send_forward(i, stage.forward(i, stage.recv_forward(i)))
    fwd, bwd = warm, 0
    x = stage.recv_forward(fwd) if fwd < m else None
    while fwd < m:
        dy = stage.send_forward_recv_backward(fwd, stage.forward(fwd, x), bwd)
        dx = stage.backward(min(bwd + 1, fwd), dy)
        fwd += 1
        if fwd < m:
            x = stage.send_backward_recv_forward(bwd, dx, fwd)
        else:
            stage.send_backward(bwd, dx)
        bwd += 1
    while bwd < m:
        stage.send_backward(bwd, stage.backward(bwd, stage.recv_backward(bwd)))
        bwd += 1


def micro_batch_loss_detached(loss, m):
    """Detached: torch raises in the backward, where no frame of this function is left."""
    return loss.detach() / m


class _GatherDim2(torch.autograd.Function):
    """g-bar whose backward gathers along dim 2 (h), not 1 (s): autograd refuses its shape."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y.chunk(dist.get_world_size(group), dim=1)[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, g):
        parts = [torch.empty_like(g) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, g.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=2), None


def exit_region_gathers_dim2(x, group, sequence_parallel):
    return _GatherDim2.apply(x, group) if sequence_parallel else reduce_from_parallel_region(
        x, group)


MISTAKES += [
    ("06", "dispatch_tokens", "dispatch_tokens_transposed_splits",
     "are recv_table's column sums, the rows per local expert over all ranks, not per source "
     "rank"),
    ("04", "micro_batch_loss", "micro_batch_loss_detached",
     "(in the backward of the loss micro_batch_loss returned at grading_probe_mistakes.py:"),
]
# a raise ends its world (a new one grades the jobs after it): graded one world each in the long
# phase (tests/test_grade.py's GradeARaiseInTheLearnersTerms), at the grader's worlds
RAISING = [
    ("04", "one_f_one_b", "one_f_one_b_backward_next",
     "asked for the backward of micro-batch 2 in step 0, but its backward had already run"),
    ("03", "exit_region", "exit_region_gathers_dim2",
     "returned an invalid gradient at index 0 - got [8, 16, 128] but expected shape compatible "
     "with [8, 32, 64] (in _GatherDim2.backward at grading_probe_mistakes.py:"),
]
MUST_NOT.update({
    "dispatch_tokens_transposed_splits": ["inLengthPerRank", "gloo"],
    "one_f_one_b_backward_next": ["KeyError"],
    "micro_batch_loss_detached": ["graph.py"],
    "exit_region_gathers_dim2": ["graph.py"],
})


def ring_forward_rank0_sleeps(q, kv, group, order, tile):
    """Rank 0 never reaches its first send: ranks 1 and 2 wait for its K/V and give up."""
    if dist.get_rank() == 0:
        time.sleep(600)  # the grader stops it once the others have left
    return _LIBRARY["ring_forward"](q, kv, group, order, tile)


# chapter 05's hang (tests/test_grade.py's GradeAHang, long phase): the rank that never sent
NEVER_SENT = ("ring_forward", "ring_forward_rank0_sleeps",
              ("hang in step 0: rank 0 never issued its send to rank 1 and its receive from "
               "rank 2: it was still in ring_forward_rank0_sleeps (grading_probe_mistakes.py:",
               "outside any send or receive, when ranks 1 and 2 gave up waiting for it",
               "rank 1 waited ", " in its receive from rank 0 at "))
MUST_NOT["ring_forward_rank0_sleeps"] = ["made no progress", "after another rank had left"]


class _ChunkByWorldRank(torch.autograd.Function):
    """g-bar keeping chunk dist.get_rank() % n of the sum; its backward gathers along dim 1."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.contiguous().clone()
        dist.all_reduce(y, group=group)
        n = dist.get_world_size(group)
        return y.chunk(n, dim=1)[dist.get_rank() % n].contiguous()

    @staticmethod
    def backward(ctx, g):
        parts = [torch.empty_like(g) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, g.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=1), None


def exit_region_world_rank_chunk(x, group, sequence_parallel):
    """Its group rank where the group is a block of consecutive ranks (the run's tp groups [0,
    1], [2, 3]), not over [0, 2], [1, 3]."""
    return _ChunkByWorldRank.apply(x, group) if sequence_parallel else \
        reduce_from_parallel_region(x, group)


# at tp 2 x dp 2 (GradeOverTheTpGroup): at tp 2 = world the dp groups have one rank
WIDE.append(
    ("exit_region", "exit_region_world_rank_chunk",
     "over groups whose ranks are not blocks of the world (the dp groups [0, 2] and [1, 3]): its "
     "forward differs from the library's on world ranks [1, 2]; world rank 1, rank 0 of its "
     "group, kept chunk 1 of the sum: the chunk of its world rank modulo the group's size"))
