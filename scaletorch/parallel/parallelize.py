"""N-D parallelism: every strategy of chapters 01-06 applied to one model, in a fixed order.

``parallelize(model, cfg, pgm, device)`` converts the reference model in place and returns what
the Trainer needs. The order (as in torchtitan), and why:

    1 expert     shard each MoE layer's experts over "ep"; routing statistics over "dp_cp".
                 First: it needs the full stacked expert weights, and the MoE stays whole
                 under tensor parallel (experts are split over ep, not tp).
    2 tensor     split attention / MLP / embedding / head over "tp" (+ sequence parallel).
                 Before context parallel: ring attention then works on this rank's heads.
    3 context    swap each attention's ``attention_fn`` for ring (or Ulysses) attention over
                 "cp"; the step shards every sequence zigzag and passes the true positions.
    4 checkpoint recompute each block in backward (``--activation-checkpointing``). After the
                 strategies that change a block (its recompute re-runs their collectives),
                 before the pipeline cuts the blocks into stages.
    5 pipeline   keep this rank's stages over "pp"; the step is the pipeline schedule.
    6 data       last, because it must see exactly the parameters this rank holds (after the
                 tp shards and the pp cut): bucketed DDP over "dp_cp", ZeRO-1/2/3 over
                 "dp_cp", or for MoE models dense gradients over "dp_cp" and expert
                 gradients over "edp" (chapter 06).

Each rank holds: layers of its pp stage, tp shards of their matrices, ep shards of their
experts, s/cp tokens of B/dp sequences; ZeRO also shards what is left over dp_cp.

Gradient clipping is one rule for every layout (``grad_norm.world_grad_norm``): every gradient
element counted once, replicated copies divided by their number of replicas, one all-reduce
over the world. ``full_state_dict()`` gathers the reference-keyed weights on global rank 0;
``save_consolidated`` / ``load_consolidated`` write and read full weights *and* full AdamW
state, so a run saved at one layout resumes at any other.

``parallel.impl`` picks whose version runs, so each chapter's native comparison goes through
this same call (chapters 01-06 all use ``parallelize``):

    scaletorch  ours, by hand, every combination above
    naive       data parallel as one all-reduce per parameter after backward (chapter 01)
    torch       PyTorch's own, first match: FSDP2 ``fully_shard`` for zero_stage 3 (dp only);
                DTensor ``parallelize_module`` for tp > 1 without pp (tp = world size);
                torch.distributed.pipelining for pp > 1 (our tp inside, torch DDP over dp);
                else DistributedDataParallel over dp_cp (around our cp)

Not supported (ValueError): ZeRO with MoE (experts would need sharding over "edp"), sequence
parallel with MoE (tensor_parallel.py), impl torch or naive with MoE, naive with ZeRO, impl
torch with ZeRO-1/2 or ZeRO-3 beside other strategies, torch pipelining with cp.
MoE parity with the reference is exact with one micro-batch (moe.py: the load-balancing
statistics are per micro-batch, and a micro-batch of the parallel run holds other tokens).
"""

import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.checkpoint import checkpoint

from scaletorch.dist import comm, get_ledger
from scaletorch.dist.functional import gather_along_dim, split_along_dim
from scaletorch.models import Llama, loss_fn
from scaletorch.parallel.context_parallel import apply_context_parallel, make_sequence_sharder
from scaletorch.parallel.data_parallel import apply_data_parallel
from scaletorch.parallel.expert_parallel import (ExpertParallel, apply_expert_parallel,
                                                 validate_expert_parallel)
from scaletorch.parallel.fsdp import ShardedDataParallel, apply_fully_shard, llama_units
from scaletorch.parallel.grad_norm import clip_grads_, replica_count, world_grad_norm
from scaletorch.parallel.pipeline_parallel import (PipelineSchedule, TorchPipelineSchedule,
                                                   apply_data_parallel_to_chunks,
                                                   apply_pipeline_parallel,
                                                   gather_pipeline_state_dict)
from scaletorch.parallel.pipeline_schedules import validate_schedule
from scaletorch.parallel.step import ForwardBackward, make_data_parallel_step
from scaletorch.parallel.tensor_parallel import (apply_dtensor_tensor_parallel,
                                                 apply_tensor_parallel, dtensor_clip_grad_norm,
                                                 dtensor_loss_fn, tensor_parallel_loss_fn,
                                                 validate_tensor_parallel)
from scaletorch.parallel.zero import ZeroAdamW

State = Dict[str, torch.Tensor]
ORDER = ("expert", "tensor", "context", "activation checkpointing", "pipeline", "data")


@dataclass
class Parallelized:
    """What ``parallelize`` hands the Trainer (and the checks) for one layout.

    model: the Trainer's model (a data-parallel wrapper, or the pipeline's PipelineModel);
    forward_backward: the step (pipeline schedule, or the data-parallel step with the
    vocab-parallel loss and the sequence sharder); clip_grad_norm: the global-norm clip;
    optimizer: ZeRO's sharded AdamW, None for the Trainer's own; layout: where each reference
    tensor lives (``Layout`` for ours, ``DTensorLayout`` for PyTorch's FSDP2 / DTensor);
    full_state_dict(): collective, the reference-keyed full weights on global rank 0 (None
    elsewhere).
    """
    model: nn.Module
    forward_backward: ForwardBackward
    clip_grad_norm: Callable[[float], torch.Tensor]
    optimizer: Optional[torch.optim.Optimizer]
    layout: Union["Layout", "DTensorLayout"]

    def full_state_dict(self) -> Optional[State]:
        return self.layout.gather(lambda p: p.detach())


def validate_nd(cfg, pgm) -> None:
    """Raise ValueError, naming the numbers, for a combination that cannot run."""
    p, m = cfg.parallel, cfg.model
    tp, pp = pgm.tensor_model_parallel_world_size, pgm.pipeline_model_parallel_world_size
    dp_cp, ep = pgm.data_parallel_world_size_with_context, pgm.expert_model_parallel_world_size
    # under context parallel, sequence parallel splits the s/cp local tokens over tp
    validate_tensor_parallel(m, tp, p.sequence_parallel,
                             cfg.data.seq_len // pgm.context_parallel_world_size)
    validate_expert_parallel(m.num_experts, ep, dp_cp)
    if pp > 1 or p.virtual_pipeline_stages > 1:
        validate_schedule(p.schedule, pp, cfg.data.num_micro_batches, p.virtual_pipeline_stages)
    if m.num_experts > 0 and p.zero_stage > 0:
        raise ValueError(f"zero_stage ({p.zero_stage}) with mixture-of-experts "
                         f"(num_experts = {m.num_experts}) is not supported: ZeRO shards over "
                         f"dp_cp ({dp_cp}) but experts are replicated over edp "
                         f"({pgm.expert_data_parallel_world_size})")
    if m.num_experts > 0 and p.impl != "scaletorch":
        raise ValueError(f"parallel.impl {p.impl!r} has no mixture-of-experts (num_experts "
                         f"{m.num_experts}): expert parallel is ours only, impl 'scaletorch'")
    if p.zero_stage > 0 and p.impl == "naive":
        raise ValueError(f"parallel.impl 'naive' is plain data parallel, not ZeRO (zero_stage "
                         f"{p.zero_stage}): use impl 'scaletorch' or 'torch'")
    others = {"tp": tp, "pp": pp, "cp": pgm.context_parallel_world_size}
    if p.zero_stage > 0 and p.impl == "torch" and (p.zero_stage != 3 or max(others.values()) > 1):
        raise ValueError(f"parallel.impl 'torch' runs ZeRO as FSDP2 fully_shard, which is ZeRO-3 "
                         f"over data parallel alone; got zero_stage {p.zero_stage}, " +
                         ", ".join(f"{k} {v}" for k, v in others.items()))
    if p.impl == "torch" and pp > 1 and others["cp"] > 1:
        raise ValueError(f"torch.distributed.pipelining (impl 'torch', pp {pp}) cannot shard "
                         f"sequences for context parallel (cp {others['cp']}): use impl "
                         f"'scaletorch'")


class _Checkpointed:
    """A block's forward that keeps only its inputs and recomputes the rest in backward."""

    def __init__(self, forward: Callable) -> None:
        self.forward = forward

    def __call__(self, *args):
        return checkpoint(self.forward, *args, use_reentrant=False)


def apply_activation_checkpointing(model: Llama) -> Llama:
    """Checkpoint every transformer block: per block only its input (b, s, h) (and RoPE's
    cos/sin) stays alive between forward and backward; the block's forward runs again in
    backward, collectives included. Parameter names (state dicts) are unchanged."""
    for block in model.layers:
        if not isinstance(block.forward, _Checkpointed):
            block.forward = _Checkpointed(block.forward)
    return model


class _Saved:
    """What autograd holds in place of a saved tensor while ``saved_activation_bytes`` watches:
    the tensor, and (through a weakref finalizer) word of when autograd lets it go."""
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def saved_activation_bytes(model: nn.Module, fn: Callable[[], Any]) -> Tuple[int, Any]:
    """The most bytes of tensors autograd kept for backward at one time while ``fn()`` ran
    (distinct storages, parameters excluded), and fn's result: what activation checkpointing
    saves. For a forward alone that is everything it saved; for a whole step (forward and
    backward of several micro-batches, or a pipeline schedule) the peak, since backward frees
    what it used."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    live: Dict[int, List[int]] = {}  # storage address -> [bytes, saved tensors using it]
    current, peak = 0, 0

    def release(ptr: int) -> None:
        nonlocal current
        live[ptr][1] -= 1
        if live[ptr][1] == 0:
            current -= live.pop(ptr)[0]

    def pack(t: torch.Tensor) -> Any:
        nonlocal current, peak
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in params:
            return t
        entry = live.setdefault(ptr, [storage.nbytes(), 0])
        if entry[1] == 0:  # a storage counts once, however many saved views share it
            current += entry[0]
            peak = max(peak, current)
        entry[1] += 1
        saved = _Saved(t)
        weakref.finalize(saved, release, ptr)
        return saved

    def unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = fn()
    return peak, out


class _ZeroChunks(nn.Module):
    """What ZeroAdamW drives when a pipeline rank holds several ZeRO-wrapped chunks."""

    def __init__(self, wrappers: List[ShardedDataParallel]) -> None:
        super().__init__()
        self.wrappers = nn.ModuleList(wrappers)

    def finish_grad_sync(self) -> None:
        for w in self.wrappers:
            w.finish_grad_sync()

    def gather_params(self) -> None:
        for w in self.wrappers:
            w.gather_params()

    def zero_grad_buffers(self) -> None:
        for w in self.wrappers:
            w.zero_grad_buffers()


def _chunk_units(chunk: nn.Module):
    """ZeRO units of a pipeline chunk, in forward order: [embedding], its blocks, [head]."""
    units = [("embed_tokens", [("embed_tokens", chunk.embed_tokens)])] \
        if chunk.embed_tokens is not None else []
    units += [(f"layers.{i}", [(f"layers.{i}", layer)]) for i, layer in chunk.layers.items()]
    if chunk.lm_head is not None:
        units.append(("head", [("norm", chunk.norm), ("lm_head", chunk.lm_head)]))
    return units


class Layout:
    """Where every reference tensor lives on this rank: which optimizer parameter holds it and
    how it is split (tp dim, ep, a ZeRO unit's flat shard over dp_cp, a pipeline stage).

    ``gather(value_of)`` builds full reference-keyed tensors from one local tensor per optimizer
    parameter (the parameter, or an AdamW state of its shape); ``scatter(full)`` is the inverse,
    used to load a full optimizer state at any layout.
    """

    def __init__(self, pgm, splits: Dict[str, Tuple[Optional[int], bool]], entries: List[Any],
                 pipe=None) -> None:
        self.pgm, self.splits, self.pipe = pgm, splits, pipe
        # each entry: (optimizer parameter, [(names, shape, offset)], ZeRO unit or None)
        self.entries = entries

    @classmethod
    def record_splits(cls, model: nn.Module) -> Dict[str, Tuple[Optional[int], bool]]:
        """{reference name: (tp partition dim or None, is expert)}, read from the tags the
        strategies put on parameters, before wrappers and ZeRO hide them."""
        splits = {}
        for name, t in model.state_dict(keep_vars=True).items():
            tp_dim = t.partition_dim if getattr(t, "tensor_model_parallel", False) else None
            splits[name] = (tp_dim, bool(getattr(t, "expert_parallel", False)))
        return splits

    def params(self) -> List[torch.Tensor]:
        """The optimizer's parameters, one per entry (what AdamW keeps state for)."""
        return [param for param, _, _ in self.entries]

    @staticmethod
    def plain_entries(modules: List[nn.Module]) -> List[Any]:
        """One entry per parameter of ``modules``, with every name it has (tied weights)."""
        by_param: Dict[int, Tuple[torch.Tensor, List[str]]] = {}
        for module in modules:
            for name, t in module.state_dict(keep_vars=True).items():
                by_param.setdefault(id(t), (t, []))[1].append(name)
        return [(t, [(names, t.shape, 0)], None) for t, names in by_param.values()]

    @staticmethod
    def zero_entries(wrappers: List[ShardedDataParallel]) -> List[Any]:
        """One entry per ZeRO unit: its flat shard and the (names, shape, offset) of its pieces."""
        return [(u.shard, list(zip(u.names, u.shapes, u.offsets)), u) for w in wrappers
                for u in w.units]

    # ---- full <-> local, one tensor at a time ----------------------------------------------

    def _full(self, name: str, t: torch.Tensor) -> torch.Tensor:
        tp_dim, expert = self.splits[name]
        if expert:
            t = gather_along_dim(t, 0, self.pgm.expert_model_parallel_group)
        if tp_dim is not None:
            t = gather_along_dim(t, tp_dim, self.pgm.tensor_model_parallel_group)
        return t

    def _local(self, name: str, t: torch.Tensor) -> torch.Tensor:
        tp_dim, expert = self.splits[name]
        if expert:
            t = split_along_dim(t, 0, self.pgm.expert_model_parallel_group)
        if tp_dim is not None:
            t = split_along_dim(t, tp_dim, self.pgm.tensor_model_parallel_group)
        return t

    def gather(self, value_of: Callable[[torch.Tensor], torch.Tensor]) -> Optional[State]:
        """Collective over the world. {reference name: full fp32 tensor} on global rank 0."""
        ledger = get_ledger()
        enabled, ledger.enabled = ledger.enabled, False  # a check, not training traffic
        try:
            local: State = {}
            for param, pieces, unit in self.entries:
                value = value_of(param).detach()
                if unit is not None:  # the unit's flat vector: all-gather the shards over dp_cp
                    flat = value.new_empty(unit.padded_numel)
                    comm.all_gather_into_tensor(flat, value.contiguous(), unit.group)
                for names, shape, offset in pieces:
                    t = value if unit is None else flat[offset:offset + shape.numel()].view(shape)
                    full = self._full(names[0], t).float().clone()
                    local.update({n: full for n in names})
            if self.pipe is not None:
                local = gather_pipeline_state_dict(self.pipe, self.pgm, local)
        finally:
            ledger.enabled = enabled
        return local if self.pgm.rank == 0 else None

    def scatter(self, full: State) -> Dict[torch.Tensor, torch.Tensor]:
        """{optimizer parameter: this rank's part of ``full``} (no communication)."""
        out = {}
        for param, pieces, unit in self.entries:
            if unit is None:
                out[param] = self._local(pieces[0][0][0], full[pieces[0][0][0]]).clone()
                continue
            flat = torch.zeros(unit.padded_numel, dtype=param.dtype)
            for names, shape, offset in pieces:
                piece = self._local(names[0], full[names[0]])
                flat[offset:offset + shape.numel()] = piece.flatten()
            out[param] = flat[unit.rank * unit.shard_numel:][:unit.shard_numel].clone()
        return {p: t.to(p.device, p.dtype) for p, t in out.items()}

    def replicas(self) -> List[Tuple[torch.Tensor, Any]]:
        """(optimizer parameter, replicas) for ``world_grad_norm``: a count per parameter, or
        per element of a ZeRO shard (whose pieces are each tp-split or tp-replicated)."""
        tp = self.pgm.tensor_model_parallel_world_size
        out = []
        for param, pieces, unit in self.entries:
            if unit is None:
                out.append((param, replica_count(param, self.pgm)))
                continue
            counts = torch.ones(unit.padded_numel, device=param.device)  # padding: zero grads
            for names, shape, offset in pieces:
                counts[offset:offset + shape.numel()] = 1 if self.splits[names[0]][0] is not None \
                    else tp
            out.append((param, counts[unit.rank * unit.shard_numel:][:unit.shard_numel]))
        return out


class DTensorLayout:
    """Where every reference tensor lives under PyTorch's FSDP2 or DTensor tensor parallel:
    each parameter keeps its reference name and is a DTensor (its placements say how it is
    split) or a plain tensor replicated on every rank. Same contract as ``Layout``."""

    def __init__(self, pgm, model: nn.Module) -> None:
        self.pgm = pgm
        by_param: Dict[int, Tuple[torch.Tensor, List[str]]] = {}
        for name, t in model.state_dict(keep_vars=True).items():
            by_param.setdefault(id(t), (t, []))[1].append(name)
        self.entries = list(by_param.values())  # (parameter, its names: tied weights)

    def params(self) -> List[torch.Tensor]:
        return [param for param, _ in self.entries]

    def gather(self, value_of: Callable[[torch.Tensor], torch.Tensor]) -> Optional[State]:
        """Collective (DTensor's own all-gathers). {reference name: full fp32 tensor} on rank 0."""
        full_state: State = {}
        for param, names in self.entries:
            value = value_of(param).detach()
            full = value.full_tensor() if isinstance(value, DTensor) else value
            full_state.update({n: full.float().clone() for n in names})
        return full_state if self.pgm.rank == 0 else None

    def scatter(self, full: State) -> Dict[torch.Tensor, torch.Tensor]:
        """{parameter: this rank's part of ``full``}, as DTensors placed like the parameter."""
        out = {}
        for param, names in self.entries:
            t = full[names[0]].to(param.device, param.dtype)
            out[param] = distribute_tensor(t, param.device_mesh, param.placements) \
                if isinstance(param, DTensor) else t.clone()
        return out


def _in_loss_parallel(step: ForwardBackward) -> ForwardBackward:
    """DTensor's vocab-sharded cross-entropy (forward and backward) needs ``loss_parallel()``."""

    def run(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with loss_parallel():
            return step(inputs, targets)

    return run


def _parallelize_native(model: Llama, cfg, pgm) -> Parallelized:
    """impl torch, one native strategy alone: FSDP2 ``fully_shard`` for zero_stage 3 over
    data parallel, or DTensor ``parallelize_module`` for tensor parallel over the world."""
    p = cfg.parallel
    if p.activation_checkpointing:  # before the hooks that gather or redistribute parameters
        apply_activation_checkpointing(model)
    loss: Callable = loss_fn
    if p.zero_stage == 3:
        model = apply_fully_shard(model, pgm)
        params = list(model.parameters())

        def clip(max_norm: float) -> torch.Tensor:  # DTensor gradients: torch sums the shards
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
    else:
        model = apply_dtensor_tensor_parallel(model, pgm, p.sequence_parallel)
        loss, clip = dtensor_loss_fn, dtensor_clip_grad_norm(model, pgm)
    step = make_data_parallel_step(model, cfg.data.num_micro_batches, pgm.data_parallel_rank,
                                   pgm.data_parallel_world_size,
                                   pgm.data_parallel_group_with_context, loss)
    if p.zero_stage != 3:
        step = _in_loss_parallel(step)
    return Parallelized(model, step, clip, None, DTensorLayout(pgm, model))


def parallelize(model: Llama, cfg, pgm, device: torch.device) -> Parallelized:
    """Apply expert -> tensor -> context -> checkpointing -> pipeline -> data parallel to the
    reference ``model`` (built with the same seed on every rank), as ``cfg.parallel`` says.

    ``cfg``: the scaletorch Config; ``pgm``: the process-group manager of the same layout.
    """
    validate_nd(cfg, pgm)
    p, t = cfg.parallel, cfg.training
    model = model.to(device)
    tp, pp = pgm.tensor_model_parallel_world_size, pgm.pipeline_model_parallel_world_size
    if p.impl == "torch" and (p.zero_stage == 3 or (tp > 1 and pp == 1)):
        return _parallelize_native(model, cfg, pgm)
    loss, shard_sequence = loss_fn, None
    moe = cfg.model.num_experts > 0
    if moe:  # 1: experts over ep (also at ep 1: the load-balancing statistics over dp_cp)
        model = apply_expert_parallel(model, pgm).module
    if pgm.tensor_model_parallel_world_size > 1:  # 2
        apply_tensor_parallel(model, pgm, p.sequence_parallel)
        loss = tensor_parallel_loss_fn(pgm)
    if pgm.context_parallel_world_size > 1:  # 3
        apply_context_parallel(model, pgm, p.cp_variant)
        shard_sequence = make_sequence_sharder(pgm, cfg.data.seq_len)
    if p.activation_checkpointing:  # 4
        apply_activation_checkpointing(model)
    splits = Layout.record_splits(model)

    pipe, optimizer = None, None
    if pgm.pipeline_model_parallel_world_size > 1:  # 5
        pipe = apply_pipeline_parallel(model, pgm, p.virtual_pipeline_stages,
                                       sequence_parallel=p.sequence_parallel)
        modules = list(pipe.chunks)
    else:
        modules = [model]

    zero = []  # 6
    if p.zero_stage > 0:
        units = [_chunk_units(c) for c in modules] if pipe is not None else [llama_units(model)]
        zero = [
            ShardedDataParallel(c, u, pgm.data_parallel_group_with_context, p.zero_stage)
            for c, u in zip(modules, units)
        ]
        wrapped = zero
        optimizer = ZeroAdamW(zero[0] if len(zero) == 1 else _ZeroChunks(zero), t.lr,
                              (t.beta1, t.beta2), t.weight_decay)
        entries = Layout.zero_entries(zero)
    else:
        entries = Layout.plain_entries(modules)
        if moe:
            wrapped = [ExpertParallel(c, pgm) for c in modules]
        elif pipe is not None:
            wrapped = list(
                apply_data_parallel_to_chunks(pipe, pgm, p.impl, p.bucket_size_mb).chunks)
        elif pgm.data_parallel_world_size_with_context > 1:
            wrapped = [apply_data_parallel(model, pgm, p.impl, p.bucket_size_mb)]
        else:
            wrapped = [model]
    layout = Layout(pgm, splits, entries, pipe)

    if pipe is not None:
        pipe.chunks = nn.ModuleList(wrapped)
        trainer_model: nn.Module = pipe
        if p.impl == "torch":  # torch.distributed.pipelining over our chunks
            step: ForwardBackward = TorchPipelineSchedule(pipe, pgm, p.schedule,
                                                          cfg.data.num_micro_batches, loss)
        else:
            step = PipelineSchedule(pipe, pgm, p.schedule, cfg.data.num_micro_batches, loss,
                                    shard_sequence)
    else:
        trainer_model = wrapped[0]
        step = make_data_parallel_step(trainer_model, cfg.data.num_micro_batches,
                                       pgm.data_parallel_rank, pgm.data_parallel_world_size,
                                       pgm.data_parallel_group_with_context, loss, shard_sequence)

    replicas = layout.replicas()

    def clip_grad_norm(max_norm: float) -> torch.Tensor:
        for w in zero:
            w.finish_grad_sync()
        norm = world_grad_norm(replicas, device)  # one all-reduce of one number, world
        return clip_grads_([param for param, _ in replicas], max_norm, norm)

    return Parallelized(trainer_model, step, clip_grad_norm, optimizer, layout)


# ---- consolidated checkpoints: full weights and full AdamW state, any layout to any layout ----


def consolidated_state(trainer, par: Parallelized) -> Optional[Dict[str, Any]]:
    """Collective. {"step", "model", "optimizer": {"step", "exp_avg", "exp_avg_sq"},
    "scheduler"} with full reference-keyed tensors, on global rank 0 (None elsewhere)."""
    opt = trainer.optimizer
    # AdamW has state once it stepped; every rank must agree before the collective gathers
    params = par.layout.params()
    have_state = torch.tensor([float(all(p in opt.state for p in params))], device=params[0].device)
    ledger = get_ledger()
    enabled, ledger.enabled = ledger.enabled, False
    comm.all_reduce(have_state, op=torch.distributed.ReduceOp.MIN)
    ledger.enabled = enabled
    optim = None
    if have_state.item():
        first = opt.state[params[0]]
        optim = {"step": float(first["step"])}
        for key in ("exp_avg", "exp_avg_sq"):
            optim[key] = par.layout.gather(lambda p, key=key: opt.state[p][key])
    model = par.full_state_dict()
    if par.layout.pgm.rank != 0:
        return None
    return {
        "step": trainer.step,
        "model": model,
        "optimizer": optim,
        "scheduler": trainer.scheduler.state_dict(),
        "schedule": _schedule(trainer.cfg),
    }


SCHEDULE = ("steps", "lr", "min_lr", "warmup_steps")


def _schedule(cfg) -> Dict[str, float]:
    """The training fields the learning-rate schedule is a function of."""
    return {key: getattr(cfg.training, key) for key in SCHEDULE}


def save_consolidated(path: str, trainer, par: Parallelized) -> Optional[str]:
    """Gather (collective) and write one file from global rank 0, atomically."""
    state = consolidated_state(trainer, par)
    if state is not None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        torch.save(state, tmp)
        os.replace(tmp, path)
    comm.barrier()
    return path


def load_consolidated(path: str) -> Dict[str, Any]:
    """Read a consolidated checkpoint (every rank reads the whole file, on CPU)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"consolidated checkpoint {path!r} does not exist")
    return torch.load(path, map_location="cpu", weights_only=False)


def resume_consolidated(trainer, par: Parallelized, state: Dict[str, Any]) -> None:
    """Continue a consolidated checkpoint at this layout. The weights must already be in the
    model that ``parallelize`` sharded (``model.load_state_dict(state["model"])`` on the full
    model first); this sets each rank's part of the AdamW state, the schedule and the step."""
    opt = trainer.optimizer
    if state["optimizer"] is not None:
        exp_avg = par.layout.scatter(state["optimizer"]["exp_avg"])
        exp_avg_sq = par.layout.scatter(state["optimizer"]["exp_avg_sq"])
        for param in exp_avg:
            opt.state[param] = {
                "step": torch.tensor(state["optimizer"]["step"]),
                "exp_avg": exp_avg[param],
                "exp_avg_sq": exp_avg_sq[param],
            }
    trainer.scheduler.load_state_dict(state["scheduler"])
    for group, lr in zip(opt.param_groups, trainer.scheduler.get_last_lr()):
        group["lr"] = lr
    trainer.step = state["step"]
    saved, now = state.get("schedule"), _schedule(trainer.cfg)
    if saved is not None and saved != now and par.layout.pgm.rank == 0:
        differ = ", ".join(f"{k} {saved[k]} -> {now[k]}" for k in SCHEDULE if saved[k] != now[k])
        print(
            f"note: resuming a run whose schedule was {differ}: from step {trainer.step} the "
            f"learning rate follows this run's schedule, so the result differs from one "
            f"uninterrupted run of either config (and --check compares with this config's)",
            flush=True)


# ---- what chapter 07 prints: every rank's place, traffic and memory in one table -------------

GROUPS = ("tp", "cp", "dp_cp", "pp", "ep", "edp", "world")
COORDS = ("tp", "cp", "dp", "pp", "ep")


def rank_report(pgm, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> str:
    """Collective over the world: one row per rank with its coordinates, the bytes it put on
    the wire per group in ``step`` (the ledger) and the bytes it holds (params, grads, AdamW
    state). The same string on every rank."""
    from scaletorch.parallel.zero import measure_memory

    ledger = get_ledger()
    coords = pgm.grid.coordinates(pgm.rank)
    memory = measure_memory(model, optimizer)
    row = [coords[c] for c in COORDS]
    row += [ledger.total(group=g, step=step, field="wire_bytes") / 1e6 for g in GROUPS]
    row += [memory[k] / 1e6 for k in ("params", "grads", "optimizer")]
    mine = torch.tensor([row], dtype=torch.float64, device=next(model.parameters()).device)
    rows = mine.new_empty(pgm.world_size, len(row))
    enabled, ledger.enabled = ledger.enabled, False  # the report is not training traffic
    comm.all_gather_into_tensor(rows, mine)
    ledger.enabled = enabled
    head = (f"{'rank':>4} " + "".join(f"{c:>3}" for c in COORDS) + " |" + "".join(f"{g:>7}"
                                                                                  for g in GROUPS) +
            " | " + "".join(f"{k:>9}" for k in ("params", "grads", "adam", "total")))
    lines = [f"per rank, step {step}: coordinates | wire MB per group | memory MB", head]
    for r, values in enumerate(rows.tolist()):
        mem = values[-3:]
        lines.append(f"{r:>4} " + "".join(f"{int(v):>3}" for v in values[:len(COORDS)]) + " |" +
                     "".join(f"{v:>7.3f}" for v in values[len(COORDS):-3]) + " | " +
                     "".join(f"{v:>9.3f}" for v in mem + [sum(mem)]))
    return "\n".join(lines)
