"""Chapter 04: pipeline parallel. The layers are cut into stages; micro-batches flow through.

    scripts/launch.sh examples/04_pipeline_parallel.py --nproc-per-node 2 -- --check
    scripts/launch.sh examples/04_pipeline_parallel.py --nproc-per-node 4 -- --pp 4 \\
        --model.num_layers 4 --check  # 4 stages: a layer each
    scripts/launch.sh examples/04_pipeline_parallel.py --nproc-per-node 4 -- --check  # x dp 2
    scripts/launch.sh examples/04_pipeline_parallel.py --nproc-per-node 4 -- --tp 2 --check
    python examples/04_pipeline_parallel.py --show-schedule --world-size 2 --micro-batches 4

The interleaved and zero-bubble schedules and torch's pipelining run in 04b_zero_bubble.py.

Chapter 03's tensor parallel (with --tp) on the whole model first, then the new idea: this rank
keeps only its stage (``apply_pipeline_parallel``), and chapter 01's data-parallel wrapper goes
around it (dp > 1). The step, in the script, calls the schedule: AFAB or 1F1B written as a loop
of named sends and receives (``pipeline_schedules.py``); the grad norm sums the stages. Then the
script prints the point-to-point traffic of the last step and its timeline: which rank computed
which micro-batch when, the measured bubble next to (p-1)/(m + p - 1), and the peak activations.
``--show-schedule`` prints each rank's calls of the loop, with the messages they send and
receive, and exits without training.
"""

import json
import math
import os
import sys
from typing import List, Optional

from torch import nn

from scaletorch.dist import (destroy_distributed, destroy_pg_manager, get_ledger, init_distributed,
                             init_pg_manager_from_config)
from scaletorch.models import build_model, loss_fn
from scaletorch.parallel.data_parallel import apply_data_parallel
from scaletorch.parallel.pipeline_parallel import apply_pipeline_parallel, gather_timeline
from scaletorch.parallel.pipeline_schedules import SCHEDULES, PipelineLoop, show_schedule
from scaletorch.parallel.tensor_parallel import (apply_tensor_parallel,
                                                 tensor_parallel_clip_grad_norm,
                                                 tensor_parallel_loss_fn)
from scaletorch.trainer import build_optimizer, check_against_reference, load_config, start_run
from scaletorch.trainer.pipeline_state import gather_pipeline_state_dict
from scaletorch.trainer.precision import autocast


def limits(cfg, world_size: int) -> None:
    """This chapter's scope (load_config checks it with the layout, before anything starts)."""
    p, t = cfg.parallel, cfg.training
    if p.schedule not in SCHEDULES or p.impl == "torch":
        raise ValueError(f"04_pipeline_parallel runs afab and 1f1b as plain loops; "
                         f"{p.schedule} with impl {p.impl} runs in the general runtime: run "
                         f"examples/04b_zero_bubble.py")
    if p.impl == "naive":
        raise ValueError("04_pipeline_parallel: --impl naive (chapter 01's per-parameter "
                         "all-reduce) is not offered here; its data parallel is impl ours")
    if p.context_parallel_size > 1 or p.expert_model_parallel_size > 1:
        raise ValueError("04_pipeline_parallel composes pp with dp and tp; context and expert "
                         "parallel join in 07_nd_parallel")
    if p.pipeline_model_parallel_size < 2:
        raise ValueError(f"04_pipeline_parallel needs pipeline_model_parallel_size >= 2 (--pp), "
                         f"got {p.pipeline_model_parallel_size}")
    later = {
        "--zero-stage": p.zero_stage > 0,
        "tied embeddings": cfg.model.tie_word_embeddings,
        "MoE": cfg.model.num_experts > 0,
        "fp16": t.precision == "fp16",
        "--activation-checkpointing": p.activation_checkpointing != "none"
    }
    if any(later.values()):
        raise ValueError(f"04_pipeline_parallel composes pp with dp and tp only: "
                         f"{', '.join(k for k, v in later.items() if v)} under a pipeline "
                         f"in 07_nd_parallel (fp16: 08; recomputation, tied: 10)")


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = load_config("examples/configs/04_pipeline_parallel.yaml", "Chapter 04: pipeline parallel",
                      limits, [a for a in argv if a != "--show-schedule"])
    p, m = cfg.parallel, cfg.data.num_micro_batches
    if "--show-schedule" in argv:  # every rank's calls of the loop, traced; no training
        if int(os.environ.get("RANK", "0")) == 0:
            print(show_schedule(p.schedule, p.pipeline_model_parallel_size, m))
        return 0
    env = init_distributed(cfg.training.timeout_seconds)
    pgm = init_pg_manager_from_config(p, cfg.training.timeout_seconds)
    pgm.log_topology()

    model = build_model(cfg.model, seed=cfg.training.model_seed).to(env.device)
    loss = loss_fn
    if pgm.tensor_model_parallel_world_size > 1:  # chapter 03 first, on the whole model
        apply_tensor_parallel(model, pgm, p.sequence_parallel)
        loss = tensor_parallel_loss_fn(pgm)
    # the new idea: keep this rank's stage; then chapter 01's wrapper around it
    pipe = apply_pipeline_parallel(model, pgm, 1, p.layer_split, p.sequence_parallel)
    if pgm.gradient_sync_world_size > 1:
        pipe.chunks = nn.ModuleList(
            apply_data_parallel(chunk, pgm, p.impl, p.bucket_size_mb) for chunk in pipe.chunks)
    schedule = PipelineLoop(pipe, pgm, p.schedule, m, loss)  # afab or one_f_one_b
    # chapter 03's clip, one rule: each element once over the world; the stages' squares add up
    clip = tensor_parallel_clip_grad_norm(pipe, pgm)
    optimizer = build_optimizer(cfg, pipe.parameters())  # AdamW, on this rank's stage
    max_norm = cfg.training.grad_clip or math.inf  # 0: no clip

    # [core: step]
    with start_run(cfg, pipe, optimizer, pgm) as run:  # run directory, resume, checkpoints
        for inputs, targets in run.batches():  # this step's global batch (B, s)
            optimizer.zero_grad(set_to_none=True)
            with autocast(cfg, env.device):
                # the new line: this rank's dp slice in m micro-batches through the stages
                # (1F1B or AFAB), the data-parallel sync in the last backward; the global mean
                loss = schedule(inputs, targets)
            grad_norm = clip(max_norm)  # every stage's squares, summed over pp (and tp)
            run.record(loss, grad_norm)  # logged; a NaN or inf stops the run here
            optimizer.step()
    # [end: step]
    result = run.result

    # What this chapter is about: activations and gradients passed between stages, the bubble.
    ledger, last = get_ledger(), cfg.training.steps - 1
    timeline = gather_timeline(schedule.timeline, pgm)
    if pgm.rank == 0:
        print(ledger.table(step=last))
        b = cfg.data.global_batch_size // (pgm.data_parallel_world_size * m)
        numel = b * cfg.data.seq_len // pipe.sequence_parallel_size * cfg.model.hidden_size
        sends = m * sum((s < pipe.num_stages - 1) + (s > 0) for s in pipe.stages)
        print(f"p2p sends of rank 0 per step: m x (stages not last + stages not first) = "
              f"{sends} messages of b x s x h = {numel:,} elements; ledger: "
              f"{ledger.total(op='send', group='pp', step=last):,.0f} elements")
        if timeline is not None:
            print(f"timeline of step {last} ({p.schedule}; a-z: forward of micro-batch 0-25, "
                  f"A-Z: its backward, '.': idle or waiting):")
            print(timeline.chart())
            print(timeline.summary())
            with open(os.path.join(cfg.run_path, "timeline.json"), "w") as f:  # scripts/plot.py
                json.dump(timeline.to_json(), f)

    ok = True
    if cfg.check:
        full = gather_pipeline_state_dict(pipe, pgm)  # every stage, gathered over tp, on rank 0
        ok = check_against_reference(cfg, result.losses, env.device, full, result.start_step,
                                     grad_norms=result.grad_norms)
    destroy_pg_manager()
    destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
