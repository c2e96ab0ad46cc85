"""Chapter 01: data parallel. Each rank trains on 1/N of every batch; gradients are averaged.

    scripts/launch.sh examples/01_ddp.py --nproc-per-node 2 -- --check
    scripts/launch.sh examples/01_ddp.py --nproc-per-node 4 -- --micro-batches 2 --check
    scripts/launch.sh examples/01_ddp.py --nproc-per-node 2 -- --impl naive --check
    scripts/launch.sh examples/01_ddp.py --nproc-per-node 2 -- --impl torch --check

Chapter 00 plus one call, ``apply_data_parallel``: it wraps the model so that backward
averages the gradients over the data-parallel ranks (``--impl naive``: per-parameter
all-reduce after backward; ``ours``: bucketed, overlapped with backward; ``torch``: PyTorch's
DistributedDataParallel).
Then it prints the gradient traffic of the last step (a ring all-reduce of Psi fp32 elements
moves 2 (N-1)/N x 4 Psi bytes per rank), for the bucketed DDP how many all-reduces each rank
had in flight while backward was still computing (``--verbose``: every bucket's), and the
bytes each rank holds: 16 Psi, the whole model state on every rank, which chapter 02 shards.
"""

import math
import sys
from contextlib import nullcontext

import torch

from scaletorch.data import local_batch, split_micro_batches
from scaletorch.dist import (comm, destroy_distributed, destroy_pg_manager, init_distributed,
                             init_pg_manager_from_config)
from scaletorch.dist.overlap_text import format_overlap, format_timeline
from scaletorch.models import build_model, loss_fn
from scaletorch.parallel.data_parallel import BucketedDataParallel, apply_data_parallel, ddp_report
from scaletorch.parallel.grad_norm import clip_replicated
from scaletorch.parallel.memory_report import memory_table
from scaletorch.parallel.overlap_chart import OverlapRecorder, record_overlap
from scaletorch.trainer import build_optimizer, check_against_reference, load_config, start_run
from scaletorch.trainer.precision import autocast

HELP = ("Chapter 01: data parallel (DDP). --impl naive: per-parameter all-reduce after backward; "
        "ours: bucketed, overlapped with backward; torch: DistributedDataParallel")


def limits(cfg, world_size: int) -> None:
    """This chapter's scope (load_config checks it with the layout, before anything starts)."""
    p = cfg.parallel
    if max(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size,
           p.expert_model_parallel_size) > 1:
        raise ValueError("01_ddp is data parallel only: every rank holds the whole model; "
                         "tp, pp, cp and ep come in the later chapters")
    later = {
        "parallel.zero_stage": (p.zero_stage, 0, "02_fsdp"),
        "model.num_experts": (cfg.model.num_experts, 0, "06_expert_parallel"),
        "parallel.activation_checkpointing": (p.activation_checkpointing, "none", "10_real_model"),
        "parallel.reduce_dtype": (p.reduce_dtype, "fp32", "08_mixed_precision"),
    }
    for key, (value, default, chapter) in later.items():
        if value != default:
            raise ValueError(f"01_ddp runs {key} {default} only, got {value!r}: see {chapter}")


def main() -> int:
    cfg = load_config("examples/configs/01_ddp.yaml", HELP, limits)
    env = init_distributed(cfg.training.timeout_seconds)
    p = cfg.parallel
    pgm = init_pg_manager_from_config(p, cfg.training.timeout_seconds)
    pgm.log_topology()

    model = build_model(cfg.model, seed=cfg.training.model_seed).to(env.device)
    # the new line: backward now averages the gradients over the data-parallel ranks
    model = apply_data_parallel(model, pgm, p.impl, p.bucket_size_mb)
    psi, n = model.num_parameters(), pgm.gradient_sync_world_size
    if pgm.rank == 0:
        print(f"model: {psi:,} parameters; data parallel over {n} ranks, impl {p.impl}")
        if isinstance(model, BucketedDataParallel):
            sizes = ", ".join(f"{b.buffer.numel():,}" for b in model.buckets)
            print(f"{len(model.buckets)} buckets of <= {p.bucket_size_mb} MB, in reverse "
                  f"parameter order (elements): {sizes}")
    if isinstance(model, BucketedDataParallel):  # marks when each bucket goes out, for the chart
        model = record_overlap(model)
    optimizer = build_optimizer(cfg, model.parameters())  # AdamW
    params, m = list(model.parameters()), cfg.data.num_micro_batches
    max_norm = cfg.training.grad_clip or math.inf  # 0: no clipping

    # [core: step]
    with start_run(cfg, model, optimizer, pgm) as run:  # run directory, resume, checkpoints
        for inputs, targets in run.batches():  # this step's batch (b, s): inputs and next tokens
            optimizer.zero_grad(set_to_none=True)
            # the new lines: this rank's b/N sequences; gradients synchronized once, at the end
            inputs, targets, _ = local_batch(inputs, targets, pgm.data_parallel_rank, n)
            loss = torch.zeros((), device=env.device)
            with autocast(cfg, env.device):  # fp32, or bf16 (the reference's precision too)
                for i, (x, y) in enumerate(split_micro_batches(inputs, targets, m)):
                    with nullcontext() if i == m - 1 else model.no_sync():  # sync the last only
                        micro_loss = loss_fn(model(x), y) / m
                        micro_loss.backward()  # the last: buckets all-reduce while it runs
                    loss += micro_loss.detach()
            model.finish_grad_sync()  # wait for the last buckets (naive: all-reduce them now)
            loss = comm.average_over_group(loss, pgm.gradient_sync_group)  # the global mean
            # every rank holds every averaged gradient: its local norm is the global one
            grad_norm = clip_replicated(params, max_norm)
            run.record(loss, grad_norm)  # logged; a NaN or inf stops the run here
            optimizer.step()
    # [end: step]
    result = run.result

    # What this chapter is about: one all-reduce of every gradient per step, not per micro-batch;
    # and what chapter 02 removes: every rank holds the whole model state, 16 Psi bytes (fp32)
    last = cfg.training.steps - 1
    report = ddp_report(model, pgm, p.impl, step=last)
    # every rank's overlap in that step: a rank launches a bucket when its own backward has
    # filled it, so the times differ from rank to rank and the order does not
    timelines = []
    if isinstance(model, OverlapRecorder) and n > 1:
        timelines = comm.gather_objects(model.timeline, pgm.gradient_sync_group)
    fp32_adamw = {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi}  # bytes per rank
    memory = memory_table(model, optimizer, pgm.gradient_sync_group,
                          f"memory per rank, bytes (data parallel, N = {n}, Psi = {psi:,})",
                          fp32_adamw, ("4Psi", "4Psi", "8Psi", "16Psi"))
    if pgm.rank == 0 and report:
        print(report)
    if timelines:  # [] but on rank 0
        print(f"overlap in step {last}, ms from each rank's forward (= compute, . waiting; "
              f"1-9: all-reduces in flight):\n{format_overlap(timelines)}")
    for rank, timeline in enumerate(timelines if cfg.logging.verbose else []):  # every bucket
        print(f"overlap in step {last} (rank {rank}; = compute, # a bucket's all-reduce in "
              f"flight, . waiting):\n{format_timeline(timeline)}")
    if pgm.rank == 0:
        print(memory)

    ok = True
    if cfg.check:
        full = model.state_dict()  # the weights of rank 0 (every rank holds them all)
        ok = check_against_reference(cfg, result.losses, env.device, full, result.start_step,
                                     grad_norms=result.grad_norms)
    destroy_pg_manager()
    destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
