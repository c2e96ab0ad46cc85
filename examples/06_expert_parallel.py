"""Chapter 06: expert parallel. Every block's MLP is a mixture of experts, split over "ep".

    scripts/launch.sh examples/06_expert_parallel.py --nproc-per-node 2 -- --check
    scripts/launch.sh examples/06_expert_parallel.py --nproc-per-node 4 -- --check
    scripts/launch.sh examples/06_expert_parallel.py --nproc-per-node 4 -- --ep 4 --check
    scripts/launch.sh examples/06_expert_parallel.py --nproc-per-node 4 -- --tp 2 --check

The experts are carved out of the data-parallel ranks: with 4 processes and the config's ep 2,
dp 4 = ep 2 x edp 2 (two ranks hold each half of the experts, each sees its own tokens).

Chapter 01 with ``num_experts`` > 0 in the config's model (chapter 00 builds the same MoE
model, the reference of ``--check``) and two calls in place of the data-parallel wrapper:
``shard_experts`` keeps this rank's experts and routes tokens through two all-to-alls per
layer; ``ExpertParallel`` reduces expert gradients over "edp", dense ones over "dp_cp". With
``--tp`` the attention is tensor parallel (chapter 03) and the MoE runs whole on every tp rank.
"""

import math
import sys

import torch

from scaletorch.config import recompute_mode
from scaletorch.data import local_batch, split_micro_batches
from scaletorch.dist import (comm, destroy_distributed, destroy_pg_manager, init_distributed,
                             init_pg_manager_from_config)
from scaletorch.models import build_model, loss_fn, moe_aux_loss
from scaletorch.parallel.expert_parallel import (ExpertParallel, ep_report,
                                                 expert_parallel_clip_grad_norm,
                                                 gather_expert_parallel_state_dict, shard_experts)
from scaletorch.parallel.tensor_parallel import apply_tensor_parallel, tensor_parallel_loss_fn
from scaletorch.trainer import build_optimizer, check_against_reference, load_config, start_run
from scaletorch.trainer.precision import autocast


def limits(cfg, world_size: int) -> None:
    """This chapter's scope (load_config checks it with the layout, before anything starts)."""
    p = cfg.parallel
    later = {
        "--pp": p.pipeline_model_parallel_size > 1,
        "--cp": p.context_parallel_size > 1,
        "--sequence-parallel": p.sequence_parallel,
        f"--impl {p.impl}": p.impl != "ours",
        "--activation-checkpointing": recompute_mode(p.activation_checkpointing) != "none",
        "--training.precision fp16": cfg.training.precision == "fp16",
    }
    if any(later.values()):
        raise ValueError(f"06_expert_parallel composes ep with dp and tp (impl ours); "
                         f"{', '.join(k for k, v in later.items() if v)}: run "
                         f"examples/07_nd_parallel.py, which composes every strategy (fp16: 08, "
                         f"recomputation: 10)")
    if cfg.model.num_experts < 1:
        raise ValueError(f"06_expert_parallel needs a mixture-of-experts model "
                         f"(model.num_experts >= 1), got {cfg.model.num_experts}")


def main() -> int:
    cfg = load_config("examples/configs/06_expert_parallel.yaml",
                      "Chapter 06: expert parallel (mixture of experts)", limits)
    env = init_distributed(cfg.training.timeout_seconds)
    pgm = init_pg_manager_from_config(cfg.parallel, cfg.training.timeout_seconds)
    pgm.log_topology(experts=True)

    model = build_model(cfg.model, seed=cfg.training.model_seed).to(env.device)
    shard_experts(model, pgm)  # the new idea: E/ep experts here, tokens go to them
    loss_of = loss_fn
    if pgm.tensor_model_parallel_world_size > 1:  # chapter 03: attention split, MoE whole
        apply_tensor_parallel(model, pgm)
        loss_of = tensor_parallel_loss_fn(pgm)
    model = ExpertParallel(model, pgm)  # in place of DDP: dense over dp_cp, experts over edp
    optimizer = build_optimizer(cfg, model.parameters())  # AdamW, on this rank's experts
    clip = expert_parallel_clip_grad_norm(model, pgm)  # an expert's squares once per copy
    m, max_norm = cfg.data.num_micro_batches, cfg.training.grad_clip or math.inf  # 0: no clip

    # [core: step]
    with start_run(cfg, model, optimizer, pgm) as run:  # run directory, resume, checkpoints
        for inputs, targets in run.batches():  # this step's batch (b, s): inputs and next tokens
            optimizer.zero_grad(set_to_none=True)
            inputs, targets, _ = local_batch(inputs, targets, pgm.data_parallel_rank,
                                             pgm.data_parallel_world_size)
            loss = torch.zeros((), device=env.device)
            with autocast(cfg, env.device):  # fp32, or bf16 (the reference's precision too)
                for x, y in split_micro_batches(inputs, targets, m):
                    # each MoE layer: all-to-all its tokens to their experts' ranks and back
                    logits = model(x)
                    # + each MoE layer's load-balancing loss of this forward
                    micro_loss = (loss_of(logits, y) + moe_aux_loss(model)) / m
                    micro_loss.backward()
                    loss += micro_loss.detach()
            model.finish_grad_sync()  # dense over dp_cp, experts over edp
            loss = comm.average_over_group(loss, pgm.gradient_sync_group)
            grad_norm = clip(max_norm)
            run.record(loss, grad_norm)  # logged; a NaN or inf stops the run here
            optimizer.step()
    # [end: step]
    result = run.result

    # What this chapter is about: where the tokens went, and what moving them cost.
    report = ep_report(model, pgm, step=cfg.training.steps - 1, micro_batches=m)
    if pgm.rank == 0:
        print(report)

    ok = True
    if cfg.check:
        full = gather_expert_parallel_state_dict(model, pgm)  # experts over ep, dense over tp
        ok = check_against_reference(cfg, result.losses, env.device, full, result.start_step,
                                     grad_norms=result.grad_norms)
    destroy_pg_manager()
    destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
