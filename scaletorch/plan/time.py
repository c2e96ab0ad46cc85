"""Step time, tokens/s per GPU and MFU of a layout on a cluster.

    compute   = hardware FLOPs per rank / (peak x compute_efficiency)    (balanced ranks)
    a group's time = wire bytes / (link bandwidth x comm_efficiency)
                     + calls x 2 log2(N) x latency      (small messages go by a tree)

Ranks are placed in Megatron's order (tp fastest, then cp, dp, pp): a group whose ranks span
stride x size <= GPUs per node stays on NVLink, others use the NIC. What overlaps with what
(as in this repository's strategies):
- tp, ep, pp and cp messages sit on the critical path (tensor parallel waits for each
  all-reduce; a pipeline stage waits for its input), except that the ring of context parallel
  hides behind the attention it feeds: exposed cp = max(0, cp time - attention core time);
- the data-parallel gradient reduction (DDP buckets, ZeRO's reduce-scatter) overlaps the last
  micro-batch's backward; ZeRO-3's gathers are prefetched, overlapping all compute.
Then the pipeline bubble stretches the busy time: step = busy / (1 - bubble) + exposed dp.
An MoE layout's ``moe_imbalance`` (max/mean rows per ep rank, 1 by default) adds the hot
rank's extra expert FLOPs to the compute and its extra dispatch and combine bytes to the ep
traffic (``imbalance_seconds``): every rank waits for it at the combine.

A measured host (``scripts/plan.py --calibrate``: CPU ranks over gloo) differs in three ways,
each measured rather than assumed:
- a small model's compute is mostly fixed cost per op: each block costs ``layer_overhead_s``
  (an MoE block ``moe_layer_overhead_s``) per micro-batch (4/3 of it under full
  recomputation: its forward again), the embedding, head and loss ``micro_batch_overhead_s``,
  clipping and AdamW ``step_overhead_s``, each attention score (b x heads x s x s per
  block) ``score_element_s``, on top of the FLOPs at the measured rate;
- nothing overlaps: the cores that compute also move the bytes, so every collective's
  calls x latency + wire bytes / bandwidth is exposed. The bandwidth is a bare call's
  (measured per world and group size); the latency is what one call adds to a training step
  as its strategy issues it (``issued``: measured by training the config with that strategy
  alone, where every rank has a core, so it holds the strategy's bookkeeping around the call
  and the wait for its peers; past the cores a measured share of that, since a rank that
  waits lends its core to another), a bare call's when not measured;
- ranks beyond the ``cores`` share them: a rank's step as if it had a core of its own,
  (compute / (1 - bubble) + communication), is stretched by ``slowdown``, measured for a
  world past the cores on a real training step (data parallel over the whole world: its
  measured step / the step predicted with a core per rank; about world / cores and some
  more: switching between ranks, waiting for a peer that is not running). Within the cores
  the slowdown is that of pure compute (about 1):
  step = slowdown x (compute / (1 - bubble) + communication).
"""

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from scaletorch.plan.cluster import Cluster
from scaletorch.plan.flops import hardware_flops, model_flops
from scaletorch.plan.imbalance import imbalance_extra_seconds
from scaletorch.plan.kernels import gpu_step
from scaletorch.plan.layout import V_SHAPED, PlanLayout
from scaletorch.plan.model import ModelSpec
from scaletorch.plan.pipeline import bubble as pipeline_bubble
from scaletorch.plan.pipeline import holds_ends, rank_layers
from scaletorch.plan.traffic import collectives


def measured_step(*runs: Sequence[float]) -> float:
    """A measured step time, as this repository reads one on a CPU host: the 10th percentile of
    the steps after each run's first (the first warms up), the runs pooled. Not the fastest
    step: ranks sharing 2 cores have a few lucky steps (chapter 03 once stepped in 16 ms where
    its 10th percentile is 22-25 ms). Not the median: the load of other programs moves it. The
    tour's runs (scripts/plan_vs_tour.py), the calibration and the trainer's plan line agree."""
    steps = sorted(s for run in runs for s in run[1:])
    if not steps:
        raise ValueError(f"a step time needs at least 2 steps (the first warms up), got "
                         f"{max((len(run) for run in runs), default=0)}")
    return steps[len(steps) // 10]


def group_span(layout: PlanLayout, group: str) -> int:
    """Consecutive ranks a group of ``group`` spans (stride x size), in tp-cp-dp-pp order."""
    lay = layout
    return {
        "tp": lay.tp,
        "cp": lay.tp * lay.cp,
        "dp": lay.tp * lay.dp,  # dp_cp at cp 1
        "dp_cp": lay.tp * lay.cp * lay.dp,
        "ep": lay.tp * lay.ep,
        "edp": lay.tp * lay.cp * lay.dp,
        "pp": lay.world,
        "world": lay.world,
    }[group]


def comm_seconds(model: ModelSpec, layout: PlanLayout, cluster: Cluster,
                 pp_rank: int = 0) -> Dict[str, float]:
    """Seconds each group's traffic of one step takes on ``cluster`` (not yet overlapped)."""
    out: Dict[str, float] = {}
    for c in collectives(model, layout, pp_rank):
        if c.op == "recv":  # its send's other end: the send pays
            continue
        intra = group_span(layout, c.group) <= cluster.gpus_per_node
        bandwidth = cluster.intra_node_bandwidth if intra else cluster.inter_node_bandwidth
        latency = cluster.intra_node_latency if intra else cluster.inter_node_latency
        hops = c.calls * 2 * math.ceil(math.log2(c.size))  # latency-bound: a tree (NCCL)
        seconds = c.wire / (bandwidth * cluster.comm_efficiency) + hops * latency
        out[c.group] = out.get(c.group, 0.0) + seconds
    return out


def issuing_strategy(group: str, layout: PlanLayout) -> Optional[str]:
    """The strategy whose calls go over ``group`` (a key of Cluster.issued), or None for the
    world's few scalars (the loss, the grad norm) and the tied embedding's all-reduce."""
    if group in ("dp", "dp_cp", "edp"):
        return "zero3" if layout.zero_stage == 3 else "dp"
    if group == "tp" and layout.sequence_parallel:
        return "sp"
    return group if group in ("tp", "cp", "pp", "ep") else None


def issued_counts(model: ModelSpec, layout: PlanLayout,
                  pp_rank: int = 0) -> Dict[Tuple[str, str], float]:
    """{(group, key of Cluster.issued): how many times that cost is paid per step}: a
    strategy's calls once each (a receive is its send's other end: the send pays); data
    parallel (DDP, ZeRO-1/2) once per step ("dp": the sync at the end of the backward, without
    cp or ep) and once per micro-batch ("dp_micro_batch": its hooks run in every backward),
    charged to the first of its groups (an MoE model's expert gradients over "edp" are synced
    by the same wrapper in the same wait as the dense ones over "dp_cp");
    ZeRO-3 once per block and micro-batch (each unit is gathered for its forward and again
    for its backward, freed, and its gradient reduce-scattered); a pipeline message once per
    block of the chunk it follows (it waits for the slower of two stages, and how much slower
    one is grows with a stage's work: measured, a message after 2 blocks cost twice one after
    1); an MoE block's routing statistics over dp_cp as an "ep" call, once per forward (it
    runs even at ep 1)."""
    out: Dict[Tuple[str, str], float] = {}
    blocks = rank_layers(model.num_layers, layout.pp, layout.virtual_stages, layout.layer_split,
                         layout.schedule)[pp_rank]
    moe = sum(1 for chunk in blocks for i in chunk if model.is_moe_layer(i))
    if moe and layout.dp_cp > 1:
        # each MoE block's routing statistics, an all-reduce over dp_cp in its forward that
        # every rank waits for, as for the dispatch: an MoE call (its bytes go with dp_cp's)
        # (full recomputation runs each MoE forward, and so this call, twice)
        redo = 2 if layout.activation_checkpointing == "full" else 1
        out[(layout.gradient_group, "ep")] = redo * moe * layout.num_micro_batches
    for c in collectives(model, layout, pp_rank):
        strategy = issuing_strategy(c.group, layout)
        if c.op == "recv" or strategy is None:
            continue
        if strategy == "zero3":  # each block's unit gathered, freed, reduced per micro-batch
            out[(c.group, "zero3")] = sum(map(len, blocks)) * layout.num_micro_batches
        elif strategy == "dp":
            if any(key in ("dp", "dp_micro_batch") for _, key in out):
                continue  # one wrapper syncs the dense (dp_cp) and expert (edp) gradients
            # its sync at the end of the backward waits for the slowest replica, unless the
            # step already keeps them together: cp's ring or ep's all-to-alls run between
            # the ranks of dp_cp block by block
            if layout.cp == 1 and layout.ep == 1:
                out[(c.group, "dp")] = 1
            out[(c.group, "dp_micro_batch")] = layout.num_micro_batches
        elif strategy == "pp":  # per message and block of a chunk
            per_chunk = max(1.0, sum(map(len, blocks)) / len(blocks))
            out[(c.group, "pp")] = out.get((c.group, "pp"), 0) + c.calls * per_chunk
        else:
            out[(c.group, strategy)] = out.get((c.group, strategy), 0) + c.calls
    return out


def measured_comm_seconds(model: ModelSpec, layout: PlanLayout, cluster: Cluster,
                          pp_rank: int = 0) -> Dict[str, float]:
    """On a measured host: seconds each group's communication of one step takes. A strategy's
    calls cost what they add to a step as the strategy issues them (``issued`` x
    ``issued_counts``: the bookkeeping around them and the wait for its peers included),
    other calls (and strategies not measured) a bare call's latency (``links``); the bytes
    go at the link's bandwidth (a receive: its send pays)."""
    out: Dict[str, float] = {}
    for c in collectives(model, layout, pp_rank):
        if c.op == "recv":
            continue
        latency, bandwidth = cluster.link(c.op, c.size, layout.world)
        strategy = issuing_strategy(c.group, layout)
        measured = strategy and cluster.issued_latency(strategy, layout.world) is not None
        out[c.group] = out.get(c.group, 0.0) + (0.0 if measured else c.calls * latency) + \
            c.wire / bandwidth
    for (group, key), count in issued_counts(model, layout, pp_rank).items():
        issued = cluster.issued_latency(key, layout.world)
        if issued is not None:
            out[group] += count * issued
    return out


REDO = {"none": 1.0, "selective": 1.0, "full": 4 / 3}  # fixed costs of a block incl. recompute


def compute_seconds(model: ModelSpec, layout: PlanLayout, cluster: Cluster,
                    pp_rank: int = 0) -> float:
    """A rank's compute per step: its share of the hardware FLOPs at peak x efficiency, plus
    the fixed costs of a measured host (zero for the GPU presets)."""
    lay = layout
    seconds = hardware_flops(model,
                             lay) / lay.world / (cluster.peak_flops * cluster.compute_efficiency)
    chunks = rank_layers(model.num_layers, lay.pp, lay.virtual_stages, lay.layer_split,
                         lay.schedule)
    blocks = [i for c in chunks[pp_rank] for i in c]
    moe = sum(1 for i in blocks if model.is_moe_layer(i))
    moe_cost = cluster.moe_layer_overhead_s or cluster.layer_overhead_s
    ends = any(holds_ends(lay, pp_rank))  # the embedding or the head and loss (a V: both)
    # the attention scores of a micro-batch on this rank: heads split by tp, rows by cp
    scores = lay.micro_batch_size * model.num_attention_heads / lay.tp * lay.seq_len**2 / lay.cp
    per_micro_batch = ((len(blocks) - moe) * cluster.layer_overhead_s + moe * moe_cost +
                       len(blocks) * scores * cluster.score_element_s) * \
        REDO[lay.activation_checkpointing] + ends * cluster.micro_batch_overhead_s
    return seconds + lay.num_micro_batches * per_micro_batch + cluster.step_overhead_s


def imbalance_seconds(model: ModelSpec, layout: PlanLayout, cluster: Cluster,
                      pp_rank: int = 0) -> Dict[str, float]:
    """{"compute": s, "ep": s}: what the hot ep rank adds to a step at ``moe_imbalance`` rho
    (scaletorch/plan/imbalance.py): its experts' FLOPs and its dispatch and combine bytes grow
    by rho, the fixed cost per op does not (as many ops, more rows each). Zero at rho 1."""
    lay = layout
    if lay.moe_imbalance == 1.0:
        return {"compute": 0.0, "ep": 0.0}
    blocks = [
        i for c in rank_layers(model.num_layers, lay.pp, lay.virtual_stages, lay.layer_split,
                               lay.schedule)[pp_rank] for i in c
    ]
    moe = sum(1 for i in blocks if model.is_moe_layer(i))
    # the balanced rank's expert FLOPs: k of 3 h x f matmuls per token, forward + backward
    # (+ the forward again under full recomputation), its share as compute_seconds takes it
    redo = 4 if lay.activation_checkpointing == "full" else 3
    flops = redo * 2 * model.moe_top_k * 3 * model.hidden_size * model.expert_size * moe * \
        lay.tokens_per_step / (lay.dp_cp * lay.tp)
    expert = flops / (cluster.peak_flops * cluster.compute_efficiency)
    receive = 0.0  # the routed rows' bytes (not the int64 counts), at the link's bandwidth
    for c in collectives(model, lay, pp_rank):
        if c.group == "ep" and c.op == "all_to_all" and c.element_size != 8:
            if cluster.cores:
                bandwidth = cluster.link(c.op, c.size, lay.world)[1]
            else:
                intra = group_span(lay, "ep") <= cluster.gpus_per_node
                bandwidth = (cluster.intra_node_bandwidth
                             if intra else cluster.inter_node_bandwidth) * cluster.comm_efficiency
            receive += c.wire / bandwidth
    return {
        "compute": imbalance_extra_seconds(expert, 0.0, lay.moe_imbalance, lay.ep),
        "ep": imbalance_extra_seconds(0.0, receive, lay.moe_imbalance, lay.ep),
    }


def _hot_rank(model: ModelSpec, layout: PlanLayout, cluster: Cluster) -> Dict[str, float]:
    """imbalance_seconds of the stage rank it adds most to (the one holding the most MoE
    blocks)."""
    extras = [imbalance_seconds(model, layout, cluster, r) for r in stage_ranks(layout)]
    return max(extras, key=lambda e: e["compute"] + e["ep"])


def stage_ranks(layout: PlanLayout) -> List[int]:
    """The pipeline ranks whose compute and traffic can set the step: the first and the last
    (the embedding; the head and loss), and in a V a middle rank too (rank 0 holds both ends,
    a middle rank sends twice as much between its two chunks' neighbours)."""
    middle = {1} if layout.schedule in V_SHAPED and layout.pp > 2 else set()
    return sorted({0, layout.pp - 1} | middle)


def _measured_host_step(model: ModelSpec, layout: PlanLayout, cluster: Cluster) -> Dict[str, Any]:
    """compute_s, exposed_s, bubble, step_time_s of a measured host (the module docstring)."""
    lay = layout
    ranks = stage_ranks(lay)
    hot = _hot_rank(model, lay, cluster)
    compute = max(compute_seconds(model, lay, cluster, r) for r in ranks) + hot["compute"]
    exposed: Dict[str, float] = {}
    for r in ranks:  # the slower stage's traffic, group by group
        for group, seconds in measured_comm_seconds(model, lay, cluster, r).items():
            exposed[group] = max(exposed.get(group, 0.0), seconds)
    if hot["ep"]:
        exposed["ep"] += hot["ep"]
    bubble = pipeline_bubble(model, lay)  # each schedule's (the zero-bubble ones simulated)
    step = cluster.time_slicing(lay.world) * (compute / (1 - bubble) + sum(exposed.values()))
    return {
        "compute_s": compute,
        "exposed_s": exposed,
        "bubble": bubble,
        "step_time_s": step,
        "imbalance_s": hot
    }


def step_time(model: ModelSpec, layout: PlanLayout, cluster: Cluster) -> Dict[str, Any]:
    """compute_s, exposed_s (by group), bubble, step_time_s, tokens_per_s_per_gpu, mfu, and
    the FLOPs (model and hardware, per step)."""
    lay = layout
    hw = hardware_flops(model, lay)
    flops = model_flops(model, lay.global_batch, lay.seq_len)
    if cluster.cores:
        out = _measured_host_step(model, lay, cluster)
        return {
            **out, "tokens_per_s_per_gpu": lay.tokens_per_step / out["step_time_s"] / lay.world,
            "mfu": flops / (out["step_time_s"] * lay.world * cluster.peak_flops),
            "model_flops": flops,
            "hardware_flops": hw
        }
    if cluster.hbm_bandwidth:  # a GPU, kernel by kind (scaletorch/plan/kernels.py)
        slowest: Dict[str, float] = {}  # per group, the slowest rank's seconds
        for r in stage_ranks(lay):
            for group, seconds in comm_seconds(model, lay, cluster, r).items():
                slowest[group] = max(slowest.get(group, 0.0), seconds)
        hot = _hot_rank(model, lay, cluster)
        if hot["ep"]:
            slowest["ep"] += hot["ep"]
        gpu = gpu_step(model, lay, cluster, stage_ranks(lay), slowest)
        gpu["compute_s"] += hot["compute"]
        gpu["busy_s"] += hot["compute"]
        bubble = pipeline_bubble(model, lay)
        step = gpu["busy_s"] / (1 - bubble) + gpu["after_s"]
        return {
            **gpu,
            "imbalance_s": hot,
            "bubble": bubble,
            "step_time_s": step,
            "tokens_per_s_per_gpu": lay.tokens_per_step / step / lay.world,
            "mfu": flops / (step * lay.world * cluster.peak_flops),
            "model_flops": flops,
            "hardware_flops": hw,
        }
    rate = cluster.peak_flops * cluster.compute_efficiency
    hot = _hot_rank(model, lay, cluster)
    compute = hw / lay.world / rate + hot["compute"]
    # the attention cores' share: what the cp ring hides behind
    core = 3 * 4 * lay.seq_len * model.hidden_size * model.num_layers * lay.tokens_per_step
    core_s = core / lay.world / rate
    last_micro_backward = compute * 2 / 3 / lay.num_micro_batches
    comm: Dict[str, float] = {}
    for r in stage_ranks(lay):  # the slowest of them sets it
        for group, seconds in comm_seconds(model, lay, cluster, r).items():
            comm[group] = max(comm.get(group, 0.0), seconds)
    if hot["ep"]:
        comm["ep"] += hot["ep"]
    exposed = {}
    for group, seconds in comm.items():
        if group == "cp":
            exposed[group] = max(0.0, seconds - core_s)
        elif group in ("dp", "dp_cp", "edp", "world"):
            window = compute if lay.zero_stage == 3 else last_micro_backward
            exposed[group] = max(0.0, seconds - window) if group != "world" else seconds
        else:
            exposed[group] = seconds
    bubble = pipeline_bubble(model, lay)  # each schedule's (the zero-bubble ones simulated)
    busy = compute + sum(v for g, v in exposed.items() if g in ("tp", "cp", "ep", "pp"))
    step = busy / (1 - bubble) + sum(
        v for g, v in exposed.items() if g in ("dp", "dp_cp", "edp", "world"))
    return {
        "compute_s": compute,
        "exposed_s": exposed,
        "bubble": bubble,
        "step_time_s": step,
        "imbalance_s": hot,
        "tokens_per_s_per_gpu": lay.tokens_per_step / step / lay.world,
        "mfu": flops / (step * lay.world * cluster.peak_flops),
        "model_flops": flops,
        "hardware_flops": hw,
    }
