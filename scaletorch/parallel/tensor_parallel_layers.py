"""Megatron's tensor-parallel layers over one "tp" group: where f, f-bar, g and g-bar sit
(tensor_parallel.py draws them), the column, row and vocabulary-parallel layers, and the loss
that never gathers the logits. ``ParallelRMSNorm.normalize`` and
``VocabParallelEmbedding.lookup`` give what enters and leaves a region, so a later chapter can
extend them in a subclass of its own.
"""

from typing import Any, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import nn

from scaletorch.dist import comm
from scaletorch.dist.comm import Group
from scaletorch.dist.functional import (copy_to_parallel_region,
                                        gather_from_sequence_parallel_region,
                                        reduce_from_parallel_region,
                                        reduce_scatter_to_sequence_parallel_region)
from scaletorch.dist.layout_check import check_sequence_parallel_length, check_split
from scaletorch.models import RMSNorm

# What one tp rank holds (jaxtyping; tests/test_tensor_parallel_shapes.py checks it at run time):
# b sequences of s tokens; s_sp = s / tp under sequence parallel, s without it; h features
# (h_tp = h / tp of them on this rank); v_tp = V / tp vocabulary rows; n = b s tokens.
FullSequence = Float[torch.Tensor, "b s h"]  # every token: after f or g, or a partial sum
SequenceShard = Float[torch.Tensor, "b s_sp h"]  # the region's input or output
ColumnShard = Float[torch.Tensor, "b s h_tp"]  # a column-parallel output, a row-parallel input
Logits = Float[torch.Tensor, "b s v_tp"]
TokenIds = Int[torch.Tensor, "b s"]
TokenLogits = Float[torch.Tensor, "n v_tp"]
TokenTargets = Int[torch.Tensor, "n"]
Scalar = Float[torch.Tensor, ""]


def _mark_sharded(param: nn.Parameter, dim: int) -> nn.Parameter:
    """Tag a parameter as split over tp along ``dim`` (for grad-norm and gathering)."""
    setattr(param, "tensor_model_parallel", True)
    setattr(param, "partition_dim", dim)
    return param


# [core: regions]
def enter_region(x: SequenceShard, group: Group, sequence_parallel: bool) -> FullSequence:
    """Hand x (b, s_sp, h), fp32 or the compute dtype, to column-parallel matmuls over ``group``.

    Without sequence parallel, f: forward identity, backward all-reduce of the gradient.
    With it, g: forward all-gather of the sequence (b, s/tp, h) -> (b, s, h) along dim 1,
    backward reduce-scatter of the gradient along dim 1.
    """
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, group, dim=1)
    return copy_to_parallel_region(x, group)


def exit_region(x: FullSequence, group: Group, sequence_parallel: bool) -> SequenceShard:
    """Sum the partial outputs x (b, s, h) of row-parallel shards over ``group``.

    Without sequence parallel, f-bar: forward all-reduce, backward identity.
    With it, g-bar: forward reduce-scatter along dim 1, (b, s, h) -> (b, s/tp, h), backward
    all-gather of the gradient along dim 1.
    """
    if sequence_parallel:
        return reduce_scatter_to_sequence_parallel_region(x, group, dim=1)
    return reduce_from_parallel_region(x, group)


# [end: regions]
class ColumnParallelLinear(nn.Module):
    """y_i = x A_i^T: this rank holds rows [i out/N, (i+1) out/N) of A (no bias).

    x: (b, s, in) replicated, or (b, s/N, in) under sequence parallel; y: (b, s, out/N).
    ``enter_region=False`` when the caller already applied f (or g) once for several layers
    reading the same input (q/k/v, gate/up): one collective instead of three.
    """

    def __init__(self, in_features: int, out_features: int, group: Group, *,
                 sequence_parallel: bool = False, enter_region: bool = True) -> None:
        super().__init__()
        n = comm.group_size(group)
        check_split(out_features, n, "column-parallel output size")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.enter_region = enter_region
        self.weight = _mark_sharded(nn.Parameter(torch.empty(out_features // n, in_features)), 0)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Group, **kwargs: Any) -> "ColumnParallelLinear":
        """This rank's row block of ``linear.weight`` (copied, so results equal the full layer)."""
        out_features, in_features = linear.weight.shape
        layer = cls(in_features, out_features, group, **kwargs).to(linear.weight)
        rows = layer.weight.shape[0]
        with torch.no_grad():
            layer.weight.copy_(linear.weight[comm.group_rank(group) * rows:][:rows])
        return layer

    # [core: column-forward]
    def forward(self, x: SequenceShard) -> ColumnShard:
        """x (b, s_sp, in) -> this rank's output features (b, s, out/tp), after the entry.

        The entry (f, or g under sequence parallel) runs here unless ``enter_region`` is
        False, as for q/k/v and gate/up: ParallelRMSNorm.forward enters once for the three,
        and autograd sums their input gradients before one all-reduce instead of three.
        """
        if self.enter_region:
            x = enter_region(x, self.group, self.sequence_parallel)
        return F.linear(x, self.weight)  # (b, s, out/tp)


# [end: column-forward]
class RowParallelLinear(nn.Module):
    """y = sum_i x_i A_i^T: this rank holds columns [i in/N, (i+1) in/N) of A (no bias).

    x: (b, s, in/N), the output of a column-parallel layer; y: (b, s, out) after the
    all-reduce over ``group``, or (b, s/N, out) after the reduce-scatter under sequence parallel.
    """

    def __init__(self, in_features: int, out_features: int, group: Group, *,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        n = comm.group_size(group)
        check_split(in_features, n, "row-parallel input size")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = _mark_sharded(nn.Parameter(torch.empty(out_features, in_features // n)), 1)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Group, **kwargs: Any) -> "RowParallelLinear":
        """This rank's column block of ``linear.weight``."""
        out_features, in_features = linear.weight.shape
        layer = cls(in_features, out_features, group, **kwargs).to(linear.weight)
        cols = layer.weight.shape[1]
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, comm.group_rank(group) * cols:][:, :cols])
        return layer

    # [core: row-forward]
    def forward(self, x: ColumnShard) -> SequenceShard:
        """x (b, s, in/tp) -> (b, s_sp, out): this rank's partial sum, then the exit (f-bar, or
        g-bar under sequence parallel)."""
        partial = F.linear(x, self.weight)  # (b, s, out), this rank's share of the sum
        return exit_region(partial, self.group, self.sequence_parallel)


# [end: row-forward]
class VocabParallelEmbedding(nn.Module):
    """Rows [i V/N, (i+1) V/N) of the embedding table on rank i.

    ids: (b, s) -> (b, s, h) after an all-reduce over ``group`` (each token's row lives on one
    rank; the others contribute zeros), or (b, s/N, h) after a reduce-scatter under sequence
    parallel.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Group, *,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        n = comm.group_size(group)
        check_split(num_embeddings, n, "vocabulary size", " (examples/10_real_model.py pads it)")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab_start = comm.group_rank(group) * (num_embeddings // n)
        self.weight = _mark_sharded(nn.Parameter(torch.empty(num_embeddings // n, embedding_dim)),
                                    0)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: Group,
                       **kwargs: Any) -> "VocabParallelEmbedding":
        """This rank's rows of ``embedding`` (copied)."""
        num_embeddings, embedding_dim = embedding.weight.shape
        layer = cls(num_embeddings, embedding_dim, group, **kwargs).to(embedding.weight)
        rows = layer.weight.shape[0]
        with torch.no_grad():
            layer.weight.copy_(embedding.weight[layer.vocab_start:][:rows])
        return layer

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (b, s) -> this rank's share of the embeddings (b, s, h): zeros for other rows."""
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (b, s, h)
        return out.masked_fill(outside.unsqueeze(-1), 0.0)  # rows held by other ranks

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            check_sequence_parallel_length(ids.size(1), comm.group_size(self.group))
        return exit_region(self.lookup(ids), self.group, self.sequence_parallel)


class ParallelRMSNorm(RMSNorm):
    """RMSNorm whose output feeds column-parallel matmuls: norm, then f (or g, the all-gather).

    Doing the entry here, once, serves q/k/v (or gate/up, or the head) with one collective.
    x: (b, s, h) or (b, s/N, h) under sequence parallel -> (b, s, h). Under sequence parallel
    each rank normalizes only its tokens, so the weight goes through f: its gradient is
    all-reduced over ``group`` in backward and stays identical on every rank.
    """

    def __init__(self, dim: int, eps: float, group: Group, sequence_parallel: bool) -> None:
        super().__init__(dim, eps)
        self.group, self.sequence_parallel = group, sequence_parallel

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm of x (..., h) in fp32, returned in x's dtype; under sequence parallel the
        weight goes through f (its gradient all-reduced over ``group``)."""
        weight: torch.Tensor = self.weight
        if self.sequence_parallel:
            weight = copy_to_parallel_region(weight, self.group)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed * weight.float()).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return enter_region(self.normalize(x), self.group, self.sequence_parallel)


# [core: cross-entropy]
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of vocab-sharded logits (n, V/N); targets (n,) global ids.

    Forward: all-reduce MAX of the row max (n), then one all-reduce SUM of [sum exp, target
    logit] (2 n) over ``group``. Backward: (softmax - one_hot) / n, local, no communication.
    """

    @staticmethod
    def forward(ctx: Any, logits: TokenLogits, targets: TokenTargets, group: Group) -> Scalar:
        logits32 = logits.float()
        row_max = logits32.max(dim=-1).values  # (n,)
        comm.all_reduce(row_max, group, op=dist.ReduceOp.MAX)
        shifted = logits32 - row_max.unsqueeze(-1)  # (n, V/N), <= 0 everywhere
        vocab_local = logits.size(-1)
        local = targets - comm.group_rank(group) * vocab_local
        mine = (local >= 0) & (local < vocab_local)  # this rank holds the target's logit
        local = local.masked_fill(~mine, 0)
        # where, not a product: a masked column's logit is -inf there (-inf * 0 = nan)
        target_logit = torch.where(mine, shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
        exp = shifted.exp()
        stats = torch.stack((exp.sum(dim=-1), target_logit))  # (2, n)
        comm.all_reduce(stats, group)
        sum_exp, target_logit = stats[0], stats[1]
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, mine)
        ctx.input_dtype = logits.dtype
        return (sum_exp.log() - target_logit).mean()

    @staticmethod
    def backward(ctx: Any, grad: Scalar) -> Tuple[TokenLogits, None, None]:
        softmax, local, mine = ctx.saved_tensors  # softmax: (n, V/N) of the full distribution
        grad_logits = softmax.clone()
        rows = torch.arange(grad_logits.size(0), device=grad_logits.device)
        grad_logits[rows, local] -= mine.to(grad_logits.dtype)
        grad_logits.mul_(grad / grad_logits.size(0))
        return grad_logits.to(ctx.input_dtype), None, None


# [end: cross-entropy]
def vocab_parallel_cross_entropy(logits: Logits, targets: TokenIds, group: Group) -> Scalar:
    """Mean cross-entropy of logits (b, s, V/tp), any float dtype, sharded over ``group`` by
    vocabulary (rank r holds columns [r V/tp, (r+1) V/tp)) and targets (b, s), int64 global ids.

    Equals ``models.loss_fn`` on the gathered logits, never gathering them: an all-reduce MAX
    of each token's max, then one all-reduce SUM of [sum of exp, target logit] over ``group``;
    the backward, (softmax - one_hot) / (b s), needs no communication. Returns the fp32 mean.
    """
    return _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.size(-1)),
                                            targets.reshape(-1), group)
