"""The independent reference: training written as a plain PyTorch loop, sharing nothing with the
Trainer but the model and the global batches.

Every parity check compares a parallel run with a single-device run. If that single-device
run were the Trainer itself, a bug in the Trainer's step, micro-batching, clipping or learning
rate schedule would appear on both sides and cancel. This loop is written out from the
textbook instead, with torch's own pieces:

    for step in range(steps):
        x, y = loader.get_batch(step)                       # the global batch (data/loader.py)
        set every param group's lr to schedule(step)        # warmup + cosine, written below
        for each of m micro-batches x[i*b:(i+1)*b]:
            loss = (F.cross_entropy(model(x_i), y_i) + MoE aux losses) / m
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        torch.optim.AdamW.step()

It must not import the Trainer, its step (parallel/step.py), its clipping
(parallel/grad_norm.py) or its ``lr_at``: tests/test_trainer.py checks that the Trainer
equals this loop, so the loop has to stand on its own. Chapter 00's ``--check`` compares
against it.
"""

import math
from typing import List, Optional, Tuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from scaletorch.config import Config, resolve_precision
from scaletorch.data import GlobalBatchLoader, build_dataset
from scaletorch.models import MoE, build_model

__all__ = ["plain_lr", "plain_training"]


def plain_lr(step: int, lr: float, min_lr: float, warmup_steps: int, steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based), as doc/00 describes it.

    Warmup: step 0 uses lr / warmup_steps, step warmup_steps - 1 uses lr. Then a half cosine
    from lr down to min_lr over the remaining ``steps - warmup_steps`` steps.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(1, steps - warmup_steps)
    fraction = min(1.0, (step - warmup_steps) / decay_steps)  # 0 -> 1 over the decay
    cosine = 0.5 * (1.0 + math.cos(math.pi * fraction))  # 1 -> 0
    return min_lr + (lr - min_lr) * cosine


def plain_training(cfg: Config, device: torch.device = torch.device("cpu"),
                   model: Optional[nn.Module] = None) -> Tuple[List[float], List[float], nn.Module]:
    """Train ``cfg``'s model on one device for ``cfg.training.steps`` steps, the plain way.

    Returns (losses, grad norms before clipping, trained model). ``model``: start from this
    one instead of ``build_model(cfg.model, cfg.training.model_seed)``. fp32, or bf16 under
    torch.autocast; fp16 needs a loss scaler, which a plain loop would have to share with the
    Trainer to match it, so it raises ValueError.
    """
    precision = resolve_precision(cfg, device.type)
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"the plain-loop reference runs fp32 or bf16, not {precision} "
                         f"(training.precision {cfg.training.precision})")
    t, d = cfg.training, cfg.data
    if model is None:
        model = build_model(cfg.model, seed=t.model_seed)
    model = model.to(device)
    dataset = build_dataset(d.dataset, cfg.model.vocab_size, d.seed, path=d.path)
    loader = GlobalBatchLoader(dataset, d.global_batch_size, d.seq_len, d.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2),
                                  weight_decay=t.weight_decay)
    m = d.num_micro_batches
    if d.global_batch_size % m != 0:
        raise ValueError(f"global_batch_size ({d.global_batch_size}) is not divisible by "
                         f"num_micro_batches ({m})")
    b = d.global_batch_size // m  # sequences per micro-batch
    moe_layers = [module for module in model.modules() if isinstance(module, MoE)]
    max_norm = t.grad_clip if t.grad_clip > 0 else math.inf  # 0 disables clipping
    losses: List[float] = []
    norms: List[float] = []
    # [core: reference-loop]
    for step in range(t.steps):
        inputs, targets = loader.get_batch(step)
        inputs, targets = inputs.to(device), targets.to(device)
        for group in optimizer.param_groups:
            group["lr"] = plain_lr(step, t.lr, t.min_lr, t.warmup_steps, t.steps)
        optimizer.zero_grad(set_to_none=True)
        step_loss = torch.zeros((), device=device)  # the step's mean loss, summed in fp32
        for i in range(m):
            x, y = inputs[i * b:(i + 1) * b], targets[i * b:(i + 1) * b]  # (b, s)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                logits = model(x)  # (b, s, V)
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
                # + the load-balancing loss of each MoE layer's forward (none: a dense model)
                loss = loss + sum(cast(torch.Tensor, layer.aux_loss) for layer in moe_layers)
            (loss / m).backward()
            step_loss += (loss / m).detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        losses.append(step_loss.item())
        norms.append(norm.item())
    # [end: reference-loop]
    return losses, norms, model
