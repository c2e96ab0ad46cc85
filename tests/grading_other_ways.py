"""More learners' functions for the grader's tests (tests/test_grade.py), none from the catalogue.

``ALTERNATIVES``: a second correct way for the four solutions a grader once rejected (a
reduce-scatter without ``scaletorch.dist.comm``, an in-place f-bar, a ring step with other
point-to-point calls, an in-place merge), each with another API or order than
tests/grading_solutions.py's; each must pass.
``CRASHES``: per chapter, a function that stops rank 1 in one way a learner's code can (a
SystemExit, os._exit, a SIGKILL, an abort, a receive never answered, a KeyboardInterrupt, a
segfault): its job's verdict names the rank, what stopped it and where, and the chapter's jobs
after it keep their own verdicts.
``MISTAKES``: chapter 06b's wrong rules of choice, each to fail with a diagnosis that names a
cause only where the grader's probe determines it, and otherwise says what was chosen and seen.
"""

import os
import signal
import sys

import torch
import torch.distributed as dist

from scaletorch.dist.all_to_all import all_to_all
from scaletorch.parallel import (expert_parallel, flat_unit, gradient_sync, loss_scale, moe_balance,
                                 pipeline_schedules, ring_attention, tensor_parallel_layers)

# ---- correct solutions written a second way -----------------------------------------------


def reduce_scatter_mean_list(full, out, group):
    """dist.reduce_scatter of a list of chunks, the mean taken out of place before the cast."""
    n = dist.get_world_size(group)
    chunks = list((full / n).to(out.dtype).chunk(n))
    return dist.reduce_scatter(out, chunks, group=group, async_op=True)


class _ReduceAsync(torch.autograd.Function):
    """f-bar in place, its all-reduce waited for through the work handle."""

    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group, async_op=True).wait()
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReduceScatterOutOfPlace(torch.autograd.Function):
    """g-bar: a summed copy, then this rank's slice of dim 1; backward all-gathers it back."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        total = x.detach().clone()
        dist.all_reduce(total, group=group)
        n, r = dist.get_world_size(group), dist.get_rank(group)
        return total.narrow(1, r * (x.size(1) // n), x.size(1) // n).contiguous()

    @staticmethod
    def backward(ctx, grad):
        n = dist.get_world_size(ctx.group)
        full = torch.empty((n * grad.size(0), ) + grad.shape[1:], dtype=grad.dtype)
        dist.all_gather_into_tensor(full, grad.contiguous(), group=ctx.group)
        return torch.cat(full.chunk(n), dim=1), None


def exit_region_async(x, group, sequence_parallel):
    if sequence_parallel:
        return _ReduceScatterOutOfPlace.apply(x, group)
    return _ReduceAsync.apply(x, group)


def ring_forward_isend(q, kv, group, order, tile):
    """dist.isend and dist.irecv one by one, K and V as one message, the send posted first; the
    neighbours from the group's list of global ranks."""
    ranks = dist.get_process_group_ranks(group)
    cp, rank = len(ranks), ranks.index(dist.get_rank())
    merged = {}
    for t, tiles in enumerate(ring_schedule(rank, cp, order)):
        if t + 1 < cp:
            incoming = torch.empty_like(kv)
            works = [
                dist.isend(kv.contiguous(), ranks[(rank + 1) % cp], group=group),
                dist.irecv(incoming, ranks[(rank - 1) % cp], group=group)
            ]
        for a, b, kind in tiles:
            if kind == "skipped":
                continue
            q_half = q.chunk(2, dim=2)[a]
            k_half, v_half = kv[0].chunk(2, dim=2)[b], kv[1].chunk(2, dim=2)[b]
            o, lse = tile(q_half, k_half, v_half, kind == "diagonal")
            o = o.float()
            merged[a] = ring_attention.merge(*merged[a], o, lse) if a in merged else (o, lse)
        if t + 1 < cp:
            for work in reversed(works):
                work.wait()
            kv = incoming
    return torch.cat([merged[0][0], merged[1][0]], dim=2), torch.cat([merged[0][1], merged[1][1]],
                                                                     dim=2)


ring_schedule = ring_attention.ring_schedule


def merge_lerp_in_place(out, lse, tile_out, tile_lse):
    """The tile's weight as a sigmoid of the lse difference, out moved towards tile_out in place
    (lerp), lse updated in place."""
    weight = torch.sigmoid(tile_lse - lse).unsqueeze(-1)
    out.lerp_(tile_out, weight)
    lse.copy_(torch.logaddexp(lse, tile_lse))
    return out, lse


# (chapter, exercise, function in this module): each must pass
ALTERNATIVES = [
    ("02", "reduce_scatter_mean", "reduce_scatter_mean_list"),
    ("03", "exit_region", "exit_region_async"),
    ("05", "ring_forward", "ring_forward_isend"),
    ("05", "merge", "merge_lerp_in_place"),
    ("06b", "biased_top_k", "top_k_weights_rescaled"),
]

# ---- chapter 06b: wrong rules of choice (probe of issue 55), each named only when determined


def top_k_scaled_by_bias(probs, bias, k):
    """The bias as a factor: rare experts' small probabilities barely move."""
    chosen = (probs * (1 + bias)).topk(k, dim=-1).indices
    return probs.gather(-1, chosen), chosen


def top_k_smallest(probs, bias, k):
    """The k smallest of probs + bias."""
    chosen = (probs + bias).topk(k, dim=-1, largest=False).indices
    return probs.gather(-1, chosen), chosen


def top_k_bias_alone(probs, bias, k):
    """Every token the same experts: the bias without the probabilities."""
    chosen = bias.expand_as(probs).topk(k, dim=-1).indices
    return probs.gather(-1, chosen), chosen


def top_k_over_tokens(probs, bias, k):
    """The top-k over dim 0, the tokens."""
    weights, chosen = (probs + bias).topk(k, dim=0)
    return probs.gather(0, chosen), chosen


def top_k_first_at_threshold(probs, bias, k):
    """Every expert at or above the k-th score, the first k of them by index: right without
    ties; at a tie on the k-th place it can leave out the largest."""
    scores = probs + bias
    at_least = scores >= scores.topk(k, dim=-1).values[:, -1:]
    chosen = at_least.float().argsort(dim=-1, descending=True, stable=True)[:, :k]
    return probs.gather(-1, chosen), chosen


def top_k_weights_rescaled(probs, bias, k):
    """Correct: the chosen probabilities divided and multiplied by their sum, equal to them up to
    rounding (3e-8; probe 55 round 2 was failed on that)."""
    chosen = (probs + bias).topk(k, dim=-1, sorted=False).indices.sort(-1).values
    weights = probs.gather(-1, chosen)
    total = weights.sum(-1, keepdim=True).detach()
    return weights / total * total, chosen


@torch.no_grad()
def update_bias_clamped(bias, load, rate):
    """The rule's step, then the bias held within +-rate: a bias at the bound comes back to it
    (probe 55 round 2: told "left the bias unchanged: change it in place", which it did)."""
    bias.add_(rate * torch.sign(load.mean() - load)).clamp_(-rate, rate)


def top_k_swapped(probs, bias, k):
    """(chosen, weights): the order of chapter 06's router, not this function's."""
    chosen = (probs + bias).topk(k, dim=-1).indices
    return chosen, probs.gather(-1, chosen)


# (chapter, exercise, function in this module, words its diagnosis must hold): each must fail,
# its cause named only where the probe's choices determine it, else what it chose and saw
MISTAKES = [
    ("06b", "biased_top_k", "top_k_scaled_by_bias",
     "choices on all 4 tokens of the probe are those of the k largest of probs x (1 + bias)"),
    ("06b", "biased_top_k", "top_k_smallest",
     "choices on all 4 tokens of the probe are those of the k smallest of probs + bias"),
    ("06b", "biased_top_k", "top_k_bias_alone",
     "choices on all 4 tokens of the probe are those of the k largest of the bias alone"),
    ("06b", "biased_top_k", "top_k_over_tokens",
     "returned weights (2, 4) and chosen (2, 4) in the probe, for probs (4, 4) and k 2: (T, k) "
     "each; (k, E) is what a top-k over dim 0 (the tokens) returns"),
    ("06b", "biased_top_k", "top_k_first_at_threshold",
     "chose experts [0, 1] for token 3 in the probe: probs [0.4375, 0.3125, 0.0625, 0.1875] + "
     "bias [-0.375, -0.25, 0.25, -0.375] = [0.0625, 0.0625, 0.3125, -0.1875], whose k largest "
     "are experts [2] and 1 of the tied [0, 1]"),
    ("06b", "update_bias", "update_bias_clamped", "holds what it held before"),
    ("06b", "biased_top_k", "top_k_swapped",
     "returned chosen of dtype torch.float32 in the probe: it returns (weights, chosen)"),
]

# ---- a rank stopped, one way per chapter (rank 0 runs the library's function) ---------------

_LIBRARY = {
    name: getattr(module, name)  # taken before any patch of the grader's
    for module, name in ((gradient_sync, "average_gradients"), (flat_unit, "reduce_scatter_mean"),
                         (tensor_parallel_layers, "enter_region"), (pipeline_schedules,
                                                                    "one_f_one_b"),
                         (ring_attention, "ring_forward"), (expert_parallel, "dispatch_tokens"),
                         (loss_scale, "unscale_and_check"), (moe_balance, "update_bias"))
}


def average_gradients_os_exit(grads, group):
    if dist.get_rank() == 1:
        os._exit(0)
    _LIBRARY["average_gradients"](grads, group)


def reduce_scatter_mean_sys_exit(full, out, group):
    if dist.get_rank() == 1:
        sys.exit(3)
    return _LIBRARY["reduce_scatter_mean"](full, out, group)


def enter_region_sigkill(x, group, sequence_parallel):
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return _LIBRARY["enter_region"](x, group, sequence_parallel)


def one_f_one_b_abort(stage, m):
    if dist.get_rank() == 1:
        os.abort()
    _LIBRARY["one_f_one_b"](stage, m)


def ring_forward_unanswered(q, kv, group, order, tile):
    if dist.get_rank() == 1:  # a tag no send of rank 0 has: never answered
        dist.recv(torch.empty(1), src=0, tag=99)
    return _LIBRARY["ring_forward"](q, kv, group, order, tile)


def dispatch_tokens_interrupt(routed, send_table, recv_table, group):
    if dist.get_rank() == 1:
        raise KeyboardInterrupt
    return _LIBRARY["dispatch_tokens"](routed, send_table, recv_table, group)


def unscale_and_check_segfault(grads, scale, group, agree=True):
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    return _LIBRARY["unscale_and_check"](grads, scale, group, agree)


def update_bias_raises(bias, load, rate):
    if dist.get_rank() == 1:
        raise RuntimeError("the learner's own error")
    _LIBRARY["update_bias"](bias, load, rate)


# chapter: (exercise, function in this module, words its verdict must hold, the statement that
# stopped the rank, whose line the verdict names; None where the rank left no Python stack)
CRASHES = {
    "01": ("average_gradients", "average_gradients_os_exit",
           ["rank 1 ended its process with os._exit(0) in average_gradients_os_exit"], "os._exit"),
    "02": ("reduce_scatter_mean", "reduce_scatter_mean_sys_exit",
           ["reduce_scatter_mean raised on rank 1: SystemExit: 3 (at"], "sys.exit"),
    "03":
    ("enter_region", "enter_region_sigkill",
     ["rank 1 died of SIGKILL in enter_region_sigkill (grading_other_ways.py, no Python stack)"
      ], None),
    "04": ("one_f_one_b", "one_f_one_b_abort", ["rank 1 died of SIGABRT in one_f_one_b_abort"],
           "os.abort"),
    "05": ("ring_forward", "ring_forward_unanswered",
           ["rank 1 waited ",
            " s in its receive from rank 0 at ring_forward_unanswered"], "dist.recv"),
    "06": ("dispatch_tokens", "dispatch_tokens_interrupt",
           ["dispatch_tokens raised on rank 1: KeyboardInterrupt (at"], "raise KeyboardInterrupt"),
    "08": ("unscale_and_check", "unscale_and_check_segfault",
           ["rank 1 died of SIGSEGV in unscale_and_check_segfault"], "os.kill"),
    "06b": ("update_bias", "update_bias_raises",
            ["update_bias raised on rank 1: RuntimeError: the learner's own error (at"
             ], "raise RuntimeError"),
}

# ---- mistakes nobody planted that only a direct call sees (the run's group is the world) ----


@torch.no_grad()
def unscale_and_check_over_the_world(grads, scale, group, agree=True):
    """Agrees over the world, whatever group it is given."""
    bad = torch.zeros(())
    for g in grads:
        g.div_(scale)
        bad = torch.maximum(bad, (~torch.isfinite(g)).any().float())
    if agree:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bool(bad.item())


@torch.no_grad()
def unscale_and_check_first_gradient(grads, scale, group, agree=True):
    """Looks for an overflow in the first gradient only."""
    for g in grads:
        g.div_(scale)
    bad = (~torch.isfinite(grads[0])).any().float()
    if agree:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    return bool(bad.item())


# (chapter, exercise, function in this module, words its diagnosis must hold)
MISTAKES += [
    ("08", "unscale_and_check", "unscale_and_check_over_the_world",
     "rank 0 learned of rank 1's value beyond the group it was given"),
    ("08", "unscale_and_check", "unscale_and_check_first_gradient",
     "rank 1, which holds it, did not find it"),
]


def dispatch_tokens_stops_at_an_empty_pair(routed, send_table, recv_table, group):
    """Regroups by local expert with ``break`` for ``continue``: a (rank, expert) pair without
    rows ends that expert's rows (the run never has one; the grader's tables do)."""
    received = all_to_all(routed, [sum(r) for r in recv_table], [sum(r) for r in send_table], group,
                          "ep")
    starts, row = [], 0
    for counts in recv_table:
        starts.append([row + sum(counts[:e]) for e in range(len(counts))])
        row += sum(counts)
    order = []
    for e in range(len(recv_table[0])):
        for i, counts in enumerate(recv_table):
            if counts[e] == 0:
                break
            order += range(starts[i][e], starts[i][e] + counts[e])
    return received[torch.tensor(order, dtype=torch.long)]


MISTAKES.append(("06", "dispatch_tokens", "dispatch_tokens_stops_at_an_empty_pair",
                 "rank 0's experts got 3 rows with the grader's tables (uneven counts, some "
                 "zero), the ranks routed 7 to them"))

# ---- chapter 04 at pp 3: another API, and a mistake a pipeline of 2 cannot see --------------


def _exchange(stage, send=None, to=None, source=None):
    """``send`` to ``to``, a receive from ``source``: one batch; the received (b, s, h) or None."""
    ops, got = [], None
    if send is not None and to is not None:
        ops.append(dist.P2POp(dist.isend, send, to, stage.group))
    if source is not None:
        got = torch.empty(stage.shape, dtype=stage.dtype)
        ops.append(dist.P2POp(dist.irecv, got, source, stage.group))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return got


def one_f_one_b_batch_isend_irecv(stage, m):
    """Correct: 1F1B whose messages are torch.distributed.batch_isend_irecv batches, not the
    named operations of PipelineRank, each send posted with the receive that answers it."""
    warmup = min(stage.p - stage.rank - 1, m)
    for mb in range(warmup):
        _exchange(stage, stage.forward(mb, _exchange(stage, source=stage.prev)), stage.next)
    x = _exchange(stage, source=stage.prev)
    for i in range(m - warmup):
        dy = _exchange(stage, stage.forward(warmup + i, x), stage.next, stage.next)
        last = warmup + i + 1 == m
        x = _exchange(stage, stage.backward(i, dy), stage.prev, None if last else stage.prev)
    for mb in range(m - warmup, m):
        dy = _exchange(stage, source=stage.next)
        _exchange(stage, stage.backward(mb, dy), stage.prev)


def one_f_one_b_warmup_on_rank_0(stage, m):
    """Warm-up forwards on rank 0 only (p - 1 of them), none on the others: right at pp 2,
    where rank 0 is the only rank with a warm-up; at pp 3 the middle rank warms up with none."""
    warmup = min(stage.p - 1, m) if stage.rank == 0 else 0
    for mb in range(warmup):
        stage.send_forward(mb, stage.forward(mb, stage.recv_forward(mb)))
    x = stage.recv_forward(warmup) if warmup < m else None
    for i in range(m - warmup):
        dy = stage.send_forward_recv_backward(warmup + i, stage.forward(warmup + i, x), i)
        dx = stage.backward(i, dy)
        if warmup + i + 1 < m:
            x = stage.send_backward_recv_forward(i, dx, warmup + i + 1)
        else:
            stage.send_backward(i, dx)
    for mb in range(m - warmup, m):
        stage.send_backward(mb, stage.backward(mb, stage.recv_backward(mb)))


ALTERNATIVES.append(("04", "one_f_one_b", "one_f_one_b_batch_isend_irecv"))
MISTAKES.append(("04", "one_f_one_b", "one_f_one_b_warmup_on_rank_0",
                 "rank 1's warm-up ran 0 forwards before the steady state (F0 B0 F1 ...): "
                 "1F1B warms up with p - r - 1 = 1; one fewer and the ranks take turns"))
