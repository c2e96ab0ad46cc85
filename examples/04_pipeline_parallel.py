"""Chapter 04: pipeline parallel. The layers are cut into stages; micro-batches flow through.

    scripts/launch.sh examples/04_pipeline_parallel.py --nproc-per-node 2 -- --check
    scripts/launch.sh examples/04_pipeline_parallel.py --nproc-per-node 4 -- --pp 4 --check
    scripts/launch.sh examples/04_pipeline_parallel.py --nproc-per-node 2 -- \\
        --schedule interleaved --virtual-stages 2 --check
    scripts/launch.sh examples/04_pipeline_parallel.py --nproc-per-node 4 -- --check  # x dp 2
    scripts/launch.sh examples/04_pipeline_parallel.py --nproc-per-node 4 -- --tp 2 --check
    scripts/launch.sh examples/04_pipeline_parallel.py --nproc-per-node 2 -- --impl torch --check
    scripts/launch.sh examples/04_pipeline_parallel.py --nproc-per-node 4 -- --pp 4 \\
        --schedule zb-h1 --check  # zero bubble: zb-h1, or zbv / dualpipev with --virtual-stages 2

Chapter 01's ``parallelize`` call, now with pp > 1: it keeps this rank's stages
(``apply_pipeline_parallel``, after tensor parallel, before the data-parallel wrapper of each
chunk) and hands the Trainer the schedule as its forward_backward and a grad norm summed over
the stages. Then it prints the point-to-point traffic of the last step and its timeline: which
stage computed which micro-batch when, the measured bubble next to (p-1)/(v m + p - 1), and the
peak activations.
"""

import sys

from scaletorch.dist import (destroy_distributed, destroy_pg_manager, get_ledger, init_distributed,
                             init_pg_manager_from_config)
from scaletorch.models import build_model
from scaletorch.parallel.parallelize import parallelize
from scaletorch.parallel.pipeline_parallel import gather_timeline
from scaletorch.trainer import Trainer, check_against_reference, load_config


def limits(cfg, world_size: int) -> None:
    """This chapter's scope (load_config checks it with the layout, before anything starts)."""
    p = cfg.parallel
    if p.context_parallel_size > 1 or p.expert_model_parallel_size > 1 or p.impl == "naive":
        raise ValueError("04_pipeline_parallel composes pp with dp and tp (impl scaletorch or "
                         "torch); context and expert parallel join in 07_nd_parallel")
    if p.pipeline_model_parallel_size < 2:
        raise ValueError(f"04_pipeline_parallel needs pipeline_model_parallel_size >= 2 (--pp), "
                         f"got {p.pipeline_model_parallel_size}")


def main() -> int:
    cfg = load_config("examples/configs/04_pipeline_parallel.yaml", "Chapter 04: pipeline parallel",
                      limits)
    env = init_distributed(cfg.training.timeout_seconds)
    p, m = cfg.parallel, cfg.data.num_micro_batches
    pgm = init_pg_manager_from_config(p, cfg.training.timeout_seconds)
    pgm.log_topology()

    model = build_model(cfg.model, seed=cfg.training.model_seed)
    par = parallelize(model, cfg, pgm, env.device)  # tensor, then pipeline, then data parallel
    pipe, schedule = par.model, par.forward_backward
    result = Trainer.from_parallelized(cfg, par, pgm, device=env.device).train()

    # What this chapter is about: activations and gradients passed between stages, the bubble.
    ledger, last = get_ledger(), cfg.training.steps - 1
    timeline = None if p.impl == "torch" else gather_timeline(schedule.timeline, pgm, env.device)
    if pgm.rank == 0:
        print(ledger.table(step=last))
        b = cfg.data.global_batch_size // (pgm.data_parallel_world_size * m)
        numel = b * cfg.data.seq_len // pipe.sequence_parallel_size * cfg.model.hidden_size
        sends = m * sum((s < pipe.num_stages - 1) + (s > 0) for s in pipe.stages)
        print(f"p2p sends of rank 0 per step: m x (stages not last + stages not first) = "
              f"{sends} messages of b x s x h = {numel:,} elements; ledger: "
              f"{ledger.total(op='send', group='pp', step=last):,.0f} elements" +
              (" (torch's pipelining bypasses our ledger)" if p.impl == "torch" else ""))
        if timeline is not None:
            print(f"timeline of step {last} ({p.schedule}; a-z: forward of micro-batch 0-25, "
                  f"A-Z: its backward, 0-9: its weight gradient (zero bubble), '.': idle or "
                  f"waiting):")
            print(timeline.chart())
            print(timeline.summary())

    ok = True
    if cfg.check:
        full = par.full_state_dict()  # every stage's layers, gathered over tp, on rank 0
        ok = check_against_reference(cfg, result.losses, env.device, full, result.start_step)
    destroy_pg_manager()
    destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
