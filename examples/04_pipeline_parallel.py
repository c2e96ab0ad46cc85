"""Chapter 04: pipeline parallel. The layers are cut into stages; micro-batches flow through.

    scripts/launch.sh examples/04_pipeline_parallel.py --nproc-per-node 2 -- --check
    scripts/launch.sh examples/04_pipeline_parallel.py --nproc-per-node 4 -- --pp 4 --check
    scripts/launch.sh examples/04_pipeline_parallel.py --nproc-per-node 2 -- \\
        --schedule interleaved --virtual-stages 2 --check
    scripts/launch.sh examples/04_pipeline_parallel.py --nproc-per-node 4 -- --check  # x dp 2
    scripts/launch.sh examples/04_pipeline_parallel.py --nproc-per-node 4 -- --tp 2 --check
    scripts/launch.sh examples/04_pipeline_parallel.py --nproc-per-node 2 -- --impl torch --check

Chapter 01 plus: keep this rank's stages (``apply_pipeline_parallel``), hand the Trainer the
schedule as its forward_backward and a grad norm summed over the stages. Then it prints the
point-to-point traffic of the last step and its timeline: which stage computed which
micro-batch when, the measured bubble next to (p-1)/(v m + p - 1), and the peak activations.
"""

import sys

from scaletorch.dist import (destroy_distributed, destroy_pg_manager, get_ledger, init_distributed,
                             init_pg_manager)
from scaletorch.models import build_model, loss_fn
from scaletorch.parallel.pipeline_parallel import (PipelineSchedule, TorchPipelineSchedule,
                                                   apply_data_parallel_to_chunks,
                                                   apply_pipeline_parallel,
                                                   gather_pipeline_state_dict, gather_timeline,
                                                   pipeline_clip_grad_norm)
from scaletorch.parallel.pipeline_schedules import validate_schedule
from scaletorch.parallel.tensor_parallel import (apply_tensor_parallel, gather_full_state_dict,
                                                 tensor_parallel_loss_fn)
from scaletorch.trainer import Trainer, check_against_reference, parse_args, validate_layout


def main() -> int:
    cfg = parse_args(default_config="examples/configs/04_pipeline_parallel.yaml",
                     description="Chapter 04: pipeline parallel")
    env = init_distributed(cfg.training.timeout_seconds)
    validate_layout(cfg, env.world_size)
    p, m = cfg.parallel, cfg.data.num_micro_batches
    if p.context_parallel_size > 1 or p.expert_model_parallel_size > 1 or p.impl == "naive":
        raise ValueError("04_pipeline_parallel composes pp with dp and tp (impl scaletorch or "
                         "torch); context and expert parallel join in 07_nd_parallel")
    validate_schedule(p.schedule, p.pipeline_model_parallel_size, m, p.virtual_pipeline_stages)
    pgm = init_pg_manager(tensor_model_parallel_size=p.tensor_model_parallel_size,
                          pipeline_model_parallel_size=p.pipeline_model_parallel_size)
    pgm.log_topology()

    model = build_model(cfg.model, seed=cfg.training.model_seed).to(env.device)
    loss = loss_fn
    if pgm.tensor_model_parallel_world_size > 1:  # tensor, then pipeline, then data parallel
        model = apply_tensor_parallel(model, pgm, p.sequence_parallel)
        loss = tensor_parallel_loss_fn(pgm)
    pipe = apply_pipeline_parallel(model, pgm, p.virtual_pipeline_stages,
                                   sequence_parallel=p.sequence_parallel)
    pipe = apply_data_parallel_to_chunks(pipe, pgm, p.impl, p.bucket_size_mb)
    schedule_cls = TorchPipelineSchedule if p.impl == "torch" else PipelineSchedule
    schedule = schedule_cls(pipe, pgm, p.schedule, m, loss)
    result = Trainer(cfg, pipe, pgm, device=env.device, forward_backward=schedule,
                     clip_grad_norm=pipeline_clip_grad_norm(pipe, pgm)).train()

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
                  f"A-Z: its backward, '.': idle or waiting):")
            print(timeline.chart())
            print(timeline.summary())

    ok = True
    if cfg.check:
        local = None  # this rank's stages, full-size (gathered over tp when split)
        if pgm.tensor_model_parallel_world_size > 1:
            local = {}
            for chunk in pipe.chunks:
                local.update(gather_full_state_dict(chunk, pgm))
        full_state = gather_pipeline_state_dict(pipe, pgm, local)
        ok = check_against_reference(cfg, result.losses, env.device,
                                     full_state if pgm.rank == 0 else None, result.start_step)
    destroy_pg_manager()
    destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
