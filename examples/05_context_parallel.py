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

import math
import sys
from contextlib import nullcontext
from functools import partial

import torch

from scaletorch.config import recompute_mode
from scaletorch.data import local_batch, split_micro_batches
from scaletorch.dist import (comm, destroy_distributed, destroy_pg_manager, init_distributed,
                             init_pg_manager_from_config)
from scaletorch.models import build_model, loss_fn
from scaletorch.parallel.context_parallel import (apply_context_parallel, cp_report,
                                                  gather_context_parallel_state_dict,
                                                  make_sequence_sharder)
from scaletorch.parallel.data_parallel import apply_data_parallel
from scaletorch.parallel.grad_norm import clip_replicated
from scaletorch.parallel.tensor_parallel import (apply_tensor_parallel,
                                                 tensor_parallel_clip_grad_norm,
                                                 tensor_parallel_loss_fn)
from scaletorch.trainer import build_optimizer, check_against_reference, load_config, start_run
from scaletorch.trainer.precision import autocast


def limits(cfg, world_size: int) -> None:
    """This chapter's scope (load_config checks it with the layout, before anything starts)."""
    p = cfg.parallel
    later = {
        "--pp": p.pipeline_model_parallel_size > 1,
        "--ep": p.expert_model_parallel_size > 1,
        "--zero-stage": p.zero_stage > 0,
        "--activation-checkpointing": recompute_mode(p.activation_checkpointing) != "none",
        "--training.precision fp16": cfg.training.precision == "fp16",
        "--parallel.reduce_dtype": p.reduce_dtype != "fp32",
    }
    if p.impl != "ours":  # torch was PyTorch's DDP around our ring: 07 composes that
        what = {"torch": "PyTorch's DDP", "naive": "chapter 01's naive DDP"}[p.impl]
        raise ValueError(f"05_context_parallel runs --impl ours only (our ring, our data "
                         f"parallel over dp x cp); {what} around our ring is "
                         f"examples/07_nd_parallel.py --cp {p.context_parallel_size} "
                         f"--impl {p.impl}")
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
    loss_of, clip = loss_fn, partial(clip_replicated, list(model.parameters()))
    if pgm.tensor_model_parallel_world_size > 1:  # chapter 03 first: ring attention on its heads
        apply_tensor_parallel(model, pgm, p.sequence_parallel)
        loss_of, clip = tensor_parallel_loss_fn(pgm), tensor_parallel_clip_grad_norm(model, pgm)
    apply_context_parallel(model, pgm, p.cp_variant, kernel=p.cp_attention)  # the ring
    model = apply_data_parallel(model, pgm, p.impl, p.bucket_size_mb)  # over dp x cp (dp_cp)
    optimizer = build_optimizer(cfg, model.parameters())  # AdamW
    shard_sequence = make_sequence_sharder(pgm, cfg.data.seq_len)  # zigzag: this rank's tokens
    m, max_norm = cfg.data.num_micro_batches, cfg.training.grad_clip or math.inf  # 0: no clip

    # [core: step]
    with start_run(cfg, model, optimizer, pgm) as run:  # run directory, resume, checkpoints
        for inputs, targets in run.batches():  # this step's batch (b, s): inputs and next tokens
            optimizer.zero_grad(set_to_none=True)
            # the new line: (b/dp, s) -> this cp rank's 2 chunks of each sequence (b/dp, s/cp),
            # and their positions in the whole sequence, for RoPE
            inputs, targets, positions = local_batch(inputs, targets, pgm.data_parallel_rank,
                                                     pgm.data_parallel_world_size, shard_sequence)
            loss = torch.zeros((), device=env.device)
            with autocast(cfg, env.device):  # fp32, or bf16 (the reference's precision too)
                for i, (x, y) in enumerate(split_micro_batches(inputs, targets, m)):
                    with nullcontext() if i == m - 1 else model.no_sync():  # chapter 01's
                        # attention passes K and V around the cp ring (ring_attention.py)
                        micro_loss = loss_of(model(x, position_ids=positions), y) / m
                        micro_loss.backward()
                    loss += micro_loss.detach()
            model.finish_grad_sync()  # gradients averaged over dp x cp (dp_cp)
            # each cp rank's loss is over its own tokens: the mean over dp_cp is the global one
            loss = comm.average_over_group(loss, pgm.gradient_sync_group)
            grad_norm = clip(max_norm)
            run.record(loss, grad_norm)  # logged; a NaN or inf stops the run here
            optimizer.step()
    # [end: step]
    result = run.result

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
