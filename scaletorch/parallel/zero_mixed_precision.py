"""Chapter 08's dtypes in chapter 02's ZeRO unit, attached from outside as a subclass.

``ShardedDataParallel(..., make_unit=zero_unit_in(param_dtype, reduce_dtype))`` builds each unit
as ``FlatUnitInDtypes``: stage 3 keeps (gathers, computes with) its full parameters in
``param_dtype``, and every stage reduce-scatters the averaged gradients in ``reduce_dtype``. The
shards, their gradients and AdamW's state stay fp32 (mixed_precision.py says why).
"""

from functools import partial
from typing import Callable

import torch

from scaletorch.parallel.flat_unit import FlatUnit, Group, NamedModules


class FlatUnitInDtypes(FlatUnit):
    """Chapter 02's ZeRO unit with chapter 08's dtypes: stage 3 gathers a copy of the fp32
    shard cast to ``param_dtype`` and computes with it; the averaged gradients are
    reduce-scattered in ``reduce_dtype``, then accumulated in fp32."""

    def __init__(self, name: str, modules: NamedModules, group: Group, zero_stage: int,
                 param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
        # read by the two methods below while FlatUnit builds the unit
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        super().__init__(name, modules, group, zero_stage)

    def full_buffer(self, master: torch.Tensor) -> torch.Tensor:
        """Stage 3: the gathered parameters in ``param_dtype``; stages 1, 2 keep the master."""
        low = self.zero_stage == 3 and self.param_dtype != master.dtype
        return master.to(self.param_dtype) if low else master

    def sent_dtype(self, full: torch.Tensor) -> torch.dtype:
        """``reduce_dtype`` (one rank: nothing is sent, nothing to round)."""
        return self.reduce_dtype if self.world > 1 else full.dtype


def zero_unit_in(param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> Callable[..., FlatUnit]:
    """ZeRO's ``make_unit`` argument: units that gather in ``param_dtype`` (stage 3) and
    reduce-scatter in ``reduce_dtype``."""
    return partial(FlatUnitInDtypes, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
