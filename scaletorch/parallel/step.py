"""One optimizer step's forward and backward, for every strategy that is not a pipeline.

The contract every strategy keeps (doc/design.md): the loss is the mean over all tokens of the
global batch, exactly as on one device. Each data-parallel rank takes an equal slice of the
batch and splits it into micro-batches; a micro-batch's mean loss is divided by their number,
so the accumulated gradient is the gradient of the rank's mean loss, and averaging gradients
over data-parallel ranks (the strategy's job) gives the gradient of the global mean.

A model wrapper may provide two hooks, both optional:
- ``no_sync()``: a context in which backward must not synchronize gradients (all
  micro-batches but the last; see 01_ddp);
- ``finish_grad_sync()``: called once after the last backward (wait for in-flight
  reductions, or do them now).
"""

from contextlib import nullcontext
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from scaletorch.data import SequenceShard, local_batch, split_micro_batches
from scaletorch.dist.comm import average_over_group
from scaletorch.models import loss_fn, moe_aux_loss

ForwardBackward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
AuxLoss = Callable[[nn.Module], Any]


def forward_backward(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                     num_micro_batches: int, loss_fn: LossFn = loss_fn,
                     position_ids: Optional[torch.Tensor] = None,
                     aux_loss: AuxLoss = moe_aux_loss) -> torch.Tensor:
    """Accumulate gradients of this rank's mean loss; returns that loss (detached).

    inputs, targets: (b, s), the rank's slice of the global batch. ``loss_fn(logits, targets)``
    is the mean loss of a micro-batch (tensor parallel passes its vocab-parallel one).
    ``position_ids`` (s,), if given, go to the model (context parallel: the true positions).
    ``aux_loss(model)``: what the model's own layers add to the loss of their last forward
    (chapter 06's load balancing; 0.0 for a dense model). fp16 (chapter 08) passes both losses
    wrapped to scale their backward.
    """
    micro_batches = split_micro_batches(inputs, targets, num_micro_batches)
    total = torch.zeros((), device=inputs.device)
    for i, (x, y) in enumerate(micro_batches):
        is_last = i == len(micro_batches) - 1
        no_sync = getattr(model, "no_sync", None)
        with nullcontext() if is_last or no_sync is None else no_sync():
            logits = model(x) if position_ids is None else model(x, position_ids=position_ids)
            loss = (loss_fn(logits, y) + aux_loss(model)) / num_micro_batches
            loss.backward()
        total += loss.detach()
    finish = getattr(model, "finish_grad_sync", None)
    if finish is not None:
        finish()
    return total


def make_data_parallel_step(model: nn.Module, num_micro_batches: int, data_parallel_rank: int,
                            data_parallel_size: int, loss_group: Optional[dist.ProcessGroup],
                            loss_fn: LossFn = loss_fn,
                            shard_sequence: Optional[SequenceShard] = None,
                            aux_loss: AuxLoss = moe_aux_loss) -> ForwardBackward:
    """The step for single device, DDP, ZeRO and tensor parallel: slice, accumulate, report.

    ``loss_group`` averages the reported loss over the ranks that saw different tokens
    (data x context parallel); the gradients are the model wrapper's business.
    ``shard_sequence(inputs, targets) -> (inputs, targets, position_ids)`` then keeps this
    rank's tokens of each sequence (context parallel). ``aux_loss``: as in ``forward_backward``.
    """

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        inputs, targets, position_ids = local_batch(inputs, targets, data_parallel_rank,
                                                    data_parallel_size, shard_sequence)
        loss = forward_backward(model, inputs, targets, num_micro_batches, loss_fn, position_ids,
                                aux_loss)
        if loss_group is None and data_parallel_size == 1:
            # A single-device run (the reference of --check, run by rank 0 alone): it must not
            # touch the world group that may exist around it (None means the world in comm).
            return loss
        return average_over_group(loss, loss_group)

    return step
