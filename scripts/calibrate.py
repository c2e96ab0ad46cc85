"""Measure this host into a cluster file the planner reads (``scripts/plan.py --calibrate``).

    python scripts/plan.py examples/configs/07_nd_parallel.yaml --calibrate runs/host.json
    python scripts/plan.py examples/configs/07_nd_parallel.yaml --cluster runs/host.json

What a spec sheet gives for a GPU, measured here for CPU ranks (one thread each, as
scripts/launch.sh runs them), in about two minutes:

- compute, one process: the matmuls of the config's block at its micro-batch sizes give
  ``peak_flops``; a whole forward + backward of the model at 1, 2 and 4 dense blocks and 1 MoE
  block and 2 dense blocks with half the heads, three micro-batch sizes each, fitted as time =
  dense blocks x layer_overhead + MoE blocks x moe_layer_overhead + micro_batch_overhead +
  attention scores x score_element + FLOPs / (peak x compute_efficiency), gives the rest (a
  small model's step is mostly the fixed cost of its many small ops, not its FLOPs; half the
  heads at the same width keep the FLOPs and halve the b x heads x s x s scores);
  clipping + AdamW gives ``step_overhead_s``;
- time-slicing, in gloo worlds of 2, 3 and 4 processes: how much longer a fixed piece of
  compute takes with every rank computing at once than alone (``slowdown``: about 1 within
  the cores, about world / cores past them, more if other programs hold cores);
- links, in the same worlds: all-reduce, all-gather, all-to-all and send/recv over every group
  size that divides the world, all groups busy at once as in a run; latency = the time a 4-byte
  call adds between pieces of compute (past the core count a rank waits for the scheduler to
  run its peer), bandwidth = the ledger's wire bytes of a 256 KiB call over its extra time;
- calls as the strategies issue them, in the worlds of an even size within the cores (2
  here, where every rank has a core): the config trained with one strategy of size 2 (tp, tp
  with sequence parallel, cp, pp, ep; the rest data parallel) or data parallel alone (DDP,
  ZeRO-3), ``steps`` steps each: the seconds one of its calls adds to a step (``issued``) =
  (the step measured - the step predicted with those calls free) / the calls
  (DDP: trained with 1 and with m micro-batches, split into a cost per step, its sync at the
  end of the backward, and one per micro-batch, its hooks; ZeRO-3: per block and
  micro-batch, each unit's gather, free and reduce-scatter; pp: per message and block of the
  chunk it follows, the wait for the slower stage). A bare call between pieces of
  compute misses what a strategy does around its calls (ring attention's block merges, the
  experts' dispatch, DDP's buckets) and the wait for its peers;
- past the cores (4 ranks here), the slowdown of a real step: the config trained data
  parallel over the whole world, its step / the step predicted with a core per rank
  (``slowdown``, replacing the compute-only figure: switching between ranks and waiting for
  a peer that is not running add to world / cores);
- past the cores, what is left of a call's cost: a rank that waits lends its core to another
  rank that has work. Three layouts that the tour does not run (tp 2 x dp 2, cp 2 x pp 2,
  cp 2 x ZeRO-3) give one factor, and ``issued`` for that world is the factor x each cost
  within the cores (data parallel's excepted: the slowdown holds them).

A step measured is the 10th percentile of its steps after the first
(scaletorch/plan/time.measured_step), as the tour reads it.
"""

import copy
import os
import statistics
import sys
import time
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from scaletorch.config import Config
from scaletorch.dist import comm
from scaletorch.dist.spawn import run_distributed
from scaletorch.models import build_model
from scaletorch.plan.cluster import ISSUED, Cluster, save_cluster
from scaletorch.plan.flops import model_flops
from scaletorch.plan.layout import PlanLayout
from scaletorch.plan.model import ModelSpec, from_config
from scaletorch.plan.time import issued_counts, measured_step, step_time
from scaletorch.rules.wire import wire_bytes

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scripts.plan_measure import checker, measure_rank, run_config  # noqa: E402

WORLDS = (2, 3, 4)
SMALL, LARGE = 1, 2**16  # fp32 elements of a latency-bound and a bandwidth-bound call
OPS = ("all_reduce", "all_gather", "all_to_all", "send")
STRATEGY_STEPS = 20  # per strategy and round (two rounds): the fastest after the first is kept
STEADY = 0.1  # how far the same compute may move between calibrate's start and end


def _seconds(fn: Callable[[], Any], reps: int, warmup: int = 2) -> float:
    """The fastest of ``reps`` timed calls: on a shared host other programs only ever add
    time, so the minimum is the host's own speed (the tour's step times are read the same
    way, scripts/plan_vs_tour.py)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _fit(rows: List[List[float]], times: List[float]) -> List[float]:
    """Least squares: times ~ rows @ coefficients (no numpy needed: torch's lstsq)."""
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(times, dtype=torch.float64).unsqueeze(1)
    return torch.linalg.lstsq(a, b).solution.squeeze(1).tolist()


def measure_compute(model_cfg: Any, seq_len: int, seed: int = 0) -> Dict[str, float]:
    """``peak_flops``, ``compute_efficiency``, ``layer_overhead_s``, ``moe_layer_overhead_s``,
    ``micro_batch_overhead_s``, ``step_overhead_s`` and ``score_element_s`` (0 unless the
    heads halve) of one CPU thread for ``model_cfg``'s shapes."""
    torch.set_num_threads(1)
    spec = from_config(model_cfg)
    h, batches = spec.hidden_size, (1, 4, 16)
    # the block's matmuls, (b s, h) x (h, out), at the largest micro-batch measured
    tokens = batches[-1] * seq_len
    x = torch.randn(tokens, h)
    shapes = [
        spec.head_dim * spec.num_attention_heads, spec.kv_size, spec.kv_size, h,
        spec.intermediate_size, spec.intermediate_size
    ]
    weights = [torch.randn(h, o) for o in shapes] + [torch.randn(spec.intermediate_size, h)]
    inputs = [x] * len(shapes) + [torch.randn(tokens, spec.intermediate_size)]
    flops = sum(2 * i.shape[0] * w.shape[0] * w.shape[1] for i, w in zip(inputs, weights))
    seconds = min(_seconds(lambda: [i @ w for i, w in zip(inputs, weights)], 10) for _ in range(3))
    peak = flops / seconds
    # forward + backward of the whole model: dense blocks x overhead + MoE blocks x theirs +
    # ends + attention scores x their cost + FLOPs / rate (the config's experts, or chapter
    # 06's 4 if it has none; half the heads at the same width: as many FLOPs, half the scores)
    dense = replace(model_cfg, num_experts=0)
    moe = replace(
        model_cfg, num_experts=model_cfg.num_experts or 4, moe_layer_freq=1,
        moe_intermediate_size=model_cfg.moe_intermediate_size or model_cfg.intermediate_size // 2)
    heads, kv = model_cfg.num_attention_heads, model_cfg.num_key_value_heads
    halves = heads % 2 == 0 and kv % 2 == 0
    half = replace(dense, num_attention_heads=heads // 2, num_key_value_heads=kv // 2)
    shapes = [(dense, 1, 0), (dense, 2, 0), (dense, 4, 0), (moe, 0, 1)] + \
        ([(half, 2, 0)] if halves else [])
    points = []  # (model, input ids, fit row)
    for cfg, dense_layers, moe_layers in shapes:
        cfg = replace(cfg, num_layers=dense_layers + moe_layers)
        model = build_model(cfg, seed=seed)
        for b in batches:
            ids = torch.randint(0, cfg.vocab_size, (b, seq_len))
            scores = (dense_layers + moe_layers) * b * cfg.num_attention_heads * seq_len**2
            row = [dense_layers, moe_layers, 1.0, model_flops(from_config(cfg), b, seq_len)]
            points.append((model, ids, row + ([scores] if halves else [])))

    def step(model: torch.nn.Module, ids: torch.Tensor) -> None:
        logits = model(ids)
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        model.zero_grad(set_to_none=True)

    # 4 or 5 coefficients from 12 or 15 points: each point the fastest of 40 steps in 4 rounds
    # over all points, so that a few seconds of load elsewhere on the host spoil a round, not
    # a point
    times = [float("inf")] * len(points)
    for _ in range(4):
        for i, (model, ids, _) in enumerate(points):
            times[i] = min(times[i], _seconds(lambda: step(model, ids), 10))
    rows = [row for _, _, row in points]
    per_layer, per_moe_layer, per_micro_batch, per_flop, *per_score = _fit(rows, times)
    efficiency = min(1.0, 1 / (per_flop * peak)) if per_flop > 0 else 1.0
    # clipping and AdamW over the config's model (gradients present)
    model = build_model(model_cfg, seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)

    def update() -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return {
        "peak_flops": peak,
        "compute_efficiency": efficiency,
        "layer_overhead_s": max(0.0, per_layer),
        "moe_layer_overhead_s": max(0.0, per_moe_layer),
        "micro_batch_overhead_s": max(0.0, per_micro_batch),
        "step_overhead_s": _seconds(update, 30),
        "score_element_s": max(0.0, per_score[0]) if per_score else 0.0,
    }


def _call(op: str, tensor: torch.Tensor, out: torch.Tensor, group: Any, peer: int,
          rank: int) -> None:
    if op == "all_reduce":
        dist.all_reduce(tensor, group=group)
    elif op == "all_gather":
        comm.torch_all_gather(out, tensor, group=group)  # bare: no ledger record
    elif op == "all_to_all":
        dist.all_to_all_single(out[:tensor.numel()], tensor, group=group)
    else:  # one message each way: half the round trip is one send
        if rank < peer:
            dist.send(tensor, peer)
            dist.recv(tensor, peer)
        else:
            dist.recv(tensor, peer)
            dist.send(tensor, peer)


def _work() -> Callable[[], Any]:
    """A fixed piece of compute (about 2 ms on one core): what ranks do between calls."""
    a = torch.randn(256, 256)
    return lambda: [a @ a for _ in range(4)]


def measure_links(rank: int, world: int, alone: float) -> Dict[str, Any]:
    """In a gloo world: ``busy`` (how much longer ``_work`` takes with every rank computing at
    once than ``alone``, its time in the parent before the world started; the smaller of a
    measurement before the links and one after) and
    ``links`` {group size: {op: (latency s, wire bytes/s)}} with every group of that size
    (consecutive ranks) busy at once; send/recv between rank pairs (2 i, 2 i + 1).

    The latency is that of a 4-byte call made between pieces of compute, as in a run: past the
    core count a rank that waits for a peer waits until the scheduler runs the peer, a cost an
    idle ping-pong never sees. The bandwidth is from the extra time of a 256 KiB call."""
    work = _work()
    dist.barrier()
    # every rank at once, against ``alone`` (the parent's); many repetitions, the fastest kept:
    # this host's own speed, not a moment of load elsewhere on it (which comes in bursts of a
    # tenth of a second: 10 repetitions read 1.2-1.4 at times, 100 read 0.97-1.02)
    busy = _seconds(work, 100) / alone
    out: Dict[str, Dict[str, Tuple[float, float]]] = {}
    for size in range(2, world + 1):
        # collectives over groups of consecutive ranks that tile the world; send/recv between
        # pairs (an odd world's last rank sits them out)
        ops = [
            op for op in OPS if (op == "send" and size == 2) or (op != "send" and world % size == 0)
        ]
        if not ops:
            continue
        groups = [
            dist.new_group(list(range(g, g + size))) for g in range(0, world, size)
            if world % size == 0
        ]
        group = groups[rank // size] if groups else None
        out[str(size)] = {}
        for op in ops:
            peer = rank ^ 1
            idle = op == "send" and peer >= world  # an odd world's last rank has no partner
            times = {}
            for numel in (SMALL, LARGE):
                tensor = torch.ones(numel * (size if op == "all_to_all" else 1))
                buffer = torch.empty(numel * size)

                def call() -> None:
                    _call(op, tensor, buffer, group, peer, rank)

                dist.barrier()
                if idle:
                    times[numel] = 0.0
                    continue
                seconds = _seconds(call, 10 if numel == SMALL else 5)
                times[numel] = seconds / (2 if op == "send" else 1)
            dist.barrier()
            loaded = 0.0 if idle else _seconds(lambda: (work(), call()), 10)
            latency = max(times[SMALL], (loaded - busy * alone) / (2 if op == "send" else 1))
            nbytes = {
                n: 4 * n * (size if op in ("all_gather", "all_to_all") else 1)
                for n in (SMALL, LARGE)
            }
            wire = {
                n:
                nbytes[n] * (size - 1) /
                size if op == "all_to_all" else wire_bytes(op, nbytes[n], size)
                for n in (SMALL, LARGE)
            }
            extra = times[LARGE] - times[SMALL]
            bandwidth = (wire[LARGE] - wire[SMALL]) / extra if extra > 0 else \
                wire[LARGE] / max(times[LARGE], 1e-9)
            out[str(size)][op] = (0.0 if idle else latency, bandwidth)
    dist.barrier()  # measured again after the links, the smaller kept
    busy = min(busy, _seconds(work, 100) / alone)
    return {"busy": busy, "links": out}


def strategy_layouts(
        cfg: Config, seq_len: int, world: int,
        steps: int = STRATEGY_STEPS) -> Dict[str, Tuple[ModelSpec, PlanLayout, Config]]:
    """For each strategy of ISSUED that ``cfg``'s model can run on ``world`` ranks: its model,
    its layout (the strategy at size 2, the rest of the world data parallel; dp,
    dp_micro_batch and zero3: all of it) and the config that trains it. MoE for ep (the
    config's experts, or chapter 06's 4), one micro-batch there and for dp, at least 2 under
    the pipeline and for dp_micro_batch."""

    dense = from_config(replace(cfg.model, num_experts=0))
    moe = from_config(
        replace(
            cfg.model, num_experts=cfg.model.num_experts or 4, moe_layer_freq=1,
            moe_intermediate_size=cfg.model.moe_intermediate_size
            or cfg.model.intermediate_size // 2))
    base = copy.deepcopy(cfg)
    base.training.steps, base.checkpoint.every, base.check = steps, 0, False
    base.logging.progress = False
    check = checker(base)
    m = cfg.data.num_micro_batches
    out = {}
    for kind in ISSUED:
        sizes = {"tp": 1, "pp": 1, "cp": 1, "ep": 1}
        if kind in sizes or kind == "sp":
            sizes["tp" if kind == "sp" else kind] = 2
        dp = world // (2 if kind in ("tp", "sp", "pp", "cp") else 1)
        # data parallel twice: 1 micro-batch ("dp") and more ("dp_micro_batch"), to split
        # its cost per step from its cost per micro-batch
        micro = {"pp": max(m, 2), "ep": 1, "dp": 1, "dp_micro_batch": max(m, 2)}.get(kind, m)
        if cfg.data.global_batch_size % (dp * micro):
            continue
        try:
            layout = PlanLayout(**sizes, dp=dp, zero_stage=3 if kind == "zero3" else 0,
                                sequence_parallel=kind == "sp", num_micro_batches=micro,
                                micro_batch_size=cfg.data.global_batch_size // (dp * micro),
                                seq_len=seq_len)
        except ValueError:
            continue
        model = moe if kind == "ep" else dense
        if check(model, layout) is None:
            out[kind] = (model, layout, run_config(base, model, layout))
    return out


def measure_slowdown(cfg: Config, seq_len: int, world: int, cluster: Cluster,
                     steps: int = STRATEGY_STEPS) -> Optional[float]:
    """How much longer a real training step takes on ``world`` ranks sharing the cores than
    ``cluster`` predicts with a core per rank: the config trained data parallel over the whole
    world, twice (the faster kept, as in measure_issued; never below world / cores), or None
    if the batch does not split over the world."""

    runs = strategy_layouts(cfg, seq_len, world, steps)
    if "dp" not in runs:
        return None
    model, layout, run = runs["dp"]
    results = run_distributed(measure_rank, world, {"dp 1": run, "dp 2": run}, timeout=300)[0]
    measured = measured_step(*(results[f"dp {r}"]["step_seconds"] for r in (1, 2)))
    own_core = replace(cluster, slowdown={**cluster.slowdown, str(world): 1.0})
    predicted = step_time(model, layout, own_core)["step_time_s"]
    return max(world / (cluster.cores or 1), measured / predicted)


def measure_issued(cfg: Config, seq_len: int, world: int, cluster: Cluster,
                   steps: int = STRATEGY_STEPS) -> Dict[str, float]:
    """{key of Cluster.issued: seconds} in a gloo world of ``world`` within the cores: each
    strategy's layout trained ``steps`` steps, twice (in two rounds); its excess = the step
    measured (rank 0's, both rounds pooled, time.measured_step) minus the step ``cluster``
    predicts with the strategy's calls free; per call = excess / the calls
    (time.issued_counts; not below 0). Data parallel first, from its two runs (1 and m
    micro-batches: excess = per step + micro-batches x per micro-batch), since the other
    strategies' layouts hold data-parallel ranks too, whose cost is then known."""

    runs = strategy_layouts(cfg, seq_len, world, steps)
    # two rounds, every strategy in each, pooled: a moment of load on a shared host (which
    # only ever adds time) then spoils a few steps of a strategy, not its cost
    configs = {f"{kind} {r}": run for r in (1, 2) for kind, (_, _, run) in runs.items()}
    results = run_distributed(measure_rank, world, configs, timeout=300)

    def excess(kind: str, known: Dict[str, float]) -> float:
        model, layout, _ = runs[kind]
        free = replace(cluster, issued={str(world): {**known, kind: 0.0}})
        measured = measured_step(*(results[0][f"{kind} {r}"]["step_seconds"] for r in (1, 2)))
        return measured - step_time(model, layout, free)["step_time_s"]

    out: Dict[str, float] = {}
    if "dp" in runs and "dp_micro_batch" in runs:
        free = {"dp": 0.0, "dp_micro_batch": 0.0}
        one, m = excess("dp", free), runs["dp_micro_batch"][1].num_micro_batches
        per_micro_batch = max(0.0, (excess("dp_micro_batch", free) - one) / (m - 1))
        out = {"dp": max(0.0, one - per_micro_batch), "dp_micro_batch": per_micro_batch}
    for kind in (k for k in ISSUED if k in runs and k not in out):
        model, layout, _ = runs[kind]
        calls = sum(n for (_, key), n in issued_counts(model, layout).items() if key == kind)
        out[kind] = max(0.0, excess(kind, out) / calls) if calls else 0.0
    return out


# past the cores: three layouts that the tour does not run (scripts/tour.sh composes tp with
# pp, cp, ZeRO-3 and ep), each strategy of size 2: pairs that wait only for each other (tp x
# dp: one pair's wait is the other's time to run) and pairs that wait for other pairs too
COMPOSED = ({"tp": 2}, {"cp": 2, "pp": 2}, {"cp": 2, "zero_stage": 3})


def composed_layouts(cfg: Config, seq_len: int, world: int) -> Tuple[ModelSpec, List[PlanLayout]]:
    """The plan's model of ``cfg`` (dense) and the COMPOSED layouts that fill ``world`` ranks,
    with at least 2 micro-batches, that the model and the global batch admit."""
    model = from_config(replace(cfg.model, num_experts=0))
    check = checker(cfg)
    m, batch = max(cfg.data.num_micro_batches, 2), cfg.data.global_batch_size
    layouts = []
    for sizes in COMPOSED:
        dp = world // (sizes.get("tp", 1) * sizes.get("pp", 1) * sizes.get("cp", 1))
        if dp < 1 or batch % (dp * m):
            continue
        try:
            layout = PlanLayout(**sizes, dp=dp, num_micro_batches=m,
                                micro_batch_size=batch // (dp * m), seq_len=seq_len)
        except ValueError:
            continue
        if layout.world == world and check(model, layout) is None:
            layouts.append(layout)
    return model, layouts


def measure_call_factor(cfg: Config, seq_len: int, world: int, cluster: Cluster,
                        steps: int = STRATEGY_STEPS) -> Optional[float]:
    """Past the cores, the share of a call's cost (``issued``, measured within them) that a
    step still pays: a rank that waits lends its core to another rank that has work. Measured
    on the composed layouts on ``world`` ranks (``cluster`` holds this world's slowdown and
    the issued costs within the cores), twice each, pooled: the sum over them of (measured
    - predicted with every call free) / the sum of (predicted - predicted with every call
    free). Data parallel's costs stay whole: the slowdown was measured with them. None if no
    composed layout runs on ``world`` ranks."""

    model, layouts = composed_layouts(cfg, seq_len, world)
    if not layouts:
        return None
    base = copy.deepcopy(cfg)
    base.training.steps, base.checkpoint.every, base.check = steps, 0, False
    base.logging.progress = False
    configs = {
        f"{i} {r}": run_config(base, model, lay)
        for r in (1, 2)
        for i, lay in enumerate(layouts)
    }
    results = run_distributed(measure_rank, world, configs, timeout=300)[0]
    within = cluster.issued[min(cluster.issued, key=int)]  # per call, within the cores
    free = replace(
        cluster,
        issued={str(world): {
                    k: (v if k.startswith("dp") else 0.0)
                    for k, v in within.items()
                }})
    paid = charged = 0.0
    for i, layout in enumerate(layouts):
        measured = measured_step(*(results[f"{i} {r}"]["step_seconds"] for r in (1, 2)))
        without = step_time(model, layout, free)["step_time_s"]
        paid += measured - without
        charged += step_time(model, layout, cluster)["step_time_s"] - without
    return max(0.0, paid / charged) if charged > 0 else None


# what an issued cost is paid per, where not per call (scaletorch/plan/time.issued_counts)
PAID_PER = {
    "pp": " per message and block",
    "dp": " per step",
    "dp_micro_batch": " per micro-batch",
    "zero3": " per block and micro-batch"
}


def summary(cluster: Cluster) -> str:
    """What ``calibrate`` measured, in a few lines (every time in ms)."""
    c = cluster
    lines = [
        f"{c.name}: fixed costs per block {1e3 * c.layer_overhead_s:.2f} ms (MoE "
        f"{1e3 * c.moe_layer_overhead_s:.2f} ms), per micro-batch "
        f"{1e3 * c.micro_batch_overhead_s:.2f} ms, per step {1e3 * c.step_overhead_s:.2f} ms, "
        f"per million attention scores {1e9 * c.score_element_s:.1f} ms"
    ]
    bare = [
        f"{1e3 * c.links[w]['2']['all_reduce'][0]:.2f} ms on {w} ranks" for w in c.links
        if "all_reduce" in c.links[w].get("2", {})
    ]
    lines.append("a 4-byte all-reduce over 2 ranks between pieces of compute: " + ", ".join(bare))
    within = c.issued[min(c.issued, key=int)] if c.issued else {}
    for world, kinds in c.issued.items():
        shares = [kinds[k] / within[k] for k in kinds if within.get(k)]
        share = f" ({shares[0]:.2f} x within the cores)" if kinds is not within and shares else ""
        lines.append(f"a call as issued on {world} ranks{share}: " +
                     ", ".join(f"{k} {1e3 * kinds[k]:.2f} ms" + PAID_PER.get(k, "")
                               for k in ISSUED if k in kinds))
    return "\n".join(lines)


def calibrate(cfg: Config, seq_len: int, path: str, progress: Callable[[str], None],
              worlds: Sequence[int] = WORLDS, steps: int = STRATEGY_STEPS) -> Cluster:
    """Measure this host for ``cfg``'s model at ``seq_len`` tokens and write ``path`` (links
    in gloo worlds of each size in ``worlds``; calls as issued in those of an even size,
    ``steps`` steps per strategy)."""
    model_cfg = cfg.model
    start = time.perf_counter()

    def say(what: str) -> None:
        progress(f"calibrate [{time.perf_counter() - start:4.0f} s] {what}")

    say("compute: matmuls; forward + backward at 1, 2, 4 blocks, 1 MoE block, half the heads, "
        "x 3 micro-batch sizes; AdamW")
    compute = measure_compute(model_cfg, seq_len)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)
    links: Dict[str, Dict[str, Dict[str, List[float]]]] = {}
    slowdown: Dict[str, float] = {}
    work = _work()
    first = _seconds(work, 100)  # again at the end: did another program take the cores?
    for world in worlds:
        say(f"links: gloo world of {world} (all-reduce, all-gather, all-to-all, send)")
        alone = _seconds(work, 100)  # no rank of ours running (a waiting rank may spin)
        results = run_distributed(measure_links, world, alone, timeout=120)
        # never below world / cores: ranks beyond the cores cannot all run at once
        slowdown[str(world)] = max(1.0, world / cores, statistics.mean(r["busy"] for r in results))
        per_rank = [r["links"] for r in results]
        links[str(world)] = {
            size: {
                op: [
                    statistics.mean(r[size][op][0] for r in per_rank if r[size][op][0] > 0),
                    statistics.mean(r[size][op][1] for r in per_rank if r[size][op][0] > 0)
                ]
                for op in per_rank[0][size]
            }
            for size in per_rank[0]
        }
    pair = links[str(min(worlds))]["2"]["all_reduce"]
    cluster = Cluster(name=f"host ({cores} cores, calibrated)", gpus_per_node=max(worlds),
                      hbm_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
                      intra_node_bandwidth=pair[1], inter_node_bandwidth=pair[1],
                      intra_node_latency=pair[0], inter_node_latency=pair[0], comm_efficiency=1.0,
                      cores=cores, slowdown=slowdown, links=links, **compute)
    issued: Dict[str, Dict[str, float]] = {}
    for world in (w for w in worlds if w % 2 == 0 and w <= cores):
        say(f"calls as issued: {', '.join(ISSUED)} trained on {world} ranks")
        issued[str(world)] = measure_issued(cfg, seq_len, world, cluster, steps)
    cluster = replace(cluster, issued=issued)
    for world in (w for w in worlds if w > cores):  # past the cores: a real step's slowdown
        say(f"slowdown of a training step: data parallel on {world} ranks")
        factor = measure_slowdown(cfg, seq_len, world, cluster, steps)
        if factor is not None:
            slowdown[str(world)] = factor
    cluster = replace(cluster, slowdown=slowdown)
    for world in (w for w in worlds if w > cores and w % 2 == 0):
        say(f"calls past the cores: tp 2 x dp 2, cp 2 x pp 2 and cp 2 x ZeRO-3 trained on "
            f"{world} ranks")
        factor = measure_call_factor(cfg, seq_len, world, cluster, steps)
        if factor is not None:  # every call but data parallel's: that share of its cost
            within = issued[min(issued, key=int)]
            issued[str(world)] = {
                k: factor * v
                for k, v in within.items() if not k.startswith("dp")
            }
    cluster = replace(cluster, issued=issued)
    save_cluster(cluster, path)
    say(f"wrote {path}")
    last = _seconds(work, 100)
    change = last / first - 1
    busy = abs(change) > STEADY
    advice = "; the host was busier at one end: calibrate again when it is quiet" if busy else ""
    say(f"steadiness: a fixed piece of compute took {1e3 * first:.2f} ms at the start, "
        f"{1e3 * last:.2f} ms at the end ({100 * change:+.0f}%){advice}")
    return cluster


if __name__ == "__main__":  # a module of plan.py: one line saying what to run, exit 2
    from scripts import module_only

    module_only(__doc__, "python scripts/plan.py [CONFIG.yaml] --calibrate FILE.json")
