"""PyTorch's own ZeRO-3, FSDP2 ``fully_shard``: chapter 02's reference beside zero.py.

Each parameter becomes a DTensor sharded on dim 0 over the data-parallel group, all-gathered
around its unit (a block, or the root: embedding, norm, head), its gradient reduce-scattered.
The Trainer's AdamW and clip work on the DTensors. Its collectives bypass our ledger.
"""

from typing import Callable, Dict, Iterable, Optional, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from scaletorch.dist import ProcessGroupManager
from scaletorch.dist.wrap_checks import check_zero_layout


def shard_blocks_then_root(modules: Iterable[nn.Module], mesh: DeviceMesh,
                           wrap: Callable = fully_shard,
                           mp_policy: Optional[MixedPrecisionPolicy] = None) -> None:
    """Each block, then each module's root, as one FSDP2 unit over ``mesh``. Chapter 07 passes
    a pipeline rank's chunks, or ``replicate`` as ``wrap``; chapter 08 an ``mp_policy``."""
    mp = mp_policy or MixedPrecisionPolicy()
    for module in modules:
        layers = module.get_submodule("layers")  # a Llama's list, or a chunk's dict
        blocks = layers.values() if isinstance(layers, nn.ModuleDict) else layers.children()
        for block in blocks:
            wrap(block, mesh=mesh, mp_policy=mp)
        wrap(module, mesh=mesh, mp_policy=mp)


def apply_fully_shard(model: nn.Module, pgm: ProcessGroupManager,
                      mp_policy: Optional[MixedPrecisionPolicy] = None) -> nn.Module:
    """FSDP2 over ``pgm.gradient_sync_group``: ``fully_shard`` each block, then
    the root, on a 1-D device mesh made of that group."""
    check_zero_layout(3, pgm.tensor_model_parallel_world_size,
                      pgm.pipeline_model_parallel_world_size, pgm.expert_model_parallel_world_size)
    if not dist.is_initialized():
        raise ValueError("fully_shard needs torch.distributed: launch with torchrun")
    group = cast(dist.ProcessGroup, pgm.gradient_sync_group)  # initialized: exists
    # named after the group: a mesh over a rebuilt pg_manager is another mesh (native.py)
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
        full[name] = value.detach().cpu().float().clone()  # host memory, piece by piece
    return full
