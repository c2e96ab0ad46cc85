"""Exercises of chapter 05 (doc/05_context_parallel.md): the zigzag split and the ring's merge.

Each is scaletorch/parallel/ring_attention.py's function with its body removed. Write one, then

    python scripts/grade.py 05

runs chapter 05 on 2 gloo ranks (ring attention, cp 2) and compares every call of your function
with the library's on the same inputs; it says "passed" or what is wrong, and names the
function to write next. Neither communicates: the ring passes K and V between them.
"""

from typing import Tuple

import torch


def chunk_ids(cp_rank: int, cp_size: int, order: str = "zigzag") -> Tuple[int, int]:
    """The two of the 2 x cp_size sequence chunks that ``cp_rank`` holds, in sequence order;
    zigzag balances the causal work over the cp group, contiguous gives two neighbours."""
    raise NotImplementedError


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
          block_lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Combine softmax attention over two disjoint key sets (doc/05_context_parallel.md):
    out, block_out (b, h, s, d) and lse, block_lse (b, h, s), fp32; no communication.

    out_i = sum_j exp(s_ij - lse) v_j over keys j; with lse = log(e^lse_a + e^lse_b),
    out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b. Every exponent is <= 0: stable.
    """
    raise NotImplementedError
