"""Whether a tensor is PyTorch's DTensor, without importing torch.distributed.tensor."""

import sys
from typing import TYPE_CHECKING, TypeGuard

if TYPE_CHECKING:  # imported by the runs that make DTensors
    from torch.distributed.tensor import DTensor


def is_dtensor(t: object) -> TypeGuard["DTensor"]:
    """True for PyTorch's DTensor (FSDP2, DTensor tensor parallel). One exists only once
    torch.distributed.tensor is imported, so a run that makes none never imports it: half a
    second of every process's start in chapters 00-06."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)
