"""Chapter 05: context parallel. Every sequence is split over the "cp" ranks; attention is not.

    scripts/launch.sh examples/05_context_parallel.py --nproc-per-node 2 -- --check
    scripts/launch.sh examples/05_context_parallel.py --nproc-per-node 4 -- --cp 2 --tp 2 --check
    scripts/launch.sh examples/05_context_parallel.py --nproc-per-node 4 -- --cp-variant ulysses

Chapter 01's ``parallelize`` call, now with cp > 1: it swaps every attention for ring attention
and returns a step that shards each sequence zigzag (positions go to RoPE) and averages
gradients over data x context ranks (also when dp = 1).
"""

import sys

from scaletorch.dist import (destroy_distributed, destroy_pg_manager, init_distributed,
                             init_pg_manager_from_config)
from scaletorch.models import build_model
from scaletorch.parallel.context_parallel import cp_report
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
    pgm = init_pg_manager_from_config(cfg.parallel, cfg.training.timeout_seconds)
    pgm.log_topology()

    model = build_model(cfg.model, seed=cfg.training.model_seed)
    par = parallelize(model, cfg, pgm, env.device)  # tensor, then context, then data parallel
    model = par.model
    result = Trainer.from_parallelized(cfg, par, pgm, device=env.device).train()

    # What this chapter is about: K/V traffic per layer and the causal work per rank.
    steps_run = cfg.training.steps - result.start_step
    report = cp_report(cfg, model, pgm, steps_run, step=cfg.training.steps - 1)
    if pgm.rank == 0:
        print(report)

    ok = True
    if cfg.check:
        full = par.full_state_dict()  # collective: the shards gathered over tp, on rank 0
        ok = check_against_reference(cfg, result.losses, env.device, full, result.start_step)
    destroy_pg_manager()
    destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
