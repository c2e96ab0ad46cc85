"""Each rank's peak host memory while it saves and loads a sharded (DCP) checkpoint, beside
the consolidated path's, on 4 CPU ranks.

    python scripts/dcp_memory.py

A Llama of 3.2M parameters trains one step at tp2 x dp2 ZeRO-1 and saves a DCP checkpoint,
then a consolidated file; a run at dp4 ZeRO-3 then loads each. Every save and load is
measured by ``PeakHostMemory`` (resident memory at its highest during the call, less before;
scaletorch/trainer/peak_memory.py), after one unmeasured save and load (imports, first
allocations). Beside each figure: the rank's own shard (its rectangles of the weights and
AdamW moments), the full model's bytes (weights and moments, 12 B per parameter in fp32) and
its largest tensor. A DCP save or load holds the rank's shard plus about one tensor; the
consolidated save holds the whole model on rank 0, and its load on every rank.
"""

import os
import sys
import tempfile
from typing import Any, Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import scaletorch.trainer.consolidated as consolidated  # noqa: E402
from scaletorch.dist import destroy_pg_manager, init_pg_manager_from_config  # noqa: E402
from scaletorch.dist.spawn import run_distributed  # noqa: E402
from scaletorch.models import build_model  # noqa: E402
from scaletorch.parallel.mixed_precision import precision_hooks  # noqa: E402
from scaletorch.parallel.parallelize import parallelize  # noqa: E402
from scaletorch.rules.errors import OneLineParser  # noqa: E402
from scaletorch.trainer import Config, Trainer  # noqa: E402
from scaletorch.trainer.dcp_checkpoint import load_sharded, save_sharded  # noqa: E402
from scaletorch.trainer.dcp_pieces import local_pieces  # noqa: E402
from scaletorch.trainer.peak_memory import PeakHostMemory  # noqa: E402

WORLD = 4
SAVED = {"tensor_model_parallel_size": 2, "zero_stage": 1}  # tp2 x dp2 ZeRO-1
LOADED = {"zero_stage": 3}  # dp4 ZeRO-3
MOMENTS = 2  # AdamW's exp_avg and exp_avg_sq, shaped like the weights


def config(parallel: Dict[str, Any]) -> Config:
    """4 layers, hidden 256, 8 sequences of 16 tokens: 3.2M parameters, one AdamW step."""
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.hidden_size, m.intermediate_size, m.num_layers = 512, 256, 704, 4
    m.num_attention_heads, m.num_key_value_heads, m.max_seq_len = 4, 2, 32
    cfg.data.seq_len, cfg.data.global_batch_size, cfg.data.num_micro_batches = 16, 8, 1
    cfg.training.steps, cfg.logging.progress = 1, False
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


def _build(cfg: Config) -> tuple:
    pgm = init_pg_manager_from_config(cfg.parallel)
    model = build_model(cfg.model, seed=cfg.training.model_seed)
    hooks = precision_hooks(cfg, "cpu")
    par = parallelize(model, cfg, pgm, torch.device("cpu"), hooks)
    return par, Trainer.from_parallelized(cfg, par, pgm, verbose=False, scaler=hooks.scaler)


def _shard_bytes(par: Any) -> int:
    """This rank's rectangles of the weights, and as many of each AdamW moment (fp32)."""
    held = sum(t.numel() * t.element_size()
               for pieces in local_pieces(par, torch.Tensor.detach).values()
               for _, t in pieces.pieces)
    return held * (1 + MOMENTS)


def _peak(fn: Callable[[], Any]) -> int:
    with PeakHostMemory() as meter:
        fn()
    return meter.peak_bytes


def measure(rank: int, world: int, root: str) -> Dict[str, int]:
    """Inside a world of 4: this rank's peaks (bytes) of a DCP save at SAVED, a DCP load at
    LOADED, a consolidated save and load; its shard at each layout; the model's sizes."""
    warm, dcp, single = (os.path.join(root, n) for n in ("warm", "dcp", "consolidated.pt"))
    par, trainer = _build(config(SAVED))
    trainer.train()  # AdamW's moments exist: the checkpoint holds 12 B per parameter
    model = build_model(config(SAVED).model, seed=0)
    out = {
        "full": sum(p.numel() for p in model.parameters()) * 4 * (1 + MOMENTS),
        "largest": max(p.numel() for p in model.parameters()) * 4,
        "save_shard": _shard_bytes(par),
    }
    del model
    save_sharded(warm, trainer, par)  # unmeasured: imports and first allocations
    load_sharded(warm, trainer, par)
    out["dcp_save"] = _peak(lambda: save_sharded(dcp, trainer, par))
    consolidated.save_consolidated(single + ".warm", trainer, par)
    out["consolidated_save"] = _peak(lambda: consolidated.save_consolidated(single, trainer, par))
    destroy_pg_manager()
    par, trainer = _build(config(LOADED))
    out["load_shard"] = _shard_bytes(par)
    out["dcp_load"] = _peak(lambda: load_sharded(dcp, trainer, par))
    out["consolidated_load"] = _peak(lambda: consolidated.resume_consolidated(
        trainer, par, consolidated.load_consolidated(single)))
    destroy_pg_manager()
    return out


def table(results: List[Dict[str, int]]) -> List[str]:
    """The lines printed: one per rank, in MB (1e6 bytes), then the model's sizes."""
    columns = [
        "save_shard", "dcp_save", "load_shard", "dcp_load", "consolidated_save", "consolidated_load"
    ]
    lines = ["  ".join(["rank"] + [f"{c}_MB" for c in columns])]
    for rank, r in enumerate(results):
        lines.append("  ".join([f"{rank:4d}"] + [f"{r[c] / 1e6:{len(c) + 3}.1f}" for c in columns]))
    r = results[0]
    lines.append(f"full model (weights + AdamW moments, fp32): {r['full'] / 1e6:.1f} MB; "
                 f"largest tensor {r['largest'] / 1e6:.2f} MB")
    return lines


def main() -> int:
    OneLineParser(
        description=__doc__.splitlines()[0]).parse_args()  # no options: --help, or one line
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(measure, WORLD, root, timeout=600)
    print("\n".join(table(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
