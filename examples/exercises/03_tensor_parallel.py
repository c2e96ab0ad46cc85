"""Exercises of chapter 03 (doc/03_tensor_parallel.md): f, f-bar, g, g-bar and the loss.

Each is scaletorch/parallel/tensor_parallel_layers.py's function with its body removed. Write
one, then

    python scripts/grade.py 03

runs chapter 03 on 2 gloo ranks (tp 2), without and then with sequence parallel, with your
function beside the library's. Each call gets the same input, and in backward the same output
gradient; it says "passed" or what is wrong, and names the function to write next.
``torch.distributed``'s collectives are invisible to autograd: write each operator as a
``torch.autograd.Function`` whose backward runs the conjugate collective. The collectives
without autograd are in scaletorch.dist: ``comm.all_reduce(t, group, op=...)`` (in place),
functional's ``all_reduce_sum``, ``gather_along_dim`` and ``reduce_scatter_along_dim``, and
split_regions' ``split_along_dim`` (out of place, any dim).
"""

import torch  # noqa: F401 - for your torch.autograd.Function

from scaletorch.dist import comm  # noqa: F401 - the collectives
from scaletorch.dist.comm import Group
from scaletorch.dist.functional import all_reduce_sum  # noqa: F401 - and the three below
from scaletorch.dist.functional import gather_along_dim  # noqa: F401
from scaletorch.dist.functional import reduce_scatter_along_dim  # noqa: F401
from scaletorch.dist.split_regions import split_along_dim  # noqa: F401
from scaletorch.parallel.tensor_parallel_layers import (FullSequence, Logits, Scalar, SequenceShard,
                                                        TokenIds)


def enter_region(x: SequenceShard, group: Group, sequence_parallel: bool) -> FullSequence:
    """Hand x (b, s_sp, h), fp32 or the compute dtype, to column-parallel matmuls over ``group``.

    Without sequence parallel, f: forward identity, backward all-reduce of the gradient.
    With it, g: forward all-gather of the sequence (b, s/tp, h) -> (b, s, h) along dim 1,
    backward reduce-scatter of the gradient along dim 1.
    """
    raise NotImplementedError


def exit_region(x: FullSequence, group: Group, sequence_parallel: bool) -> SequenceShard:
    """Sum the partial outputs x (b, s, h) of row-parallel shards over ``group``.

    Without sequence parallel, f-bar: forward all-reduce, backward identity.
    With it, g-bar: forward reduce-scatter along dim 1, (b, s, h) -> (b, s/tp, h), backward
    all-gather of the gradient along dim 1.
    """
    raise NotImplementedError


def vocab_parallel_cross_entropy(logits: Logits, targets: TokenIds, group: Group) -> Scalar:
    """Mean cross-entropy of logits (b, s, V/tp), any float dtype, sharded over ``group`` by
    vocabulary (rank r holds columns [r V/tp, (r+1) V/tp)) and targets (b, s), int64 global ids.

    Equals ``models.loss_fn`` on the gathered logits, never gathering them: an all-reduce MAX
    of each token's max, then one all-reduce SUM of [sum of exp, target logit] over ``group``;
    the backward, (softmax - one_hot) / (b s), needs no communication. Returns the fp32 mean.
    """
    raise NotImplementedError
