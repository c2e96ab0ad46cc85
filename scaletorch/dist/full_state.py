"""The full weights of a tensor-parallel model, for ``--check`` (chapters 03, 05, 06).

Not training: the parity check compares them with the single-device run's, so the gather is
paused in the ledger. Each parameter that tensor parallel tags (``tensor_model_parallel``,
``partition_dim``; tensor_parallel_layers.py) is all-gathered along its partition dim; a
DTensor (``--impl torch``) gathers itself; a replicated weight is taken as it is.
"""

from typing import Dict, Optional

import torch
from torch import nn

from scaletorch.dist.dtensor import is_dtensor
from scaletorch.dist.functional import gather_along_dim
from scaletorch.dist.ledger import get_ledger
from scaletorch.dist.pg_manager import ProcessGroupManager

State = Dict[str, torch.Tensor]


def gather_tensor_parallel_state_dict(model: nn.Module,
                                      pgm: ProcessGroupManager) -> Optional[State]:
    """Collective over "tp": the reference-keyed full weights on global rank 0, None elsewhere.

    Each tp shard is all-gathered along its partition dim; a DTensor (``--impl torch``) gathers
    itself; a replicated norm weight is taken as it is.
    """
    full: State = {}
    with get_ledger().paused():  # a check, not training traffic
        for name, t in model.state_dict(keep_vars=True).items():
            value = t.detach()
            if is_dtensor(value):
                value = value.full_tensor()
            elif getattr(t, "tensor_model_parallel", False):
                value = gather_along_dim(value, t.partition_dim, pgm.tensor_model_parallel_group)
            full[name] = value.float().clone()
    return full if pgm.rank == 0 else None
