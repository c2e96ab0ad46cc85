"""ZeRO building blocks: flat units of parameters, their shards, the sharded AdamW, the ledgers.

ZeRO (Rajbhandari et al., 2020) removes the redundancy of data parallel over the N ranks of
``pgm.data_parallel_group_with_context``. The parameters of one *unit* (the embedding, one
transformer block, the head) are laid end to end in a flat vector of P elements, padded with
zeros to P' = N * ceil(P / N) so that it cuts into N equal shards of S = P' / N elements:

    flat   | shard 0 | shard 1 | ... | shard N-1 |pad|        rank r owns shard r: it keeps
             rank 0    rank 1          rank N-1               the Adam state for it, updates it

What else a rank keeps is the stage (fp32 everywhere, 4 bytes per element, Psi parameters):

    stage     params       grads          Adam state     bytes per rank
    0 (DDP)   full         full           full           4Psi + 4Psi + 8Psi      = 16 Psi
    1         full         full           shard          4Psi + 4Psi + 8Psi/N
    2         full         shard          shard          4Psi + (4Psi + 8Psi)/N
    3         shard        shard          shard          16 Psi/N  (+ gathered units in flight)

Communication per step (elements of the flat vectors; a ring puts (N-1)/N of each on the wire):
stages 1, 2 reduce-scatter the gradients and all-gather the updated parameters: 2 Psi, the same
as DDP's all-reduce. Stage 3 all-gathers each unit before its forward and again before its
backward, and reduce-scatters its gradients: 3 Psi. With m micro-batches, stage 3 gathers
2 m Psi (the gradients are still reduced once, after the last micro-batch).
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from scaletorch.dist import comm, get_ledger

NamedModules = Sequence[Tuple[str, nn.Module]]  # (name inside the model, module)


class FlatUnit:
    """Some modules' parameters as one flat vector of P' elements, and this rank's shard.

    Each parameter is replaced in its module by a plain leaf tensor that lives on the storage
    of ``self.flat`` (same shape, requires grad), so writing ``flat`` (an all-gather) sets every
    parameter, and resizing its storage to 0 frees them all (stage 3) even while autograd still
    holds views of them (``weight.t()`` saved by a matmul). ``shard`` (S elements, a Parameter)
    is what the optimizer updates: a view of ``flat`` when the full parameters stay (stages 1,
    2), its own tensor otherwise (stage 3). Stage 1 also keeps a full flat gradient buffer that
    the parameters' ``.grad`` are views of, so backward accumulates into it in place.
    """

    def __init__(self, name: str, modules: NamedModules, group: Optional[dist.ProcessGroup],
                 zero_stage: int) -> None:
        self.name, self.group, self.zero_stage = name, group, zero_stage
        self.modules = [module for _, module in modules]
        self.world, self.rank = comm.group_size(group), comm.group_rank(group)
        # Every distinct parameter once, with every (module, attribute, name) that holds it.
        found: Dict[int, Tuple[nn.Parameter, List[Tuple[nn.Module, str, str]]]] = {}
        for prefix, module in modules:
            for sub_name, sub in module.named_modules(prefix=prefix):
                for attr, param in sub._parameters.items():
                    if param is not None:
                        found.setdefault(id(param), (param, []))[1].append(
                            (sub, attr, f"{sub_name}.{attr}"))
        if not found:
            raise ValueError(f"unit {name!r} has no parameters")
        params = [param for param, _ in found.values()]
        self.names = [[fqn for _, _, fqn in holders] for _, holders in found.values()]
        self.shapes = [p.shape for p in params]
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.numel = self.offsets[-1]  # P
        self.shard_numel = -(-self.numel // self.world)  # S = ceil(P / N)
        self.padded_numel = self.shard_numel * self.world  # P'
        first = params[0]
        self.flat = torch.zeros(self.padded_numel, dtype=first.dtype, device=first.device)
        self.tensors: List[torch.Tensor] = []
        storage = self.flat.untyped_storage()
        for param, (_, holders), start in zip(params, found.values(), self.offsets):
            self.flat[start:start + param.numel()].copy_(param.detach().reshape(-1))
            # set_ (not a view): the tensor shares flat's storage but not its version counter,
            # so re-gathering flat between forward and backward is not an in-place error.
            tensor = torch.empty(0, dtype=first.dtype, device=first.device).set_(
                storage, start, param.shape).requires_grad_(param.requires_grad)
            for sub, attr, _ in holders:
                del sub._parameters[attr]  # the module keeps a plain tensor, not a Parameter
                setattr(sub, attr, tensor)
            self.tensors.append(tensor)
        self.trainable = sum(t.requires_grad for t in self.tensors)
        own = self.flat[self.rank * self.shard_numel:(self.rank + 1) * self.shard_numel]
        self.shard = nn.Parameter(own if zero_stage < 3 else own.clone())
        self.flat_grad: Optional[torch.Tensor] = None
        if zero_stage == 1:
            self.flat_grad = torch.zeros_like(self.flat)
            for tensor, start in zip(self.tensors, self.offsets):
                if tensor.requires_grad:
                    tensor.grad = self.flat_grad[start:start + tensor.numel()].view(tensor.shape)
        if zero_stage == 3:
            self.free()

    @property
    def gathered_bytes(self) -> int:
        """Bytes of full parameters this unit holds right now (0 when freed)."""
        return self.flat.untyped_storage().nbytes()

    def gather(self, async_op: bool = False):
        """All-gather every rank's shard into ``flat`` over the group: (S,) -> (P',)."""
        if self.gathered_bytes == 0:
            self.flat.untyped_storage().resize_(self.padded_numel * self.flat.element_size())
        source = self.shard.detach()
        if self.zero_stage < 3:
            source = source.clone()  # the shard is a slice of flat: do not alias in and out
        return comm.all_gather_into_tensor(self.flat, source, self.group, async_op=async_op)

    def free(self) -> None:
        """Drop the full parameters (stage 3); every tensor on flat's storage goes with it."""
        self.flat.untyped_storage().resize_(0)

    def reduce_grads(self) -> Tuple[object, object]:
        """Start the reduce-scatter of this unit's gradients over the group: (P',) -> (S,).

        Gradients are averaged (divided by N), so the shard's gradient is that of the global
        mean loss. Returns (work, finish); call ``finish()`` after ``work.wait()``. Stages 2, 3
        free the full gradients here; stage 1 keeps them (its flat gradient buffer).
        """
        if self.flat_grad is not None:
            full = self.flat_grad
        else:
            pieces = [
                t.grad.reshape(-1) if t.grad is not None else self.flat.new_zeros(t.numel())
                for t in self.tensors
            ]
            pieces.append(self.flat.new_zeros(self.padded_numel - self.numel))
            full = torch.cat(pieces)  # (P',)
            for tensor in self.tensors:
                tensor.grad = None
        full.div_(self.world)
        out = torch.empty_like(self.shard)
        work = comm.reduce_scatter_tensor(out, full, self.group, async_op=True)

        def finish(full=full, out=out) -> None:  # full stays alive until the work is done
            if self.flat_grad is not None:
                own = self.flat_grad[self.rank * self.shard_numel:(self.rank + 1) *
                                     self.shard_numel]
                own.copy_(out)
                self.shard.grad = own  # still one full gradient buffer (4 Psi), as stage 1 says
            elif self.shard.grad is None:
                self.shard.grad = out
            else:
                self.shard.grad += out

        return work, finish

    def zero_grad(self) -> None:
        """Stage 1: zero the flat gradient buffer in place (the parameters' grads view it)."""
        if self.flat_grad is not None:
            self.flat_grad.zero_()
        else:
            for tensor in self.tensors:
                tensor.grad = None

    def all_gather_flat(self, shard: torch.Tensor) -> torch.Tensor:
        """A new (P',) vector of every rank's (S,) ``shard`` (the parameters' shard, or an AdamW
        state shaped like it), all-gathered over the group: how ``Layout`` un-shards a unit."""
        flat = shard.new_empty(self.padded_numel)
        comm.all_gather_into_tensor(flat, shard.detach().contiguous(), self.group)
        return flat


class ZeroAdamW(torch.optim.AdamW):
    """torch.optim.AdamW over this rank's shards: the same arithmetic, 1/N of the state.

    ``model`` is the ZeRO wrapper (``ShardedDataParallel``). ``step()`` first finishes any
    gradient sync still in flight, updates the shards, then (stages 1, 2) all-gathers them into
    every rank's full parameters. ``zero_grad()`` also clears the wrapper's full gradients.
    """

    def __init__(self, model: nn.Module, lr: float, betas: Tuple[float, float], weight_decay: float,
                 eps: float = 1e-8) -> None:
        super().__init__(list(model.parameters()), lr=lr, betas=betas, eps=eps,
                         weight_decay=weight_decay)
        self.model = model

    @torch.no_grad()
    def step(self, closure=None):
        self.model.finish_grad_sync()
        loss = super().step(closure)
        self.model.gather_params()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.model.zero_grad_buffers()


# ---- the ledgers ----------------------------------------------------------------------------


def memory_formula(zero_stage: int, numel: int, world: int,
                   element_size: int = 4) -> Dict[str, float]:
    """Bytes per rank the formulas predict for ``numel`` parameters (Psi) over N = ``world``.

    Stage 0 is plain data parallel (16 Psi). Exact integers when N divides ``numel`` (pass the
    padded count P' to compare with a measurement).
    """
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
    """Elements each collective carries per step (the full flat size, as the ledger records).

    A ring moves (N-1)/N of them per rank. Stages 1, 2: reduce-scatter + all-gather of Psi;
    stage 3: all-gather 2 m Psi (forward and backward of m micro-batches) + reduce-scatter Psi.
    """
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"zero_stage must be 1, 2 or 3, got {zero_stage}")
    gathers = 2 * num_micro_batches if zero_stage == 3 else 1
    return {"all_gather": gathers * numel, "reduce_scatter": numel}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly DTensor) tensor that lives on this rank."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def measure_memory(model: nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, int]:
    """Bytes this rank holds now for parameters, gradients and optimizer state.

    Counts each storage once, whole (so padding and the full buffer behind a shard view are
    included); DTensors (FSDP2) count their local shard; scalar state (Adam's step) is left out.
    """

    def total(tensors) -> int:
        seen = {}
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


def comm_report(zero_stage: int, padded_numel: int, num_micro_batches: int, world: int,
                step: int) -> str:
    """The ledger's all-gather and reduce-scatter volume of ``step`` next to the formula."""
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
