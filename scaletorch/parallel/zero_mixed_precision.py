"""Chapter 08's dtypes in chapter 02's ZeRO unit, attached from outside as subclasses.

``zero_in_dtypes(ShardedDataParallel, param_dtype, reduce_dtype)`` is the ZeRO wrapper (or any
subclass of it) whose units are ``FlatUnitInDtypes``: stage 3 keeps (gathers, computes with)
its full parameters in ``param_dtype``, and every stage reduce-scatters the averaged gradients
in ``reduce_dtype``. The shards, their gradients and AdamW's state stay fp32
(mixed_precision.py says why).
"""

from functools import partial
from typing import Callable, Tuple, Type, TypeVar, cast

import torch

from scaletorch.parallel.flat_unit import FlatUnit, Group, NamedModules, put_tensor, release_unit
from scaletorch.parallel.zero import ShardedDataParallel

W = TypeVar("W", bound=ShardedDataParallel)


class FlatUnitInDtypes(FlatUnit):
    """Chapter 02's ZeRO unit with chapter 08's dtypes: stage 3 gathers a copy of the fp32
    shard cast to ``param_dtype`` and computes with it; the averaged gradients are
    reduce-scattered in ``reduce_dtype``, then accumulated in fp32."""

    def __init__(self, name: str, modules: NamedModules, group: Group, zero_stage: int,
                 param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        super().__init__(name, modules, group, zero_stage)
        if zero_stage == 3 and param_dtype != self.flat.dtype:
            self._compute_in(param_dtype)

    def _compute_in(self, dtype: torch.dtype) -> None:
        """Stage 3: the full parameters (gathered, computed with) in ``dtype``: a new flat
        vector, released until its first gather, and new tensors on it in every holder's place
        (chapter 02's unit built them on the fp32 master); the shard stays fp32."""
        self.flat = self.flat.new_empty(self.padded_numel, dtype=dtype)
        storage = self.flat.untyped_storage()
        for k, (old, start) in enumerate(zip(self.tensors, self.offsets)):
            tensor = torch.empty(0, dtype=dtype, device=old.device)
            tensor.set_(storage, start, old.shape)  # type: ignore[call-overload]
            tensor.requires_grad_(old.requires_grad)
            for sub, attr, _ in self.slots[k]:
                put_tensor(sub, attr, tensor)
            self.tensors[k] = tensor
        release_unit(self.flat)

    def gather_source(self) -> torch.Tensor:
        """The fp32 shard cast to ``param_dtype`` (stage 3): the copy that is sent."""
        source = self.shard.detach()
        if source.dtype != self.flat.dtype:
            return source.to(self.flat.dtype)
        return super().gather_source()

    def grads_to_reduce(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """The mean is received in ``reduce_dtype`` (one rank: nothing is sent, nothing to
        round)."""
        full, out = super().grads_to_reduce()
        return full, out if self.world == 1 else torch.empty_like(out, dtype=self.reduce_dtype)

    def take_grad(self, out: torch.Tensor) -> None:
        super().take_grad(out.to(self.shard.dtype))  # accumulated in fp32


def zero_unit_in(param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> Callable[..., FlatUnit]:
    """ZeRO's ``new_unit``: units that gather in ``param_dtype`` (stage 3) and reduce-scatter
    in ``reduce_dtype``."""
    return partial(FlatUnitInDtypes, param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def zero_in_dtypes(wrapper: Type[W], param_dtype: torch.dtype,
                   reduce_dtype: torch.dtype) -> Type[W]:
    """A subclass of ``wrapper`` (chapter 02's ZeRO wrapper, or a subclass of it: chapter 10's
    tied one, any module's) whose units are built by ``zero_unit_in``."""
    unit = zero_unit_in(param_dtype, reduce_dtype)  # a partial: no method, so no self
    return cast(Type[W], type(f"{wrapper.__name__}InDtypes", (wrapper, ), {"new_unit": unit}))
