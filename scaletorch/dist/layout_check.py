"""The one layout check: can this config run on ``world_size`` ranks?

``validate_layout(cfg, world_size)`` decides from the config's sizes alone: no process group,
no model. Every script calls it before it starts a process group or builds a model
(``trainer.load_config``), ``scripts/launch.sh`` calls it before torchrun starts any process
(``--validate-only``), and ``parallelize`` calls it again before any surgery. A refusal is a
ValueError naming the user's settings and what to change, e.g.

    model.tie_word_embeddings true with parallel.schedule 'zbv' ...: ...; use ...

The strategies' own size rules (heads divisible by tp, experts over ep, the zigzag slices of
cp) are here too, and each strategy calls its rule by one line when it is applied: refusals
are no chapter's idea, so they live beside wrap_checks.py, not in the strategy a learner
reads. doc/07_nd_parallel.md, "Limits", lists them all. ``cfg`` is a scaletorch.config
``Config`` (read, never imported here: the config sits above dist).
"""

import math
from typing import Any, Dict, Optional

from scaletorch.rules.group_names import gradient_group_name
from scaletorch.rules.recompute import recompute_mode
from scaletorch.schedule.catalog import validate_schedule
from scaletorch.schedule.placement import V_SHAPED, stage_ranges


def validate_tensor_parallel(config: Any, tensor_model_parallel_size: int,
                             sequence_parallel: bool = False,
                             seq_len: Optional[int] = None) -> None:
    """Raise ValueError if the model ``config`` (a LlamaConfig) cannot be split over
    ``tensor_model_parallel_size`` ranks (chapter 03)."""
    tp = tensor_model_parallel_size
    if sequence_parallel and tp == 1:
        raise ValueError("sequence parallel shards activations over the tensor-parallel group "
                         "and needs tensor_model_parallel_size > 1, got 1: set --tp, or drop "
                         "--sequence-parallel")
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
    }  # the vocabulary is checked by the embedding: chapter 10 pads it first when tp does not
    for name, value in sizes.items():
        if value % tp != 0:
            divides = math.gcd(*sizes.values())
            raise ValueError(f"model.{name} ({value}) is not divisible by "
                             f"tensor_model_parallel_size ({tp}): tp must divide the heads, "
                             f"key/value heads and intermediate size; here a divisor of "
                             f"{divides}")
    if sequence_parallel and seq_len is not None:
        check_sequence_parallel_length(seq_len, tp)


def check_sequence_parallel_length(seq_len: int, tp: int) -> None:
    """Sequence parallel splits each sequence (of a cp rank) over the tp ranks (chapter 03)."""
    if seq_len % tp != 0:
        raise ValueError(f"sequence parallel needs the sequence length ({seq_len}) of a cp "
                         f"rank divisible by tensor_model_parallel_size ({tp}): change "
                         f"data.seq_len or --tp")


def check_split(size: int, n: int, what: str, hint: str = "") -> None:
    """A tensor-parallel layer's split of ``size`` rows or columns into ``n`` equal shards."""
    if size % n != 0:
        raise ValueError(f"{what} {size} is not divisible by the tensor-parallel size {n}{hint}")


def check_sequence_length(seq_len: int, cp_size: int) -> None:
    """Zigzag cuts each sequence into 2 x cp slices: ``seq_len`` must be divisible by it
    (chapter 05)."""
    if seq_len % (2 * cp_size) != 0:
        raise ValueError(f"sequence length {seq_len} (data.seq_len) is not divisible by 2 x "
                         f"context_parallel_size ({cp_size}) = {2 * cp_size}, the zigzag "
                         f"slices: set data.seq_len to a multiple of {2 * cp_size}")


def validate_expert_parallel(num_experts: int, expert_model_parallel_size: int,
                             data_parallel_size_with_context: int) -> None:
    """Raise ValueError if ``num_experts`` experts cannot be split over the ep ranks
    (chapter 06)."""
    ep, e, dp_cp = expert_model_parallel_size, num_experts, data_parallel_size_with_context
    if ep > 1 and e == 0:
        raise ValueError(f"expert_model_parallel_size ({ep}) needs a mixture-of-experts model, "
                         f"but model.num_experts is 0: set model.num_experts (e.g. "
                         f"--model.num_experts {2 * ep}) or --ep 1")
    if e % ep != 0:
        raise ValueError(f"model.num_experts ({e}) is not divisible by "
                         f"expert_model_parallel_size ({ep}): every ep rank holds "
                         f"num_experts / ep experts")
    if dp_cp % ep != 0:
        raise ValueError(f"expert_model_parallel_size ({ep}) does not divide data_parallel_size "
                         f"x context_parallel_size ({dp_cp}): ep is carved out of those ranks; "
                         f"choose an ep that divides {dp_cp}")


def data_parallel_size(cfg: Any, world_size: int) -> int:
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


def layout_sizes(cfg: Any, world_size: int) -> Dict[str, int]:
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


def validate_layout(cfg: Any, world_size: int) -> Dict[str, int]:
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


def validate_parallelize(cfg: Any, pgm: Any, precision: Any = None, tied: Any = None,
                         recompute: Any = None) -> Dict[str, int]:
    """``parallelize``'s refusals, before any surgery: ``validate_layout``, then ``pgm`` (a
    ProcessGroupManager) must hold the process groups of ``cfg``'s layout, and what later
    chapters attach from outside (08's ``precision``, 10's ``tied`` and ``recompute``) must be
    given when the config asks for it. Returns ``layout_sizes``."""
    sizes = validate_layout(cfg, pgm.world_size)
    have = {
        "tp": pgm.tensor_model_parallel_world_size,
        "pp": pgm.pipeline_model_parallel_world_size,
        "cp": pgm.context_parallel_world_size,
        "ep": pgm.expert_model_parallel_world_size,
        "dp": pgm.data_parallel_world_size,
    }
    wrong = [f"{k} {have[k]} (config: {sizes[k]})" for k in have if have[k] != sizes[k]]
    if wrong:
        raise ValueError(f"the process-group manager's sizes differ from cfg.parallel: "
                         f"{', '.join(wrong)}; build it from the same config")
    if precision is None:
        check_fp32_without_hooks(cfg)
    if tied is None:
        check_tied_without_hooks(cfg)
    if recompute is None:
        check_recompute_without_hook(cfg)
    return sizes


def check_fp32_without_hooks(cfg: Any) -> None:
    """Without chapter 08's hooks every wire is fp32 (autocast may still compute in bf16):
    ValueError for what needs them, fp16's loss scale and the policy's dtypes."""
    t, p = cfg.training, cfg.parallel
    if t.precision == "fp16" or p.param_dtype not in ("auto", "fp32") or p.reduce_dtype != "fp32":
        raise ValueError(f"training.precision {t.precision}, parallel.param_dtype "
                         f"{p.param_dtype}, parallel.reduce_dtype {p.reduce_dtype} need chapter "
                         f"08's hooks: parallelize(..., precision=precision_hooks(cfg, "
                         f"device.type)) from scaletorch.parallel.mixed_precision, as "
                         f"examples/08_mixed_precision.py does")


def check_recompute_without_hook(cfg: Any) -> None:
    """Recomputation is chapter 10's, attached from outside: ValueError when asked without it."""
    mode = recompute_mode(cfg.parallel.activation_checkpointing)
    if mode != "none":
        raise ValueError(f"parallel.activation_checkpointing {mode!r} needs chapter 10's hook: "
                         f"parallelize(..., recompute=apply_activation_checkpointing) from "
                         f"scaletorch.parallel.activation_checkpointing, as "
                         f"examples/10_real_model.py does")


def check_tied_without_hooks(cfg: Any) -> None:
    """A tied model under our pipeline or ZeRO needs chapter 10's hooks: ValueError."""
    p, pp = cfg.parallel, cfg.parallel.pipeline_model_parallel_size
    if cfg.model.tie_word_embeddings and p.impl != "torch" and (pp > 1 or p.zero_stage > 0):
        raise ValueError(f"model.tie_word_embeddings true with pipeline_model_parallel_size "
                         f"{pp} and zero_stage {p.zero_stage} needs chapter 10's hooks: "
                         f"parallelize(..., tied=TiedEmbeddings()) from "
                         f"scaletorch.parallel.tied_embeddings, as examples/10_real_model.py does")


def _check_batch(cfg: Any, sizes: Dict[str, int]) -> None:
    m, batch = cfg.data.num_micro_batches, cfg.data.global_batch_size
    if batch % (sizes["dp"] * m) != 0:
        raise ValueError(f"data.global_batch_size ({batch}) is not divisible by "
                         f"data_parallel_size ({sizes['dp']}) x data.num_micro_batches ({m}): "
                         f"set data.global_batch_size to a multiple of {sizes['dp'] * m}")


def _check_context(cfg: Any, sizes: Dict[str, int]) -> None:
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


def _check_pipeline(cfg: Any, sizes: Dict[str, int]) -> None:
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


def _check_tied_embeddings(cfg: Any, sizes: Dict[str, int]) -> None:
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


def _check_combinations(cfg: Any, sizes: Dict[str, int]) -> None:
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


def validate_balancing(model: Any, pp: int, cp: int) -> None:
    """ValueError naming the numbers for a remedy of chapter 06b that a layout of chapter 07
    cannot hold: the bias under a pipeline (a checkpoint keeps one rank's bias, and each stage
    holds other MoE layers), capacity under context parallel (its queue runs along whole
    sequences). ``model`` is the config's model section."""
    if model.num_experts > 0 and model.moe_bias_rate > 0 and pp > 1:
        raise ValueError(f"model.moe_bias_rate {model.moe_bias_rate} with pipeline_model_"
                         f"parallel_size {pp}: a checkpoint keeps one rank's routing bias, and "
                         f"each stage holds other MoE layers; use pp 1 or model.moe_bias_rate 0")
    if model.num_experts > 0 and model.moe_capacity_factor > 0 and cp > 1:
        raise ValueError(f"model.moe_capacity_factor {model.moe_capacity_factor} with context_"
                         f"parallel_size {cp}: the global capacity queues whole sequences in "
                         f"token order, and cp splits each one; use cp 1 or capacity factor 0")
