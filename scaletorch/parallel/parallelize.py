"""N-D parallelism: every strategy of chapters 01-06 applied to one model, in a fixed order.

``parallelize(model, cfg, pgm, device)`` converts the reference model in place and returns what
the Trainer needs. The order (as in torchtitan), and why:

    1 expert     shard each MoE layer's experts over "ep"; routing statistics (and 06b's
                 capacity) over "dp_cp". First: it needs the full stacked expert weights, and
                 the MoE stays whole under tensor parallel (experts are split over ep, not tp).
    2 tensor     split attention / MLP / embedding / head over "tp" (+ sequence parallel).
                 Before context parallel: ring attention then works on this rank's heads.
    3 context    swap each attention's ``attention_fn`` for ring (or Ulysses) attention over
                 "cp"; the step shards every sequence zigzag and passes the true positions.
    4 checkpoint recompute each block in backward (``--activation-checkpointing``, chapter
                 10's ``recompute`` hook). After the strategies that change a block (its
                 recompute re-runs their collectives), before the pipeline cuts the blocks.
    5 pipeline   keep this rank's stages over "pp"; the step is the pipeline schedule.
    6 data       last, because it must see exactly the parameters this rank holds (after the
                 tp shards and the pp cut): bucketed DDP over "dp_cp", ZeRO-1/2/3 over
                 "dp_cp", or for MoE models dense gradients over "dp_cp" and expert
                 gradients over "edp" (chapter 06).

Each rank holds: layers of its pp stage, tp shards of their matrices, ep shards of their
experts, s/cp tokens of B/dp sequences; ZeRO also shards what is left over dp_cp.

Gradient clipping is one rule for every layout (``grad_norm.world_grad_norm``): every gradient
element counted once, replicated copies divided by their number of replicas, one all-reduce
over the world. The returned ``layout`` (tensor_layout.py) says where every reference tensor
lives; the trainer's param map (scaletorch/trainer/param_map.py) gathers the full weights from
it for --check, and consolidated checkpoints write and read full weights *and* full AdamW state
through it, so a run saved at one layout resumes at any other.

``parallel.impl`` picks whose version runs, so every native comparison of the N-D layouts
goes through this same call (chapters 07, 08 and 10 use ``parallelize``):

    ours        this repository's, by hand, every combination above
    naive       data parallel as one all-reduce per parameter after backward (chapter 01)
    torch       PyTorch's own, composed on one DeviceMesh (native.py): DTensor
                ``parallelize_module`` over "tp", torch.distributed.pipelining over "pp",
                FSDP2 ``fully_shard`` (ZeRO-3) or ``replicate`` over "dp"; a whole model
                takes DistributedDataParallel over dp_cp (around our cp)

What cannot compose (ZeRO with MoE, impl torch with cp beside tp, ...) is refused before any
surgery by the one layout check (layout_check.py); doc/07_nd_parallel.md, "Limits", lists all.
MoE parity with the reference is exact with one micro-batch (moe.py: the load-balancing
statistics are per micro-batch, and a micro-batch of the parallel run holds other tokens).
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from scaletorch.dist import ProcessGroupManager, comm, get_ledger
from scaletorch.dist.layout_check import validate_parallelize
from scaletorch.models import MLP, Llama, loss_fn, moe_aux_loss
from scaletorch.parallel.context_parallel import apply_context_parallel, make_sequence_sharder
from scaletorch.parallel.data_parallel import apply_data_parallel
from scaletorch.parallel.expert_parallel import ExpertParallel, shard_experts
from scaletorch.parallel.grad_norm import clip_grads_, world_grad_norm
from scaletorch.parallel.moe_balance import apply_global_capacity
from scaletorch.parallel.moe_pipeline import MoELossInPipeline
from scaletorch.parallel.pipeline_parallel import apply_pipeline_parallel
from scaletorch.parallel.pipeline_runtime import PipelineSchedule
from scaletorch.parallel.step import ForwardBackward, LossFn, make_data_parallel_step
from scaletorch.parallel.tensor_layout import (TensorLayout, plain_entries, record_splits,
                                               zero_entries)
from scaletorch.parallel.tensor_parallel import (BLOCK_PLAN, apply_tensor_parallel,
                                                 tensor_parallel_loss_fn)
from scaletorch.parallel.zero import ShardedDataParallel, ZeroAdamW, llama_units
from scaletorch.parallel.zero_chunks import ZeroChunks
from scaletorch.rules.group_names import gradient_group_name
from scaletorch.schedule.placement import V_SHAPED

if TYPE_CHECKING:  # the config module imports scaletorch.parallel
    from scaletorch.config import Config

ORDER = ("expert", "tensor", "context", "activation checkpointing", "pipeline", "data")


@dataclass
class Parallelized:
    """What ``parallelize`` hands the Trainer (and the checks) for one layout.

    model: the Trainer's model (a data-parallel wrapper, or the pipeline's PipelineModel);
    forward_backward: the step (pipeline schedule, or the data-parallel step with the
    vocab-parallel loss and the sequence sharder); clip_grad_norm: the global-norm clip;
    optimizer: ZeRO's sharded AdamW, None for the Trainer's own; layout: where each reference
    tensor lives (tensor_layout.py; ours, or PyTorch's DTensors).
    """
    model: nn.Module
    forward_backward: ForwardBackward
    clip_grad_norm: Callable[[float], torch.Tensor]
    optimizer: Optional[torch.optim.Optimizer]
    layout: TensorLayout


def _apply_data_parallel(
        modules: List[nn.Module], cfg: "Config", pgm: ProcessGroupManager, precision: Optional[Any],
        tied: Optional[Any]) -> Tuple[List[nn.Module], Optional[torch.optim.Optimizer]]:
    """Step 6: wrap each of ``modules`` (the model, or this rank's pipeline chunks) for data
    parallel over "dp_cp": ZeRO-1/2/3 (with its sharded AdamW), a MoE model's ExpertParallel
    (dense gradients over "dp_cp", expert gradients over "edp"), or DDP (bucketed, or naive).
    ``precision``: chapter 08's hooks (their dtypes), or None for fp32 on the wire; ``tied``:
    chapter 10's hooks (ZeRO units that share a tied weight). Returns (wrapped modules, ZeRO's
    optimizer or None for the Trainer's AdamW)."""
    p, t = cfg.parallel, cfg.training
    if p.zero_stage > 0:
        # chapter 10's units may share a tied weight; 08's gather and reduce in its dtypes
        wrapper, units = (ShardedDataParallel, llama_units) if tied is None else tied.zero()
        if precision is not None:
            wrapper = precision.zero_in(wrapper)
        group = pgm.gradient_sync_group
        zero = [wrapper(m, units(m), group, p.zero_stage) for m in modules]
        for z in zero:
            if precision is not None:
                precision.after_zero(z)
        # one optimizer over the chunks' wrappers (zero_chunks.py: chapter 02's steps one)
        optimizer = ZeroAdamW(ZeroChunks(zero), t.lr, (t.beta1, t.beta2), t.weight_decay)
        return list(zero), optimizer
    if cfg.model.num_experts > 0:
        return [ExpertParallel(m, pgm) for m in modules], None
    if pgm.gradient_sync_world_size == 1:
        return modules, None
    wrap = apply_data_parallel if precision is None else precision.data_parallel
    return [wrap(m, pgm, p.impl, p.bucket_size_mb) for m in modules], None


def tensor_parallel_plan(block: nn.Module) -> Dict[str, Tuple[str, ...]]:
    """Chapter 03's plan for a dense block. A MoE block (06) splits its attention only: the
    experts, split over ep and not tp, run whole on every tp rank on the replicated input."""
    if isinstance(block.mlp, MLP):
        return BLOCK_PLAN
    return {
        k: tuple(n for n in v if not n.startswith(("post_", "mlp.")))
        for k, v in BLOCK_PLAN.items()
    }


def parallelize(model: Llama, cfg: "Config", pgm: ProcessGroupManager, device: torch.device,
                precision: Optional[Any] = None, tied: Optional[Any] = None,
                recompute: Optional[Callable[[nn.Module, str], Any]] = None,
                tensor_parallel: Callable[..., Llama] = apply_tensor_parallel) -> Parallelized:
    """Apply expert -> tensor -> context -> checkpointing -> pipeline -> data parallel to the
    reference ``model`` (built with the same seed on every rank), as ``cfg.parallel`` says.

    ``cfg``: the Config; ``pgm``: the process groups of its layout; ``precision``: chapter 08's
    ``PrecisionHooks`` (mixed_precision.py), None for fp32 wires; ``tied``: chapter 10's
    ``TiedEmbeddings``, which a tied model needs under a pipeline or ZeRO; ``recompute``: 10's
    ``apply_activation_checkpointing``; ``tensor_parallel``: 03's surgery, or 10's padded one.
    """
    validate_parallelize(cfg, pgm, precision, tied, recompute)  # every refusal, before surgery
    p = cfg.parallel
    model = model.to(device)
    if p.impl == "torch":  # PyTorch's own strategies on one DeviceMesh (native.py)
        from scaletorch.parallel.native import parallelize_native  # its imports: ~1 s of a core
        return Parallelized(*parallelize_native(model, cfg, pgm, precision, recompute))
    # [core: order]
    loss: LossFn = loss_fn
    shard_sequence: Optional[Callable] = None
    if cfg.model.num_experts > 0:  # 1 (also at ep 1: the routing statistics over dp_cp)
        shard_experts(model, pgm)
        apply_global_capacity(model, pgm)  # a capacity drops what one device drops (06b)
        if precision is not None:  # the routed tokens in autocast's dtype (chapter 08)
            precision.after_expert_parallel(model)
    if pgm.tensor_model_parallel_world_size > 1:  # 2
        tensor_parallel(model, pgm, p.sequence_parallel, plan=tensor_parallel_plan)
        if cfg.model.tie_word_embeddings:  # both split by vocabulary rows: the same shard
            model.lm_head.weight = model.embed_tokens.weight
        if precision is not None:  # activations on the wire in autocast's dtype (chapter 08)
            precision.after_tensor_parallel(model)
        loss = tensor_parallel_loss_fn(pgm)
    if pgm.context_parallel_world_size > 1:  # 3
        apply_context_parallel(model, pgm, p.cp_variant, kernel=p.cp_attention)
        shard_sequence = make_sequence_sharder(pgm, cfg.data.seq_len)
    if recompute is not None:  # 4
        recompute(model, p.activation_checkpointing)
    splits = record_splits(model)

    pipe = None
    if pgm.pipeline_model_parallel_world_size > 1:  # 5
        if tied is not None and cfg.model.tie_word_embeddings:
            tied.before_pipeline(model, p.schedule in V_SHAPED)
        pipe = apply_pipeline_parallel(model, pgm, p.virtual_pipeline_stages, p.layer_split,
                                       p.sequence_parallel, p.schedule in V_SHAPED)
    modules: List[nn.Module] = list(pipe.chunks) if pipe is not None else [model]

    wrapped, optimizer = _apply_data_parallel(modules, cfg, pgm, precision, tied)  # 6
    # [end: order]
    zero = [w for w in wrapped if isinstance(w, ShardedDataParallel)]
    layout = TensorLayout(pgm, splits, zero_entries(zero) if zero else plain_entries(modules), pipe)

    if pipe is not None:
        pipe.chunks = nn.ModuleList(wrapped)
        trainer_model: nn.Module = pipe
        schedule = PipelineSchedule(pipe, pgm, p.schedule, cfg.data.num_micro_batches, loss,
                                    shard_sequence)
        schedule.hooks.append(MoELossInPipeline(cfg.data.num_micro_batches))  # MoE's loss (06)
        for i, chunk in enumerate(pipe.chunks):  # a split backward's W: ZeRO's full parameters,
            units = getattr(chunk, "units", None)  # which the forward reads, not its shards
            if units is not None:
                schedule.params[i] = [t for u in units for t in u.tensors if t.requires_grad]
        if precision is not None:  # chapter 08: messages in autocast's dtype, fp16's scaling
            precision.attach_to_pipeline(schedule)
        if tied is not None and cfg.model.tie_word_embeddings:  # sum the two copies' grads
            tied.after_schedule(schedule, pgm)
        step: ForwardBackward = schedule
    else:
        trainer_model = wrapped[0]
        aux_loss: Callable = moe_aux_loss
        if precision is not None:  # chapter 08: under fp16, backward from scale x each loss
            loss, aux_loss = precision.scale_losses(loss, aux_loss)
        step = make_data_parallel_step(trainer_model, cfg.data.num_micro_batches,
                                       pgm.data_parallel_rank, pgm.data_parallel_world_size,
                                       pgm.gradient_sync_group, loss, shard_sequence, aux_loss)

    replicas = layout.replicas()

    def clip_grad_norm(max_norm: float) -> torch.Tensor:
        for w in zero:
            w.finish_grad_sync()
        norm = world_grad_norm(replicas, device)  # one all-reduce of one number, world
        return clip_grads_([param for param, _ in replicas], max_norm, norm)

    return Parallelized(trainer_model, step, clip_grad_norm, optimizer, layout)


# ---- what chapter 07 prints: every rank's place, traffic and memory in one table -------------

GROUPS = ("tp", "cp", "dp_cp", "pp", "ep", "edp", "world")
COORDS = ("tp", "cp", "dp", "pp", "ep")


def report_groups(context_parallel_size: int) -> Tuple[str, ...]:
    """GROUPS as the ledger names them: the dp_cp group is "dp" at cp 1, where it is dp."""
    name = gradient_group_name(context_parallel_size)
    return tuple(name if g == "dp_cp" else g for g in GROUPS)


def rank_report(pgm: ProcessGroupManager, model: nn.Module, optimizer: torch.optim.Optimizer,
                step: int) -> str:
    """Collective over the world: one row per rank with its coordinates, the bytes it put on
    the wire per group in ``step`` (the ledger) and the bytes it holds (params, grads, AdamW
    state). The same string on every rank."""
    from scaletorch.parallel.memory_report import measure_memory

    ledger = get_ledger()
    coords = pgm.grid.coordinates(pgm.rank)
    memory = measure_memory(model, optimizer)
    groups = report_groups(pgm.context_parallel_world_size)
    row: List[float] = [coords[c] for c in COORDS]
    row += [ledger.total(group=g, step=step, field="wire_bytes") / 1e6 for g in groups]
    row += [memory[k] / 1e6 for k in ("params", "grads", "optimizer")]
    mine = torch.tensor([row], dtype=torch.float64, device=next(model.parameters()).device)
    rows = mine.new_empty(pgm.world_size, len(row))
    with ledger.paused():  # the report is not training traffic
        comm.all_gather_into_tensor(rows, mine)
    head = (f"{'rank':>4} " + "".join(f"{c:>3}" for c in COORDS) + " |" + "".join(f"{g:>7}"
                                                                                  for g in groups) +
            " | " + "".join(f"{k:>9}" for k in ("params", "grads", "adam", "total")))
    lines = [f"per rank, step {step}: coordinates | wire MB per group | memory MB", head]
    for r, values in enumerate(rows.tolist()):
        mem = values[-3:]
        lines.append(f"{r:>4} " + "".join(f"{int(v):>3}" for v in values[:len(COORDS)]) + " |" +
                     "".join(f"{v:>7.3f}" for v in values[len(COORDS):-3]) + " | " +
                     "".join(f"{v:>9.3f}" for v in mem + [sum(mem)]))
    return "\n".join(lines)
