"""A pipeline's full weights on pipeline rank 0: what ``--check`` compares with the reference.

Each pipeline rank holds its stages' tensors (scaletorch/parallel/pipeline_parallel.py), maybe
split over "tp" (chapter 03). This gathers them, un-split, in host memory, under the full
model's names: the check's business and the checkpoints', not training (nothing in the ledger).
``ParamMap`` (param_map.py) reuses it for any layout with a pipeline.
"""

from typing import Dict, Optional

import torch

from scaletorch.dist import ProcessGroupManager, comm, get_ledger
from scaletorch.dist.functional import gather_along_dim
from scaletorch.parallel.pipeline_parallel import PipelineModel
from scaletorch.schedule.placement import rank_of_stage

State = Dict[str, torch.Tensor]


def gather_pipeline_state_dict(pipe: PipelineModel, pgm: ProcessGroupManager,
                               state: Optional[State] = None) -> Optional[State]:
    """Every stage's tensors (fp32, full-model names, in host memory) on pipeline rank 0; None
    elsewhere. Collective over "pp" (and "tp" to un-split).

    ``state``: this rank's stages' tensors, un-sharded (``ParamMap.gather``'s); by default the
    chunks' own, their tensor-parallel shards gathered over "tp" (by chapter 03's tags)."""
    p, rank = pgm.pipeline_model_parallel_world_size, pgm.pipeline_model_parallel_rank
    mine = [k for k in pipe.owner if rank_of_stage(pipe.owner[k], p, pipe.v_shape) == rank]
    if state is None:
        with get_ledger().paused():
            tensors = [c.state_dict(keep_vars=True).items() for c in pipe.chunks]  # with tags
            state = {k: _unshard(t, pgm) for items in tensors for k, t in items}
    if sorted(state) != sorted(mine):
        raise ValueError(f"state keys {sorted(state)} are not this stage's {mine}")
    # one tensor under two names (a V's tied weight) stays one tensor: pickle keeps the alias
    # on the host: pipeline rank 0's device would hold the whole model (and AdamW's moments)
    cpu: Dict[int, torch.Tensor] = {}
    host = {k: cpu.setdefault(id(t), t.detach().cpu().float().clone()) for k, t in state.items()}
    parts = comm.gather_objects(host, pgm.pipeline_model_parallel_group)
    return {k: t for part in parts for k, t in part.items()} if rank == 0 else None


def _unshard(t: torch.Tensor, pgm: ProcessGroupManager) -> torch.Tensor:
    """The full tensor of a tensor-parallel shard (collective over "tp"), without the padding
    rows of a padded vocabulary; other tensors as they are."""
    if getattr(t, "tensor_model_parallel", False):
        dim = getattr(t, "partition_dim")  # noqa: B009 - set by chapter 03, not typed
        full = gather_along_dim(t.detach(), dim, pgm.tensor_model_parallel_group)
        padding = getattr(t, "vocab_padding", None)
        return full if padding is None else full[:padding[0]]
    return t
