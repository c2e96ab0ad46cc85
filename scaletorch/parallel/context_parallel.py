"""Context parallel: split every sequence over the "cp" group; attention still sees all of it.

Each of the N ranks of a context-parallel group holds s/N tokens of every sequence (and their
activations). Everything except attention is per token, so only attention talks:

ring (default)  K/V slices travel around the ring; each rank attends its queries to every
                slice as it passes and merges the partial results with their log-sum-exp.
                Forward: each rank sends its K and V (hkv heads, not expanded) N-1 times per
                layer: (N-1) x 2 x b x s/N x hkv x d elements. Backward: K/V go round again
                (N-1 sends) and dK/dV go round back to their owners (N sends).
ulysses         all-to-all: scatter heads, gather the sequence, run ordinary causal attention
                on h/N heads, all-to-all back. 4 all-to-alls per layer (q, k, v, out), each
                sending (N-1)/N of its tensor; needs heads divisible by N.

Zigzag sharding balances the causal work: the sequence is cut into 2N slices and rank r keeps
slices r and 2N-1-r, so every rank computes 2N-1 full tiles and 2 diagonal tiles.
Picture for N = 2 (rows: query slices, columns: key slices; F full, D diagonal, . skipped):

    rank 0 holds slices 0, 3      rank 1 holds slices 1, 2
    q0 | D . . .                  q1 | F D . .
    q3 | F F F D                  q2 | F F D .

RoPE uses each token's true position (``zigzag_positions``), passed to the model as
``position_ids``. Gradients are averaged over data x context ranks (``dp_cp``): each cp rank
computes the loss of different tokens, exactly like a data-parallel rank.
"""

from typing import TYPE_CHECKING, Callable, Dict, Optional, Tuple

import torch
from torch import nn

from scaletorch.dist import ProcessGroupManager, comm, get_ledger
from scaletorch.dist.all_to_all import all_to_all
from scaletorch.dist.comm import Group
from scaletorch.dist.full_state import gather_tensor_parallel_state_dict
from scaletorch.dist.functional import gather_along_dim
from scaletorch.dist.layout_check import check_sequence_length
from scaletorch.models.llama import Attention, causal_attention
from scaletorch.parallel.ring_attention import RingAttention, attention_tile_counts, slice_ids

if TYPE_CHECKING:
    from scaletorch.config import Config

VARIANTS = ("ring", "ulysses")

# ---- which tokens each rank holds ------------------------------------------------------------


# [core: zigzag-positions]
def zigzag_positions(seq_len: int, cp_size: int, cp_rank: int, order: str = "zigzag",
                     device: Optional[torch.device] = None) -> torch.Tensor:
    """(seq_len / cp_size,) int64: the true positions of the tokens ``cp_rank`` holds.

    They are the RoPE ``position_ids`` of the local tokens and the indices that shard them.
    """
    check_sequence_length(seq_len, cp_size)
    width = seq_len // (2 * cp_size)  # tokens per slice
    return torch.cat([
        torch.arange(c * width, (c + 1) * width, device=device)
        for c in slice_ids(cp_rank, cp_size, order)
    ])


# [end: zigzag-positions]
def make_sequence_sharder(pgm: ProcessGroupManager, seq_len: int,
                          order: str = "zigzag") -> Callable:
    """fn(inputs, targets) (b, s) -> (inputs, targets) (b, s/cp) and position_ids (s/cp,).

    For ``make_data_parallel_step(..., shard_sequence=fn)``: after the batch is cut over
    data-parallel ranks, this rank keeps its context-parallel tokens.
    """
    positions = zigzag_positions(seq_len, pgm.context_parallel_world_size,
                                 pgm.context_parallel_rank, order)

    def shard(inputs: torch.Tensor,
              targets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if inputs.size(1) != seq_len:
            raise ValueError(f"batch sequence length {inputs.size(1)} != {seq_len}")
        pos = positions.to(inputs.device)
        return inputs[:, pos], targets[:, pos], pos

    return shard


# ---- Ulysses (all-to-all) ------------------------------------------------------------------


def _heads_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(b, s_local, h, d) -> (b, cp x s_local, h / cp, d): all-to-all over ``group``."""
    cp = comm.group_size(group)
    b, s, h, d = x.shape
    x = x.reshape(b, s, cp, h // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # head slice first
    x = all_to_all(x.view(cp * b, s, h // cp, d), None, None, group, "cp")  # source rank first
    return x.view(cp, b, s, h // cp, d).transpose(0, 1).reshape(b, cp * s, h // cp, d)


def _sequence_to_heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """(b, cp x s_local, h / cp, d) -> (b, s_local, h, d): the inverse all-to-all."""
    cp = comm.group_size(group)
    b, s_all, hl, d = x.shape
    s = s_all // cp
    x = x.view(b, cp, s, hl, d).transpose(0, 1).contiguous()  # sequence slice first
    x = all_to_all(x.view(cp * b, s, hl, d), None, None, group, "cp")  # head slice first
    return x.view(cp, b, s, hl, d).permute(1, 2, 0, 3, 4).reshape(b, s, cp * hl, d)


# [core: ulysses]
class UlyssesAttention:
    """``Attention.attention_fn`` that trades the sequence split for a head split.

    Every rank gathers the whole sequence for hq/cp query and hkv/cp key-value heads, puts the
    tokens back in true order (they arrive in zigzag order), runs causal attention, and sends
    the result back.
    """

    def __init__(self, group: Group, order: str = "zigzag") -> None:
        slice_ids(0, 1, order)
        self.group, self.order = group, order

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cp = comm.group_size(self.group)
        check_ulysses_heads(q.size(2), k.size(2), cp)
        seq_len = cp * q.size(1)
        # position of each gathered token; argsort puts the sequence in true order
        order = torch.cat(
            [zigzag_positions(seq_len, cp, r, self.order, q.device) for r in range(cp)])
        natural = order.argsort()
        q, k, v = (_heads_to_sequence(t, self.group)[:, natural] for t in (q, k, v))
        out = causal_attention(q, k, v)[:, order]  # (b, s, hq / cp, d), back in gathered order
        return _sequence_to_heads(out, self.group)


# [end: ulysses]
def check_ulysses_heads(num_q_heads: int, num_kv_heads: int, cp_size: int) -> None:
    if num_q_heads % cp_size != 0 or num_kv_heads % cp_size != 0:
        raise ValueError(
            f"Ulysses splits heads over context_parallel_size ({cp_size}): query heads "
            f"({num_q_heads}) and key/value heads ({num_kv_heads}) must both be divisible by it")


# ---- install -------------------------------------------------------------------------------


def apply_context_parallel(model: nn.Module, pgm: ProcessGroupManager, variant: str = "ring",
                           order: str = "zigzag", kernel: str = "auto") -> nn.Module:
    """Replace every attention module's ``attention_fn``; the weights are untouched.

    Apply after tensor parallel (heads are then the local ones) and before data parallel,
    which must average gradients over ``pgm.gradient_sync_group``.
    ``kernel`` (ring only, ``parallel.cp_attention``): the attention tiles' kernel, "math"
    (fp32, readable), "fused" (torch's kernels for the device) or "auto" (fused on CUDA, math
    elsewhere).
    """
    if variant not in VARIANTS:
        raise ValueError(f"cp variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    group, cp = pgm.context_parallel_group, pgm.context_parallel_world_size
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    if not attentions:
        raise ValueError("the model has no module with an attention_fn to replace")
    for module in attentions:
        if variant == "ring":
            module.attention_fn = RingAttention(group, order, kernel)
        else:
            head_dim = module.head_dim
            check_ulysses_heads(
                module.q_proj.weight.size(0) // head_dim,
                module.k_proj.weight.size(0) // head_dim, cp)
            module.attention_fn = UlyssesAttention(group, order)
    return model


def gather_context_parallel_state_dict(
        model: nn.Module, pgm: ProcessGroupManager) -> Optional[Dict[str, torch.Tensor]]:
    """Collective over "tp": the reference-keyed full weights on global rank 0, None elsewhere.

    Context parallel splits tokens, not weights: every cp rank holds the same weights, so this
    is chapter 03's gather (which, at tp 1, is rank 0's own weights).
    """
    return gather_tensor_parallel_state_dict(model, pgm)


def cp_report(cfg: "Config", model: nn.Module, pgm: ProcessGroupManager, steps_run: int,
              step: int) -> str:
    """What chapter 05 prints after training. Collective over "cp" (every rank's attention
    tiles are gathered); the text on global rank 0, "" elsewhere: the ledger's table of
    ``step``, the K/V (ring) or q/k/v/out (Ulysses) traffic per layer next to its formula, and
    the causal work per cp rank. ``steps_run``: the optimizer steps this process ran (the
    tiles are counted since it started)."""
    p, d, ledger = cfg.parallel, cfg.data, get_ledger()
    cp, m, layers = pgm.context_parallel_world_size, d.num_micro_batches, cfg.model.num_layers
    b, s_local, hd = d.global_batch_size // pgm.data_parallel_world_size, d.seq_len // cp, \
        cfg.model.head_dim
    tp = pgm.tensor_model_parallel_world_size
    hq, hkv = cfg.model.num_attention_heads // tp, cfg.model.num_key_value_heads // tp
    if p.cp_variant == "ring":  # fwd: K/V (cp-1)x; bwd: K/V (cp-1)x, dK/dV cp x
        op, formula = "send", (3 * cp - 2) * 2 * b * s_local * hkv * hd if cp > 1 else 0
    else:  # q, k, v, out all-to-all in forward and again in backward; (cp-1)/cp leaves
        op, formula = "all_to_all", 2 * (cp - 1) * b * s_local * (2 * hq + 2 * hkv) * hd // cp
    measured = ledger.total(op=op, group="cp", step=step, phase="compute") / layers
    # the bytes of what was sent: 2 per element under bf16 (chapter 08), 4 in fp32
    measured_mb = ledger.total(op=op, group="cp", step=step, phase="compute",
                               field="bytes") / layers / 1e6
    tiles = attention_tile_counts(model)
    device = next(model.parameters()).device
    per_forward = torch.tensor([tiles["full"], tiles["diagonal"]], device=device) \
        // (layers * m * steps_run)
    with ledger.paused():  # the report's own gather is not training traffic
        all_tiles = gather_along_dim(per_forward, 0, pgm.context_parallel_group)
    if pgm.rank != 0:
        return ""
    what = "K/V" if p.cp_variant == "ring" else "q/k/v/out"
    lines = [
        ledger.table(step=step),
        f"{p.cp_variant} {what} traffic per layer per step per rank ({op} over cp): "
        f"{measured:,.0f} elements = {measured_mb:.3f} MB; formula {formula:,}"
    ]
    if p.cp_variant == "ring":
        pairs = all_tiles.view(cp, 2).tolist()
        lines.append("attention tiles per layer per forward, by cp rank (full + diagonal): " +
                     ", ".join(f"rank {r}: {f} + {g}" for r, (f, g) in enumerate(pairs)))
    return "\n".join(lines)
