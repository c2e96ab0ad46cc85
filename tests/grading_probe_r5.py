"""Probe 54 round 5's learners' mistakes, as tests/test_grade.py grades them."""

import torch

from scaletorch.dist import comm
from scaletorch.parallel.loss_scale import unscale_and_check as library_unscale_and_check
from scaletorch.parallel.tensor_parallel_layers import \
    vocab_parallel_cross_entropy as library_cross_entropy

MISTAKES = []
MUST_NOT = {}

# ---- g14b: chapters 01, 03, 08 ------------------------------------------------------------


def average_divided_while_in_flight(grads, group):
    """One flat all-reduce, divided before its wait: the division races with the sum (the
    gradients come out a mix of mean and sum, or right when the race happens to go well)."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    work = comm.all_reduce(flat, group, async_op=True)
    flat /= comm.group_size(group)
    work.wait()
    off = 0
    for g in grads:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()


def cross_entropy_cast_to_logits_dtype(logits, targets, group):
    """The right loss, cast back to the logits' dtype: bf16 logits give a bf16 loss."""
    return library_cross_entropy(logits, targets, group).to(logits.dtype)


def cross_entropy_returned_in_bf16(logits, targets, group):
    """The right loss, always returned in bf16: off by its rounding, not by a target's shard."""
    return library_cross_entropy(logits, targets, group).to(torch.bfloat16)


def unscale_and_check_skipped_when_alone(grads, scale, group, agree=True):
    """With agree=False neither unscaled nor checked: every inf and NaN found with agree=True."""
    if not agree:
        return False
    return library_unscale_and_check(grads, scale, group, agree)


MISTAKES += [
    ("01", "average_gradients", "average_divided_while_in_flight",
     "while that tensor's all-reduce was in flight (launched with async_op=True"),
    ("03", "vocab_parallel_cross_entropy", "cross_entropy_cast_to_logits_dtype",
     "given torch.bfloat16 logits, the loss came back in torch.bfloat16 (the logits' dtype)"),
    ("03", "vocab_parallel_cross_entropy", "cross_entropy_returned_in_bf16",
     "given torch.float32 logits, the loss came back in torch.bfloat16"),
    ("08", "unscale_and_check", "unscale_and_check_skipped_when_alone",
     "did not find it with agree=False, yet with agree=True the check found every one"),
]
MUST_NOT.update({
    "cross_entropy_returned_in_bf16": ["target", "shard"],
    "unscale_and_check_skipped_when_alone": ["look at every element"],
})
