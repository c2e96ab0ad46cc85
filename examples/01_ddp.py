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

import sys
from functools import partial

from scaletorch.dist import (comm, destroy_distributed, destroy_pg_manager, init_distributed,
                             init_pg_manager_from_config)
from scaletorch.models import build_model
from scaletorch.parallel.data_parallel import BucketedDataParallel, apply_data_parallel, ddp_report
from scaletorch.parallel.grad_norm import clip_replicated
from scaletorch.parallel.memory_report import memory_table
from scaletorch.parallel.overlap_chart import (OverlapRecorder, format_overlap, format_timeline,
                                               record_overlap)
from scaletorch.trainer import Trainer, check_against_reference, load_config

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
    # every rank holds every averaged gradient: the local norm is the global one, no all-reduce
    clip = partial(clip_replicated, list(model.parameters()))
    trainer = Trainer(cfg, model, pgm, device=env.device, clip_grad_norm=clip)
    result = trainer.train()

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
    memory = memory_table(model, trainer.optimizer, pgm.gradient_sync_group,
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
