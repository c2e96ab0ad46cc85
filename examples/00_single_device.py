"""Chapter 00: train a tiny Llama on one device. Every later chapter's --check
runs this single-device training on its own config and compares.

    python examples/00_single_device.py                 # about half a minute on a CPU
    scripts/launch.sh examples/00_single_device.py -- --steps 50

The data is a random Markov chain whose entropy rate is known exactly: it is the lowest
loss any model can reach, so the printed floor tells how much there is left to learn.
"""

import sys

from scaletorch.data import build_dataset
from scaletorch.dist import destroy_distributed, init_distributed, init_pg_manager_from_config
from scaletorch.models import build_model
from scaletorch.trainer import (Trainer, load_config, plain_training, report_norm_parity,
                                report_parity, report_weight_parity)
from scaletorch.trainer.precision import NORM_TOLERANCES, TOLERANCES, resolve_precision


def limits(cfg, world_size: int) -> None:
    """This chapter's scope (load_config checks it with the layout, before anything starts)."""
    if world_size > 1:
        raise ValueError(f"00_single_device runs on one process, got world size "
                         f"{world_size}; chapter 01 is the first with several")
    if cfg.check and cfg.training.precision == "fp16":
        raise ValueError("00_single_device --check compares with a plain PyTorch loop, which "
                         "runs fp32 or bf16: training.precision fp16 has no plain reference")


def main() -> int:
    cfg = load_config("examples/configs/00_single_device.yaml",
                      "Chapter 00: single-device training", limits,
                      unread={"parallel.": "one device, no strategy (chapters 01 on)"})
    env = init_distributed(cfg.training.timeout_seconds)
    pgm = init_pg_manager_from_config(cfg.parallel, cfg.training.timeout_seconds)

    model = build_model(cfg.model, seed=cfg.training.model_seed).to(env.device)
    print(f"model: {model.num_parameters():,} parameters, {cfg.model.num_layers} layers, "
          f"hidden {cfg.model.hidden_size}; device {env.device}")
    result = Trainer(cfg, model, pgm, device=env.device).train()

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
