"""Chapter 12's one call: a ResNet under data parallel or ZeRO, with a BatchNorm mode.

    parallelize_resnet(model, pgm, impl, zero_stage, batchnorm, lr)
      1. convert_batchnorm     per-rank | sync (ours, sync_batchnorm.py) | torch (GPU only)
      2. the data-parallel strategy over pgm.gradient_sync_group:
           impl ours,  zero_stage 0     our bucketed DDP              (chapter 01)
           impl ours,  zero_stage 1-3   our ZeRO, units below         (chapter 02)
           impl torch, zero_stage 0     torch's DistributedDataParallel
           impl torch, zero_stage 3     torch's FSDP2 fully_shard, block by block

BatchNorm first: ZeRO and FSDP2 take the parameters into flat units or DTensors, after which
swapping a module would lose them. ZeRO's units are the stem, each residual block and the head,
as a Llama's are the embedding, each block and the head. Returns the model with what the
training loop needs beside it: the optimizer, the clip, the full weights and buffers for a
parity check, and what to do after each step (per-rank BatchNorm: average the buffers).
"""

from dataclasses import dataclass
from functools import partial
from typing import Callable, Dict, cast

import torch
from torch import nn

from scaletorch.dist import ProcessGroupManager
from scaletorch.parallel.data_parallel import apply_data_parallel
from scaletorch.parallel.fully_shard import apply_fully_shard, full_state_dict
from scaletorch.parallel.grad_norm import clip_grads_, clip_replicated, world_grad_norm
from scaletorch.parallel.sync_batchnorm import average_running_stats, convert_batchnorm
from scaletorch.parallel.zero import ShardedDataParallel, Units, ZeroAdamW, apply_zero

State = Dict[str, torch.Tensor]


@dataclass
class ParallelResNet:
    model: nn.Module  # the wrapped (or sharded) ResNet
    optimizer: torch.optim.Optimizer
    clip_grad_norm: Callable[[float], torch.Tensor]  # max_norm -> global norm (collective)
    full_state: Callable[[], State]  # collective: {name: full tensor}, parameters and buffers
    after_step: Callable[[], None]  # per-rank BatchNorm: average the running buffers


def resnet_units(model: nn.Module) -> Units:
    """ZeRO's units of a ResNet, in forward order: stem, each block, head (fc)."""
    blocks = cast(nn.ModuleList, model.layers)
    units: Units = [("stem", [("stem", cast(nn.Module, model.stem))])]
    units += [(f"layers.{i}", [(f"layers.{i}", block)]) for i, block in enumerate(blocks)]
    return units + [("head", [("fc", cast(nn.Module, model.fc))])]


def _zero_full_state(model: ShardedDataParallel) -> State:
    """ZeRO's gathered parameters plus the buffers every rank holds whole."""
    full = model.full_state_dict()
    full.update({k: v.detach().cpu().clone() for k, v in model.module.named_buffers()})
    return full


def parallelize_resnet(model: nn.Module, pgm: ProcessGroupManager, impl: str, zero_stage: int,
                       batchnorm: str, lr: float, bucket_size_mb: float = 25.0) -> ParallelResNet:
    """``model`` (every rank the same weights) made data parallel over
    ``pgm.gradient_sync_group``, its BatchNorm layers in mode ``batchnorm``."""
    if impl == "torch" and zero_stage not in (0, 3):
        raise ValueError(f"impl torch has DDP (zero_stage 0) and fully_shard (3), got "
                         f"zero_stage {zero_stage}: our ZeRO-1/2 is impl ours")
    group = pgm.gradient_sync_group
    model = convert_batchnorm(model, batchnorm, group)
    adamw = partial(torch.optim.AdamW, lr=lr, weight_decay=0.0)
    # torch's DDP broadcasts rank 0's buffers before each forward itself; the others average
    average = batchnorm == "per-rank" and not (impl == "torch" and zero_stage == 0)
    after_step = partial(average_running_stats, model, group) if average else (lambda: None)
    if zero_stage == 0:
        # ours leaves the buffers to ``batchnorm``'s rule; torch's broadcasts rank 0's
        wrapped = apply_data_parallel(model, pgm, impl, bucket_size_mb)
        params = list(wrapped.parameters())
        return ParallelResNet(
            wrapped, adamw(params), partial(clip_replicated, params), lambda: {
                k: v.detach().cpu().clone()
                for k, v in wrapped.state_dict().items()
            }, after_step)
    if impl == "torch":
        sharded = apply_fully_shard(model, pgm)  # FSDP2: every element on one rank, replicas 1
        params = list(sharded.parameters())
        device = params[0].device

        def clip(max_norm: float) -> torch.Tensor:
            return clip_grads_(params, max_norm,
                               world_grad_norm([(p, 1) for p in params], device, group))

        return ParallelResNet(sharded, adamw(params), clip, partial(full_state_dict, sharded),
                              after_step)
    zero = apply_zero(model, pgm, zero_stage, units=resnet_units(model))
    optimizer = ZeroAdamW(zero, lr, (0.9, 0.999), 0.0)
    return ParallelResNet(zero, optimizer, zero.clip_grad_norm, partial(_zero_full_state, zero),
                          after_step)
