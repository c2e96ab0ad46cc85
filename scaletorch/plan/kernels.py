"""A GPU's step, kernel by kind: matmuls by shape, flash attention, memory-bound work, launches.

``time.step_time`` uses this for a GPU cluster that states its HBM bandwidth (the presets do).
Per pipeline rank and step (T = b s / cp tokens of a micro-batch, t = tp):

- matmuls: each linear of a block is three GEMMs of 2 M N K FLOPs (forward, input gradient,
  weight gradient), M = T (sequence parallel gathers the sequence first), N and K the weight's
  sides on this tp rank; the head's too. A GEMM runs its 128 x 256 output tiles in waves of
  ``sms`` (the last wave partly idle) and fills its pipeline over K (K / (K + 128)), on top of
  ``compute_efficiency`` x peak (fp8 linears: x the fp8 peak). Recomputation adds forwards:
  full every block's, "op" the even-numbered matmuls' (wk, wo, w3), every-N 1 / N of full.
- flash attention: 2 T s h / t FLOPs forward (the causal half of 4 T s h / t), 2.5 times that
  backward (it recomputes the scores), at ``attention_efficiency`` x peak; full recomputation
  and Korthikanti's selective add a forward, "op" keeps the output and adds none.
- memory-bound: bytes per token of a block's elementwise kernels (``ELEMENTWISE``: the norms
  and residual adds, RoPE and the head layout copies, SwiGLU), eager or compiled, forward 1,
  backward 2, each recomputed forward 1 more; the loss over the vocabulary (40 V / t bytes a
  token: the fp32 cast, log-softmax and their backward); fp8's scaling and casts; per step
  the optimizer (56 bytes per local parameter: foreach AdamW's passes over four fp32 tensors)
  and ZeRO's copies into and out of its flat buffers (4 bytes a gathered parameter, 6 a
  reduced gradient), all at ``hbm_bandwidth`` x ``hbm_efficiency``.
- launches: ``KERNELS`` kernels per block and micro-batch, ``kernel_overhead_s`` each.
- communication, per strategy: tp's and ep's collectives and pp's messages wait (exposed);
  cp's ring hides behind the attention it feeds; ZeRO-3's gathers are prefetched (exposed:
  what the compute cannot cover, and the first gather and the last reduce-scatter); DDP's and
  ZeRO-1/2's reduction overlaps the last micro-batch's backward. Hidden traffic costs
  ``overlap_cost`` of its duration in compute.

step = (compute + exposed tp, cp, ep, pp) / (1 - bubble) + exposed dp + the optimizer step.
Each constant is an assumption stated here and in doc/09_appendix_validation.md;
scripts/plan_validate.py prints what it gives against published runs.
"""

import math
from typing import Any, Dict, List, Tuple

from scaletorch.plan.cluster import Cluster
from scaletorch.plan.layout import PRECISION_BYTES, PlanLayout, every_n
from scaletorch.plan.memory import state_bytes
from scaletorch.plan.model import ModelSpec
from scaletorch.plan.pipeline import holds_ends, rank_layers

# bytes per token a block's elementwise kernels read and write in its forward (h hidden, kv
# key-value width, f MLP width): (norms + residual adds, attention's RoPE / repeat / layout
# copies, SwiGLU). Eager: each RMSNorm is about six fp32 passes over h (cast, square, mean,
# scale, cast back, weight: 36 h), the residual adds 6 h each; RoPE casts q and k to fp32,
# multiplies and casts back (20 bytes an element), repeat_kv and the transposes copy q, k, v
# and the output (12 h); silu and the product read 2 x 2 f and write 2 x 2 f (+ 2 f). Compiled
# (torch.compile, or a framework's fused kernels): one pass each: a norm reads and writes 2 h
# (+ the residual), RoPE 4 bytes an element of q and k, SwiGLU reads 4 f and writes 2 f.
ELEMENTWISE = {False: (84, 32, 20, 10), True: (12, 8, 4, 6)}  # (h, h, kv, f) coefficients
KERNELS = {False: (45, 90), True: (12, 24)}  # (forward, backward) kernels per block
LOSS_BYTES = 40  # x V / t a token: bf16 -> fp32, log-softmax, its backward, back to bf16
OPTIMIZER_BYTES = 56 + 8  # AdamW (foreach) and the gradient norm, per local parameter
TILE = (128, 256)  # a GEMM's output tile (cuBLAS / CUTLASS on Hopper)
K_FILL = 128  # a GEMM reaches K / (K + K_FILL) of its rate: its pipeline fills over K


def gemm_efficiency(m: int, n: int, k: int, cluster: Cluster) -> float:
    """Fraction of the peak one GEMM (m x k) @ (k x n) reaches: ``compute_efficiency`` x the
    tiles' wave fill x K / (K + 128). Without ``sms``, compute_efficiency alone."""
    if min(m, n, k) <= 0:
        raise ValueError(f"a GEMM's sides must be positive, got m {m}, n {n}, k {k}")
    if not cluster.sms:
        return cluster.compute_efficiency
    tiles = math.ceil(m / TILE[0]) * math.ceil(n / TILE[1])
    waves = math.ceil(tiles / cluster.sms)
    fill = m * n / (waves * cluster.sms * TILE[0] * TILE[1])
    return cluster.compute_efficiency * fill * k / (k + K_FILL)


def block_gemms(model: ModelSpec, layout: PlanLayout) -> List[Tuple[str, int, int, int]]:
    """(name, M, N, K) of one block's forward linears on one tp rank, in the order they run
    (an MoE block: its experts' GEMMs as one of k T rows, each expert's M = k T / E)."""
    h, f, kv, t = model.hidden_size, model.intermediate_size, model.kv_size, layout.tp
    T = layout.micro_batch_size * layout.seq_len // layout.cp
    if model.kind == "gpt":
        return [("qkv", T, 3 * h // t, h), ("o", T, h, h // t), ("fc1", T, f // t, h),
                ("fc2", T, h, f // t)]
    out = [("q", T, h // t, h), ("k", T, kv // t, h), ("v", T, kv // t, h), ("o", T, h, h // t)]
    if model.num_experts:
        e = model.expert_size
        rows = max(1, model.moe_top_k * T // model.num_experts)
        return out + [("expert_up", rows, 2 * e, h), ("expert_down", rows, h, e)]
    return out + [("gate", T, f // t, h), ("up", T, f // t, h), ("down", T, h, f // t)]


def _gemm_seconds(m: int, n: int, k: int, cluster: Cluster, fp8: bool, repeats: float) -> float:
    efficiency = gemm_efficiency(m, n, k, cluster)
    if fp8:
        peak = cluster.fp8_flops or 2 * cluster.peak_flops
        efficiency *= (cluster.fp8_efficiency or cluster.compute_efficiency) / \
            cluster.compute_efficiency
    else:
        peak = cluster.peak_flops
    return repeats * 2.0 * m * n * k / (peak * efficiency)


def ring_bytes_per_element(cp: int, redo: float) -> float:
    """HBM bytes torch's ring attention (torch.distributed.tensor.experimental, as torchtitan
    ran it in December 2024) moves per element of a block's local q (T x h: torchtitan repeats
    k and v to every head before SDPA, so k and v are as wide), on top of the flash kernels,
    run eagerly. Per forward (1 + ``redo`` of them): k and v copied into one buffer for the
    exchange at each of the cp - 1 steps that send (8 bytes an element); each later step's
    output cast to fp32 and merged by its log-sum-exp in three elementwise passes (38 bytes;
    for the half of the steps that update only the second half of the rows, 19 plus the
    8-byte copy that rebuilds the whole tensor); the first output's cast and the last one back
    (12). Per backward: the k, v copy again (8 per sending step); dq, dk and dv accumulated in
    fp32 at every step (10 bytes each, 13 for a half update and its copy: 34.5 on average);
    dk and dv copied into one fp32 buffer for their send (16 a step); the three fp32
    accumulators zeroed and cast back at the end (30). This repository's ring
    (scaletorch/parallel/ring_attention.py) also merges each block's output in fp32 and
    accumulates its gradients in fp32; the planner charges it the same bytes, an
    approximation (its k and v are narrower: not repeated to every head)."""
    forward = 8 * (cp - 1) + (38 + 27) / 2 * (cp - 1) + 12
    backward = 8 * (cp - 1) + (34.5 + 16) * cp + 30
    return forward * (1 + redo) + backward


def _recomputed(mode: str) -> float:
    """Fraction of the blocks whose forward is run again (full, and every-N's 1 / N)."""
    n = every_n(mode)
    return 1.0 if mode == "full" else (1.0 / n if n else 0.0)


def rank_compute(model: ModelSpec, layout: PlanLayout, cluster: Cluster,
                 pp_rank: int = 0) -> Dict[str, float]:
    """Seconds pipeline rank ``pp_rank`` computes per step, by kind: matmul, attention,
    memory (memory-bound kernels), launch; and ``optimizer`` (once per step)."""
    lay, mode = layout, layout.activation_checkpointing
    h, t, m = model.hidden_size, lay.tp, lay.num_micro_batches
    T = lay.micro_batch_size * lay.seq_len // lay.cp
    blocks = sum(
        len(c) for c in rank_layers(model.num_layers, lay.pp, lay.virtual_stages, lay.layer_split,
                                    lay.schedule)[pp_rank])
    first, last = holds_ends(lay, pp_rank)
    fp8 = lay.fp8 != "none"
    redo = _recomputed(mode)
    fused = lay.compiled
    # matmuls: 3 each (+ recomputed forwards); "op" recomputes the even-numbered ones
    matmul = 0.0
    for i, (name, mm, n, k) in enumerate(block_gemms(model, lay)):
        again = redo + (1.0 if mode == "op" and i % 2 == 1 else 0.0)
        matmul += _gemm_seconds(mm, n, k, cluster, fp8, 3 + again)
    matmul *= blocks * m
    if last:  # the head stays bf16 under torchao's float8 (torchtitan leaves it out)
        matmul += m * _gemm_seconds(T, model.vocab_rows(t) // t, h, cluster, False, 3)
    # flash attention: the causal half, backward 2.5 x forward, recomputed forwards
    forward = 2.0 * T * lay.seq_len * h / t
    again = redo + (1.0 if mode == "selective" else 0.0)
    attention = blocks * m * forward * (3.5 + again) / (cluster.peak_flops *
                                                        cluster.attention_efficiency)
    # memory-bound kernels
    rows, attn, kv_c, f_c = ELEMENTWISE[fused]
    ts = t if lay.sequence_parallel else 1
    f = model.intermediate_size if not model.num_experts else model.moe_top_k * model.expert_size
    per_token = rows * h / ts + (attn * h + kv_c * model.kv_size + f_c * f) / t
    passes = 3 + redo + (1.0 if mode == "op" else 0.0)
    moved = blocks * m * T * per_token * passes
    if fp8:  # dynamic scaling: each operand's amax, then its cast (5 bytes an element eager,
        # 3 fused), the inputs and output gradients of the linears; and each weight, twice
        per_element = 3 if fused else 5
        moved += blocks * m * T * per_element * (8 * h + 3 * f / t) * 2
        moved += blocks * m * 6 * sum(n * k for _, _, n, k in block_gemms(model, lay))
    if last:
        moved += m * T * LOSS_BYTES * model.vocab_rows(t) / t
    if lay.cp > 1 and lay.cp_variant == "ring":  # the ring's copies and fp32 merges
        moved += blocks * m * T * h / t * ring_bytes_per_element(lay.cp, redo)
    bandwidth = cluster.hbm_bandwidth * cluster.hbm_efficiency
    memory = moved / bandwidth
    forward_k, backward_k = KERNELS[fused]
    launch = blocks * m * (forward_k * (1 + redo) + backward_k) * cluster.kernel_overhead_s
    # once per step: the optimizer over the local shard, ZeRO's copies of the gathered units
    states = state_bytes(model, lay, pp_rank)
    local = states["optimizer"] / PRECISION_BYTES[lay.precision][2]
    optimizer = OPTIMIZER_BYTES * local
    if lay.zero_stage:
        full = local * lay.dp_cp  # the rank's units, gathered
        gathers = 2 * m if lay.zero_stage == 3 else 1
        optimizer += full * (4 * gathers + 6)
    return {
        "matmul": matmul,
        "attention": attention,
        "memory": memory,
        "launch": launch,
        "optimizer": optimizer / bandwidth,
    }


def gpu_step(model: ModelSpec, layout: PlanLayout, cluster: Cluster, ranks: List[int],
             comm: Dict[str, float]) -> Dict[str, Any]:
    """compute_s, exposed_s, hidden_s, breakdown, step_time_s (without the bubble's stretch:
    ``busy_s`` and ``after_s`` for time.step_time) of the slowest of ``ranks``; ``comm``:
    seconds per group of the slowest rank's traffic (time.comm_seconds)."""
    lay = layout
    parts = [rank_compute(model, lay, cluster, r) for r in ranks]
    worst = max(parts, key=lambda p: sum(p.values()))
    compute = worst["matmul"] + worst["attention"] + worst["memory"] + worst["launch"]
    last_backward = compute * 2 / 3 / lay.num_micro_batches
    units = sum(
        len(c) for c in rank_layers(model.num_layers, lay.pp, lay.virtual_stages, lay.layer_split,
                                    lay.schedule)[0]) + 2
    exposed, hidden = {}, 0.0
    for group, seconds in comm.items():
        if group == "cp":
            exposed[group] = max(0.0, seconds - worst["attention"])
        elif group in ("dp", "dp_cp", "edp") and lay.zero_stage == 3:
            edges = seconds * 2 / (3 * lay.num_micro_batches * units)
            exposed[group] = max(0.0, seconds - compute) + edges
        elif group in ("dp", "dp_cp", "edp"):
            exposed[group] = max(0.0, seconds - last_backward)
        else:
            exposed[group] = seconds
        hidden += seconds - exposed[group]
    compute += cluster.overlap_cost * hidden
    busy = compute + sum(v for g, v in exposed.items() if g in ("tp", "cp", "ep", "pp"))
    after = worst["optimizer"] + sum(
        v for g, v in exposed.items() if g in ("dp", "dp_cp", "edp", "world", "embd"))
    return {
        "compute_s": compute,
        "exposed_s": exposed,
        "hidden_s": hidden,
        "breakdown_s": worst,
        "busy_s": busy,
        "after_s": after,
    }
