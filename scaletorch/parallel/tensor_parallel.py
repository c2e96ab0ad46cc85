"""Tensor parallel (Megatron-LM) and sequence parallel: split every matrix over the "tp" group.

A linear layer y = x A^T (A: out x in) can be split two ways over N ranks:

    column parallel   A = [A_1; ...; A_N] by output rows   y_i = x A_i^T    (b, s, out/N)
    row parallel      A = [A_1 ... A_N] by input columns   y = sum_i x_i A_i^T  (b, s, out)

A column-parallel layer followed by a row-parallel one needs no communication in between:
attention (q/k/v column, heads split; o row) and the MLP (gate/up column; down row) each cost
one all-reduce of (b, s, h) in forward (g, after the row-parallel matmul) and one in backward
(f, on the input of the column-parallel matmuls): 2 + 2 per transformer block.

    x (b,s,h) --f--> q,k,v | gate,up (column) --> (b,s,out/N) --> o | down (row) --g--> (b,s,h)
                 fwd: identity, bwd: all-reduce             fwd: all-reduce, bwd: identity

Sequence parallel (Korthikanti et al. 2022) shards the activations *between* those regions
(norms, residual adds) on the sequence: (b, s/N, h). f becomes an all-gather of the sequence
(backward: reduce-scatter) and g a reduce-scatter (backward: all-gather): the same bytes on
the wire as the all-reduce (= reduce-scatter + all-gather), but the norms and the residual
stream now hold s/N tokens per rank. The RMSNorm weights stay whole on every rank; each rank
sees only its tokens, so their gradients are summed over "tp" (the f operator on the weight).

Embedding and head are split over the vocabulary; the loss never gathers the logits: each
rank has (b, s, V/N) and only the max and the sum of exponentials are all-reduced. A vocabulary
that N does not divide (32000 at tp 3, 50257 at tp 2) is padded with zero rows to a multiple of
``vocab_pad_to`` x N, as Megatron does; the head gives the padding rows -inf logits, so loss,
gradients and sampling are those of the unpadded model, and a gathered state has no padding.

Longer than 300 lines on purpose: the column, row and vocabulary-parallel layers, the loss that
never gathers the logits and the model surgery that uses them are one lesson; the chapter's
report and its formulas (scaletorch/plan) are the only other things here.
"""

import math
from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from scaletorch.dist import ProcessGroupManager, comm, get_ledger
from scaletorch.dist.comm import Group
from scaletorch.dist.functional import (copy_to_parallel_region,
                                        gather_from_sequence_parallel_region,
                                        reduce_from_parallel_region,
                                        reduce_scatter_to_sequence_parallel_region)
from scaletorch.models import Llama, LlamaConfig, MoE, RMSNorm
from scaletorch.parallel.mixed_precision import to_compute
from scaletorch.plan.model import padded_vocab_size
# the formulas live with the planner (scaletorch/plan), which predicts whole layouts with them
from scaletorch.plan.traffic import tp_comm_elements as comm_elements_per_step

if TYPE_CHECKING:  # the config module imports scaletorch.parallel
    from scaletorch.config import Config


def _pad_rows(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """weight (V, h) with zero rows appended up to (rows, h): rows no token id reaches."""
    return torch.cat((weight, weight.new_zeros(rows - weight.size(0), weight.size(1))))


def _mark_padded(param: nn.Parameter, vocab_size: int, padded_size: int) -> None:
    """Tag a vocabulary-split parameter whose full form has rows [vocab_size, padded_size) of
    padding (param_map strips them when gathering and adds them back when scattering)."""
    setattr(param, "vocab_padding", (vocab_size, padded_size))


def _mark_sharded(param: nn.Parameter, dim: int) -> nn.Parameter:
    """Tag a parameter as split over tp along ``dim`` (for grad-norm and gathering)."""
    setattr(param, "tensor_model_parallel", True)
    setattr(param, "partition_dim", dim)
    return param


def _enter_region(x: torch.Tensor, group: Group, sequence_parallel: bool) -> torch.Tensor:
    """Hand a replicated activation to column-parallel matmuls.

    Without sequence parallel: f (forward identity, backward all-reduce over ``group``).
    With it: (b, s/N, h) -> (b, s, h) all-gather (backward reduce-scatter over ``group``).
    """
    x = to_compute(x)  # the matmuls' dtype under autocast: half the bytes (chapter 08)
    if sequence_parallel:
        return gather_from_sequence_parallel_region(x, group, dim=1)
    return copy_to_parallel_region(x, group)


def _exit_region(x: torch.Tensor, group: Group, sequence_parallel: bool) -> torch.Tensor:
    """Sum the partial outputs of row-parallel shards: all-reduce (g), or reduce-scatter of
    the sequence under sequence parallel: (b, s, h) -> (b, s/N, h)."""
    if sequence_parallel:
        return reduce_scatter_to_sequence_parallel_region(x, group, dim=1)
    return reduce_from_parallel_region(x, group)


class ColumnParallelLinear(nn.Module):
    """y_i = x A_i^T: this rank holds rows [i out/N, (i+1) out/N) of A (no bias).

    x: (b, s, in) replicated, or (b, s/N, in) under sequence parallel; y: (b, s, out/N).
    ``enter_region=False`` when the caller already applied f / the all-gather once for several
    layers reading the same input (q/k/v, gate/up): one collective instead of three.
    """

    def __init__(self, in_features: int, out_features: int, group: Group, *,
                 sequence_parallel: bool = False, enter_region: bool = True) -> None:
        super().__init__()
        n = comm.group_size(group)
        if out_features % n != 0:
            raise ValueError(f"column-parallel output size {out_features} is not divisible by "
                             f"the tensor-parallel size {n}")
        self.group, self.sequence_parallel, self.enter_region = group, sequence_parallel, \
            enter_region
        self.weight = _mark_sharded(nn.Parameter(torch.empty(out_features // n, in_features)), 0)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Group, **kwargs: Any) -> "ColumnParallelLinear":
        """This rank's row block of ``linear.weight`` (copied, so results equal the full layer)."""
        out_features, in_features = linear.weight.shape
        layer = cls(in_features, out_features, group, **kwargs).to(linear.weight)
        rows = layer.weight.shape[0]
        with torch.no_grad():
            layer.weight.copy_(linear.weight[comm.group_rank(group) * rows:][:rows])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter_region:
            x = _enter_region(x, self.group, self.sequence_parallel)
        return F.linear(x, self.weight)  # (b, s, out/N)


class RowParallelLinear(nn.Module):
    """y = sum_i x_i A_i^T: this rank holds columns [i in/N, (i+1) in/N) of A (no bias).

    x: (b, s, in/N), the output of a column-parallel layer; y: (b, s, out) after the
    all-reduce over ``group``, or (b, s/N, out) after the reduce-scatter under sequence parallel.
    """

    def __init__(self, in_features: int, out_features: int, group: Group, *,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        n = comm.group_size(group)
        if in_features % n != 0:
            raise ValueError(f"row-parallel input size {in_features} is not divisible by the "
                             f"tensor-parallel size {n}")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.weight = _mark_sharded(nn.Parameter(torch.empty(out_features, in_features // n)), 1)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: Group, **kwargs: Any) -> "RowParallelLinear":
        """This rank's column block of ``linear.weight``."""
        out_features, in_features = linear.weight.shape
        layer = cls(in_features, out_features, group, **kwargs).to(linear.weight)
        cols = layer.weight.shape[1]
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, comm.group_rank(group) * cols:][:, :cols])
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)  # (b, s, out), this rank's share of the sum
        return _exit_region(partial, self.group, self.sequence_parallel)


class VocabParallelEmbedding(nn.Module):
    """Rows [i V/N, (i+1) V/N) of the embedding table on rank i.

    ids: (b, s) -> (b, s, h) after an all-reduce over ``group`` (each token's row lives on one
    rank; the others contribute zeros), or (b, s/N, h) after a reduce-scatter under sequence
    parallel.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group: Group, *,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        n = comm.group_size(group)
        if num_embeddings % n != 0:
            raise ValueError(f"vocabulary size {num_embeddings} is not divisible by the "
                             f"tensor-parallel size {n}")
        self.group, self.sequence_parallel = group, sequence_parallel
        self.vocab_start = comm.group_rank(group) * (num_embeddings // n)
        self.weight = _mark_sharded(nn.Parameter(torch.empty(num_embeddings // n, embedding_dim)),
                                    0)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group: Group, padded_size: int = 0,
                       **kwargs: Any) -> "VocabParallelEmbedding":
        """This rank's rows of ``embedding``, padded with zero rows to ``padded_size`` if larger."""
        num_embeddings, embedding_dim = embedding.weight.shape
        padded_size = max(padded_size, num_embeddings)
        layer = cls(padded_size, embedding_dim, group, **kwargs).to(embedding.weight)
        rows = layer.weight.shape[0]
        with torch.no_grad():
            layer.weight.copy_(_pad_rows(embedding.weight, padded_size)[layer.vocab_start:][:rows])
        if padded_size > num_embeddings:
            _mark_padded(layer.weight, num_embeddings, padded_size)
        return layer

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = comm.group_size(self.group)
        if self.sequence_parallel and ids.size(1) % n != 0:
            raise ValueError(f"sequence parallel splits the sequence over the tensor-parallel "
                             f"group: sequence length {ids.size(1)} is not divisible by "
                             f"tensor_model_parallel_size {n}")
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (b, s, h)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)  # rows held by other ranks
        # the wire in the compute dtype under autocast (chapter 08), the residual stream in
        # the embedding's dtype again (fp32, as on one device)
        return _exit_region(to_compute(out), self.group, self.sequence_parallel).to(out.dtype)


class VocabParallelHead(ColumnParallelLinear):
    """The output layer split by vocabulary rows, padded like the embedding; the logits of the
    padding rows are -inf, so the loss and sampling never see them (exp(-inf) = 0: no
    probability, no gradient). x: (b, s, h) -> logits (b, s, V_padded/N)."""

    vocab_size: int = 0  # the real vocabulary
    vocab_start: int = 0  # this rank's first row

    @classmethod
    def from_head(cls, head: nn.Linear, group: Group, padded_size: int,
                  **kwargs: Any) -> "VocabParallelHead":
        vocab_size, hidden = head.weight.shape
        full = nn.Linear(hidden, max(padded_size, vocab_size), bias=False).to(head.weight)
        with torch.no_grad():
            full.weight.copy_(_pad_rows(head.weight, full.weight.size(0)))
        layer = cast(VocabParallelHead, cls.from_linear(full, group, **kwargs))
        layer.vocab_size = vocab_size
        layer.vocab_start = comm.group_rank(group) * layer.weight.shape[0]
        if full.weight.size(0) > vocab_size:
            _mark_padded(layer.weight, vocab_size, full.weight.size(0))
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)  # (b, s, V_padded/N)
        first_pad = self.vocab_size - self.vocab_start  # local columns from here are padding
        if first_pad < logits.size(-1):
            pad = torch.arange(logits.size(-1), device=logits.device) >= first_pad
            logits = logits.masked_fill(pad, float("-inf"))
        return logits


class ParallelRMSNorm(RMSNorm):
    """RMSNorm whose output feeds column-parallel matmuls: norm, then f or the all-gather.

    Doing the entry here, once, serves q/k/v (or gate/up, or the head) with one collective.
    x: (b, s, h) or (b, s/N, h) under sequence parallel -> (b, s, h). Under sequence parallel
    each rank normalizes only its tokens, so the weight goes through f: its gradient is
    all-reduced over ``group`` in backward and stays identical on every rank.
    """

    def __init__(self, dim: int, eps: float, group: Group, sequence_parallel: bool) -> None:
        super().__init__(dim, eps)
        self.group, self.sequence_parallel = group, sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight: torch.Tensor = self.weight
        if self.sequence_parallel:
            weight = copy_to_parallel_region(weight, self.group)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        y = (normed * weight.float()).to(x.dtype)
        return _enter_region(y, self.group, self.sequence_parallel)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of vocab-sharded logits (n, V/N); targets (n,) global ids.

    Forward: all-reduce MAX of the row max (n), then one all-reduce SUM of [sum exp, target
    logit] (2 n) over ``group``. Backward: (softmax - one_hot) / n, local, no communication.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor,
                group: Group) -> torch.Tensor:
        logits32 = logits.float()
        row_max = logits32.max(dim=-1).values  # (n,)
        comm.all_reduce(row_max, group, op=dist.ReduceOp.MAX)
        shifted = logits32 - row_max.unsqueeze(-1)  # (n, V/N), <= 0 everywhere
        vocab_local = logits.size(-1)
        local = targets - comm.group_rank(group) * vocab_local
        mine = (local >= 0) & (local < vocab_local)  # this rank holds the target's logit
        local = local.masked_fill(~mine, 0)
        # where, not a product: a rank holding only padding has -inf there (-inf * 0 = nan)
        target_logit = torch.where(mine, shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
        exp = shifted.exp()
        stats = torch.stack((exp.sum(dim=-1), target_logit))  # (2, n)
        comm.all_reduce(stats, group)
        sum_exp, target_logit = stats[0], stats[1]
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, mine)
        ctx.input_dtype = logits.dtype
        return (sum_exp.log() - target_logit).mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None, None]:
        softmax, local, mine = ctx.saved_tensors  # softmax: (n, V/N) of the full distribution
        grad_logits = softmax.clone()
        rows = torch.arange(grad_logits.size(0), device=grad_logits.device)
        grad_logits[rows, local] -= mine.to(grad_logits.dtype)
        grad_logits.mul_(grad / grad_logits.size(0))
        return grad_logits.to(ctx.input_dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor,
                                 group: Group) -> torch.Tensor:
    """Mean cross-entropy of logits (b, s, V/N) sharded over ``group`` by vocabulary and
    targets (b, s); equals ``models.loss_fn`` on the gathered logits, never gathering them."""
    return _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.size(-1)),
                                            targets.reshape(-1), group)


def tensor_parallel_loss_fn(
        pgm: ProcessGroupManager) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss_fn(logits, targets)`` for the trainer step of a model converted here."""
    group = pgm.tensor_model_parallel_group
    return lambda logits, targets: vocab_parallel_cross_entropy(logits, targets, group)


def validate_tensor_parallel(config: LlamaConfig, tensor_model_parallel_size: int,
                             sequence_parallel: bool = False,
                             seq_len: Optional[int] = None) -> None:
    """Raise ValueError if ``config`` cannot be split over ``tensor_model_parallel_size`` ranks."""
    tp = tensor_model_parallel_size
    if sequence_parallel and tp == 1:
        raise ValueError("sequence parallel shards activations over the tensor-parallel group "
                         "and needs tensor_model_parallel_size > 1, got 1: set --tp, or drop "
                         "--sequence-parallel")
    if sequence_parallel and config.num_experts > 0:
        raise ValueError(f"sequence parallel with mixture-of-experts layers is not supported "
                         f"(num_experts = {config.num_experts}): the MoE runs whole on every "
                         f"tensor-parallel rank and needs the full sequence; drop "
                         f"--sequence-parallel")
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
    }  # the vocabulary need not divide: apply_tensor_parallel pads it (vocab_pad_to)
    for name, value in sizes.items():
        if value % tp != 0:
            divides = math.gcd(*sizes.values())
            raise ValueError(f"model.{name} ({value}) is not divisible by "
                             f"tensor_model_parallel_size ({tp}): tp must divide the heads, "
                             f"key/value heads and intermediate size; here a divisor of "
                             f"{divides}")
    if sequence_parallel and seq_len is not None and seq_len % tp != 0:
        raise ValueError(f"sequence parallel needs the sequence length ({seq_len}) of a cp "
                         f"rank divisible by tensor_model_parallel_size ({tp}): change "
                         f"data.seq_len or --tp")


def apply_tensor_parallel(model: Llama, pgm: ProcessGroupManager,
                          sequence_parallel: bool = False) -> Llama:
    """Convert the reference Llama in place; every shard is copied from the full weights.

    q/k/v, gate/up: column parallel (heads and kv heads split contiguously, so a rank's query
    heads use its own kv heads); o, down: row parallel; embedding and head: vocabulary
    parallel; norms: replicated. The model's forward then returns logits (b, s, V/N): use
    ``tensor_parallel_loss_fn(pgm)`` as the trainer's loss.
    """
    group, tp = pgm.tensor_model_parallel_group, pgm.tensor_model_parallel_world_size
    cfg = model.config
    validate_tensor_parallel(cfg, tp, sequence_parallel)

    def norm(old: RMSNorm) -> ParallelRMSNorm:
        new = ParallelRMSNorm(old.weight.numel(), old.eps, group, sequence_parallel).to(old.weight)
        with torch.no_grad():
            new.weight.copy_(old.weight)
        return new

    def column(linear: nn.Linear) -> ColumnParallelLinear:  # the norm before it enters the region
        return ColumnParallelLinear.from_linear(linear, group, enter_region=False,
                                                sequence_parallel=sequence_parallel)

    def row(linear: nn.Linear) -> RowParallelLinear:
        return RowParallelLinear.from_linear(linear, group, sequence_parallel=sequence_parallel)

    # The surgery puts parallel modules where the reference's types say nn.Linear, nn.Embedding
    # or RMSNorm, which mypy cannot follow: it works on an untyped handle of the same model.
    ref: Any = model
    for block in ref.layers:
        attn, mlp = block.self_attn, block.mlp
        block.input_layernorm = norm(block.input_layernorm)
        attn.q_proj, attn.k_proj, attn.v_proj = column(attn.q_proj), column(attn.k_proj), \
            column(attn.v_proj)
        attn.o_proj = row(attn.o_proj)
        if isinstance(mlp, MoE):  # experts are split over "ep" (chapter 06), not "tp": the MoE
            continue  # runs whole on every tp rank on the replicated input, so no f before it
        block.post_attention_layernorm = norm(block.post_attention_layernorm)
        mlp.gate_proj, mlp.up_proj = column(mlp.gate_proj), column(mlp.up_proj)
        mlp.down_proj = row(mlp.down_proj)
    padded = padded_vocab_size(cfg.vocab_size, tp, cfg.vocab_pad_to)
    ref.embed_tokens = VocabParallelEmbedding.from_embedding(ref.embed_tokens, group, padded,
                                                             sequence_parallel=sequence_parallel)
    ref.norm = norm(ref.norm)
    ref.lm_head = VocabParallelHead.from_head(ref.lm_head, group, padded, enter_region=False,
                                              sequence_parallel=sequence_parallel)
    if cfg.tie_word_embeddings:  # both are split by vocabulary rows: the same shard
        ref.lm_head.weight = ref.embed_tokens.weight
    return model


def format_block_comm(config: LlamaConfig, tokens: int, tp: int, sequence_parallel: bool,
                      precision: str = "fp32") -> str:
    """The collectives of one transformer block for one micro-batch of ``tokens`` = b x s;
    activations cross the wire in the compute ``precision`` (chapter 08: 2 bytes in bf16)."""
    e = 4 if precision == "fp32" else 2
    n = tokens * config.hidden_size
    if sequence_parallel:
        sites = [("attention input (g-bar)", "all_gather", "reduce_scatter"),
                 ("o_proj output (f-bar)", "reduce_scatter", "all_gather"),
                 ("MLP input (g-bar)", "all_gather", "reduce_scatter"),
                 ("down_proj output (f-bar)", "reduce_scatter", "all_gather")]
        wire = 8 * (tp - 1) / tp * e * n
    else:
        sites = [("attention input (f)", "-", "all_reduce"),
                 ("o_proj output (g)", "all_reduce", "-"), ("MLP input (f)", "-", "all_reduce"),
                 ("down_proj output (g)", "all_reduce", "-")]
        wire = 4 * 2 * (tp - 1) / tp * e * n
    lines = [
        f"one transformer block, one micro-batch: b x s x h = {tokens} x "
        f"{config.hidden_size} = {n:,} elements per collective, tp {tp}",
        f"{'site':<26}{'forward':<16}{'backward':<16}"
    ]
    lines += [f"{site:<26}{fwd:<16}{bwd:<16}" for site, fwd, bwd in sites]
    lines.append(f"per block: 2 forward + 2 backward = 4 x b x s x h = {4 * n:,} elements" +
                 (" in each of all_gather and reduce_scatter" if sequence_parallel else "") +
                 f"; ring wire {wire / 1e6:.3f} MB per rank ({precision})")
    return "\n".join(lines)


def tp_report(cfg: "Config", pgm: ProcessGroupManager, step: int) -> str:
    """What chapter 03 prints after training (rank 0's view, no communication): one block's
    collectives, the ledger's table of ``step`` and every tp op next to its formula."""
    p, d, tp = cfg.parallel, cfg.data, pgm.tensor_model_parallel_world_size
    if tp == 1:
        return ""
    from scaletorch.config import resolve_precision
    tokens = d.global_batch_size // pgm.data_parallel_world_size * d.seq_len  # per rank
    ledger = get_ledger()
    precision = resolve_precision(cfg, "cuda" if torch.cuda.is_available() else "cpu")
    lines = [
        format_block_comm(cfg.model, tokens // d.num_micro_batches, tp, p.sequence_parallel,
                          precision),
        ledger.table(step=step)
    ]
    if p.impl == "torch":
        lines.append("note: DTensor issues its collectives itself, out of our ledger's sight")
        return "\n".join(lines)
    # the grad norm is one all-reduce over the world (grad_norm.py), not over tp
    formula = comm_elements_per_step(cfg.model, tokens, p.sequence_parallel, d.num_micro_batches)
    for op, expected in formula.items():
        measured = ledger.total(op=op, group="tp", step=step, phase="compute")
        lines.append(f"{op} over tp in step {step}: ledger {measured:,.0f} elements, formula "
                     f"{expected:,} ({'OK' if measured == expected else 'MISMATCH'})")
    return "\n".join(lines)
