"""What chapter 02 prints: ZeRO's formulas (zero.py's table) next to what the ledgers measured.

Bytes per rank (``memory_formula``: 16 Psi, ZeRO-1 8 Psi + 8 Psi/N, ZeRO-2 4 Psi + 12 Psi/N,
ZeRO-3 16 Psi/N) and elements per collective and step (``comm_formula``: all-gather Psi', or
2 m Psi' at stage 3 with m micro-batches; reduce-scatter Psi'), Psi' padded to multiples of N.
The planner (scaletorch/plan) predicts the same for whole layouts; tests check both.
"""

from typing import Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from scaletorch.dist import ProcessGroupManager, comm, get_ledger
from scaletorch.parallel.memory_report import memory_table


def memory_formula(zero_stage: int, numel: int, world: int,
                   element_size: int = 4) -> Dict[str, float]:
    """Bytes per rank for ``numel`` parameters over N = ``world`` ranks (table above; stage 0
    is plain data parallel). Exact integers when N divides ``numel`` (pass the padded P')."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {zero_stage}")
    psi = numel * element_size
    shard = psi // world if psi % world == 0 else psi / world
    return {
        "params": shard if zero_stage == 3 else psi,
        "grads": shard if zero_stage >= 2 else psi,
        "optimizer": 2 * shard if zero_stage >= 1 else 2 * psi,
    }


def comm_formula(zero_stage: int, numel: int, num_micro_batches: int = 1) -> Dict[str, int]:
    """Elements each ZeRO collective carries per step (the full flat size, as the ledger
    records it; table above)."""
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"zero_stage must be 1, 2 or 3, got {zero_stage}")
    gathers = 2 * num_micro_batches if zero_stage == 3 else 1
    return {"all_gather": gathers * numel, "reduce_scatter": numel}


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer, zero_stage: int, numel: int,
                  padded_numel: int, group: Optional[dist.ProcessGroup], name: str = "") -> str:
    """Every rank's memory ledger next to ZeRO's formula (``memory_table``: collective over
    ``group``, the same table on every rank). ``name`` labels the table (default: the stage)."""
    n = comm.group_size(group)
    symbols = ("4Psi 4Psi 8Psi 16Psi", "4Psi 4Psi 8Psi/N 8Psi+8Psi/N",
               "4Psi 4Psi/N 8Psi/N 4Psi+12Psi/N", "4Psi/N 4Psi/N 8Psi/N 16Psi/N")[zero_stage]
    name = name or (f"ZeRO-{zero_stage}" if zero_stage else "baseline")
    return memory_table(
        model, optimizer, group, f"memory per rank, bytes ({name}, N = {n}, Psi = {numel:,}, "
        f"Psi' = {padded_numel:,} with padding to multiples of N)",
        memory_formula(zero_stage, padded_numel, n), symbols.split(),
        "   + units in flight" if zero_stage == 3 else "")


def comm_report(zero_stage: int, padded_numel: int, num_micro_batches: int, world: int,
                step: int) -> str:
    """The ledger's all-gather and reduce-scatter volume of ``step`` next to the formula (fp32:
    4 bytes per element)."""
    ledger = get_ledger()
    formula = comm_formula(zero_stage, padded_numel, num_micro_batches)
    measured = {op: int(ledger.total(op=op, step=step)) for op in formula}
    wire = sum(ledger.total(op=op, step=step, field="wire_bytes") for op in formula)
    expected_wire = sum(formula.values()) * 4 * (world - 1) / world
    gathers = "Psi'" if zero_stage < 3 else f"2 x {num_micro_batches} x Psi'"
    return (f"formula, step {step}: all-gather {gathers} = {formula['all_gather']:,} elements "
            f"(measured {measured['all_gather']:,}), reduce-scatter Psi' = "
            f"{formula['reduce_scatter']:,} (measured {measured['reduce_scatter']:,}); on the "
            f"wire (N-1)/N x 4 B each: {expected_wire / 1e6:.3f} MB (measured {wire / 1e6:.3f})")


def zero_report(model: nn.Module, optimizer: torch.optim.Optimizer, pgm: ProcessGroupManager,
                zero_stage: int, impl: str, num_micro_batches: int, numel: int, step: int) -> str:
    """What chapter 02 prints after training. Collective over the data-parallel group (the
    memory table gathers every rank's row); the text on its rank 0, "" elsewhere: the ledger's
    table of ``step``, the all-gather and reduce-scatter volume next to the formula, and every
    rank's memory next to the formula. ``numel``: Psi of the unsharded model; ``impl``
    "torch": FSDP2, whose collectives the ledger does not see."""
    group = pgm.gradient_sync_group
    padded = getattr(model, "padded_numel", numel)  # FSDP2 does not pad
    label = "FSDP2 fully_shard" if impl == "torch" else ""  # its formula is ZeRO-3's
    memory = memory_report(model, optimizer, zero_stage, numel, padded, group, label)
    if comm.group_rank(group) != 0:
        return ""
    lines = [get_ledger().table(step=step)]
    if impl == "torch":
        lines.append("(fully_shard and clip_grad_norm_ call the backend directly: their "
                     "collectives are not in the ledger, only the loss all-reduce is)")
    else:
        lines.append(
            comm_report(zero_stage, padded, num_micro_batches, comm.group_size(group), step))
    return "\n".join(lines + [memory])
