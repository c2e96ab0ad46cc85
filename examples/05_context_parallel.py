"""Chapter 05: context parallel. Every sequence is split over the "cp" ranks; attention is not.

    scripts/launch.sh examples/05_context_parallel.py --nproc-per-node 2 -- --check
    scripts/launch.sh examples/05_context_parallel.py --nproc-per-node 4 -- --cp 2 --tp 2 --check
    scripts/launch.sh examples/05_context_parallel.py --nproc-per-node 4 -- --cp-variant ulysses

Chapter 01's ``parallelize`` call, now with cp > 1: it swaps every attention for ring attention
and returns a step that shards each sequence zigzag (positions go to RoPE) and averages
gradients over data x context ranks (also when dp = 1).
"""

import sys

import torch

from scaletorch.dist import (destroy_distributed, destroy_pg_manager, functional, get_ledger,
                             init_distributed, init_pg_manager)
from scaletorch.models import build_model
from scaletorch.parallel.context_parallel import attention_block_counts
from scaletorch.parallel.parallelize import parallelize
from scaletorch.trainer import Trainer, check_against_reference, load_config


def limits(cfg, world_size: int) -> None:
    """This chapter's scope (load_config checks it with the layout, before anything starts)."""
    p = cfg.parallel
    if p.pipeline_model_parallel_size > 1 or p.expert_model_parallel_size > 1:
        raise ValueError("05_context_parallel composes cp with dp and tp; pipeline and expert "
                         "parallel join in 07_nd_parallel")
    if p.context_parallel_size < 2:
        raise ValueError(f"05_context_parallel needs context_parallel_size >= 2 (--cp), got "
                         f"{p.context_parallel_size}")


def main() -> int:
    cfg = load_config("examples/configs/05_context_parallel.yaml",
                      "Chapter 05: context parallel (ring attention)", limits)
    env = init_distributed(cfg.training.timeout_seconds)
    p = cfg.parallel
    pgm = init_pg_manager(tensor_model_parallel_size=p.tensor_model_parallel_size,
                          context_parallel_size=p.context_parallel_size)
    pgm.log_topology()

    model = build_model(cfg.model, seed=cfg.training.model_seed)
    par = parallelize(model, cfg, pgm, env.device)  # tensor, then context, then data parallel
    model = par.model
    result = Trainer.from_parallelized(cfg, par, pgm, device=env.device).train()

    # What this chapter is about: K/V traffic per layer and the causal work per rank.
    cp, m, layers = pgm.context_parallel_world_size, cfg.data.num_micro_batches, \
        cfg.model.num_layers
    b, s_local, d = cfg.data.global_batch_size // pgm.data_parallel_world_size, \
        cfg.data.seq_len // cp, cfg.model.head_dim
    hq, hkv = (cfg.model.num_attention_heads // pgm.tensor_model_parallel_world_size,
               cfg.model.num_key_value_heads // pgm.tensor_model_parallel_world_size)
    ledger, last = get_ledger(), cfg.training.steps - 1
    if p.cp_variant == "ring":  # fwd: K/V (cp-1)x; bwd: K/V (cp-1)x, dK/dV cp x
        op, formula = "send", (3 * cp - 2) * 2 * b * s_local * hkv * d if cp > 1 else 0
    else:  # q, k, v, out all-to-all in forward and again in backward; (cp-1)/cp leaves
        op, formula = "all_to_all", 2 * (cp - 1) * b * s_local * (2 * hq + 2 * hkv) * d // cp
    measured = ledger.total(op=op, group="cp", step=last, phase="compute") / layers
    # activation checkpointing re-runs each block's forward in backward: its K/V ring again
    recomputed = ledger.total(op=op, group="cp", step=last, phase="recompute") / layers
    forward = (cp - 1) * 2 * b * s_local * hkv * d if p.cp_variant == "ring" else formula // 2
    blocks = attention_block_counts(model)
    per_forward = torch.tensor([blocks["full"], blocks["diagonal"]], device=env.device) \
        // (layers * m * (cfg.training.steps - result.start_step))
    with ledger.paused():  # the report's own gather is not training traffic
        all_blocks = functional.gather_along_dim(per_forward, 0, pgm.context_parallel_group)
    if pgm.rank == 0:
        print(ledger.table(step=last))
        what = "K/V" if p.cp_variant == "ring" else "q/k/v/out"
        print(f"{p.cp_variant} {what} traffic per layer per step per rank ({op} over cp): "
              f"{measured:,.0f} elements = {measured * 4 / 1e6:.3f} MB; formula {formula:,}")
        if p.activation_checkpointing:
            print(f"recomputed (activation checkpointing): {recomputed:,.0f} elements per layer; "
                  f"formula: the forward's {forward:,}")
        if p.cp_variant == "ring":
            pairs = all_blocks.view(cp, 2).tolist()
            print("attention blocks per layer per forward, by cp rank (full + diagonal): " +
                  ", ".join(f"rank {r}: {f} + {g}" for r, (f, g) in enumerate(pairs)))

    ok = True
    if cfg.check:
        full = par.full_state_dict()  # collective: the shards gathered over tp, on rank 0
        ok = check_against_reference(cfg, result.losses, env.device, full, result.start_step)
    destroy_pg_manager()
    destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
