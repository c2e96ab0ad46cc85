"""The memory ledger: the bytes of parameters, gradients and optimizer state a rank holds,
for any layout; chapter 02 prints it next to ZeRO's formulas (zero_report.py), 07 per rank."""

from typing import Dict, Iterable

import torch
from torch import nn


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly DTensor) tensor that lives on this rank."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def measure_memory(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, int]:
    """Bytes this rank holds now for parameters, gradients and optimizer state.

    Counts each storage once, whole (so padding and the full buffer behind a shard view are
    included); DTensors (FSDP2) count their local shard; scalar state (Adam's step) is left out.
    """

    def total(tensors: Iterable[torch.Tensor]) -> int:
        seen: Dict[int, int] = {}
        for t in tensors:
            storage = _local(t).untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    params = list(model.parameters())
    state = [
        v for s in optimizer.state.values() for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    ]
    return {
        "params": total(params),
        "grads": total(p.grad for p in params if p.grad is not None),
        "optimizer": total(state),
    }
