"""Chapter 02: ZeRO and FSDP. Same global batch as chapter 01, but each of the N data-parallel
ranks keeps only 1/N of the optimizer state (ZeRO-1), of the gradients too (ZeRO-2), of the
parameters too (ZeRO-3 = FSDP). Chapter 00's run: its model, data, lr and schedule. ``--check``
trains the same config on one device and wants losses and weights within 1e-5 (or 32 x the
measured floor above it: scaletorch/trainer/parity.py).

    scripts/launch.sh examples/02_fsdp.py --nproc-per-node 2 -- --check
    scripts/launch.sh examples/02_fsdp.py --nproc-per-node 4 -- --zero-stage 1 --micro-batches 2
    scripts/launch.sh examples/02_fsdp.py --nproc-per-node 2 -- --impl torch --check   # FSDP2

Chapter 01 with ZeRO in place of DDP: ``apply_zero`` wraps the model in ZeRO's
``ShardedDataParallel``, ``ZeroAdamW`` updates this rank's shards only, and the Trainer clips
with the wrapper's ``clip_grad_norm`` (each shard element counted once). ``--impl torch``
hands the model to FSDP2 (``apply_fully_shard``) and keeps the Trainer's AdamW. Prints the
communication of the last step and the memory ledger of every rank, each next to its formula,
and writes runs/<name>/consolidated.pt: full weights and full AdamW state, keyed like chapter
00's model (``build_model(cfg.model, seed).load_state_dict(torch.load(path)["model"])``;
chapter 07 resumes it with ``--resume``).
"""

import math
import os
import sys
from contextlib import nullcontext
from functools import partial

import torch

from scaletorch.data import local_batch, split_micro_batches
from scaletorch.dist import (comm, destroy_distributed, destroy_pg_manager, init_distributed,
                             init_pg_manager_from_config)
from scaletorch.dist.wrap_checks import check_zero_layout
from scaletorch.models import build_model, loss_fn
from scaletorch.parallel.fully_shard import apply_fully_shard, full_state_dict
from scaletorch.parallel.zero import ZeroAdamW, apply_zero
from scaletorch.parallel.zero_report import zero_report
from scaletorch.trainer import build_optimizer, check_against_reference, load_config, start_run
from scaletorch.trainer.consolidated import save_consolidated
from scaletorch.trainer.precision import autocast


def limits(cfg, world_size: int) -> None:
    """This chapter's scope, ZeRO over data parallel only (load_config checks it with the
    layout, before anything starts); chapter 07 combines ZeRO with the others."""
    p = cfg.parallel
    check_zero_layout(p.zero_stage, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                      p.expert_model_parallel_size)
    later = {
        "parallel.context_parallel_size": (p.context_parallel_size, 1, "07_nd_parallel"),
        "model.num_experts": (cfg.model.num_experts, 0, "06_expert_parallel"),
        "model.tie_word_embeddings": (cfg.model.tie_word_embeddings, False, "10_real_model"),
        "parallel.activation_checkpointing": (p.activation_checkpointing, "none", "10_real_model"),
        "parallel.param_dtype": (p.param_dtype, ("auto", "fp32"), "08_mixed_precision"),
        "parallel.reduce_dtype": (p.reduce_dtype, "fp32", "08_mixed_precision"),
    }
    for key, (value, allowed, chapter) in later.items():
        allowed = allowed if isinstance(allowed, tuple) else (allowed, )
        if value not in allowed:
            raise ValueError(f"02_fsdp runs {key} {' or '.join(map(str, allowed))} only, got "
                             f"{value!r}: see {chapter}")


def main() -> int:
    cfg = load_config("examples/configs/02_fsdp.yaml", "Chapter 02: ZeRO-1/2/3 and FSDP", limits)
    env = init_distributed(cfg.training.timeout_seconds)
    p = cfg.parallel
    pgm = init_pg_manager_from_config(p, cfg.training.timeout_seconds)
    pgm.log_topology()

    model = build_model(cfg.model, seed=cfg.training.model_seed).to(env.device)
    numel = model.num_parameters()
    t = cfg.training
    if p.impl == "torch":  # PyTorch's ZeRO-3: AdamW and the clip work on its DTensors
        model = apply_fully_shard(model, pgm)
        optimizer = build_optimizer(cfg, model.parameters())
        clip = partial(torch.nn.utils.clip_grad_norm_, list(model.parameters()))
        gather = partial(full_state_dict, model)
        # FSDP2 reduce-scatters in every backward: nothing to hold back, nothing to finish
        model.no_sync, model.finish_grad_sync = nullcontext, lambda: None
    else:
        # the new idea: shard, and let each rank's AdamW update its shard only
        model = apply_zero(model, pgm, p.zero_stage)
        optimizer = ZeroAdamW(model, t.lr, (t.beta1, t.beta2), t.weight_decay)
        clip, gather = model.clip_grad_norm, model.full_state_dict  # each shard counted once
    name = "FSDP2 fully_shard" if p.impl == "torch" else f"ZeRO-{p.zero_stage}"
    n = pgm.gradient_sync_world_size
    if env.rank == 0:
        print(f"{name}: {numel:,} parameters over {n} data-parallel ranks")
    m, max_norm = cfg.data.num_micro_batches, t.grad_clip or math.inf  # 0: no clipping

    # [core: step]
    with start_run(cfg, model, optimizer, pgm) as run:  # run directory, resume, checkpoints
        for inputs, targets in run.batches():  # this step's batch (b, s): inputs and next tokens
            optimizer.zero_grad(set_to_none=True)
            inputs, targets, _ = local_batch(inputs, targets, pgm.data_parallel_rank, n)
            loss = torch.zeros((), device=env.device)
            with autocast(cfg, env.device):  # fp32, or bf16 (the reference's precision too)
                for i, (x, y) in enumerate(split_micro_batches(inputs, targets, m)):
                    with nullcontext() if i == m - 1 else model.no_sync():  # the last reduces
                        micro_loss = loss_fn(model(x), y) / m  # stage 3: gathers each unit
                        micro_loss.backward()  # stage 2-3: each unit's gradients scattered
                    loss += micro_loss.detach()
            model.finish_grad_sync()  # wait for the last reduce-scatters
            loss = comm.average_over_group(loss, pgm.gradient_sync_group)  # the global mean
            grad_norm = clip(max_norm)
            run.record(loss, grad_norm)  # logged; a NaN or inf stops the run here
            optimizer.step()  # ZeRO: each rank updates its shard only
    # [end: step]
    result = run.result

    # What this chapter is about: 1/N of the model state per rank (stage 3: for 1.5x the traffic).
    report = zero_report(model, optimizer, pgm, p.zero_stage, p.impl, cfg.data.num_micro_batches,
                         numel, step=t.steps - 1)
    path = os.path.join(cfg.run_path, "consolidated.pt")
    save_consolidated(path, run.trainer, gather)
    if env.rank == 0:
        print(report)
        print(f"consolidated checkpoint (full weights and AdamW state, chapter 00's keys): "
              f"{path}")

    ok = True
    if cfg.check:
        full = gather()  # collective: every rank gathers, rank 0 compares
        ok = check_against_reference(cfg, result.losses, env.device, full, result.start_step,
                                     grad_norms=result.grad_norms)
    destroy_pg_manager()
    destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
