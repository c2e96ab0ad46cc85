"""The bytes each rank holds by kind and dtype: what the dry run prints (trainer/dry_run.py).

Chapter 01's memory ledger (parallel/memory_report.py's ``measure_memory``) counts bytes by
kind; the dry run, whose fake tensors hold no data, also splits them by dtype, and counts the
buffers.
"""

from typing import Dict, Iterable

import torch
from torch import nn

from scaletorch.parallel.memory_report import local_part, storage_key


def memory_by_dtype(model: nn.Module,
                    optimizer: torch.optim.Optimizer) -> Dict[str, Dict[torch.dtype, int]]:
    """Bytes this rank holds now, by kind (params, grads, optimizer, buffers) and dtype.

    Counts each storage once, whole (so padding and the full buffer behind a shard view are
    included); DTensors (FSDP2) count their local shard; scalar state (Adam's step) is left out.
    Buffers (RoPE's tables, say) whose storage a parameter shares count with the parameters.
    """
    seen: Dict[int, str] = {}
    out: Dict[str, Dict[torch.dtype, int]] = {}

    def add(kind: str, tensors: Iterable[torch.Tensor]) -> None:
        mine = out.setdefault(kind, {})
        for t in tensors:
            key = storage_key(t)
            if key in seen:
                continue
            seen[key] = kind
            storage = local_part(t).untyped_storage()
            mine[t.dtype] = mine.get(t.dtype, 0) + storage.nbytes()

    params = list(model.parameters())
    add("params", params)
    add("grads", [p.grad for p in params if p.grad is not None])
    add("optimizer", [
        v for s in optimizer.state.values()
        for v in s.values() if torch.is_tensor(v) and v.dim() > 0
    ])
    add("buffers", model.buffers())
    return out
