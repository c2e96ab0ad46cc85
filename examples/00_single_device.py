"""Chapter 00: train a tiny Llama on one device. Every later chapter's --check
runs this single-device training on its own config and compares.

    python examples/00_single_device.py                 # about half a minute on a CPU
    scripts/launch.sh examples/00_single_device.py -- --steps 50

The data is a random Markov chain whose entropy rate is known exactly: it is the lowest
loss any model can reach, so the printed floor tells how much there is left to learn.
"""

import math
import sys

import torch

from scaletorch.data import build_dataset, split_micro_batches
from scaletorch.dist import destroy_distributed, init_distributed, init_pg_manager_from_config
from scaletorch.models import build_model, loss_fn
from scaletorch.parallel.grad_norm import clip_replicated
from scaletorch.trainer import (build_optimizer, load_config, plain_training, report_norm_parity,
                                report_parity, report_weight_parity, start_run)
from scaletorch.trainer.precision import NORM_TOLERANCES, TOLERANCES, autocast, resolve_precision


def limits(cfg, world_size: int) -> None:
    """This chapter's scope (load_config checks it with the layout, before anything starts)."""
    if world_size > 1:
        raise ValueError(f"00_single_device runs on one process, got world size "
                         f"{world_size}; chapter 01 is the first with several")
    if cfg.training.precision == "fp16":
        raise ValueError("00_single_device runs fp32 or bf16: training.precision fp16 needs a "
                         "loss scale, which examples/08_mixed_precision.py adds")
    if cfg.model.num_experts > 0:
        raise ValueError(f"00_single_device trains a dense model, got model.num_experts "
                         f"{cfg.model.num_experts}: a mixture of experts trains in "
                         f"examples/06_expert_parallel.py")


def main() -> int:
    cfg = load_config("examples/configs/00_single_device.yaml",
                      "Chapter 00: single-device training", limits,
                      unread={"parallel.": "one device, no strategy (chapters 01 on)"})
    env = init_distributed(cfg.training.timeout_seconds)
    pgm = init_pg_manager_from_config(cfg.parallel, cfg.training.timeout_seconds)

    model = build_model(cfg.model, seed=cfg.training.model_seed).to(env.device)
    print(f"model: {model.num_parameters():,} parameters, {cfg.model.num_layers} layers, "
          f"hidden {cfg.model.hidden_size}; device {env.device}")
    optimizer = build_optimizer(cfg, model.parameters())  # AdamW
    params, m = list(model.parameters()), cfg.data.num_micro_batches
    max_norm = cfg.training.grad_clip or math.inf  # 0: no clipping

    # [core: step]
    with start_run(cfg, model, optimizer, pgm) as run:  # run directory, resume, checkpoints
        for inputs, targets in run.batches():  # this step's batch (b, s): inputs and next tokens
            optimizer.zero_grad(set_to_none=True)
            loss = torch.zeros((), device=env.device)
            with autocast(cfg, env.device):  # fp32, or bf16 (the reference's precision too)
                for x, y in split_micro_batches(inputs, targets, m):  # (b/m, s) each
                    micro_loss = loss_fn(model(x), y) / m  # the batch's mean, a part at a time
                    micro_loss.backward()  # adds this micro-batch's share to p.grad
                    loss += micro_loss.detach()
            grad_norm = clip_replicated(params, max_norm)
            run.record(loss, grad_norm)  # logged; a NaN or inf stops the run here
            optimizer.step()
    # [end: step]
    result = run.result

    if cfg.data.dataset == "synthetic":
        floor = build_dataset("synthetic", cfg.model.vocab_size, cfg.data.seed).entropy_rate()
        print(f"final loss {result.losses[-1]:.4f} nats/token; entropy floor {floor:.4f} "
              f"(the best any model can do); start was {result.losses[0]:.4f}")
    ok = True
    if cfg.check:  # the reference: a plain PyTorch loop that shares only model and data
        reference, ref_norms, plain_model = plain_training(cfg, env.device)
        precision = resolve_precision(cfg, env.device.type)  # the reference's too
        tolerance = TOLERANCES[precision]
        ok = report_parity(result.losses, reference[result.start_step:], tolerance, precision)
        ok = report_weight_parity(model.state_dict(), plain_model.state_dict(), cfg.training.steps,
                                  tolerance, precision) and ok
        ok = report_norm_parity(result.grad_norms, ref_norms[result.start_step:],
                                NORM_TOLERANCES[precision], precision) and ok
    destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
