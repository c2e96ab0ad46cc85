"""The one layout check: can this config run on ``world_size`` ranks?

``validate_layout(cfg, world_size)`` decides from the config's sizes alone: no process group,
no model. Every script calls it before it starts a process group or builds a model
(``trainer.load_config``), ``scripts/launch.sh`` calls it before torchrun starts any process
(``--validate-only``), and ``parallelize`` calls it again before any surgery. A refusal is a
ValueError naming the user's settings and what to change, e.g.

    model.tie_word_embeddings true with parallel.schedule 'zbv' ...: ...; use ...

Rules that are a strategy's own (heads divisible by tp, the pipeline schedule, experts over
ep, the split of the layers) live in its module and are called from here; the strategies keep
their checks on the tensors they are handed. doc/07_nd_parallel.md, "Limits", lists them all.
"""

from typing import TYPE_CHECKING, Dict

from scaletorch.parallel.context_parallel import check_sequence_length
from scaletorch.parallel.expert_parallel import validate_expert_parallel
from scaletorch.parallel.moe_balance import validate_balancing
from scaletorch.parallel.tensor_parallel import validate_tensor_parallel
from scaletorch.rules.group_names import gradient_group_name
from scaletorch.schedule.catalog import validate_schedule
from scaletorch.schedule.placement import V_SHAPED, stage_ranges

if TYPE_CHECKING:  # the config module imports this one
    from scaletorch.config import Config


def data_parallel_size(cfg: "Config", world_size: int) -> int:
    """Ranks that see different samples: world / (tp x pp x cp), checked against the config."""
    p = cfg.parallel
    model_parallel = (p.tensor_model_parallel_size * p.pipeline_model_parallel_size *
                      p.context_parallel_size)
    if world_size % model_parallel != 0:
        raise ValueError(f"world size {world_size} is not divisible by tensor_model_parallel_size "
                         f"({p.tensor_model_parallel_size}) x pipeline_model_parallel_size "
                         f"({p.pipeline_model_parallel_size}) x context_parallel_size "
                         f"({p.context_parallel_size}) = {model_parallel}: launch a multiple of "
                         f"{model_parallel} processes, or change these sizes")
    dp = world_size // model_parallel
    if p.data_parallel_size not in (0, dp):
        raise ValueError(
            f"data_parallel_size ({p.data_parallel_size}) x tensor_model_parallel_size "
            f"({p.tensor_model_parallel_size}) x pipeline_model_parallel_size "
            f"({p.pipeline_model_parallel_size}) x context_parallel_size "
            f"({p.context_parallel_size}) != world size ({world_size}): set "
            f"parallel.data_parallel_size {dp}, or 0 for whatever the world leaves")
    return dp


def layout_sizes(cfg: "Config", world_size: int) -> Dict[str, int]:
    """{tp, pp, cp, ep, dp, dp_cp, stages}: the group sizes ``cfg`` asks of ``world_size`` ranks."""
    p = cfg.parallel
    dp = data_parallel_size(cfg, world_size)
    return {
        "tp": p.tensor_model_parallel_size,
        "pp": p.pipeline_model_parallel_size,
        "cp": p.context_parallel_size,
        "ep": p.expert_model_parallel_size,
        "dp": dp,
        "dp_cp": dp * p.context_parallel_size,
        "stages": p.pipeline_model_parallel_size * p.virtual_pipeline_stages,
    }


def validate_layout(cfg: "Config", world_size: int) -> Dict[str, int]:
    """Raise ValueError, naming the settings and what to change, for any layout of ``cfg`` that
    cannot run on ``world_size`` ranks; else return ``layout_sizes``."""
    sizes = layout_sizes(cfg, world_size)
    _check_batch(cfg, sizes)
    _check_context(cfg, sizes)
    # under context parallel, sequence parallel splits the s/cp local tokens over tp
    validate_tensor_parallel(cfg.model, sizes["tp"], cfg.parallel.sequence_parallel,
                             cfg.data.seq_len // sizes["cp"])
    validate_expert_parallel(cfg.model.num_experts, sizes["ep"], sizes["dp_cp"])
    validate_balancing(cfg.model, sizes["pp"], sizes["cp"])  # chapter 06b's remedies
    _check_pipeline(cfg, sizes)
    _check_tied_embeddings(cfg, sizes)
    _check_combinations(cfg, sizes)
    return sizes


def _check_batch(cfg: "Config", sizes: Dict[str, int]) -> None:
    m, batch = cfg.data.num_micro_batches, cfg.data.global_batch_size
    if batch % (sizes["dp"] * m) != 0:
        raise ValueError(f"data.global_batch_size ({batch}) is not divisible by "
                         f"data_parallel_size ({sizes['dp']}) x data.num_micro_batches ({m}): "
                         f"set data.global_batch_size to a multiple of {sizes['dp'] * m}")


def _check_context(cfg: "Config", sizes: Dict[str, int]) -> None:
    cp, tp = sizes["cp"], sizes["tp"]
    if cp > 1:
        check_sequence_length(cfg.data.seq_len, cp)
    if cp == 1 or cfg.parallel.cp_variant != "ulysses":
        return
    # Ulysses gives each cp rank 1/cp of the heads that this tp rank holds
    for name in ("num_attention_heads", "num_key_value_heads"):
        total = getattr(cfg.model, name)
        local = total // tp
        if local % cp != 0:
            per_rank = f" / tensor_model_parallel_size {tp} = {local} heads per tp rank," \
                if tp > 1 else " heads"
            raise ValueError(
                f"model.{name} {total}{per_rank} not divisible by context_parallel_size {cp} "
                f"for Ulysses (it splits each tp rank's heads over cp): use "
                f"--cp-variant ring, or a context_parallel_size that divides {local}")


def _check_pipeline(cfg: "Config", sizes: Dict[str, int]) -> None:
    p = cfg.parallel
    if sizes["pp"] > 1 or p.virtual_pipeline_stages > 1:
        validate_schedule(p.schedule, sizes["pp"], cfg.data.num_micro_batches,
                          p.virtual_pipeline_stages)
    m, pp = cfg.data.num_micro_batches, sizes["pp"]
    rounds = max(1, m // pp)  # how torch's ScheduleInterleavedZeroBubble groups micro-batches
    if p.impl == "torch" and p.schedule == "zb-h1" and pp > 1 and m % rounds != 0:
        raise ValueError(f"parallel.impl 'torch' runs zb-h1 as ScheduleInterleavedZeroBubble, "
                         f"which needs num_micro_batches ({m}) divisible by max(1, "
                         f"num_micro_batches // pipeline_model_parallel_size ({pp})) = {rounds}: "
                         f"use a multiple of {pp}, or impl 'ours'")
    if p.layer_split is not None and sizes["pp"] == 1:
        raise ValueError(f"parallel.layer_split {list(p.layer_split)} needs a pipeline: "
                         f"pipeline_model_parallel_size is 1 (set --pp, or drop layer_split)")
    if sizes["pp"] > 1:
        stage_ranges(cfg.model.num_layers, sizes["stages"], p.layer_split)


def _check_tied_embeddings(cfg: "Config", sizes: Dict[str, int]) -> None:
    """Tied embeddings run with ZeRO (one shard, zero.py) and with our pipeline (a copy on the
    first and the last stage, tied_embeddings.py; in a V both are rank 0's chunks, which
    share the one parameter), except where a V's chunks are wrapped one by one."""
    p = cfg.parallel
    if not cfg.model.tie_word_embeddings or sizes["pp"] == 1:
        return
    wrapped = sizes["dp_cp"] > 1 or p.zero_stage > 0 or cfg.model.num_experts > 0
    dp = gradient_group_name(sizes["cp"])  # "dp" at cp 1, "dp_cp" when context parallel runs
    if p.schedule in V_SHAPED and p.impl != "torch" and wrapped:
        raise ValueError(f"model.tie_word_embeddings true with parallel.schedule {p.schedule!r} "
                         f"(pipeline_model_parallel_size {sizes['pp']}), {dp} {sizes['dp_cp']}, "
                         f"zero_stage {p.zero_stage}, num_experts {cfg.model.num_experts}: a "
                         f"V-shaped schedule's two chunks on rank 0 share the tied weight, and "
                         f"each chunk's data-parallel, ZeRO or expert wrapper would sync it on "
                         f"its own; run the V with {dp} 1, zero_stage 0 and no experts, use "
                         f"afab, 1f1b, interleaved or zb-h1, or model.tie_word_embeddings false")
    if p.impl == "torch":
        raise ValueError(f"model.tie_word_embeddings true with parallel.impl 'torch' and "
                         f"pipeline_model_parallel_size {sizes['pp']}: torch.distributed."
                         f"pipelining stages do not share parameters across ranks (no embedding "
                         f"group sums the first and the last stage's copies); use impl "
                         f"'ours', or model.tie_word_embeddings false")


def _check_combinations(cfg: "Config", sizes: Dict[str, int]) -> None:
    """What ``parallelize`` cannot compose (its module docstring says why)."""
    p, m = cfg.parallel, cfg.model
    tp, pp, cp = sizes["tp"], sizes["pp"], sizes["cp"]
    if m.num_experts > 0 and p.zero_stage > 0:
        raise ValueError(f"zero_stage ({p.zero_stage}) with mixture-of-experts "
                         f"(num_experts = {m.num_experts}) is not supported: ZeRO shards over "
                         f"{gradient_group_name(cp)} ({sizes['dp_cp']}) but experts are "
                         f"replicated over edp ({sizes['dp_cp'] // sizes['ep']}); set "
                         f"parallel.zero_stage 0")
    if m.num_experts > 0 and p.sequence_parallel:
        raise ValueError(f"sequence parallel with mixture-of-experts layers is not supported "
                         f"(num_experts = {m.num_experts}): the MoE runs whole on every "
                         f"tensor-parallel rank and needs the full sequence; drop "
                         f"--sequence-parallel")
    if m.num_experts > 0 and p.impl != "ours":
        raise ValueError(f"parallel.impl {p.impl!r} has no mixture-of-experts (num_experts "
                         f"{m.num_experts}): expert parallel is ours only, impl 'ours'")
    if p.zero_stage > 0 and p.impl == "naive":
        raise ValueError(f"parallel.impl 'naive' is plain data parallel, not ZeRO (zero_stage "
                         f"{p.zero_stage}): use impl 'ours' or 'torch'")
    if p.impl == "torch" and p.zero_stage in (1, 2):
        raise ValueError(f"parallel.impl 'torch' runs ZeRO as FSDP2 fully_shard, which is ZeRO-3; "
                         f"got zero_stage {p.zero_stage}: use zero_stage 3, or impl 'ours'")
    if p.impl == "torch" and tp > 1 and m.vocab_size % tp != 0:
        raise ValueError(f"parallel.impl 'torch' splits the embedding and head with DTensor, "
                         f"which does not pad the vocabulary: vocab_size {m.vocab_size} is not "
                         f"divisible by tensor_model_parallel_size {tp}; chapter 10 pads it "
                         f"(examples/10_real_model.py, impl 'ours')")
    others = {"tp": tp, "pp": pp, "zero_stage": p.zero_stage}
    if p.impl == "torch" and cp > 1 and (tp > 1 or pp > 1 or p.zero_stage == 3):
        got = ", ".join(f"{k} {v}" for k, v in others.items())
        raise ValueError(f"parallel.impl 'torch' with context_parallel_size {cp} runs our ring "
                         f"or Ulysses attention beside DistributedDataParallel only (PyTorch's "
                         f"context_parallel shards CUDA attention kernels, none on CPU); got "
                         f"{got}: use impl 'ours'")
