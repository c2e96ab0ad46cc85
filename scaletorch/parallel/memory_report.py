"""The memory ledger: the bytes of parameters, gradients and optimizer state each rank holds.

``measure_memory`` counts them on this rank, for any layout; ``memory_table`` prints every
rank's next to a formula: 16 Psi for data parallel (chapter 01), ZeRO's stages (chapter 02,
zero_report.py). Chapter 07 prints them per rank beside the traffic.
"""

from typing import Dict, Iterable, Optional, Sequence, Set

import torch
import torch.distributed as dist
from torch import nn

from scaletorch.dist import comm, get_ledger


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly DTensor) tensor that lives on this rank."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def storage_key(tensor: torch.Tensor) -> int:
    """One number per storage, shared by its views: the storage object's address, not its
    data's (a fake tensor's storage has none: every data pointer is 0 in a dry run)."""
    return local_part(tensor).untyped_storage()._cdata


def measure_memory(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, int]:
    """Bytes this rank holds now for parameters, gradients and optimizer state. Each storage
    counts once, whole (so padding and the full buffer behind a shard view are included), with
    the first kind that holds it; DTensors (FSDP2) count their local shard; scalar state (Adam's
    step) is left out. (The dry run splits them by dtype: trainer/memory_by_dtype.py.)"""
    seen: Set[int] = set()

    def held(tensors: Iterable[torch.Tensor]) -> int:
        new = {storage_key(t): local_part(t).untyped_storage().nbytes() for t in tensors}
        new = {key: n for key, n in new.items() if key not in seen}
        seen.update(new)
        return sum(new.values())

    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values()]
    return {
        "params": held(params),
        "grads": held(p.grad for p in params if p.grad is not None),
        "optimizer": held(v for v in state if torch.is_tensor(v) and v.dim() > 0)
    }


KINDS = ("params", "grads", "optimizer", "peak_gathered")


def memory_table(model: nn.Module, optimizer: torch.optim.Optimizer,
                 group: Optional[dist.ProcessGroup], title: str, formula: Dict[str, float],
                 symbols: Sequence[str], note: str = "") -> str:
    """Collective over ``group``: each rank's ``measure_memory`` (gathered) and, under them, the
    ``formula`` bytes and its ``symbols`` (params, grads, optimizer, total). The same table on
    every rank. "peak gathered", a column when a rank's ZeRO wrapper tracks it (chapter 02 on):
    the most bytes of full parameters it held at once (0 in stages 1, 2, which keep them all)."""
    mine = measure_memory(model, optimizer)
    mine["peak_gathered"] = getattr(model, "peak_gathered_bytes", -1)  # -1: not tracked
    row = torch.tensor([[mine[k] for k in KINDS]], dtype=torch.float64,
                       device=next(model.parameters()).device)
    rows = row.new_empty(comm.group_size(group), len(KINDS))
    with get_ledger().paused():  # bookkeeping, not the strategy's traffic
        comm.all_gather_into_tensor(rows, row, group)
    tracked = bool((rows[:, 3] >= 0).any())
    lines = [
        title, f"{'rank':<10}{'params':>12}{'grads':>12}{'optimizer':>12}{'total':>14}" +
        (f"{'peak gathered':>16}" if tracked else "")
    ]
    for r, values in enumerate(rows.tolist()):
        peak = f"{int(values[3]):,}" if values[3] >= 0 else "-"
        lines.append(f"{r:<10}" + "".join(f"{int(v):>12,}" for v in values[:3]) +
                     f"{int(sum(values[:3])):>14,}" + (f"{peak:>16}" if tracked else ""))
    total = sum(formula[k] for k in KINDS[:3])
    lines.append(f"{'formula':<10}" + "".join(f"{int(formula[k]):>12,}"
                                              for k in KINDS[:3]) + f"{int(total):>14,}")
    lines.append(f"{'':<10}" + "".join(f"{s:>12}"
                                       for s in symbols[:3]) + f"{symbols[3]:>14}" + note)
    return "\n".join(lines)
