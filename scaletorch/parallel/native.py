"""PyTorch's own strategies composed on one DeviceMesh (``parallel.impl = "torch"``).

What a PyTorch user runs for N-D training, built over the same process groups as ours so that
chapter 07 compares them layout for layout. One mesh names the dims of our rank grid (tp
fastest, then dp, then pp); each strategy takes the sub-mesh it works over:

    mesh (pp, dp, tp), 8 ranks      pp 0: dp 0 [0 1]  dp 1 [2 3]    pp 1: dp 0 [4 5]  dp 1 [6 7]

    1 context    ours (ring / Ulysses), only beside plain data parallel: PyTorch's own
                 ``context_parallel`` shards the CUDA attention kernels, it has none on CPU
    2 checkpoint recompute each block in backward (chapter 10's ``recompute`` hook)
    3 tensor     ``parallelize_module`` on mesh["tp"]: weights become DTensors sharded over tp
                 (column / row parallel, torchtitan's plan; sequence parallel between blocks)
    4 pipeline   our cut into chunks (pipeline_parallel.py), one torch.distributed.pipelining
                 ``PipelineStage`` per chunk over "pp" (pipeline_native.py)
    5 data       per block, then per model or chunk (its root: embedding, norm, head), on
                 mesh["dp"]: ``fully_shard`` for ZeRO-3 (with tp: 2-D (dp, tp) DTensors), else
                 FSDP2's ``replicate`` (whole weights, gradients all-reduced over dp); a model
                 without tp, pp or ZeRO-3 takes DistributedDataParallel over dp_cp (chapter 01)

Why ``replicate`` beside tp and pp, not DistributedDataParallel: tensor_parallel_dtensor.py
(chapter 03's native piece, which also holds the mesh, the DTensor split, its loss and its
clip) says why for tp; ``PipelineStage`` drives ``replicate`` between micro-batches, as it
drives ``fully_shard`` (gradients reduced once, after the last).

Clip: ``world_grad_norm`` (grad_norm.py), every local gradient element divided by the number
of ranks that hold it; one all-reduce over the world, which also sums the pipeline stages.
Loss: without a pipeline the head's logits stay sharded on the vocabulary and the loss runs
under ``loss_parallel()``; pipelining's ``loss_fn`` gets plain tensors, so there the head
gathers them. DTensor, FSDP2 and pipelining issue their own collectives: our ledger does not
see them. What cannot run here (layout_check.py): MoE, ZeRO-1/2, context parallel beside tp, pp
or ZeRO-3.
"""

from typing import TYPE_CHECKING, Any, Callable, Iterable, List, Optional, Tuple

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import loss_parallel

from scaletorch.dist import ProcessGroupManager
from scaletorch.models import Llama, loss_fn
from scaletorch.parallel.context_parallel import apply_context_parallel, make_sequence_sharder
from scaletorch.parallel.data_parallel import apply_data_parallel
from scaletorch.parallel.fully_shard import shard_blocks_then_root
from scaletorch.parallel.pipeline_native import TorchPipelineSchedule
from scaletorch.parallel.pipeline_parallel import apply_pipeline_parallel
from scaletorch.parallel.step import ForwardBackward, make_data_parallel_step
from scaletorch.parallel.tensor_layout import TensorLayout
from scaletorch.parallel.tensor_parallel_dtensor import (apply_dtensor_tensor_parallel, device_mesh,
                                                         dtensor_loss_fn, native_clip_grad_norm)
from scaletorch.schedule.placement import V_SHAPED

if TYPE_CHECKING:  # the config module imports scaletorch.parallel
    from scaletorch.config import Config

# ---- 5 data parallel: fully_shard or replicate on mesh["dp"] ---------------------------------


def apply_native_data_parallel(modules: Iterable[nn.Module], dp_mesh: DeviceMesh, zero3: bool,
                               mp_policy: Optional[Any] = None) -> None:
    """Each block, then each module's root, as one FSDP2 unit over ``dp_mesh`` (chapter 02's
    ``shard_blocks_then_root``): ``fully_shard`` (ZeRO-3) or ``replicate``; ``mp_policy``:
    FSDP2's, from chapter 08's hooks (None: no casts)."""
    shard_blocks_then_root(modules, dp_mesh, fully_shard if zero3 else replicate, mp_policy)


def _in_loss_parallel(step: ForwardBackward) -> ForwardBackward:
    """DTensor's vocab-sharded cross-entropy (forward and backward) needs ``loss_parallel()``."""

    def run(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with loss_parallel():
            return step(inputs, targets)

    return run


# ---- all of it, in order ---------------------------------------------------------------------


def parallelize_native(
    model: Llama, cfg: "Config", pgm: ProcessGroupManager, precision: Optional[Any] = None,
    recompute: Optional[Callable[[nn.Module, str], Any]] = None
) -> Tuple[nn.Module, ForwardBackward, Callable[[float], torch.Tensor],
           Optional[torch.optim.Optimizer], TensorLayout]:
    """impl torch: context -> checkpointing -> tensor -> pipeline -> data on ``model`` (built
    with the same seed on every rank). Returns (model for the Trainer, step, clip, None: the
    Trainer's AdamW over the DTensors, layout), the fields of ``Parallelized``.
    ``precision`` (chapter 08), ``recompute`` (chapter 10): ``parallelize``'s hooks."""
    p, m = cfg.parallel, cfg.data.num_micro_batches
    tp, pp = pgm.tensor_model_parallel_world_size, pgm.pipeline_model_parallel_world_size
    zero3 = p.zero_stage == 3
    # [core: native-order]
    mesh = device_mesh(pgm, next(model.parameters()).device.type) \
        if pgm.context_parallel_world_size == 1 else {}  # cp: DDP only (layout_check.py)
    shard_sequence = None
    if pgm.context_parallel_world_size > 1:  # 1
        apply_context_parallel(model, pgm, p.cp_variant, kernel=p.cp_attention)
        shard_sequence = make_sequence_sharder(pgm, cfg.data.seq_len)
    if recompute is not None:  # 2
        recompute(model, p.activation_checkpointing)
    if tp > 1:  # 3
        apply_dtensor_tensor_parallel(model, mesh["tp"], p.sequence_parallel)
        if pp > 1:  # a pipeline's loss takes plain logits: gathered, a copy (FSDP2 warns of a view)
            model.lm_head.register_forward_hook(lambda m, args, out: out.full_tensor().clone())
        if cfg.model.tie_word_embeddings:  # both split by vocabulary rows: the same shard
            model.lm_head.weight = model.embed_tokens.weight
    modules: List[nn.Module] = [model]
    pipe = None
    if pp > 1:  # 4
        pipe = apply_pipeline_parallel(model, pgm, p.virtual_pipeline_stages, p.layer_split,
                                       p.sequence_parallel, p.schedule in V_SHAPED)
        modules = list(pipe.chunks)
    trainer_model: nn.Module = model if pipe is None else pipe
    if zero3 or (pgm.data_parallel_world_size > 1 and (tp > 1 or pp > 1)):  # 5
        # chapter 08: ZeRO-3 gathers in param_dtype; replicate gathers nothing, only reduces
        mp = None if precision is None else precision.fsdp_policy(gather=zero3)
        apply_native_data_parallel(modules, mesh["dp"], zero3, mp)
    elif pgm.gradient_sync_world_size > 1 and pipe is None:
        wrap = apply_data_parallel if precision is None else precision.data_parallel
        trainer_model = wrap(model, pgm, "torch", p.bucket_size_mb)
    # [end: native-order]
    # FSDP2 swapped in DTensors (their placements say the split); DDP is around model
    layout = TensorLayout(pgm, {}, [], pipe, dtensor_model=model)

    if pipe is not None:
        step: ForwardBackward = TorchPipelineSchedule(pipe, pgm, p.schedule, m, loss_fn)
    else:
        step = make_data_parallel_step(trainer_model, m, pgm.data_parallel_rank,
                                       pgm.data_parallel_world_size, pgm.gradient_sync_group,
                                       dtensor_loss_fn if tp > 1 else loss_fn, shard_sequence)
        if tp > 1:
            step = _in_loss_parallel(step)
    clip = native_clip_grad_norm(list(trainer_model.parameters()), pgm)
    return trainer_model, step, clip, None, layout
