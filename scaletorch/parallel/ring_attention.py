"""Ring attention: context parallel's default attention (chapter 05), by hand.

The N ranks of a "cp" group each hold two of the 2N slices of every sequence (``slice_ids``:
zigzag, rank r keeps slices r and 2N-1-r, or contiguous). K/V slices travel around the ring;
at step t a rank holds the K/V of rank (r - t) mod N, attends its queries to them tile by
tile (a tile is full, diagonal or skipped under the causal mask: ``ring_schedule``) and
merges the partial results with their log-sum-exp. Forward: each rank sends its K and V
(hkv heads, not expanded) N-1 times per layer. Backward: K/V go round again (N-1 sends) and
dK/dV go round back to their owners (N sends). K/V and dK/dV cross the ring in q's dtype; the
merges and the softmax statistics (log-sum-exp) are fp32, the tiles too under ``kernel="math"``
(attention_kernels.py: the fused tiles, the default on CUDA). context_parallel.py shards the
sequences and installs this attention (or Ulysses).
"""

import math
from contextlib import nullcontext
from functools import partial
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple, cast

import torch
import torch.distributed as dist
from jaxtyping import Float
from torch import nn

from scaletorch.dist import comm
from scaletorch.dist.comm import Group
from scaletorch.parallel import attention_kernels as kernels

ORDERS = ("zigzag", "contiguous")
KERNELS = ("auto", "math", "fused", *kernels.OPS)  # auto: fused on CUDA, math elsewhere
KV_TAG, DKV_TAG = 1, 2  # distinct tags: K/V and dK/dV are in flight between the same ranks

# ---- which tokens each rank holds ------------------------------------------------------------


# [core: zigzag]
def slice_ids(cp_rank: int, cp_size: int, order: str = "zigzag") -> Tuple[int, int]:
    """The two of the 2 x cp_size sequence slices that ``cp_rank`` holds, in sequence order;
    zigzag balances the causal work over the cp group, contiguous gives two neighbours. Any
    other order raises ValueError (zigzag_positions and Ulysses refuse a misspelt order so)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    if order == "zigzag":
        return cp_rank, 2 * cp_size - 1 - cp_rank
    return 2 * cp_rank, 2 * cp_rank + 1


# [end: zigzag]
# ---- which (query slice, key slice) tiles are computed --------------------------------------


def tile_kind(q_slice: int, kv_slice: int) -> str:
    """Causal mask of one slice pair: "full" (keys all earlier), "diagonal", or "skipped"."""
    if kv_slice < q_slice:
        return "full"
    return "diagonal" if kv_slice == q_slice else "skipped"


def ring_schedule(cp_rank: int, cp_size: int,
                  order: str = "zigzag") -> List[List[Tuple[int, int, str]]]:
    """Per ring step, (local q half, kv half, kind) of the tiles ``cp_rank`` computes.

    At step t the rank holds the K/V of rank (cp_rank - t) mod cp_size.
    """
    q_slices = slice_ids(cp_rank, cp_size, order)
    steps = []
    for t in range(cp_size):
        kv_slices = slice_ids((cp_rank - t) % cp_size, cp_size, order)
        steps.append([(a, b, tile_kind(qc, kc)) for a, qc in enumerate(q_slices)
                      for b, kc in enumerate(kv_slices)])
    return steps


def tile_counts(cp_rank: int, cp_size: int, order: str = "zigzag") -> Dict[str, int]:
    """How many full / diagonal / skipped tiles ``cp_rank`` meets in one attention forward."""
    counts = {"full": 0, "diagonal": 0, "skipped": 0}
    for step in ring_schedule(cp_rank, cp_size, order):
        for _, _, kind in step:
            counts[kind] += 1
    return counts


# ---- attention on one tile, with its log-sum-exp --------------------------------------------
# q (b, hq, sq, d); k, v (b, hkv, sk, d); query head j uses kv head j // (hq / hkv).


def _grouped(q: torch.Tensor, hkv: int) -> torch.Tensor:
    b, hq, s, d = q.shape
    return q.reshape(b, hkv, hq // hkv, s, d)  # (b, hkv, g, s, d): broadcasts with kv heads


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    scores = _grouped(q, k.size(1)) @ k.unsqueeze(2).transpose(-2, -1) * scale
    if causal:  # the diagonal tile: query i sees keys 0..i of the same slice
        sq, sk = scores.shape[-2:]
        future = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores  # (b, hkv, g, sq, sk)


def _math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Readable path for every device: out (b, hq, sq, d) and lse (b, hq, sq)."""
    scores = _scores(q, k, causal, scale)
    lse = scores.logsumexp(dim=-1, keepdim=True)
    out = torch.exp(scores - lse) @ v.unsqueeze(2)
    return out.flatten(1, 2), lse.squeeze(-1).flatten(1, 2)


def _math_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool,
                   scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of one tile, given the *merged* out and lse of the whole row.

    p = exp(s - lse) is this tile's share of the final softmax, so the tile's gradients
    are those of ordinary attention with delta = rowsum(dout * out) (FlashAttention-2).
    """
    hkv = k.size(1)
    p = torch.exp(_scores(q, k, causal, scale) - _grouped(lse.unsqueeze(-1), hkv))
    dout_g = _grouped(dout, hkv)
    dv = (p.transpose(-2, -1) @ dout_g).sum(2)  # sum over the g query heads sharing a kv head
    dp = dout_g @ v.unsqueeze(2).transpose(-2, -1)
    delta = _grouped((dout * out).sum(-1, keepdim=True), hkv)
    ds = p * (dp - delta) * scale
    dq = (ds @ k.unsqueeze(2)).flatten(1, 2)
    dk = (ds.transpose(-2, -1) @ _grouped(q, hkv)).sum(2)
    return dq, dk, dv


# [core: merge]
def merge(out: torch.Tensor, lse: torch.Tensor, tile_out: torch.Tensor,
          tile_lse: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Combine softmax attention over two disjoint key sets (doc/05_context_parallel.md):
    out, tile_out (b, h, s, d) and lse, tile_lse (b, h, s), fp32; no communication.

    out_i = sum_j exp(s_ij - lse) v_j over keys j; with lse = log(e^lse_a + e^lse_b),
    out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b. Every exponent is <= 0: stable.
    """
    new_lse = torch.logaddexp(lse, tile_lse)
    out = torch.exp(lse - new_lse).unsqueeze(-1) * out + \
        torch.exp(tile_lse - new_lse).unsqueeze(-1) * tile_out
    return out, new_lse


# [end: merge]
# ---- ring attention ------------------------------------------------------------------------


def _ring_peers(group: Group) -> Tuple[int, int]:
    """Global ranks of the next and previous rank of ``group``'s ring."""
    ranks = dist.get_process_group_ranks(group)
    r = comm.group_rank(group)
    return ranks[(r + 1) % len(ranks)], ranks[(r - 1) % len(ranks)]


def _exchange(send: torch.Tensor, group: Group, tag: int) -> Tuple[torch.Tensor, list]:
    """Post: send ``send`` to the next rank, receive the previous rank's into a new buffer."""
    nxt, prev = _ring_peers(group)
    recv = torch.empty_like(send)
    ops = [
        dist.P2POp(dist.isend, send, nxt, group, tag),
        dist.P2POp(dist.irecv, recv, prev, group, tag)
    ]
    return recv, comm.batch_isend_irecv(ops, group, name="cp")


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _autocast_off(t: torch.Tensor) -> ContextManager[Any]:
    """Autocast off on ``t``'s device, if that device has an autocast to turn off."""
    on = torch.amp.is_autocast_available(t.device.type)
    return torch.autocast(t.device.type, enabled=False) if on else nullcontext()


def _upcast(kernel: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return (lambda t: t.float()) if kernel == "math" else (lambda t: t)


# What one cp rank holds (jaxtyping; tests/test_context_parallel.py checks it at run time):
# s = s_local, its two sequence slices; hq query heads, hkv key-value heads, d per head.
Queries = Float[torch.Tensor, "b hq s d"]
KeysValues = Float[torch.Tensor, "2 b hkv s d"]  # K and V stacked: one message
Attended = Float[torch.Tensor, "b hq s d"]
LogSumExp = Float[torch.Tensor, "b hq s"]
Tile = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], Tuple[torch.Tensor, torch.Tensor]]


# [core: ring-step]
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
    cp, rank = comm.group_size(group), comm.group_rank(group)
    qs = q.chunk(2, dim=2)
    merged: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # query half: (out, lse)
    for t, tiles in enumerate(ring_schedule(rank, cp, order)):
        if t + 1 < cp:  # post the next K/V before computing: comm overlaps compute
            next_kv, works = _exchange(kv, group, KV_TAG)
        ks, vs = kv[0].chunk(2, dim=2), kv[1].chunk(2, dim=2)
        for a, b, kind in tiles:
            if kind == "skipped":
                continue
            o, lse = tile(qs[a], ks[b], vs[b], kind == "diagonal")
            o = o.float()  # the merged output and lse are fp32 whatever the tile's
            merged[a] = merge(*merged[a], o, lse) if a in merged else (o, lse)
        if t + 1 < cp:
            _wait(works)
            kv = next_kv
    out = torch.cat([merged[0][0], merged[1][0]], dim=2)
    return out, torch.cat([merged[0][1], merged[1][1]], dim=2)


# [end: ring-step]


class _RingAttention(torch.autograd.Function):
    """Causal attention of local queries over the whole sequence, K/V passed around ``group``.

    q (b, hq, s_local, d), k and v (b, hkv, s_local, d): this rank's two slices, concatenated.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,
                order: str, kernel: str, counts: Dict[str, int]) -> torch.Tensor:
        tile_fwd = _math_forward if kernel == "math" else partial(kernels.forward, kernel)
        scale = 1.0 / math.sqrt(q.size(-1))
        dtype = q.dtype  # the compute dtype (bf16 under autocast): what crosses the ring
        up = _upcast(kernel)  # math: tiles in fp32; kernels: in the compute dtype
        with _autocast_off(q):  # merges in fp32

            def tile(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
                     causal: bool) -> Tuple[torch.Tensor, torch.Tensor]:
                return tile_fwd(up(qh), up(kh), up(vh), causal, scale)  # math: fp32

            out, lse = ring_forward(q, torch.stack([k, v]), group, order, tile)
            out = out.to(dtype)  # the softmax statistics stay fp32
        ctx.save_for_backward(q, k, v, out, lse)  # q, k, v, out in the compute dtype
        ctx.group, ctx.order, ctx.scale, ctx.counts = group, order, scale, counts
        ctx.kernel = kernel
        return out

    @staticmethod
    def backward(
        ctx: Any, dout: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None, None, None]:
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        cp, rank = comm.group_size(group), comm.group_rank(group)
        # Counted here, once per forward-and-backward: a forward run again before its backward
        # (to save memory) is not counted twice.
        for kind, n in tile_counts(rank, cp, ctx.order).items():
            ctx.counts[kind] += n
        tile_bwd = _math_backward if ctx.kernel == "math" else partial(kernels.backward, ctx.kernel)
        dtype, up = q.dtype, _upcast(ctx.kernel)  # dK/dV cross the ring in dtype; sums: fp32
        with _autocast_off(q):
            qs, outs, lses = up(q).chunk(2, 2), up(out).chunk(2, 2), lse.chunk(2, 2)
            douts = up(dout).chunk(2, 2)
            dq = torch.zeros_like(q, dtype=torch.float32)
            dqs = dq.chunk(2, dim=2)  # views: accumulating into them fills dq
            kv = torch.stack([k, v])
            dkv_in: Optional[torch.Tensor] = None
            dkv_works: List[Any] = []
            for t, tiles in enumerate(ring_schedule(rank, cp, ctx.order)):
                if t + 1 < cp:
                    next_kv, kv_works = _exchange(kv, group, KV_TAG)
                # dkv: gradient w.r.t. the K/V held now, i.e. of rank (rank - t) mod cp
                dkv = torch.zeros_like(kv, dtype=torch.float32)
                kv_up = up(kv)
                ks, vs = kv_up[0].chunk(2, dim=2), kv_up[1].chunk(2, dim=2)
                dks, dvs = dkv[0].chunk(2, dim=2), dkv[1].chunk(2, dim=2)
                for a, b, kind in tiles:
                    if kind == "skipped":
                        continue
                    dq_a, dk_b, dv_b = tile_bwd(douts[a], qs[a], ks[b], vs[b], outs[a], lses[a],
                                                kind == "diagonal", scale)
                    dqs[a].add_(dq_a)
                    dks[b].add_(dk_b)
                    dvs[b].add_(dv_b)
                if dkv_in is not None:  # what the ranks before us added to the same K/V
                    _wait(dkv_works)
                    dkv += dkv_in
                if cp > 1:  # pass it on; after cp hops it is back at its owner
                    dkv_in, dkv_works = _exchange(dkv.to(dtype), group, DKV_TAG)
                if t + 1 < cp:
                    _wait(kv_works)
                    kv = next_kv
            if cp > 1:
                _wait(dkv_works)
                dkv = cast(torch.Tensor, dkv_in)  # the last hop brought it back
        return dq.to(dtype), dkv[0].to(dtype), dkv[1].to(dtype), None, None, None, None


class RingAttention:
    """``Attention.attention_fn`` for ring attention over ``group``; counts tiles computed.

    Called with q (b, s_local, hq, d), k and v (b, s_local, hkv, d); returns (b, s_local, hq, d).
    ``tiles``: the full / diagonal / skipped tiles of every forward whose backward ran.
    ``kernel``: the tiles' kernel, auto, math, fused (attention_kernels.pick) or a fused
    kernel's name (forced).
    """

    def __init__(self, group: Group, order: str = "zigzag", kernel: str = "auto") -> None:
        if kernel not in KERNELS:
            raise ValueError(
                f"attention kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
        slice_ids(0, 1, order)  # validates order
        self.group, self.order, self.kernel = group, order, kernel
        self.tiles = {"full": 0, "diagonal": 0, "skipped": 0}

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if q.size(1) % 2 != 0:
            raise ValueError(f"local sequence length {q.size(1)} must be even (two slices)")
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, heads, s_local, d)
        tile_kernel = kernels.pick(self.kernel, q.device.type, q)  # math or a fused kernel
        out = _RingAttention.apply(q, k, v, self.group, self.order, tile_kernel, self.tiles)
        return out.transpose(1, 2)


def attention_tile_counts(model: nn.Module) -> Dict[str, int]:
    """Full / diagonal / skipped tiles this rank's ring attention computed, over all layers."""
    total = {"full": 0, "diagonal": 0, "skipped": 0}
    for module in model.modules():
        fn = getattr(module, "attention_fn", None)
        if isinstance(fn, RingAttention):
            for kind, n in fn.tiles.items():
                total[kind] += n
    return total
