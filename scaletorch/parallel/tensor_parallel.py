"""Tensor parallel (Megatron-LM) and sequence parallel: split every matrix over the "tp" group.

A linear layer y = x A^T (A: out x in) can be split two ways over N ranks:

    column parallel   A = [A_1; ...; A_N] by output rows   y_i = x A_i^T    (b, s, out/N)
    row parallel      A = [A_1 ... A_N] by input columns   y = sum_i x_i A_i^T  (b, s, out)

A column-parallel layer followed by a row-parallel one needs no communication in between:
attention (q/k/v column, heads split; o row) and the MLP (gate/up column; down row) each cost
one all-reduce of (b, s, h) in forward (f-bar, after the row-parallel matmul) and one in
backward (f, on the input of the column-parallel matmuls): 2 + 2 per transformer block.

    x (b,s,h) --f--> q,k,v | gate,up (column) --> (b,s,out/N) --> o | down (row) --f-bar--> (b,s,h)
                 fwd: identity, bwd: all-reduce             fwd: all-reduce, bwd: identity

Sequence parallel (Korthikanti et al. 2022, whose names these are) shards the activations
*between* those regions (norms, residual adds) on the sequence: (b, s/N, h). f becomes g, an
all-gather of the sequence (backward: reduce-scatter), and f-bar becomes g-bar, a
reduce-scatter (backward: all-gather): the same bytes on the wire as the all-reduce (=
reduce-scatter + all-gather), but the norms and the residual stream now hold s/N tokens per
rank. The RMSNorm weights stay whole on every rank; each rank sees only its tokens, so their
gradients are summed over "tp" (the f operator on the weight).

Embedding and head are split over the vocabulary; the loss never gathers the logits: each
rank has (b, s, V/N) and only the max and the sum of exponentials are all-reduced. N must
divide the vocabulary here; chapter 10 pads one it does not divide (vocab_padding.py).

Here: the model surgery, the chapter's clip and formula; the layers are in
tensor_parallel_layers.py, PyTorch's DTensor version in tensor_parallel_dtensor.py.
"""

from typing import Any, Callable, Dict, Tuple

import torch
from torch import nn

from scaletorch.config import Config
from scaletorch.dist import ProcessGroupManager, get_ledger
from scaletorch.dist.layout_check import validate_tensor_parallel
from scaletorch.models import Llama, LlamaConfig, RMSNorm
from scaletorch.parallel.grad_norm import clip_grads_, replica_count, world_grad_norm
from scaletorch.parallel.tensor_parallel_layers import (ColumnParallelLinear, ParallelRMSNorm,
                                                        RowParallelLinear, VocabParallelEmbedding,
                                                        vocab_parallel_cross_entropy)

# Which layers of a block (their names in chapter 00's Llama) are split how; PyTorch's version
# (tensor_parallel_dtensor.py) hands the same plan to parallelize_module
BLOCK_PLAN = {
    "norm": ("input_layernorm", "post_attention_layernorm"),
    "column":
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
    "row": ("self_attn.o_proj", "mlp.down_proj"),
}
Plan = Callable[[nn.Module], Dict[str, Tuple[str, ...]]]  # block -> {kind: layer names}


def apply_tensor_parallel(model: Llama, pgm: ProcessGroupManager, sequence_parallel: bool = False,
                          plan: Plan = lambda block: BLOCK_PLAN) -> Llama:
    """Convert the reference Llama in place; every shard is copied from the full weights.

    q/k/v, gate/up: column parallel (heads and kv heads split contiguously, so a rank's query
    heads use its own kv heads); o, down: row parallel; embedding and head: vocabulary
    parallel; norms: replicated. The model's forward then returns logits (b, s, V/N): use
    ``tensor_parallel_loss_fn(pgm)`` as the trainer's loss. ``plan(block)``: which of a block's
    layers are split how (``BLOCK_PLAN``; a later chapter's block may keep some whole).
    """
    group, tp = pgm.tensor_model_parallel_group, pgm.tensor_model_parallel_world_size
    validate_tensor_parallel(model.config, tp, sequence_parallel)
    kwargs: Dict[str, Any] = dict(sequence_parallel=sequence_parallel)

    def norm(old: RMSNorm) -> ParallelRMSNorm:
        new = ParallelRMSNorm(old.weight.numel(), old.eps, group, sequence_parallel).to(old.weight)
        with torch.no_grad():
            new.weight.copy_(old.weight)
        return new

    def column(linear: nn.Linear) -> ColumnParallelLinear:  # the norm before it enters the region
        return ColumnParallelLinear.from_linear(linear, group, enter_region=False, **kwargs)

    def row(linear: nn.Linear) -> RowParallelLinear:
        return RowParallelLinear.from_linear(linear, group, sequence_parallel=sequence_parallel)

    split: Dict[str, Callable[[Any], nn.Module]] = dict(norm=norm, column=column, row=row)
    for block in model.layers:
        for kind, names in plan(block).items():
            for name in names:
                block.set_submodule(name, split[kind](block.get_submodule(name)))
    embed = VocabParallelEmbedding.from_embedding(model.embed_tokens, group, **kwargs)
    model.set_submodule("embed_tokens", embed)
    model.set_submodule("norm", norm(model.norm))
    model.set_submodule("lm_head", column(model.lm_head))  # the vocabulary-parallel head
    return model


def tensor_parallel_loss_fn(
        pgm: ProcessGroupManager) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss_fn(logits, targets)`` for the trainer step of a model converted here."""
    group = pgm.tensor_model_parallel_group
    return lambda logits, targets: vocab_parallel_cross_entropy(logits, targets, group)


def tensor_parallel_clip_grad_norm(model: nn.Module,
                                   pgm: ProcessGroupManager) -> Callable[[float], torch.Tensor]:
    """The Trainer's ``clip_grad_norm``: the global norm counts a tp shard once and a replicated
    norm weight once per tp group (divided by its tp x dp copies, grad_norm.py); one
    all-reduce of one number over the world."""
    params = list(model.parameters())
    replicas = [(p, replica_count(p, pgm)) for p in params]

    def clip(max_norm: float) -> torch.Tensor:
        return clip_grads_(params, max_norm, world_grad_norm(replicas, params[0].device))

    return clip


def format_block_comm(config: LlamaConfig, tokens: int, tp: int, sequence_parallel: bool,
                      element_size: int = 4) -> str:
    """The collectives of one transformer block for one micro-batch of ``tokens`` = b x s;
    activations cross the wire as they are computed, ``element_size`` bytes each (fp32: 4)."""
    n = tokens * config.hidden_size
    if sequence_parallel:  # Korthikanti et al.'s names: g enters a region, g-bar leaves it
        enter, leave = ("g", "all_gather", "reduce_scatter"), ("g-bar", "reduce_scatter",
                                                               "all_gather")
    else:
        enter, leave = ("f", "-", "all_reduce"), ("f-bar", "all_reduce", "-")
    sites = [(f"{where} ({op[0]})", op[1], op[2])
             for where, op in (("attention input", enter), ("o_proj output", leave),
                               ("MLP input", enter), ("down_proj output", leave))]
    # 4 all-reduces, or 4 all-gather + reduce-scatter pairs
    wire = 8 * (tp - 1) / tp * element_size * n
    lines = [
        f"one transformer block, one micro-batch: b x s x h = {tokens} x "
        f"{config.hidden_size} = {n:,} elements per collective, tp {tp}",
        f"{'site':<26}{'forward':<16}{'backward':<16}"
    ]
    lines += [f"{site:<26}{fwd:<16}{bwd:<16}" for site, fwd, bwd in sites]
    lines.append(f"per block: 2 forward + 2 backward = 4 x b x s x h = {4 * n:,} elements" +
                 (" in each of all_gather and reduce_scatter" if sequence_parallel else "") +
                 f"; ring wire {wire / 1e6:.3f} MB per rank ({element_size} bytes per element)")
    return "\n".join(lines)


def tp_comm_elements(config: LlamaConfig, tokens: int, sequence_parallel: bool,
                     num_micro_batches: int = 1) -> Dict[str, int]:
    """Elements a rank sends over "tp" per optimizer step, by op, as the ledger counts them (the
    full tensor of an all-gather or reduce-scatter); ``tokens`` = b x s over its micro-batches:

        blocks       4 tokens h per block (2 forward + 2 backward)
        embedding      tokens h   (forward: the sum of the vocabulary shards' rows)
        head input     tokens h   (backward: f before the vocabulary-parallel head)
        loss         3 tokens     (the max, then [sum exp, target logit])
        sp norms     h m per norm (the RMSNorm weight gradients, per micro-batch; sp only)

    Without sequence parallel all are all-reduces; with it each activation term is one
    all-gather and one reduce-scatter. (The grad norm's one number goes over the world.)
    """
    layers, h = config.num_layers, config.hidden_size
    activations = (4 * layers + 2) * tokens * h
    if not sequence_parallel:
        return {"all_reduce": activations + 3 * tokens}
    norms = (2 * layers + 1) * h * num_micro_batches
    return {
        "all_gather": activations,
        "reduce_scatter": activations,
        "all_reduce": 3 * tokens + norms
    }


def tp_report(cfg: Config, pgm: ProcessGroupManager, step: int, element_size: int = 4) -> str:
    """What chapter 03 prints after training (rank 0's view, no communication): one block's
    collectives, the ledger's table of ``step`` and every tp op next to its formula;
    ``element_size``: bytes of one activation element as the run computes it."""
    p, d, tp = cfg.parallel, cfg.data, pgm.tensor_model_parallel_world_size
    tokens = d.global_batch_size // pgm.data_parallel_world_size * d.seq_len  # per rank
    ledger = get_ledger()
    block = format_block_comm(cfg.model, tokens // d.num_micro_batches, tp, p.sequence_parallel,
                              element_size)
    lines = [block, ledger.table(step=step)]
    if p.impl == "torch":
        lines.append("note: DTensor issues its collectives itself, out of our ledger's sight")
        return "\n".join(lines)
    # the grad norm is one all-reduce over the world (grad_norm.py), not over tp
    formula = tp_comm_elements(cfg.model, tokens, p.sequence_parallel, d.num_micro_batches)
    for op, expected in formula.items():
        measured = ledger.total(op=op, group="tp", step=step, phase="compute")
        lines.append(f"{op} over tp in step {step}: ledger {measured:,.0f} elements, formula "
                     f"{expected:,} ({'OK' if measured == expected else 'MISMATCH'})")
    return "\n".join(lines)
