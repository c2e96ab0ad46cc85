"""Chapter 06's load-balancing loss under chapter 04b's pipeline runtime (composed in 07).

A pipeline stage's chunk holds some of the MoE layers, so its own load-balancing loss must
backpropagate from that stage. ``parallelize`` appends ``MoELossInPipeline`` to the schedule's
hooks: each chunk's output carries the loss (forward: the output as it is; backward: 1 for the
loss), so one backward from the output covers both, as Megatron's aux-loss scaler does.
"""

from typing import Any, Callable, Tuple

import torch
from torch import nn

from scaletorch.models.moe import moe_aux_loss
from scaletorch.parallel.pipeline_runtime import PipelineSchedule, StageHooks


class _CarryLoss(torch.autograd.Function):
    """Forward: ``out`` as it is. Backward: ``out``'s gradient, and 1 for ``loss``, so a chunk's
    own loss backpropagates with its output on any stage (Megatron's aux-loss auto-scaler)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape = loss.shape
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones(ctx.loss_shape, dtype=grad.dtype, device=grad.device)


class MoELossInPipeline(StageHooks):
    """Chapter 06's loss attached to a pipeline schedule (``schedule.hooks.append(...)``): each
    chunk's MoE layers' load-balancing loss / m joins the reported loss (summed over "pp") and
    backpropagates with the chunk's output. ``loss_of(chunk)``: a 0-dim tensor, or 0.0 for a
    dense chunk (fp16 wraps it to scale its backward: mixed_precision.py)."""

    def __init__(self, num_micro_batches: int) -> None:
        self.m = num_micro_batches
        self.loss_of: Callable[[nn.Module], Any] = moe_aux_loss

    def output(self, schedule: PipelineSchedule, chunk: nn.Module,
               out: torch.Tensor) -> torch.Tensor:
        loss = self.loss_of(chunk)
        if not torch.is_tensor(loss):  # a dense chunk's extra loss is 0.0
            return out
        loss = loss / self.m
        schedule.loss += loss.detach()
        return _CarryLoss.apply(out, loss)
