"""Chapter 03's planted mistakes (scripts/grading/tensor.py grades them): the library's
enter_region, exit_region and vocab_parallel_cross_entropy, each with one learner's mistake.
scripts/grading/variants.py names them all (``PLANTED``) and gives each one's ``Source``."""

from typing import Dict, Tuple

import torch
import torch.distributed as dist

from scaletorch.dist import comm
from scaletorch.dist.comm import Group
from scaletorch.dist.functional import (copy_to_parallel_region,
                                        gather_from_sequence_parallel_region,
                                        reduce_from_parallel_region,
                                        reduce_scatter_to_sequence_parallel_region)
from scaletorch.dist.split_regions import gather_from_parallel_region, scatter_to_parallel_region

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
