"""The differentiable all-to-all of chapter 05's Ulysses and chapter 06's token dispatch:
forward an all-to-all of dim-0 slices, backward the same with the split sizes swapped (each
received row's gradient goes back to the rank it came from)."""

from typing import Any, List, Optional, Tuple

import torch

from scaletorch.dist import comm
from scaletorch.dist.comm import Group


class _AllToAll(torch.autograd.Function):
    """Forward: all-to-all of dim-0 slices; backward: the reverse all-to-all (splits swapped)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, output_split_sizes: Optional[List[int]],
                input_split_sizes: Optional[List[int]], group: Group,
                name: Optional[str]) -> torch.Tensor:
        ctx.group, ctx.name = group, name
        ctx.output_split_sizes, ctx.input_split_sizes = output_split_sizes, input_split_sizes
        n = comm.group_size(group)
        rows = sum(output_split_sizes) if output_split_sizes is not None else x.shape[0]
        if output_split_sizes is None and x.shape[0] % n != 0:
            raise ValueError(f"all_to_all without split sizes needs dim 0 ({x.shape[0]}) "
                             f"divisible by the group size ({n})")
        out = x.new_empty((rows, *x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), output_split_sizes, input_split_sizes, group,
                               name=name)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None, None, None, None]:
        # What this rank received from rank j goes back to rank j: the splits swap roles.
        out = _AllToAll.apply(grad.contiguous(), ctx.input_split_sizes, ctx.output_split_sizes,
                              ctx.group, ctx.name)
        return out, None, None, None, None


def all_to_all(x: torch.Tensor, output_split_sizes: Optional[List[int]],
               input_split_sizes: Optional[List[int]], group: Group,
               name: Optional[str] = None) -> torch.Tensor:
    """Differentiable all-to-all along dim 0.

    x (sum(input_split_sizes), ...) -> (sum(output_split_sizes), ...); backward is the reverse.
    ``name``: the ledger's label of both directions (comm.py).
    """
    return _AllToAll.apply(x, output_split_sizes, input_split_sizes, group, name)
