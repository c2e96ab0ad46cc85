"""Chapter 05: context parallel. Every sequence is split over the "cp" ranks; attention is not.

    scripts/launch.sh examples/05_context_parallel.py --nproc-per-node 2 -- --check
    scripts/launch.sh examples/05_context_parallel.py --nproc-per-node 4 -- --cp 2 --tp 2 --check
    scripts/launch.sh examples/05_context_parallel.py --nproc-per-node 4 -- --cp-variant ulysses

Chapter 01 plus two calls: ``apply_context_parallel`` swaps every attention for ring (or
Ulysses) attention, and the step's sequence sharder keeps this rank's tokens of each sequence
(zigzag) and passes their true positions to RoPE. Chapter 01's bucketed data parallel
averages gradients over the data x context ranks, also when dp = 1: each cp rank's loss is
over different tokens. With ``--tp`` chapter 03 splits the matrices first.
"""

import sys

from scaletorch.config import recompute_mode
from scaletorch.dist import (destroy_distributed, destroy_pg_manager, init_distributed,
                             init_pg_manager_from_config)
from scaletorch.models import build_model, loss_fn
from scaletorch.parallel.context_parallel import (apply_context_parallel, cp_report,
                                                  gather_context_parallel_state_dict,
                                                  make_sequence_sharder)
from scaletorch.parallel.data_parallel import apply_data_parallel
from scaletorch.parallel.step import make_data_parallel_step
from scaletorch.parallel.tensor_parallel import (apply_tensor_parallel,
                                                 tensor_parallel_clip_grad_norm,
                                                 tensor_parallel_loss_fn)
from scaletorch.trainer import Trainer, check_against_reference, load_config


def limits(cfg, world_size: int) -> None:
    """This chapter's scope (load_config checks it with the layout, before anything starts)."""
    p = cfg.parallel
    later = {
        "--pp": p.pipeline_model_parallel_size > 1,
        "--ep": p.expert_model_parallel_size > 1,
        "--zero-stage": p.zero_stage > 0,
        f"--impl {p.impl}": p.impl != "ours",  # our ring; its data parallel is ours too
        "--activation-checkpointing": recompute_mode(p.activation_checkpointing) != "none",
        "--training.precision fp16": cfg.training.precision == "fp16",
        "--parallel.reduce_dtype": p.reduce_dtype != "fp32",
    }
    if any(later.values()):
        raise ValueError(f"05_context_parallel composes cp with dp and tp (impl ours); "
                         f"{', '.join(k for k, v in later.items() if v)}: run "
                         f"examples/07_nd_parallel.py, which composes every strategy (fp16: 08, "
                         f"recomputation: 10)")
    if p.context_parallel_size < 2:
        raise ValueError(f"05_context_parallel needs context_parallel_size >= 2 (--cp), got "
                         f"{p.context_parallel_size}")


def main() -> int:
    cfg = load_config("examples/configs/05_context_parallel.yaml",
                      "Chapter 05: context parallel (ring attention)", limits)
    env = init_distributed(cfg.training.timeout_seconds)
    p = cfg.parallel
    pgm = init_pg_manager_from_config(p, cfg.training.timeout_seconds)
    pgm.log_topology()

    model = build_model(cfg.model, seed=cfg.training.model_seed).to(env.device)
    loss, clip = loss_fn, None
    if pgm.tensor_model_parallel_world_size > 1:  # chapter 03 first: ring attention on its heads
        apply_tensor_parallel(model, pgm, p.sequence_parallel)
        loss, clip = tensor_parallel_loss_fn(pgm), tensor_parallel_clip_grad_norm(model, pgm)
    apply_context_parallel(model, pgm, p.cp_variant, kernel=p.cp_attention)  # the ring
    model = apply_data_parallel(model, pgm, p.impl, p.bucket_size_mb)  # over dp x cp (dp_cp)
    step = make_data_parallel_step(model, cfg.data.num_micro_batches, pgm.data_parallel_rank,
                                   pgm.data_parallel_world_size, pgm.gradient_sync_group, loss,
                                   shard_sequence=make_sequence_sharder(pgm, cfg.data.seq_len))
    result = Trainer(cfg, model, pgm, device=env.device, forward_backward=step,
                     clip_grad_norm=clip).train()

    # What this chapter is about: K/V traffic per layer and the causal work per rank.
    steps_run = cfg.training.steps - result.start_step
    report = cp_report(cfg, model, pgm, steps_run, step=cfg.training.steps - 1)
    if pgm.rank == 0:
        print(report)

    ok = True
    if cfg.check:
        full = gather_context_parallel_state_dict(model, pgm)  # collective over tp, on rank 0
        ok = check_against_reference(cfg, result.losses, env.device, full, result.start_step,
                                     grad_norms=result.grad_norms)
    destroy_pg_manager()
    destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
