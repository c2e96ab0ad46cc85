"""Exercises of chapter 05 (doc/05_context_parallel.md): the zigzag split, the merge, the ring.

Each is scaletorch/parallel/ring_attention.py's function with its body removed. Write one, then

    python scripts/grade.py 05

runs chapter 05 on 2 gloo ranks (ring attention, cp 2) and compares every call of your function
with the library's on the same inputs; it says "passed" or what is wrong, and names the
function to write next. ``slice_ids`` and ``merge`` do not communicate; ``ring_forward`` passes
K and V around the ring with ``ring._exchange(tensor, group, ring.KV_TAG)`` (post a send to the next
rank and a receive from the previous one: (the received buffer, works to ``ring._wait`` for)),
and calls ``merge``. The grader runs your ``ring_forward`` with the library's ``slice_ids`` and
``merge``: each exercise is judged on its own.
"""

from typing import Dict, Tuple  # noqa: F401 - Dict: for your code

import torch

from scaletorch.dist import comm  # noqa: F401 - comm.group_rank, comm.group_size: for your code
from scaletorch.dist.comm import Group
from scaletorch.parallel import ring_attention as ring  # noqa: F401 - ring._exchange, ring._wait,
# ring.KV_TAG, ring.ring_schedule: for your code
from scaletorch.parallel.ring_attention import Attended, KeysValues, LogSumExp, Queries, Tile


def slice_ids(cp_rank: int, cp_size: int, order: str = "zigzag") -> Tuple[int, int]:
    """The two of the 2 x cp_size sequence slices that ``cp_rank`` holds, in sequence order;
    zigzag balances the causal work over the cp group, contiguous gives two neighbours. Any
    other order raises ValueError (zigzag_positions and Ulysses refuse a misspelt order so)."""
    raise NotImplementedError


def merge(out: torch.Tensor, lse: torch.Tensor, tile_out: torch.Tensor,
          tile_lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Combine softmax attention over two disjoint key sets (doc/05_context_parallel.md):
    out, tile_out (b, h, s, d) and lse, tile_lse (b, h, s), fp32; no communication.

    out_i = sum_j exp(s_ij - lse) v_j over keys j; with lse = log(e^lse_a + e^lse_b),
    out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b. Every exponent is <= 0: stable.
    """
    raise NotImplementedError


def ring_forward(q: Queries, kv: KeysValues, group: Group, order: str,
                 tile: Tile) -> Tuple[Attended, LogSumExp]:
    """Causal attention of this rank's queries over the whole sequence, K and V passed around
    the ring of ``group`` (cp, N ranks): N steps, N - 1 messages.

    q (b, hq, s, d) and kv (2, b, hkv, s, d): this rank's two slices, in q's dtype. At step t
    the rank holds the K/V of rank (r - t) mod N and posts its send to rank r + 1 and its receive
    from rank r - 1 (``_exchange``) before computing. ``tile(q_half, k_half, v_half, causal)``:
    one tile's out (b, hq, s/2, d) and lse (b, hq, s/2), merged into each query half's running
    (out, lse) with ``merge``. Returns out (b, hq, s, d) and lse (b, hq, s), fp32.
    """
    raise NotImplementedError
