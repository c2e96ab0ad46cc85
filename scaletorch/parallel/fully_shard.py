"""PyTorch's own ZeRO-3, FSDP2 ``fully_shard``: chapter 02's reference beside zero.py.

``apply_fully_shard`` calls ``fully_shard`` on each block, then on the root (embedding, norm,
head), over a 1-D DeviceMesh of the data-parallel group: every parameter becomes a DTensor
sharded on dim 0 over the N ranks, all-gathered before its unit's forward and backward, its
gradient reduce-scattered. The Trainer's own AdamW and ``clip_grad_norm_`` work on the
DTensors; ``full_state_dict`` gathers them. Its collectives bypass our ledger. Chapter 07
(native.py) wraps the same way beside DTensor tensor parallel and pipelining.
"""

from typing import Callable, Dict, Iterable, Optional, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from scaletorch.dist import ProcessGroupManager
from scaletorch.parallel.zero import check_zero_layout


def shard_blocks_then_root(modules: Iterable[nn.Module], mesh: DeviceMesh,
                           wrap: Callable = fully_shard,
                           mp_policy: Optional[MixedPrecisionPolicy] = None) -> None:
    """Each block, then each module's root (embedding, norm, head), as one FSDP2 unit over
    ``mesh``. ``modules``: a Llama, or a pipeline rank's chunks (chapter 07, each its own
    root). ``wrap``: ``fully_shard``, or chapter 07's ``replicate``; ``mp_policy``: FSDP2's
    (chapter 08), None for fp32."""
    mp = mp_policy or MixedPrecisionPolicy()
    for module in modules:
        layers = module.get_submodule("layers")  # a Llama's list, or a chunk's dict
        blocks = layers.values() if isinstance(layers, nn.ModuleDict) else layers.children()
        for block in blocks:
            wrap(block, mesh=mesh, mp_policy=mp)
        wrap(module, mesh=mesh, mp_policy=mp)


def apply_fully_shard(model: nn.Module, pgm: ProcessGroupManager,
                      mp_policy: Optional[MixedPrecisionPolicy] = None) -> nn.Module:
    """FSDP2 over ``pgm.data_parallel_group_with_context``: ``fully_shard`` each block, then
    the root, on a 1-D device mesh made of that group."""
    check_zero_layout(3, pgm.tensor_model_parallel_world_size,
                      pgm.pipeline_model_parallel_world_size, pgm.expert_model_parallel_world_size)
    if not dist.is_initialized():
        raise ValueError("fully_shard needs torch.distributed: launch with torchrun")
    group = cast(dist.ProcessGroup, pgm.data_parallel_group_with_context)  # initialized: exists
    # Named after the group: DeviceMesh equality ignores process groups, and DTensor caches by
    # mesh, so a mesh over a rebuilt pg_manager must not be taken for one over destroyed groups.
    mesh = DeviceMesh.from_group(group,
                                 next(model.parameters()).device.type,
                                 mesh_dim_names=(f"dp_cp{group.group_name}", ))
    shard_blocks_then_root([model], mesh, fully_shard, mp_policy)
    return model


def full_state_dict(
    model: nn.Module,
    value_of: Callable[[torch.Tensor],
                       torch.Tensor] = torch.Tensor.detach) -> Dict[str, torch.Tensor]:
    """Collective over the mesh (DTensor's all-gathers): chapter 00's {name: full tensor} of
    the parameters, or of anything shaped like them (``value_of(param)``: an AdamW state)."""
    full = {}
    for name, param in model.state_dict(keep_vars=True).items():
        value = value_of(param)
        value = value.full_tensor() if isinstance(value, DTensor) else value
        full[name] = value.detach().float().clone()
    return full
