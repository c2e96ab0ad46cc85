"""ZeRO's ledgers: the bytes and elements the formulas predict, and what a run measures.

Memory per rank (``memory_formula``, fp32: 4 bytes per element) and the elements each collective
carries per step (``comm_formula``) for the ZeRO stages of zero.py; ``measure_memory`` counts the
tensors a rank actually holds, ``memory_report`` and ``comm_report`` print both side by side.
"""

from typing import TYPE_CHECKING, Dict, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from scaletorch.dist import ProcessGroupManager, comm, get_ledger
from scaletorch.parallel.mixed_precision import MixedPrecisionPolicy
from scaletorch.plan.memory import memory_formula
# the formulas live with the planner (scaletorch/plan), which predicts whole layouts with them
from scaletorch.plan.traffic import zero_comm_elements as comm_formula

if TYPE_CHECKING:  # the config module imports scaletorch.parallel
    from scaletorch.config import Config


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


KINDS = ("params", "grads", "optimizer", "peak_gathered")


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer, zero_stage: int, numel: int,
                  padded_numel: int, group: Optional[dist.ProcessGroup]) -> str:
    """The memory ledger of every rank of ``group`` (gathered over it) next to the formula.

    Collective over ``group``; returns the same table on every rank. ``peak_gathered`` is the
    most bytes of full parameters our stage-3 wrapper held at once (0 in stages 1, 2: they
    keep the full parameters anyway; "-" for FSDP2, which we do not track).
    """
    mine = measure_memory(model, optimizer)
    mine["peak_gathered"] = getattr(model, "peak_gathered_bytes", -1)  # -1: not tracked
    row = torch.tensor([[mine[k] for k in KINDS]], dtype=torch.float64,
                       device=next(model.parameters()).device)
    rows = row.new_empty(comm.group_size(group), len(KINDS))
    with get_ledger().paused():  # bookkeeping, not the strategy's traffic
        comm.all_gather_into_tensor(rows, row, group)
    n = comm.group_size(group)
    formula = memory_formula(zero_stage, padded_numel, n)
    names = {0: "baseline", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
    *symbols, total_symbol = {
        0: ("4Psi", "4Psi", "8Psi", "16Psi"),
        1: ("4Psi", "4Psi", "8Psi/N", "8Psi+8Psi/N"),
        2: ("4Psi", "4Psi/N", "8Psi/N", "4Psi+12Psi/N"),
        3: ("4Psi/N", "4Psi/N", "8Psi/N", "16Psi/N"),
    }[zero_stage]
    lines = [
        f"memory per rank, bytes ({names[zero_stage]}, N = {n}, Psi = {numel:,}, "
        f"Psi' = {padded_numel:,} with padding to multiples of N)",
        f"{'rank':<10}{'params':>12}{'grads':>12}{'optimizer':>12}{'total':>14}"
        f"{'peak gathered':>16}",
    ]
    for r, values in enumerate(rows.tolist()):
        peak = f"{int(values[3]):,}" if values[3] >= 0 else "-"
        lines.append(f"{r:<10}" + "".join(f"{int(v):>12,}" for v in values[:3]) +
                     f"{int(sum(values[:3])):>14,}{peak:>16}")
    total = sum(formula.values())
    lines.append(f"{'formula':<10}" + "".join(f"{int(formula[k]):>12,}"
                                              for k in KINDS[:3]) + f"{int(total):>14,}")
    lines.append(f"{'':<10}" + "".join(f"{s:>12}" for s in symbols) + f"{total_symbol:>14}" +
                 ("   + units in flight" if zero_stage == 3 else ""))
    return "\n".join(lines)


def comm_report(zero_stage: int, padded_numel: int, num_micro_batches: int, world: int, step: int,
                policy: Optional[MixedPrecisionPolicy] = None) -> str:
    """The ledger's all-gather and reduce-scatter volume of ``step`` next to the formula; the
    bytes per element are the policy's (chapter 08): stage 3 gathers in ``param_dtype``,
    stages 1, 2 gather the fp32 masters, all reduce-scatter in ``reduce_dtype``."""
    ledger = get_ledger()
    formula = comm_formula(zero_stage, padded_numel, num_micro_batches)
    measured = {op: int(ledger.total(op=op, step=step)) for op in formula}
    wire = sum(ledger.total(op=op, step=step, field="wire_bytes") for op in formula)
    p = policy or MixedPrecisionPolicy()
    size = {
        "all_gather": p.param_dtype.itemsize if zero_stage == 3 else 4,
        "reduce_scatter": p.reduce_dtype.itemsize
    }
    expected_wire = sum(n * size[op] for op, n in formula.items()) * (world - 1) / world
    gather, reduce = size["all_gather"], size["reduce_scatter"]
    each = f"{gather} B each" if gather == reduce else \
        f"{gather} B (all-gather) and {reduce} B (reduce-scatter)"
    gathers = "Psi'" if zero_stage < 3 else f"2 x {num_micro_batches} x Psi'"
    return (f"formula, step {step}: all-gather {gathers} = {formula['all_gather']:,} elements "
            f"(measured {measured['all_gather']:,}), reduce-scatter Psi' = "
            f"{formula['reduce_scatter']:,} (measured {measured['reduce_scatter']:,}); on the "
            f"wire (N-1)/N x {each}: {expected_wire / 1e6:.3f} MB (measured {wire / 1e6:.3f})")


def zero_report(model: nn.Module, optimizer: torch.optim.Optimizer, cfg: "Config",
                pgm: ProcessGroupManager, numel: int, step: int) -> str:
    """What chapter 02 prints after training. Collective over the data-parallel group (the
    memory table gathers every rank's row); the text on its rank 0, "" elsewhere: the ledger's
    table of ``step``, the all-gather and reduce-scatter volume next to the formula, and every
    rank's memory next to the formula. ``numel``: Psi of the unsharded model."""
    from scaletorch.parallel.mixed_precision import policy_for as run_policy
    p, group = cfg.parallel, pgm.data_parallel_group_with_context
    mp = run_policy(cfg, next(model.parameters()).device.type)
    padded = getattr(model, "padded_numel", numel)  # FSDP2 does not pad
    memory = memory_report(model, optimizer, p.zero_stage, numel, padded, group)
    if comm.group_rank(group) != 0:
        return ""
    lines = [get_ledger().table(step=step)]
    if p.impl == "torch":
        lines.append("(fully_shard calls the backend directly: its collectives are not in the "
                     "ledger, only the loss and norm all-reduces are)")
    else:
        lines.append(
            comm_report(p.zero_stage, padded, cfg.data.num_micro_batches, comm.group_size(group),
                        step, mp))
    return "\n".join(lines + [memory])
