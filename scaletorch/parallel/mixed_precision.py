"""Mixed precision, one policy for every strategy: which dtype is kept, gathered, reduced.

In the spirit of FSDP2's ``MixedPrecisionPolicy``. The master weights and AdamW's m and v are
fp32 always (an update of lr x 1e-3 is below bf16's resolution of a weight near 1: it would be
lost); the forward and backward compute in the autocast dtype (``training.precision``); and

    param_dtype    the dtype ZeRO-3 all-gathers a unit's parameters in: a copy of the fp32
                   shard cast to it, so the gather moves 2 bytes per element instead of 4, and
                   the unit then computes with those weights (fp32 or the compute dtype; the
                   default "auto" is the compute dtype). Why the compute dtype: a unit gathered
                   in fp32 under bf16 autocast has autocast cast each weight to bf16, and
                   autograd saves those copies for backward, outside the unit's flat buffer
                   that ZeRO-3 frees: 2 bytes per parameter of every unit stay until its
                   backward (autocast's cache kept them to the end of the step until each unit
                   turned it off). Gathered in bf16, there is nothing to cast: what backward
                   saves lives on the flat buffer, freed after the unit and gathered again.
    reduce_dtype   the dtype gradients cross the wire in: DDP (naive and bucketed) casts its
                   fp32 gradients (or bucket) to it, all-reduces, and casts the average back
                   into the fp32 gradients; ZeRO-1/2/3 reduce-scatter in it

Gradients are accumulated in fp32 (DDP's buckets, ZeRO-1's flat buffer, every shard's .grad):
micro-batches add up there, and the optimizer reads fp32. Only the wire is low precision.

The policy attaches from here to chapters 01 and 02: DDP reduces in ``reduce_dtype`` through
its subclasses (``apply_data_parallel_in``, ddp_reduce_dtype.py; torch's DDP: a comm hook),
ZeRO through its units (zero_mixed_precision.py) with ``disable_autocast_cache_per_unit``, and
FSDP2 its ``mp_policy`` (``fsdp_mp_policy``).

fp16 (5 exponent bits, largest finite 65504, smallest normal 6e-5) needs a loss scale: the
gradients of a loss of ~4 are often below 6e-5 and would flush to zero. ``DynamicLossScaler``
multiplies the loss by S before backward and divides the gradients by S after; a step whose
gradients hold an inf or NaN is skipped and S halved; after ``growth_interval`` clean steps S
doubles. The overflow flag is all-reduced (MAX) over every rank that holds gradients: under
ZeRO or tensor / pipeline / expert parallel each rank sees only its own gradients, and a rank
that skipped alone would leave the replicas different forever. bf16 has fp32's exponent range
(8 bits): its gradients do not underflow, so it needs no scale.
"""

import warnings
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterable, List, Optional, Tuple, Type, cast

import torch
import torch.distributed as dist
from torch import nn

from scaletorch.config import Config, resolve_precision
from scaletorch.dist import ProcessGroupManager
from scaletorch.parallel.ddp_reduce_dtype import apply_data_parallel_in
from scaletorch.parallel.expert_parallel import AllToAllDispatcher
from scaletorch.parallel.loss_scale import unscale_and_check, update_scale
from scaletorch.parallel.moe_pipeline import MoELossInPipeline
from scaletorch.parallel.pipeline_runtime import LossFn, PipelineSchedule, StageHooks
from scaletorch.parallel.tensor_parallel_layers import ParallelRMSNorm, VocabParallelEmbedding
from scaletorch.parallel.zero_mixed_precision import W, zero_in_dtypes

if TYPE_CHECKING:  # FSDP2's own class, imported only where FSDP2 runs (its import costs ~0.4 s)
    from torch.distributed.fsdp import MixedPrecisionPolicy as FSDPMixedPrecision

# fp64 is named only to be refused (wider than the master)
DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
MASTER = torch.float32  # master weights, optimizer state and accumulated gradients


def dtype_of(name: str, key: str) -> torch.dtype:
    """The torch dtype of ``name`` ("fp32", "bf16", "fp16"), for the config field ``key``."""
    if name not in DTYPES:
        raise ValueError(f"{key} must be one of fp32, bf16, fp16, got {name!r}")
    return DTYPES[name]


def supports_fp16(device_type: str) -> bool:
    """Whether autocast computes in fp16 on this device type (asked, not assumed: torch
    warns and disables autocast for a dtype a device does not support)."""
    from torch.amp.autocast_mode import is_autocast_available
    if not is_autocast_available(device_type):
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autocast(device_type, dtype=torch.float16):
            return torch.is_autocast_enabled(device_type)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """The dtypes a strategy gathers parameters in and reduces gradients in (see the module
    docstring). The default, fp32 for both, is exactly what the strategies did before."""
    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32

    @classmethod
    def of(cls, param_dtype: str, reduce_dtype: str,
           compute: str = "fp32") -> "MixedPrecisionPolicy":
        """The policy of two dtype names (``parallel.param_dtype``, ``parallel.reduce_dtype``),
        already checked together with the precision by ``from_names`` (config validation);
        param_dtype "auto" is ``compute`` (the resolved ``training.precision``)."""
        param_dtype = compute if param_dtype == "auto" else param_dtype
        return cls(dtype_of(param_dtype, "parallel.param_dtype"),
                   dtype_of(reduce_dtype, "parallel.reduce_dtype"))

    @classmethod
    def from_names(cls, compute: str, param_dtype: str = "fp32", reduce_dtype: str = "fp32",
                   device_type: str = "cpu") -> "MixedPrecisionPolicy":
        """The policy of ``training.precision`` (resolved: fp32 | bf16 | fp16),
        ``parallel.param_dtype`` ("auto": the compute dtype) and ``parallel.reduce_dtype``;
        ValueError naming the values for unknown names, fp16 on a device type that cannot
        compute in it, a param_dtype wider than the fp32 master or other than the compute
        dtype."""
        compute_dtype = dtype_of(compute, "training.precision")
        param_dtype = compute if param_dtype == "auto" else param_dtype
        param = dtype_of(param_dtype, "parallel.param_dtype")
        reduce = dtype_of(reduce_dtype, "parallel.reduce_dtype")
        for key, name, dtype in (("parallel.param_dtype", param_dtype, param),
                                 ("parallel.reduce_dtype", reduce_dtype, reduce)):
            if dtype.itemsize > MASTER.itemsize:
                raise ValueError(f"{key} {name} ({dtype.itemsize} bytes) is wider than the fp32 "
                                 f"master weights ({MASTER.itemsize} bytes)")
        if torch.float16 in (compute_dtype, param, reduce) and not supports_fp16(device_type):
            raise ValueError(f"fp16 (training.precision {compute}, parallel.param_dtype "
                             f"{param_dtype}, parallel.reduce_dtype {reduce_dtype}) needs a "
                             f"device that computes in fp16; device type {device_type!r} "
                             f"does not: use bf16")
        if param not in (MASTER, compute_dtype):
            raise ValueError(f"parallel.param_dtype {param_dtype} must be fp32 or the compute "
                             f"dtype (training.precision {compute})")
        return cls(param, reduce)

    def __str__(self) -> str:
        return f"param_dtype {NAMES[self.param_dtype]}, reduce_dtype {NAMES[self.reduce_dtype]}"


FP32 = MixedPrecisionPolicy()


def policy_for(cfg: Config, device_type: str) -> MixedPrecisionPolicy:
    """The run's mixed-precision policy: the resolved precision with ``parallel.param_dtype``
    and ``parallel.reduce_dtype`` (ValueError naming the values if they cannot go together)."""
    p = cfg.parallel
    return MixedPrecisionPolicy.from_names(resolve_precision(cfg, device_type), p.param_dtype,
                                           p.reduce_dtype, device_type)


def compute_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype autocast computes matmuls in on ``device_type`` now; None when it is off."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def to_compute(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the autocast dtype when autocast is on and ``x`` is wider: what activations
    cross the wire in (tensor, sequence and expert parallel call it before a collective).

    ``x`` is about to enter an autocast matmul, which would cast it after the collective: done
    before, it is the same numbers and half the bytes, and the cast's backward receives the
    matmul's gradient in the compute dtype, so the conjugate collective sends that too."""
    dtype = compute_dtype(x.device.type)
    if dtype is None or not x.is_floating_point() or x.element_size() <= dtype.itemsize:
        return x
    return x.to(dtype)


class _NormEntersInCompute(ParallelRMSNorm):
    """Chapter 03's norm whose output enters the tp region in autocast's dtype: f's backward
    all-reduce (or sequence parallel's all-gather and reduce-scatter) carries 2 bytes in bf16."""

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return to_compute(super().normalize(x))


class _EmbeddingLeavesInCompute(VocabParallelEmbedding):
    """Chapter 03's embedding whose shares are summed over tp in autocast's dtype; the residual
    stream it returns is in the weight's dtype again, as the reference's embedding gives it."""

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return to_compute(super().lookup(ids))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids).to(self.weight.dtype)


def tensor_parallel_wire_in_compute(model: nn.Module) -> None:
    """Tensor parallel's activations cross the wire in autocast's dtype (``to_compute``): each
    of chapter 03's norms and embeddings becomes its subclass here, in place (the class swap
    FSDP2's ``fully_shard`` does); its parameters, state and hooks stay. Without autocast, or
    in fp32, nothing is cast."""
    for module in model.modules():
        if type(module) is ParallelRMSNorm:
            module.__class__ = _NormEntersInCompute
        elif type(module) is VocabParallelEmbedding:
            module.__class__ = _EmbeddingLeavesInCompute


class _DispatchInCompute(AllToAllDispatcher):
    """Chapter 06's dispatcher whose routed tokens cross in autocast's dtype (``to_compute``):
    the numbers the experts' matmul would cast, half the bytes each way."""

    def outgoing(self, routed: torch.Tensor) -> torch.Tensor:
        return to_compute(routed)


def expert_parallel_wire_in_compute(model: nn.Module) -> None:
    """Chapter 06's token dispatch in autocast's dtype: each of its dispatchers becomes the
    subclass above, in place (as ``tensor_parallel_wire_in_compute`` swaps tp's layers)."""
    for module in model.modules():
        dispatch = getattr(module, "dispatch_fn", None)
        if type(dispatch) is AllToAllDispatcher:
            dispatch.__class__ = _DispatchInCompute


def fsdp_mp_policy(policy: Optional[MixedPrecisionPolicy]) -> "FSDPMixedPrecision":
    """FSDP2's ``mp_policy`` of ours: fp32 means no cast (None)."""
    p = policy or FP32
    from torch.distributed.fsdp import MixedPrecisionPolicy as FSDPMixedPrecision
    return FSDPMixedPrecision(
        param_dtype=None if p.param_dtype == torch.float32 else p.param_dtype,
        reduce_dtype=None if p.reduce_dtype == torch.float32 else p.reduce_dtype)


def disable_autocast_cache_per_unit(zero: nn.Module) -> None:
    """ZeRO-3 under autocast (zero.py's ``ShardedDataParallel``): while a unit runs whose
    gathered weights are wider than the compute dtype, autocast's cache is off.

    Why: autocast casts each fp32 weight to the compute dtype and caches the copy to the end of
    the step, so every unit's copy would stay although ZeRO-3 frees the unit; uncached, each
    copy goes with its backward. A forward pre-hook and a forward hook on each unit's first and
    last module, beside ZeRO's own.
    """
    saved: List[bool] = []

    def before(unit: Any, module: nn.Module, args: Any) -> None:
        low = compute_dtype(unit.flat.device.type)
        if low is not None and low.itemsize < unit.flat.element_size():
            saved.append(torch.is_autocast_cache_enabled())
            torch.set_autocast_cache_enabled(False)

    def after(module: nn.Module, args: Any, output: Any) -> None:
        if saved:
            torch.set_autocast_cache_enabled(saved.pop())

    for unit in getattr(zero, "units"):
        unit.modules[0].register_forward_pre_hook(partial(before, unit))
        unit.modules[-1].register_forward_hook(after)


class DynamicLossScaler:
    """fp16's dynamic loss scale, agreed over ``group`` (the world: every rank holding
    gradients). Use: ``(loss * scaler.scale).backward()``, sync the gradients, then
    ``scaler.step(optimizer, params)``, which unscales, checks, steps or skips, and updates.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 2000,
                 group: Optional[dist.ProcessGroup] = None, agree: bool = True) -> None:
        if not init_scale > 0 or growth_interval < 1:
            raise ValueError(f"init_scale must be positive and growth_interval >= 1, got "
                             f"{init_scale} and {growth_interval}")
        self.scale = float(init_scale)
        self.growth_interval = growth_interval
        self.group = group
        self.agree = agree  # False: one process alone (a single-device run inside a world)
        self.clean_steps = 0  # steps since the last overflow
        self.skipped = 0  # steps skipped so far

    def unscale_and_check(self, params: Iterable[torch.Tensor]) -> bool:
        """Divide this rank's gradients by the scale; True if any rank's hold inf or NaN: one
        all-reduce (MAX) of a single flag over the group (loss_scale.py)."""
        params = list(params)
        if not params:
            raise ValueError("unscale_and_check needs this rank's parameters (none given)")
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:  # the flag on the parameters' device all the same: it goes through NCCL
            grads = [torch.zeros((), device=params[0].device)]
        return unscale_and_check(grads, self.scale, self.group, self.agree)

    def update(self, found_inf: bool) -> None:
        """Halve the scale after an overflow; double it after ``growth_interval`` clean steps."""
        self.skipped += int(found_inf)
        self.scale, self.clean_steps = update_scale(self.scale, self.clean_steps, found_inf,
                                                    self.growth_interval)

    def step(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> bool:
        """Unscale, then step unless some rank overflowed; returns whether the step ran."""
        found_inf = self.unscale_and_check(params)
        if not found_inf:
            optimizer.step()
        self.update(found_inf)
        return not found_inf

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = state["scale"], state["clean_steps"]
        self.skipped = state["skipped"]


class _ScaledBackward(torch.autograd.Function):
    """Forward: ``loss`` as it is. Backward: its gradient times ``scale``."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def scale_backward(loss_fn: Optional[Callable], scaler: DynamicLossScaler) -> Optional[Callable]:
    """``loss_fn`` whose value stays the loss and whose backward runs from ``scaler.scale`` x
    the loss: fp16's scaling attached to a pipeline schedule's losses from outside. A scale is
    a power of two, so scale x (1 / m) is exact: the same gradients as scaling the sum."""
    if loss_fn is None:
        return None

    def scaled(*args: Any) -> Any:
        loss = loss_fn(*args)
        return _ScaledBackward.apply(loss, scaler.scale) if torch.is_tensor(loss) else loss

    return scaled


class MessagesInComputeDtype(StageHooks):
    """A pipeline schedule's messages (activations and their gradients) in the dtype autocast
    computes in this step, when it is on: half the bytes of fp32 between stages."""

    def begin_step(self, schedule: PipelineSchedule, inputs: torch.Tensor) -> None:
        schedule.dtype = compute_dtype(inputs.device.type) or schedule.param_dtype


@dataclass
class PrecisionHooks:
    """Chapter 08 attached to chapter 07's ``parallelize`` from outside, as its ``precision``
    argument (``precision_hooks(cfg, device_type)``): the policy's dtypes for DDP, ZeRO and
    FSDP2, the pipeline's and tensor parallel's messages in autocast's dtype, and fp16's loss
    scaler. Without it
    ``parallelize`` keeps every wire in fp32 and refuses fp16 and non-default dtypes."""
    policy: MixedPrecisionPolicy
    scaler: Optional[DynamicLossScaler] = None  # fp16 only

    after_zero = staticmethod(disable_autocast_cache_per_unit)  # each ZeRO wrapper, once
    after_tensor_parallel = staticmethod(tensor_parallel_wire_in_compute)  # the model, once
    after_expert_parallel = staticmethod(expert_parallel_wire_in_compute)  # the model, once

    def attach_to_pipeline(self, schedule: PipelineSchedule) -> None:
        """A pipeline schedule's messages in autocast's dtype; under fp16 its backward starts
        from scale x loss (and scale x each chunk's own loss), the losses it reports unscaled."""
        schedule.hooks.append(MessagesInComputeDtype())
        if self.scaler is not None:
            schedule.loss_fn = cast(LossFn, scale_backward(schedule.loss_fn, self.scaler))
            for hooks in schedule.hooks:
                if isinstance(hooks, MoELossInPipeline):
                    hooks.loss_of = cast(Callable, scale_backward(hooks.loss_of, self.scaler))

    def scale_losses(self, loss_fn: Callable, aux_loss: Callable) -> Tuple[Callable, Callable]:
        """The data-parallel step's two losses (step.py); under fp16 their backward starts from
        scale x loss, as a pipeline's does (``attach_to_pipeline``), their values unscaled."""
        if self.scaler is None:
            return loss_fn, aux_loss
        return (cast(Callable, scale_backward(loss_fn, self.scaler)),
                cast(Callable, scale_backward(aux_loss, self.scaler)))

    def data_parallel(self, model: nn.Module, pgm: ProcessGroupManager, impl: str,
                      bucket_size_mb: float) -> nn.Module:
        """Chapter 01's data parallel reducing in the policy's ``reduce_dtype``."""
        return apply_data_parallel_in(self.policy.reduce_dtype, model, pgm, impl, bucket_size_mb)

    def fsdp_policy(self, gather: bool = True) -> "FSDPMixedPrecision":
        """FSDP2's ``mp_policy``; ``gather`` False (``replicate``): reduce_dtype only."""
        policy = self.policy if gather else MixedPrecisionPolicy(
            reduce_dtype=self.policy.reduce_dtype)
        return fsdp_mp_policy(policy)

    def zero_in(self, wrapper: Type[W]) -> Type[W]:  # ZeRO's units in the policy's dtypes
        return zero_in_dtypes(wrapper, self.policy.param_dtype, self.policy.reduce_dtype)


def precision_hooks(cfg: Config, device_type: str) -> PrecisionHooks:
    """The hooks of ``cfg``'s precision on ``device_type`` (ValueError naming bad dtypes)."""
    fp16 = resolve_precision(cfg, device_type) == "fp16"
    return PrecisionHooks(policy_for(cfg, device_type), DynamicLossScaler() if fp16 else None)
