"""Bytes a rank holds: model states (parameters, gradients, optimizer) and activations.

Model states. Each rank holds the units of its pipeline chunks (embedding, blocks, final norm
+ head), tensor parallel splits their matrices (norms stay whole), expert parallel gives each
rank E / ep experts, and ZeRO over the N = dp x cp ranks shards a unit padded to a multiple of
N (scaletorch/parallel/flat_unit.py). Bytes per parameter by precision (PRECISION_BYTES):

    stage     params      grads        optimizer            fp32: 4 + 4 + 8; bf16: 2 + 2 + 12
    0         P           P            P                    (ZeRO's Psi, K = 12)
    1         P           P            P'/N
    2         P           P'/N         P'/N
    3         P'/N        P'/N         P'/N

Activations per micro-batch, derived for this repository's Llama (llama.py) from what autograd
keeps for backward (b micro-batch, s tokens per rank = seq / cp, h hidden, f MLP width, a
heads, kv key-value width, t = tp, e bytes of an activation; RMSNorm computes in fp32, the
softmax in fp32):

    norms (2)    4 (4 b s h + 2 b s)      input x, x / rms and 1 / rms, each norm; / t with SP
    linears      e (2 b s h)              the two normed inputs (q/k/v and gate/up read them)
    attention    e (4 b s h / t)          q after RoPE, k and v repeated to a heads, o's input
    scores       (4 + e') b a s^2 / t + s^2   softmax output (fp32), its e-byte copy if e < 4,
                                              and the causal mask (bool)
    MLP          e (4 b s f / t)          gate, silu(gate), up, their product
    MoE MLP      4 (T + 1) E + 28 k T + e k T (3 h + 4 f_e)   (T = b s; moe_activation_bytes)

Selective recomputation keeps the attention core's inputs (q, k, v: e (b s h + 2 b s kv) / t)
instead of the repeated k, v and the scores; full recomputation keeps a block's input,
e b s h (/ t with SP), and rebuilds one block at a time in backward. Flash attention keeps the
output and the log-sum-exp (4 b a s / t) instead of the scores. The GPT kind uses Korthikanti
et al.'s formulas (16-bit activations, dropout masks), which the planner is checked against.
"""

import math
from typing import Dict, List, NamedTuple, Tuple

from scaletorch.plan.layout import (ACTIVATION_BYTES, PRECISION_BYTES, V_SHAPED, ZERO_BUBBLE,
                                    PlanLayout, every_n)
from scaletorch.plan.model import ModelSpec
from scaletorch.plan.pipeline import held_peak, holds_ends, in_flight, rank_layers, rank_stages


def memory_formula(zero_stage: int, numel: int, world: int,
                   element_size: int = 4) -> Dict[str, float]:
    """Bytes per rank the formulas predict for ``numel`` parameters (Psi) over N = ``world``.

    Stage 0 is plain data parallel (16 Psi). Exact integers when N divides ``numel`` (pass the
    padded count P' to compare with a measurement).
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    psi = numel * element_size
    shard = psi // world if psi % world == 0 else psi / world
    return {
        "params": shard if zero_stage == 3 else psi,
        "grads": shard if zero_stage >= 2 else psi,
        "optimizer": 2 * shard if zero_stage >= 1 else 2 * psi,
    }


# [core: model-states]
def model_state_bytes(zero_stage: int, numel: float, world: int,
                      precision: str = "bf16") -> Dict[str, float]:
    """Bytes per rank of ``numel`` parameters over ``world`` ZeRO ranks, by precision (no
    padding): ZeRO's Table 1 is this with precision "bf16" (2 + 2 + 12)."""
    p, g, o = PRECISION_BYTES[precision]
    return {
        "params": p * numel / (world if zero_stage == 3 else 1),
        "grads": g * numel / (world if zero_stage >= 2 else 1),
        "optimizer": o * numel / (world if zero_stage >= 1 else 1),
    }


# [end: model-states]
class Unit(NamedTuple):
    """Parameters of one sharding unit on one rank: dense (replicated over dp x cp) and
    expert (replicated over the expert-data-parallel ranks)."""
    name: str
    dense: int
    expert: int
    chunk: int = 0  # which of the rank's pipeline chunks holds it (each has its own wrapper)


def _split(model: ModelSpec, tp: int, i: int, ep: int) -> Tuple[int, int]:
    """(dense, expert) parameters of block ``i`` on one tp rank, 1 / ep of its experts."""
    h, t = model.hidden_size, tp
    norms = 2 * model.norm_params()
    if model.kind == "gpt":  # qkv, fc1 biases are split; the row layers' biases are not
        attention = (4 * h * h + 3 * h) // t + h
        mlp = (2 * h * model.intermediate_size + model.intermediate_size) // t + h
    else:
        attention = model.attention_params() // t
        mlp = model.mlp_params() // t
    if model.is_moe_layer(i):  # the MoE runs whole on every tp rank (expert_parallel.py)
        return attention + norms + model.router_params(), model.expert_params() // ep
    return attention + norms + mlp, 0


def rank_units(model: ModelSpec, layout: PlanLayout, pp_rank: int = 0) -> List[Unit]:
    """The units pipeline rank ``pp_rank`` holds, per tp rank, in forward order (in a V rank 0
    holds the embedding and the head: stages 0 and 2p - 1). The embedding and the head hold the
    vocabulary padded for tp (``ModelSpec.vocab_rows``), V' h / t each."""
    chunks = rank_layers(model.num_layers, layout.pp, layout.virtual_stages, layout.layer_split,
                         layout.schedule)
    stages = layout.pp * layout.virtual_stages
    t, units = layout.tp, []
    table = model.vocab_rows(t) * model.hidden_size // t  # this tp rank's rows of V' x h
    mine = rank_stages(layout.pp, layout.virtual_stages, pp_rank, layout.schedule)
    for c, (stage, layers) in enumerate(zip(mine, chunks[pp_rank])):
        if stage == 0:
            units.append(Unit("embed_tokens", table, 0, c))
        units += [Unit(f"layers.{i}", *_split(model, t, i, layout.ep), c) for i in layers]
        if stage == stages - 1:
            head = 0 if model.tie_word_embeddings else table
            units.append(Unit("head", model.norm_params() + head + model.extra_params, 0, c))
            if has_tied_copy(model, layout):  # ZeRO gives the copy a unit of its own
                units.append(Unit("tied_embedding_copy", table, 0, c))
    return units


def has_tied_copy(model: ModelSpec, layout: PlanLayout) -> bool:
    """A tied embedding under a pipeline: the last stage holds a copy of it as its output
    layer, summed with the first stage's over the embedding group (pipeline_parallel.py). Not
    in a V (zbv, dualpipev): both ends are rank 0's chunks, which share the one parameter."""
    return model.tie_word_embeddings and layout.pp * layout.virtual_stages > 1 and \
        layout.schedule not in V_SHAPED


def _padded(numel: int, n: int) -> int:
    return n * math.ceil(numel / n)


def state_bytes(model: ModelSpec, layout: PlanLayout, pp_rank: int = 0) -> Dict[str, float]:
    """Parameter, gradient and optimizer bytes on pipeline rank ``pp_rank`` (any tp rank).

    ZeRO shards each dense unit over dp x cp, padded to a multiple of it; expert units over the
    expert-data-parallel ranks (dp x cp / ep). Stage 3 also holds gathered units in flight
    (``buffers``: the unit computing and the next, prefetched: the largest such pair)."""
    p, g, o = PRECISION_BYTES[layout.precision]
    z, out = layout.zero_stage, {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    gathered: Dict[int, List[int]] = {}  # chunk -> its units' full (padded) sizes, in order
    for unit in rank_units(model, layout, pp_rank):
        for numel, n in ((unit.dense, layout.dp_cp), (unit.expert, layout.dp_cp // layout.ep)):
            if numel == 0:
                continue
            full = _padded(numel, n) if z else numel
            shard = full // n if z else numel
            out["params"] += p * (shard if z == 3 else full)
            out["grads"] += g * (shard if z >= 2 else full)
            out["optimizer"] += o * (shard if z >= 1 else full)
        dense = _padded(unit.dense, layout.dp_cp) if unit.dense else 0
        expert = _padded(unit.expert, layout.dp_cp // layout.ep) if unit.expert else 0
        gathered.setdefault(unit.chunk, []).append(dense + expert)
    # stage 3: a chunk's unit computing and the next one, prefetched (zero.py), at most
    out["buffers"] = p * max(
        max([a + b for a, b in zip(units, units[1:])] + units)
        for units in gathered.values()) if z == 3 else 0
    if layout.framework == "torchtitan" and z == 3:
        out["buffers"] = _titan_gathered(model, layout, pp_rank)
    return out


def checkpoint_bytes(model: ModelSpec, layout: PlanLayout, pp_rank: int = 0) -> Dict[str, float]:
    """What pipeline rank ``pp_rank`` saves of its model states. Its per-rank file: ``model``,
    the weights it keeps (under ZeRO of any stage only its shard, P'/N: the full weights are
    the same on every dp rank), and ``optimizer``, its AdamW m and v; gradients are not saved.
    ``consolidated``: the one file that gathers the full weights, m and v (fp32) on global
    rank 0. AdamW's step counters, the schedule and the RNG states add a few kB."""
    sharded = PlanLayout(**{**layout.as_dict(), "zero_stage": 3}) if layout.zero_stage else layout
    weight, _, moments = PRECISION_BYTES["fp32"]
    return {
        "model": state_bytes(model, sharded, pp_rank)["params"],
        "optimizer": state_bytes(model, layout, pp_rank)["optimizer"],
        "consolidated": (weight + moments) * model.num_parameters(),
    }


def _titan_gathered(model: ModelSpec, layout: PlanLayout, pp_rank: int) -> float:
    """FSDP2's gathered parameters under torchtitan: in bf16 (1 byte under fp8's all-gather
    of the blocks), the block computing and the one prefetched, plus the stage's root unit
    (embedding, final norm, head), which FSDP2 does not free between forward and backward.
    Under a pipeline, all of the stage's, and its unsharded fp32 gradients."""
    units = rank_units(model, layout, pp_rank)
    blocks = [u.dense + u.expert for u in units if u.name.startswith("layers.")]
    root = sum(u.dense for u in units if not u.name.startswith("layers."))
    per_block = 1 if layout.fp8 == "matmul+all-gather" else 2
    if layout.pp > 1:  # each stage keeps its parameters gathered and accumulates its gradients
        # unsharded in fp32 across the micro-batches (the pipeline turns the sync off but on
        # the last): 2 (or 1) + 4 bytes a parameter of the stage
        return (per_block + 4) * sum(blocks) + 6 * root
    return per_block * 2 * max(blocks, default=0) + 2 * root


# ---- activations ------------------------------------------------------------------------
def _gpt_layer(b: int, s: int, h: int, a: int, t: int, sp: bool, recompute: str) -> float:
    """Korthikanti et al. 2022, bytes per layer per micro-batch (16-bit, dropout included)."""
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    attention_core = 0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return sbh / t * (34 + attention_core)
    return sbh * (10 + 24 / t + attention_core / t)


def moe_activation_bytes(model: ModelSpec, tokens: int, e: int) -> float:
    """What an MoE block's MLP keeps for ``tokens`` tokens (moe.py; it runs whole on each tp
    rank): the router's fp32 probabilities (T E) and the balance loss's f_e (E), three int64
    index tensors of the k T assignments (top-k's choices, the assignment order, the token
    index) and their fp32 weights; per assignment the routed input, the experts' output and
    the weighted output (e 3 h: index_add keeps its source) and the expert's SwiGLU (e 4 f).
    Under expert parallel a rank runs the k T assignments its experts receive (balanced
    routing: as many as it sends)."""
    routed = model.moe_top_k * tokens
    return 4 * (tokens + 1) * model.num_experts + routed * (3 * 8 + 4) + \
        e * routed * (3 * model.hidden_size + 4 * model.expert_size)


def layer_activation_bytes(model: ModelSpec, layout: PlanLayout, moe: bool = False) -> float:
    """Bytes one block keeps for backward for one micro-batch on one rank (an MoE block if
    ``moe``)."""
    b, s = layout.micro_batch_size, layout.seq_len // layout.cp
    h, t, a = model.hidden_size, layout.tp, model.num_attention_heads
    sp, mode = layout.sequence_parallel and t > 1, layout.activation_checkpointing
    e = ACTIVATION_BYTES[layout.precision]
    if model.kind == "gpt":
        return _gpt_layer(b, s, h, a, t, sp, mode)
    if layout.framework == "torchtitan":
        return b * s * titan_layer_bytes(model, t, sp, mode, layout.fp8 != "none")
    norm_t = t if sp else 1
    if mode == "full":
        return e * b * s * h / norm_t
    bsh, kv, f = b * s * h, b * s * model.kv_size, model.intermediate_size
    norms = 4 * (4 * bsh + 2 * b * s) / norm_t
    linears = e * 2 * bsh + (moe_activation_bytes(model, b * s, e) if moe else e * 4 * b * s * f /
                             t)
    if mode == "selective" or layout.flash_attention:  # q, k, v and o's input
        attention = e * (2 * bsh + 2 * kv) / t
    else:
        attention = e * 4 * bsh / t
    if mode == "selective":
        scores = 0.0
    elif layout.flash_attention or layout.cp > 1:  # output kept above; log-sum-exp (fp32)
        scores = 4 * b * a * s / t
    else:
        scores = (4 + (e if e < 4 else 0)) * b * a * s * s / t + s * s
    return norms + linears + attention + scores


def titan_layer_bytes(model: ModelSpec, t: int, sp: bool, mode: str, fp8: bool = False) -> float:
    """Bytes per token one torchtitan block keeps for backward on a tp rank (bf16
    activations; its RMSNorm computes in fp32 and keeps x in fp32 (4 h) and the normed bf16
    output (2 h); RoPE multiplies q, k as fp32 complex numbers and keeps them; SDPA's flash
    kernel keeps q, k and v (k, v repeated to every head), its output and the fp32
    log-sum-exp; SwiGLU keeps w1's and w3's outputs and their product). Under tensor parallel
    the column-parallel linears keep their all-gathered input (2 h, not / t); the norms' part
    is / t with sequence parallel (``sp``). Per mode:

        none, selective   12 h / t_sp + 4 h + (14 h + 4 kv + 4 a + 8 f) / t
        op                2 h / t_sp + 2 h + (4 h + 2 kv + 4 a + 2 f) / t (+ 4 h / t if t > 1)
        full              2 h / t_sp                      (the block's input)
        every-N           (full + (N - 1) none) / N        (an average block)

    "selective" (Korthikanti et al.'s: the attention core recomputed) keeps as much as none
    here: flash attention never keeps the s x s scores it would drop. "op" keeps the block's
    input, the outputs of the odd-numbered matmuls (wq, wv, w1, w2; w2's output is whole
    before its reduce-scatter), the attention output and log-sum-exp, and under tp the
    reduce-scatters' outputs (torchtitan's save list). fp8: float8 linears keep their
    inputs as 1-byte copies instead of bf16 ones: the linears' inputs count half."""
    h, f, kv, a = model.hidden_size, model.intermediate_size, model.kv_size, \
        model.num_attention_heads
    ts = t if sp else 1
    linear_inputs = 4 * h + (2 * h + 2 * f) / t  # qkv's and w1/w3's inputs; wo's and w2's
    none = 12 * h / ts + 4 * h + (14 * h + 4 * kv + 4 * a + 8 * f) / t
    if fp8:
        none -= linear_inputs / 2
    if mode in ("none", "selective"):
        return none
    full = 2 * h / ts
    if mode == "full":
        return full
    if mode == "op":
        return 2 * h / ts + 2 * h + (4 * h + 2 * kv + 4 * a + 2 * f) / t + (4 * h /
                                                                            t if t > 1 else 0)
    n = every_n(mode)
    return (full + (n - 1) * none) / n


def _ends(model: ModelSpec, layout: PlanLayout, first: bool, last: bool) -> float:
    """What the embedding, RoPE and the head keep per micro-batch (this repo's Llama)."""
    if model.kind == "gpt":  # left out in the paper's figures
        return 0.0
    b, s, h, t = layout.micro_batch_size, layout.seq_len // layout.cp, model.hidden_size, \
        layout.tp
    if layout.framework == "torchtitan":  # token ids; final norm, head input, fp32 log-softmax
        ts = t if layout.sequence_parallel else 1
        return b * s * ((8 if first else 0) +
                        ((6 * h / ts + 2 * h + 4 * model.vocab_rows(t) / t) if last else 0))
    e, norm_t = ACTIVATION_BYTES[layout.precision], t if layout.sequence_parallel else 1
    out = 0.0
    if first:
        out += 8 * b * s + 2 * 4 * s * model.head_dim  # token ids (int64); cos, sin (fp32)
    if last:  # final norm, the head's input, the fp32 log-softmax of the logits, the targets
        out += 4 * (2 * b * s * h + b * s) / norm_t + e * b * s * h
        out += 4 * b * s * model.vocab_rows(t) / t + 8 * b * s  # padded columns included
    return out


def activation_bytes(model: ModelSpec, layout: PlanLayout, pp_rank: int = 0) -> Dict[str, float]:
    """Activations on pipeline rank ``pp_rank``: ``micro_batch`` (one micro-batch through all
    the rank's layers, as a forward leaves it), ``in_flight`` (micro-batches the schedule keeps
    at once on this rank), ``saved`` (in_flight x micro_batch, the head's logits once: the last
    stage runs each micro-batch's backward right after its forward; under a zero-bubble
    schedule the most its chunks hold at once, each from its F to its W; what autograd keeps for
    backward, which ``saved_tensors_hooks`` see), ``rebuilt`` (under recomputation, the one block or
    attention core rebuilt in backward: inside torch.utils.checkpoint, unseen by an outer hook)
    and ``peak`` = saved + rebuilt."""
    chunks = rank_layers(model.num_layers, layout.pp, layout.virtual_stages, layout.layer_split,
                         layout.schedule)
    layers = sum(len(c) for c in chunks[pp_rank])
    first, last = holds_ends(layout, pp_rank)
    mine = [i for c in chunks[pp_rank] for i in c]
    moe = sum(1 for i in mine if model.is_moe_layer(i))
    per_layer = layer_activation_bytes(model, layout)
    per_moe = layer_activation_bytes(model, layout, moe=True) if moe else 0.0
    head = _ends(model, layout, False, last)  # the last stage's head: one micro-batch at a time
    micro = (layers - moe) * per_layer + moe * per_moe + _ends(model, layout, first, False) + head
    n = in_flight(layout.schedule, layout.pp, layout.num_micro_batches, layout.virtual_stages,
                  pp_rank)
    if layout.schedule in ZERO_BUBBLE and layout.pp > 1:
        saved = _held_from_f_to_w(model, layout, pp_rank, per_layer, per_moe)
    else:
        saved = n * (micro - head) + head
    rebuilt = 0.0
    if layout.activation_checkpointing != "none":  # one block (full) or attention core
        whole = PlanLayout(**{**layout.as_dict(), "activation_checkpointing": "none"})
        rebuilt = max(
            layer_activation_bytes(model, whole, moe=m) -
            layer_activation_bytes(model, layout, moe=m)
            for m in {False, moe > 0})  # the largest rebuilt in backward
        if every_n(layout.activation_checkpointing):  # a recomputed block: all it drops
            kept = PlanLayout(**{**whole.as_dict(), "activation_checkpointing": "full"})
            rebuilt = layer_activation_bytes(model, whole) - layer_activation_bytes(model, kept)
    if layout.framework == "torchtitan" and last:
        rebuilt = max(rebuilt, titan_loss_backward_bytes(model, layout))
    return {
        "micro_batch": micro,
        "in_flight": n,
        "saved": saved,
        "rebuilt": rebuilt,
        "peak": saved + rebuilt
    }


def titan_loss_backward_bytes(model: ModelSpec, layout: PlanLayout) -> float:
    """What torchtitan's loss backward allocates beside the saved fp32 log-softmax output, per
    micro-batch on the last stage (b s / cp tokens, V' / t vocabulary columns a tp rank holds).

    Without tp, cross-entropy runs as aten's fused kernels: the nll loss's dense fp32 gradient
    and the log-softmax's fp32 input gradient, 8 V' / t bytes a token. Under tp torchtitan turns
    on torch's loss parallel (the head's output stays sharded over the vocabulary), whose
    backward is written in eager elementwise ops (torch/distributed/tensor/parallel/loss.py:
    a zeroed fp32 gradient with the targets scattered in, exp of the saved log-probabilities,
    their sum, then its product with the incoming gradient): three fp32 tensors of b s V' / t
    live at once beside the saved one, 12 V' / t bytes a token."""
    per_token = 12 if layout.tp > 1 else 8
    return per_token * layout.micro_batch_size * (layout.seq_len // layout.cp) * \
        model.vocab_rows(layout.tp) / layout.tp


def _held_from_f_to_w(model: ModelSpec, layout: PlanLayout, pp_rank: int, per_layer: float,
                      per_moe: float) -> float:
    """A zero-bubble schedule's peak on ``pp_rank``: each (micro-batch, chunk) holds its chunk's
    blocks, its RoPE tables (each chunk computes its own) and the ends its stage holds, from its
    F to its W (the head's logits too: W walks the graph again), summed at the schedule's worst
    moment (``held_peak`` on its action list)."""
    chunks = rank_layers(model.num_layers, layout.pp, layout.virtual_stages, layout.layer_split,
                         layout.schedule)[pp_rank]
    stages = rank_stages(layout.pp, layout.virtual_stages, pp_rank, layout.schedule)
    last = layout.pp * layout.virtual_stages - 1
    rope = 0.0 if model.kind == "gpt" else 2 * 4 * (layout.seq_len // layout.cp) * model.head_dim
    sizes = []
    for stage, layers in zip(stages, chunks):
        moe = sum(1 for i in layers if model.is_moe_layer(i))
        ends = _ends(model, layout, stage == 0, stage == last)
        sizes.append((len(layers) - moe) * per_layer + moe * per_moe + ends +
                     (rope if stage > 0 else 0.0))  # stage 0's tables are in _ends
    return held_peak(layout.schedule, layout.pp, layout.num_micro_batches, layout.virtual_stages,
                     pp_rank, sizes)


def rank_memory(model: ModelSpec, layout: PlanLayout, pp_rank: int = 0) -> Dict[str, float]:
    """params, grads, optimizer, buffers, activations (peak) and total on ``pp_rank``."""
    out = state_bytes(model, layout, pp_rank)
    out["activations"] = activation_bytes(model, layout, pp_rank)["peak"]
    out["total"] = sum(out.values())
    out["reserved"] = out["total"] * (1 + ALLOCATOR_SLACK[layout.framework])
    return out


# What PyTorch's caching allocator reserves beyond the bytes allocated at the peak (blocks
# split and cached for reuse; torchtitan logs the peak reserved), as a fraction of them: 0 for
# this repository's formulas (they count tensors); torchtitan 0.08, fitted: the mean gap of
# its six 8B FSDP rows (scripts/plan_validate.py) before any slack, not a measured constant.
ALLOCATOR_SLACK = {"scaletorch": 0.0, "torchtitan": 0.08}
