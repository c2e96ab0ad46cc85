"""Probe 54 round 3's learners' mistakes, as tests/test_grade.py grades them: a loss whose backward
torch has not (``loss // m``: named at the learner's return line, not torch's), a function that
changes torch's default dtype (graded in chapter 06b's world, the next jobs unaffected), a
cross-entropy whose shard offset comes from the world rank and that picks the target's raw logit
(not the shifted one: a target no rank holds then adds 0 to the raw logit), and a function that
never returns (the grader's CPU limit for one job, tests/test_grade.py's long phase)."""

import torch
import torch.distributed as dist

from scaletorch.dist.functional import reduce_from_parallel_region
from scaletorch.parallel.moe_balance import biased_top_k as library_biased_top_k


def biased_top_k_sets_float64(probs, bias, k):
    """Right choices and weights, but every tensor made after it would be float64."""
    torch.set_default_dtype(torch.float64)
    return library_biased_top_k(probs, bias, k)


def update_bias_never_returns(bias, load, rate):
    """A loop whose condition never changes: the rank computes until the grader stops it."""
    spins = 0
    while load.numel() > 0:
        spins += 1
    return bias


def vocab_parallel_cross_entropy_world_offset_raw(logits, targets, group):
    """The shard offset from dist.get_rank(), the target's logit picked unshifted; right on
    ranks 0 and 1 of tp 2 x dp 2, wrong on ranks 2 and 3."""
    z = logits.reshape(-1, logits.size(-1)).float()
    width = z.size(-1)
    top = z.max(dim=-1).values.detach()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    local = targets.reshape(-1) - dist.get_rank() * width
    mine = (local >= 0) & (local < width)
    picked = z.gather(-1, local.clamp(0, width - 1).unsqueeze(-1))[:, 0] * mine
    both = reduce_from_parallel_region(
        torch.stack(((z - top.unsqueeze(-1)).exp().sum(dim=-1), picked)), group)
    return (both[0].log() + top - both[1]).mean()


def micro_batch_loss_floor_divides(loss, m):
    """An integer division: torch has no backward for it (the error is torch's, in backward)."""
    return loss // m


MISTAKES = [("04", "micro_batch_loss", "micro_batch_loss_floor_divides",
             "derivative for aten::floor_divide is not implemented (in the backward of the loss "
             "micro_batch_loss returned at grading_probe_r3.py:"),
            ("06b", "biased_top_k", "biased_top_k_sets_float64",
             "biased_top_k left torch's default dtype at torch.float64 (it was torch.float32): "
             "every job after it")]
WIDE = [("vocab_parallel_cross_entropy", "vocab_parallel_cross_entropy_world_offset_raw",
         "the loss is off on ranks 2 and 3 (rank 2: tp rank 0 of the tp group [2, 3], rank 3: tp "
         "rank 1 of the tp group [2, 3]) and right on ranks 0 and 1")]
MUST_NOT = {
    "vocab_parallel_cross_entropy_world_offset_raw": ["subtract r V/tp"],
    "micro_batch_loss_floor_divides": ["graph.py"]
}
# chapter, exercise, function, the words of its verdict
NEVER_RETURNS = ("06b", "update_bias", "update_bias_never_returns",
                 "was still computing in update_bias_never_returns (grading_probe_r3.py:")
