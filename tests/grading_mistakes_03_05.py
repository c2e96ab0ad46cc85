"""Mistakes nobody planted, chapters 03 and 05, beside tests/grading_solutions.py's ``MISTAKES``
(tests/test_grade.py grades both): each is seen only by what the graded worlds now have, a tp
group that is not the world, an output gradient other than 1, a ring of 3 ranks, both orders.
Each must fail with a diagnosis that says what was measured.
"""

import torch
import torch.distributed as dist

from scaletorch.dist.functional import reduce_scatter_to_sequence_parallel_region
from scaletorch.parallel.ring_attention import merge as library_merge
from scaletorch.parallel.ring_attention import ring_schedule


class _CrossEntropyIgnoresGradOutput(torch.autograd.Function):
    """Megatron's vocabulary-parallel loss whose backward returns the gradient of an output
    gradient of 1, whatever it is given."""

    @staticmethod
    def forward(ctx, logits, targets, group):
        logits = logits.float().clone()
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        logits -= top.unsqueeze(-1)
        width, rank = logits.size(-1), dist.get_rank(group)
        outside = (targets < rank * width) | (targets >= (rank + 1) * width)
        local = (targets - rank * width).masked_fill(outside, 0)
        target_logit = logits[torch.arange(logits.size(0)), local].masked_fill(outside, 0.0)
        exp = logits.exp()
        total = torch.stack([exp.sum(dim=-1), target_logit])
        dist.all_reduce(total, group=group)
        ctx.save_for_backward(exp / total[0].unsqueeze(-1), local, outside)
        return (total[0].log() - total[1]).mean()

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        g = softmax.clone()
        g[torch.arange(g.size(0)), local] -= (~outside).float()
        return g / g.size(0), None, None  # grad never used


def cross_entropy_ignores_grad_output(logits, targets, group):
    return _CrossEntropyIgnoresGradOutput.apply(logits.reshape(-1, logits.size(-1)),
                                                targets.reshape(-1), group)


class _ReduceOverTheWorld(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        dist.all_reduce(x)  # no group: the world's
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


def exit_region_over_the_world(x, group, sequence_parallel):
    """f-bar's all-reduce with no group: right only where the tp group is the world."""
    if sequence_parallel:
        return reduce_scatter_to_sequence_parallel_region(x, group, dim=1)
    return _ReduceOverTheWorld.apply(x)


def slice_ids_ignores_order(cp_rank, cp_size, order="zigzag"):
    """Always zigzag's pair."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def ring_forward_reversed(q, kv, group, order, tile):
    """The library's ring, with the K/V sent to r - 1 and received from r + 1."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    to = dist.get_global_rank(group, (rank - 1) % cp)
    source = dist.get_global_rank(group, (rank + 1) % cp)
    qs = q.chunk(2, dim=2)
    merged = {}
    for t, tiles in enumerate(ring_schedule(rank, cp, order)):
        if t + 1 < cp:
            recv = torch.empty_like(kv)
            works = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, kv, to, group),
                dist.P2POp(dist.irecv, recv, source, group)
            ])
        ks, vs = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
        for a, b, kind in tiles:
            if kind != "skipped":
                o, lse = tile(qs[a], ks[b], vs[b], kind == "diagonal")
                merged[a] = library_merge(*merged[a], o.float(), lse) if a in merged else \
                    (o.float(), lse)
        if t + 1 < cp:
            for work in works:
                work.wait()
            kv = recv
    return (torch.cat([merged[0][0], merged[1][0]],
                      dim=2), torch.cat([merged[0][1], merged[1][1]], dim=2))


# (chapter, exercise, function, words its diagnosis must hold)
MISTAKES = [
    ("03", "vocab_parallel_cross_entropy", "cross_entropy_ignores_grad_output",
     "its gradient is 2.67x = 1 / 0.375 the library's: the backward ignores its output gradient"),
    ("05", "slice_ids", "slice_ids_ignores_order",
     "slice_ids(0, 2, 'contiguous') returned (0, 3), zigzag's pair"),
    ("05", "ring_forward", "ring_forward_reversed", "the ring sends to the next rank, r + 1 mod N"),
]
# (exercise, function, words) of chapter 03 that only the grader's 4 ranks see (its tp group is
# not the world): tests/test_grade.py's GradeOverTheTpGroup
WIDE = [("exit_region", "exit_region_over_the_world",
         "f-bar's forward equals the same operation over the whole world (4 ranks), not over the "
         "tp group it is given (2 ranks)")]
