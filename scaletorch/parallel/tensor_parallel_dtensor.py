"""PyTorch's own tensor parallel (chapter 03's ``--impl torch``): DTensor ``parallelize_module``
over the "tp" dim of a DeviceMesh made of the pg_manager's groups, the loss (train under
``loss_parallel()``), the global grad norm of DTensor gradients, FSDP2's ``replicate`` over dp.

Why ``replicate`` over dp, not DistributedDataParallel: DDP takes a tp model only through a
stop-gap (given a dp sub-mesh it turns the DTensor weights back into plain local tensors, and
its own comment says state dicts then need care), so the placements that the clip and the
gather read would be gone. FSDP2's ``replicate`` (the hooks of ``fully_shard``, no sharding)
keeps 2-D (dp, tp) DTensors and all-reduces the gradients over dp once, after the last
micro-batch. DTensor and FSDP2 issue their own collectives: our ledger does not see them."""

from typing import Callable, Dict, List, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
from torch.nn import functional as F

from scaletorch.dist import ProcessGroupManager
from scaletorch.dist.layout_check import validate_tensor_parallel
from scaletorch.models import Llama
from scaletorch.parallel.grad_norm import clip_grads_, world_grad_norm

MESH_DIMS = ("pp", "dp", "tp")  # slowest to fastest, as the rank grid orders them


def device_mesh(pgm: ProcessGroupManager, device_type: str) -> Dict[str, DeviceMesh]:
    """One DeviceMesh (pp, dp, tp) over the world, made of the pg_manager's own groups (no new
    ones; cp 1), and its 1-D sub-meshes: {"world": mesh, "pp": .., "dp": .., "tp": ..}."""
    grid = pgm.grid
    ranks = torch.empty([grid.size(d) for d in MESH_DIMS], dtype=torch.int)
    for rank in range(pgm.world_size):
        where = grid.coordinates(rank)
        ranks[tuple(where[d] for d in MESH_DIMS)] = rank
    # a mesh needs torch.distributed initialized, and then every group exists (never None)
    groups = [cast(dist.ProcessGroup, pgm.get_group(d)) for d in MESH_DIMS]
    # DeviceMesh equality ignores the process groups and DTensor caches by mesh: dims named
    # after this pg_manager's groups keep a mesh over a rebuilt pg_manager (tests rebuild it
    # inside one world) from being taken for a mesh over destroyed groups.
    names = tuple(f"{d}{g.group_name}" for d, g in zip(MESH_DIMS, groups))
    mesh = DeviceMesh.from_group(groups, device_type, ranks, mesh_dim_names=names)
    return {"world": mesh, **{d: mesh[name] for d, name in zip(MESH_DIMS, names)}}


def apply_dtensor_tensor_parallel(model: Llama, tp_mesh: DeviceMesh,
                                  sequence_parallel: bool = False) -> Llama:
    """Chapter 03's split with ``parallelize_module`` (torchtitan's plan) over ``tp_mesh``.

    The head returns (b, s, V) logits as a DTensor sharded on the vocabulary: train inside
    ``loss_parallel()`` with ``dtensor_loss_fn``."""
    validate_tensor_parallel(model.config, tp_mesh.size(), sequence_parallel)
    seq = Shard(1) if sequence_parallel else Replicate()  # the layout between blocks
    top = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                   use_local_output=False),
    }
    if sequence_parallel:
        top["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, top)
    for block in model.layers:
        plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=seq),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=seq),
        }
        if sequence_parallel:  # norms on s/N tokens; one all-gather per attention / MLP input
            plan["input_layernorm"] = SequenceParallel()
            plan["post_attention_layernorm"] = SequenceParallel()
            plan["self_attn"] = PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                   desired_input_layouts=(Replicate(), None, None))
            plan["mlp"] = PrepareModuleInput(input_layouts=Shard(1),
                                             desired_input_layouts=Replicate())
        parallelize_module(block, tp_mesh, plan)
    return model


def dtensor_loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of vocab-sharded DTensor logits (b, s, V); call (and backward)
    inside ``loss_parallel()``. Returns this rank's (replicated) loss as a plain tensor."""
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    return cast(DTensor, loss).to_local()  # a DTensor, as the logits were


def copies(param: torch.Tensor, pgm: ProcessGroupManager) -> int:
    """Ranks of the world holding the same elements as this rank's part of ``param``: those
    of its pipeline stage (world / pp), divided by each mesh dim that shards it."""
    n = pgm.world_size // pgm.pipeline_model_parallel_world_size
    if isinstance(param, DTensor):
        for size, placement in zip(param.device_mesh.shape, param.placements):
            # Shard or FSDP2's _StridedShard (dp over a tp-sharded dim), whose is_shard() is False
            n //= 1 if placement.is_replicate() or placement.is_partial() else size
    return n


def native_clip_grad_norm(params: List[nn.Parameter],
                          pgm: ProcessGroupManager) -> Callable[[float], torch.Tensor]:
    """``clip(max_norm)``: the global norm of DTensor and plain gradients, then the scaling."""
    device = params[0].device

    def clip(max_norm: float) -> torch.Tensor:
        for p in params:
            if isinstance(p, DTensor) and isinstance(p.grad, DTensor) \
                    and p.grad.placements != p.placements:
                # Norm weights under sequence parallel get Partial(sum) gradients (each rank
                # saw its tokens only): sum them now, as the optimizer step would.
                p.grad = p.grad.redistribute(p.grad.device_mesh, p.placements)
        norm = world_grad_norm([(p, copies(p, pgm)) for p in params], device)
        return clip_grads_(params, max_norm, norm)

    return clip
