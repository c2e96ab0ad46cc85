"""Chapter 05's planted mistakes (scripts/grading/context.py grades them): the library's slice_ids,
merge and ring_forward, each with one learner's mistake. scripts/grading/variants.py names them
all (``PLANTED``) and gives each one's ``Source``."""

from typing import Callable, Dict, Tuple

import torch

from scaletorch.dist import comm
from scaletorch.dist.comm import Group
from scaletorch.parallel.ring_attention import KV_TAG, _exchange, _wait, merge, ring_schedule

# ---- chapter 05: slice_ids -----------------------------------------------------------------


def slice_ids_contiguous(cp_rank: int, cp_size: int, order: str = "zigzag") -> Tuple[int, int]:
    return 2 * cp_rank, 2 * cp_rank + 1  # the last rank gets every query's full causal work


def slice_ids_past_the_end(cp_rank: int, cp_size: int, order: str = "zigzag") -> Tuple[int, int]:
    if order == "zigzag":
        return cp_rank, 2 * cp_size - cp_rank  # the mirror off by one
    return 2 * cp_rank, 2 * cp_rank + 1


def slice_ids_unsorted(cp_rank: int, cp_size: int, order: str = "zigzag") -> Tuple[int, int]:
    if order == "zigzag":
        return 2 * cp_size - 1 - cp_rank, cp_rank  # the late slice first
    return 2 * cp_rank, 2 * cp_rank + 1


# ---- chapter 05: merge ---------------------------------------------------------------------


def merge_without_max_shift(out: torch.Tensor, lse: torch.Tensor, tile_out: torch.Tensor,
                            tile_lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    a, b = torch.exp(lse), torch.exp(tile_lse)  # e^lse overflows for large scores
    merged = (a.unsqueeze(-1) * out + b.unsqueeze(-1) * tile_out) / (a + b).unsqueeze(-1)
    return merged, torch.log(a + b)


def merge_lse_kept(out: torch.Tensor, lse: torch.Tensor, tile_out: torch.Tensor,
                   tile_lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    new_lse = torch.logaddexp(lse, tile_lse)
    merged = torch.exp(lse - new_lse).unsqueeze(-1) * out + \
        torch.exp(tile_lse - new_lse).unsqueeze(-1) * tile_out
    return merged, lse  # the next tile merges with the first tile's statistics


def merge_plain_average(out: torch.Tensor, lse: torch.Tensor, tile_out: torch.Tensor,
                        tile_lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    return (out + tile_out) / 2, torch.logaddexp(lse, tile_lse)  # blocks weigh the same


# ---- chapter 05: ring_forward --------------------------------------------------------------


def _ring(q: torch.Tensor, kv: torch.Tensor, group: Group, order: str, tile: Callable,
          messages: Callable[[int, int], bool], keep_last: bool = False,
          skip: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """The library's ring with a mistake: ``messages(t, cp)`` says whether step t exchanges,
    ``keep_last`` keeps the last tile instead of merging, ``skip=False`` computes every tile."""
    cp, rank = comm.group_size(group), comm.group_rank(group)
    qs, merged = q.chunk(2, dim=2), {}
    for t, tiles in enumerate(ring_schedule(rank, cp, order)):
        if messages(t, cp):
            next_kv, works = _exchange(kv, group, KV_TAG)
        ks, vs = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
        for a, b, kind in tiles:
            if kind == "skipped" and skip:
                continue
            o, lse = tile(qs[a], ks[b], vs[b], kind == "diagonal")
            o = o.float()
            merged[a] = merge(*merged[a], o, lse) if a in merged and not keep_last else (o, lse)
        if messages(t, cp):
            _wait(works)
            kv = next_kv
    out = torch.cat([merged[0][0], merged[1][0]], dim=2)
    return out, torch.cat([merged[0][1], merged[1][1]], dim=2)


def ring_never_exchanges(q: torch.Tensor, kv: torch.Tensor, group: Group, order: str,
                         tile: Callable) -> Tuple[torch.Tensor, torch.Tensor]:
    return _ring(q, kv, group, order, tile, lambda t, cp: False)  # its own K/V at every step


def ring_exchanges_every_step(q: torch.Tensor, kv: torch.Tensor, group: Group, order: str,
                              tile: Callable) -> Tuple[torch.Tensor, torch.Tensor]:
    return _ring(q, kv, group, order, tile, lambda t, cp: True)  # the last K/V goes unused


def ring_keeps_last_tile(q: torch.Tensor, kv: torch.Tensor, group: Group, order: str,
                         tile: Callable) -> Tuple[torch.Tensor, torch.Tensor]:
    return _ring(q, kv, group, order, tile, lambda t, cp: t + 1 < cp, keep_last=True)


def ring_attends_skipped_tiles(q: torch.Tensor, kv: torch.Tensor, group: Group, order: str,
                               tile: Callable) -> Tuple[torch.Tensor, torch.Tensor]:
    return _ring(q, kv, group, order, tile, lambda t, cp: t + 1 < cp, skip=False)


# (chapter, exercise, variant) -> words its diagnosis must contain
CATALOGUE: Dict[Tuple[str, str, str], str] = {
    ("05", "slice_ids", "slice_ids_contiguous"):
    "slice_ids(0, 2, 'zigzag') returned (0, 1), the contiguous split: zigzag pairs",
    ("05", "slice_ids", "slice_ids_past_the_end"):
    "returned (0, 2): there are 2 x 1 = 2 slices, numbered 0 to 1",
    ("05", "slice_ids", "slice_ids_unsorted"):
    "returned (1, 0): give the two slices in sequence order, (0, 1)",
    ("05", "merge", "merge_without_max_shift"): "merging tiles with lse 100 and 90 gave nan",
    ("05", "merge", "merge_lse_kept"):
    "merge's output matches, its lse does not: return the merged",
    ("05", "merge", "merge_plain_average"): "merge averaged the two tiles' outputs: weight each",
    ("05", "ring_forward", "ring_never_exchanges"):
    "ring_forward sent no K/V message on rank 0 in step 0",
    ("05", "ring_forward", "ring_exchanges_every_step"):
    "ring_forward sent 3 blocks of K/V on rank 0 in step 0",
    ("05", "ring_forward", "ring_keeps_last_tile"): "below the library's",
    ("05", "ring_forward", "ring_attends_skipped_tiles"): "above the library's",
}
