"""Issue 44 row: training steps with an async sharded checkpoint vs a blocking one.

One world of ``args.world_size`` gloo ranks (2 by default) at dp ZeRO-1 trains two copies of
the same 3.2M-parameter Llama (weights and AdamW moments: 38 MB per checkpoint). A round of
each copy saves a DCP checkpoint, then trains ``STEPS_PER_SAVE`` steps: the blocking copy
writes before its steps (``save_sharded_checkpoint``), the async one writes while they run
and then waits for the write, its checksums and its manifest (``AsyncSaver``). Rounds
alternate between the copies (the order rotating every round), so background load hits both
alike; a round's time is the slowest rank's, and the row reports the median over rounds of
async / blocking.

    python scripts/benchmark.py --only dcp_async --steps 4 --repeats 2
"""

import os
import tempfile
from typing import Any, Dict, List

import torch

from scaletorch.dist import destroy_pg_manager, init_pg_manager_from_config
from scaletorch.models import build_model
from scaletorch.parallel.mixed_precision import precision_hooks
from scaletorch.parallel.parallelize import parallelize
from scaletorch.trainer import Config, Trainer
from scaletorch.trainer.dcp_async import AsyncSaver
from scaletorch.trainer.dcp_checkpoint import save_sharded_checkpoint
from scripts.benchmarks import timing

STEPS_PER_SAVE, WARMUP = 2, 1
NAMES = ("async", "blocking")


def config(world: int) -> Config:
    """4 layers, hidden 256, 8 sequences of 32 tokens: 3.2M parameters, dp ``world`` ZeRO-1."""
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.hidden_size, m.intermediate_size, m.num_layers = 512, 256, 704, 4
    m.num_attention_heads, m.num_key_value_heads, m.max_seq_len = 4, 2, 32
    cfg.data.seq_len, cfg.data.global_batch_size, cfg.data.num_micro_batches = 32, 8, 1
    cfg.training.steps, cfg.logging.progress = 10**6, False
    cfg.parallel.zero_stage = 1
    cfg.checkpoint.format = "dcp"
    return cfg


def _measure(rank: int, world: int, samples: int, root: str) -> Dict[str, Any]:
    """``samples`` round times per copy (max over ranks) and the parameter count."""
    cfg = config(world)
    pgm = init_pg_manager_from_config(cfg.parallel)
    built: Dict[str, Any] = {}
    for name in NAMES:
        model = build_model(cfg.model, seed=cfg.training.model_seed)
        hooks = precision_hooks(cfg, "cpu")
        par = parallelize(model, cfg, pgm, torch.device("cpu"), hooks)
        built[name] = (par,
                       Trainer.from_parallelized(cfg, par, pgm, verbose=False, scaler=hooks.scaler))
    saver = AsyncSaver()
    layout = built["async"][1].layout()

    def round_of(name: str) -> None:
        par, trainer = built[name]
        where = os.path.join(root, name)
        if name == "async":
            saver.start(where, trainer.step, trainer, par, 1, layout)
        else:
            save_sharded_checkpoint(where, trainer.step, trainer, par, 1, layout)
        for _ in range(STEPS_PER_SAVE):
            trainer.train_step()
        saver.finish()  # the async write, checksums and manifest belong to the round

    times, _ = timing.alternate(NAMES, samples, WARMUP, round_of, lambda name: None)
    params = sum(p.numel() for p in build_model(cfg.model, seed=0).parameters())
    times = timing.max_over_ranks(times)
    destroy_pg_manager()
    return {"times": times, "params": params}


def run(args) -> List[dict]:
    """One row: a round of one save and STEPS_PER_SAVE steps, async / blocking."""
    from scaletorch.dist.spawn import run_distributed  # gloo ranks, as the tests spawn them

    world = getattr(args, "world_size", 2)
    samples = timing.samples(args)
    with tempfile.TemporaryDirectory() as root:
        result = run_distributed(_measure, world, samples, root, timeout=900)[0]
    times = result["times"]
    common = {"ranks": world, "params": result["params"], "steps": samples}
    return [
        timing.versus(f"dcp save + {STEPS_PER_SAVE} steps: async / blocking", times["async"],
                      times["blocking"], "< 1", **common),
    ]
