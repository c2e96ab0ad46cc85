"""Chapter 04b: zero-bubble pipeline schedules. Each backward is split in two, and the weight
gradients fill the bubble.

    scripts/launch.sh examples/04b_zero_bubble.py --nproc-per-node 2 -- --check
    scripts/launch.sh examples/04b_zero_bubble.py --nproc-per-node 4 -- --pp 4 --check
    scripts/launch.sh examples/04b_zero_bubble.py --nproc-per-node 2 -- \\
        --schedule zbv --virtual-stages 2 --check
    scripts/launch.sh examples/04b_zero_bubble.py --nproc-per-node 2 -- --schedule dualpipev \\
        --virtual-stages 2 --impl torch --check
    python examples/04b_zero_bubble.py --show-schedule --world-size 2 --schedule zbv \\
        --virtual-stages 2 --micro-batches 4

Chapter 04's script with the general runtime: a schedule is data, each rank's list of actions
and messages, so one executor (pipeline_runtime.py) runs afab, 1f1b and interleaved (v chunks
per rank), bit for bit as 04's loops where both run, and the zero-bubble schedules: B (the
input gradient) at once and W (the weight gradient) later, with asynchronous sends in the
order of the schedule's simulation; zbv and dualpipev place two chunks per rank in a V
(stages r and 2p - 1 - r). The timeline shows each W as a digit, and its theory is the
schedule simulated with F = B = W. ``--show-schedule`` prints each rank's actions with the
messages they wait for and send, and exits without training.
"""

import math
import os
import sys
from typing import List, Optional

from torch import nn

from scaletorch.dist import (destroy_distributed, destroy_pg_manager, get_ledger, init_distributed,
                             init_pg_manager_from_config)
from scaletorch.models import build_model, loss_fn
from scaletorch.parallel.data_parallel import apply_data_parallel
from scaletorch.parallel.pipeline_native import TorchPipelineSchedule
from scaletorch.parallel.pipeline_parallel import apply_pipeline_parallel, gather_timeline
from scaletorch.parallel.pipeline_runtime import PipelineSchedule
from scaletorch.parallel.tensor_parallel import (apply_tensor_parallel,
                                                 tensor_parallel_clip_grad_norm,
                                                 tensor_parallel_loss_fn)
from scaletorch.schedule.catalog import show_plan
from scaletorch.schedule.placement import V_SHAPED, ZERO_BUBBLE
from scaletorch.trainer import build_optimizer, check_against_reference, load_config, start_run
from scaletorch.trainer.pipeline_state import gather_pipeline_state_dict
from scaletorch.trainer.precision import autocast


def limits(cfg, world_size: int) -> None:
    """This chapter's scope (load_config checks it with the layout, before anything starts)."""
    p, t = cfg.parallel, cfg.training
    if p.context_parallel_size > 1 or p.expert_model_parallel_size > 1 or p.impl == "naive":
        raise ValueError(f"04b_zero_bubble composes pp with dp and tp (--impl ours or torch, "
                         f"got --impl {p.impl}); context and expert parallel join in 07")
    if p.pipeline_model_parallel_size < 2:
        raise ValueError(f"04b_zero_bubble needs pipeline_model_parallel_size >= 2 (--pp), "
                         f"got {p.pipeline_model_parallel_size}")
    dp = world_size // (p.pipeline_model_parallel_size * p.tensor_model_parallel_size)
    if p.impl == "torch" and dp > 1 and p.schedule in ZERO_BUBBLE:  # torch DDP, each chunk
        raise ValueError(f"04b_zero_bubble --impl torch with data parallel ({dp} ranks): torch "
                         f"DDP cannot follow a backward split in B and W (its reducer sees each "
                         f"parameter twice and asserts in step 2; with find_unused_parameters "
                         f"zbv at pp 2 x dp 2 trains 3.4e-2 off in 6 steps); run dp 1 "
                         f"(--nproc-per-node = pp x tp), or --impl ours")
    later = {
        "--zero-stage": p.zero_stage > 0,
        "tied embeddings": cfg.model.tie_word_embeddings,
        "MoE": cfg.model.num_experts > 0,
        "fp16": t.precision == "fp16",
        "--activation-checkpointing": p.activation_checkpointing != "none",
        "--impl torch with --tp": p.impl == "torch" and p.tensor_model_parallel_size > 1
    }
    if any(later.values()):
        raise ValueError(f"04b_zero_bubble composes pp with dp and tp only: "
                         f"{', '.join(k for k, v in later.items() if v)} under a pipeline "
                         f"in 07_nd_parallel (fp16: 08; recomputation, tied: 10)")


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = load_config("examples/configs/04b_zero_bubble.yaml",
                      "Chapter 04b: zero-bubble pipeline schedules", limits,
                      [a for a in argv if a != "--show-schedule"])
    p, m = cfg.parallel, cfg.data.num_micro_batches
    if "--show-schedule" in argv:  # every rank's actions and messages, from the data; no training
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                show_plan(p.schedule, p.pipeline_model_parallel_size, m, p.virtual_pipeline_stages))
        return 0
    env = init_distributed(cfg.training.timeout_seconds)
    pgm = init_pg_manager_from_config(p, cfg.training.timeout_seconds)
    pgm.log_topology()

    model = build_model(cfg.model, seed=cfg.training.model_seed).to(env.device)
    loss = loss_fn
    if pgm.tensor_model_parallel_world_size > 1:  # chapter 03 first, on the whole model
        apply_tensor_parallel(model, pgm, p.sequence_parallel)
        loss = tensor_parallel_loss_fn(pgm)
    # chapter 04's cut (in a V for zbv and dualpipev), chapter 01's wrapper around each chunk
    pipe = apply_pipeline_parallel(model, pgm, p.virtual_pipeline_stages, p.layer_split,
                                   p.sequence_parallel, v_shape=p.schedule in V_SHAPED)
    if pgm.gradient_sync_world_size > 1:
        pipe.chunks = nn.ModuleList(
            apply_data_parallel(chunk, pgm, p.impl, p.bucket_size_mb) for chunk in pipe.chunks)
    # the new idea: any schedule as data; the zero-bubble ones run B now, W later
    schedule = TorchPipelineSchedule(pipe, pgm, p.schedule, m) if p.impl == "torch" else \
        PipelineSchedule(pipe, pgm, p.schedule, m, loss)
    # chapter 03's clip, one rule: each element once over the world; the stages' squares add up
    clip = tensor_parallel_clip_grad_norm(pipe, pgm)
    optimizer = build_optimizer(cfg, pipe.parameters())  # AdamW, on this rank's chunks
    max_norm = cfg.training.grad_clip or math.inf  # 0: no clip

    # [core: step]
    with start_run(cfg, pipe, optimizer, pgm) as run:  # chapter 04's step, another schedule
        for inputs, targets in run.batches():  # this step's global batch (B, s)
            optimizer.zero_grad(set_to_none=True)
            with autocast(cfg, env.device):
                loss = schedule(inputs, targets)  # the new line: any plan, W in the bubble
            grad_norm = clip(max_norm)  # every chunk's squares, summed over pp (and tp)
            run.record(loss, grad_norm)  # logged; a NaN or inf stops the run here
            optimizer.step()
    # [end: step]
    result = run.result

    # What this chapter is about: the W's in the bubble.
    ledger, last = get_ledger(), cfg.training.steps - 1
    timeline = None if p.impl == "torch" else gather_timeline(schedule.timeline, pgm)
    if pgm.rank == 0:
        print(ledger.table(step=last))
        if timeline is not None:
            print(f"timeline of step {last} ({p.schedule}; a-z: forward of micro-batch 0-25, "
                  f"A-Z: its backward (B), 0-9: its weight gradient (W), '.': idle or "
                  f"waiting):")
            print(timeline.chart())
            print(timeline.summary())

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
