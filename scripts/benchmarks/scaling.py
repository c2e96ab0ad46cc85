"""Chapter 07 rows: memory and communication per rank as the world grows 1 -> 2 -> 4.

For each world size one gloo world trains the same model under several layouts (built with
``parallelize``, each with its own process-group manager), their steps alternating so that
background load hits all alike. A row: the layout, the median step time and its ratio to
plain data parallel in the same world (measured alternately), the most memory any rank holds
(parameters + gradients + AdamW state), the most activations autograd held for backward at
once during one step (``saved_activation_bytes``; ZeRO-3 rows include the gathered weights
the matmuls keep, which vary a little with the prefetch timing) and the most bytes any rank
puts on the wire per step, by group.
Expected: tp and pp divide the memory by about tp x pp, ZeRO-3 by dp, plain dp not at all;
tp pays activations on "tp", pp a few messages on "pp", dp the gradients on "dp";
activation checkpointing keeps only each block's input.

    python scripts/benchmark.py --scaling --steps 5 --repeats 1
"""

from typing import Dict, List

import torch

from scaletorch.dist import get_ledger
from scaletorch.dist.pg_manager import ProcessGroupManager, RankGrid
from scaletorch.models import LlamaConfig, build_model
from scaletorch.parallel.activation_checkpointing import (apply_activation_checkpointing,
                                                          saved_activation_bytes)
from scaletorch.parallel.memory_report import measure_memory
from scaletorch.parallel.mixed_precision import precision_hooks
from scaletorch.parallel.parallelize import parallelize, report_groups
from scaletorch.trainer import Config, Trainer
from scripts.benchmarks import timing

WORLDS = (1, 2, 4)
# world -> [(name, tp, pp, zero_stage)]; the rest of the world is data parallel
LAYOUTS = {
    1: [("single", 1, 1, 0)],
    2: [("dp2", 1, 1, 0), ("tp2", 2, 1, 0), ("pp2", 1, 2, 0), ("zero3_dp2", 1, 1, 3)],
    4: [("dp4", 1, 1, 0), ("tp2_dp2", 2, 1, 0), ("tp2_pp2", 2, 2, 0), ("zero3_dp4", 1, 1, 3),
        ("tp2_pp2_ckpt", 2, 2, -1)],
}
WARMUP = 2
GROUPS = report_groups(1)  # every layout here has cp 1: the gradients' group is "dp"


def _config(tp: int, pp: int, zero: int) -> Config:
    cfg = Config()
    cfg.model = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_layers=4,
                            num_attention_heads=8, num_key_value_heads=4, max_seq_len=64)
    cfg.data.seq_len, cfg.data.global_batch_size, cfg.data.num_micro_batches = 64, 8, 2
    cfg.training.steps, cfg.logging.progress = 10**6, False
    p = cfg.parallel
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size = tp, pp
    p.zero_stage, p.activation_checkpointing = max(zero, 0), zero < 0
    return cfg


def _measure(rank: int, world: int, samples: int) -> Dict[str, dict]:
    runs = {}
    for name, tp, pp, zero in LAYOUTS[world]:
        cfg = _config(tp, pp, zero)
        pgm = ProcessGroupManager(RankGrid(world, tp, pp))
        hooks = precision_hooks(cfg, "cpu")
        par = parallelize(build_model(cfg.model, seed=0), cfg, pgm, torch.device("cpu"), hooks,
                          recompute=apply_activation_checkpointing)
        trainer = Trainer(cfg, par.model, pgm, optimizer=par.optimizer,
                          forward_backward=par.forward_backward, clip_grad_norm=par.clip_grad_norm,
                          scaler=hooks.scaler, verbose=False)
        runs[name] = (pgm, trainer)
    times, wires = timing.alternate(
        list(runs), samples, WARMUP, lambda name: runs[name][1].train_step(),
        lambda name: {g: get_ledger().total(group=g, field="wire_bytes")
                      for g in GROUPS})
    rows = {}
    with timing.untracked():  # the benchmark's own bookkeeping is not traffic
        for name, (pgm, trainer) in runs.items():
            mem = measure_memory(trainer.model, trainer.optimizer)
            activations, _ = saved_activation_bytes(trainer.model, trainer.train_step)  # one more
            rows[name] = (times[name] + [sum(mem.values()), activations] +
                          [wires[name][g] for g in GROUPS])
    rows = timing.max_over_ranks(rows)  # the slowest / fullest rank
    for pgm, _ in runs.values():
        pgm.destroy()
    return {
        name: {
            "times": row[:samples],
            "memory": row[samples],
            "activations": row[samples + 1],
            "wire": dict(zip(GROUPS, row[samples + 2:]))
        }
        for name, row in rows.items()
    }


def run(args) -> List[dict]:
    """Rows: per layout, step time (and ratio to dp of the same world), max memory and max
    wire bytes per rank and step."""
    from scaletorch.dist.spawn import run_distributed

    samples = timing.samples(args)
    rows = []
    for world in WORLDS:
        result = run_distributed(_measure, world, samples, timeout=1800)[0]
        base = next(iter(result.values()))["times"]
        for name, r in result.items():
            wire = {g: v / 1e6 for g, v in r["wire"].items() if v}
            rows.append({
                "world": world,
                "layout": name,
                "ms/step": timing.median_ms(r["times"]),
                "vs_dp": timing.paired_ratio(r["times"], base),
                "mem_MB/rank": r["memory"] / 1e6,
                "saved_act_MB": r["activations"] / 1e6,
                "wire_MB/step": sum(wire.values()),
                "by_group": " ".join(f"{g}:{v:.2f}" for g, v in wire.items()) or "-",
            })
    return rows
