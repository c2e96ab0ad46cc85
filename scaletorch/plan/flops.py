"""Floating-point operations per step: model FLOPs (for MFU) and what the hardware executes.

A matmul of an (n x k) by a (k x o) matrix costs 2 n k o. Per token and block, forward: the
projections cost 2 x their weights (the GPT block: 2 x 12 h^2; our Llama: 2 (2 h^2 + 2 h kv +
3 h f)) and the attention core 4 s h (q k^T and the weighted sum over s positions, the full
square as Megatron counts it, not the causal half); the head 2 h V per token. Backward costs
twice the forward. So for B sequences of s tokens, GPT (Korthikanti et al. 2022, eq. for
model FLOPs):

    3 x [ L (24 B s h^2 + 4 B s^2 h) + 2 B s h V ] = 72 B L s h^2 (1 + s / (6 h) + V / (12 h L))

whose large-h limit is 6 N D (N = 12 L h^2 parameters, D = B s tokens). Recomputation adds a
forward of the blocks (full) or of the attention cores (selective) to the hardware FLOPs, not
to the model FLOPs: MFU counts only the work the model needs. Likewise the head's rows of
padding (a vocabulary tp does not divide, padded as the trainer pads it) are hardware FLOPs.
"""

from typing import Sequence, Tuple

from scaletorch.plan.layout import PlanLayout
from scaletorch.plan.model import ModelSpec


def block_matmul_params(model: ModelSpec, i: int = 0) -> int:
    """Weights a token multiplies in block ``i`` (MoE: the router and k of the experts)."""
    h = model.hidden_size
    if model.kind == "gpt":
        return 12 * h * h
    attention = 2 * h * h + 2 * h * model.kv_size
    if model.is_moe_layer(i):
        return attention + h * model.num_experts + model.moe_top_k * 3 * h * model.expert_size
    return attention + 3 * h * model.intermediate_size


def forward_flops(model: ModelSpec, sequences: int, seq_len: int, vocab: int = 0) -> float:
    """One forward of ``sequences`` sequences of ``seq_len`` tokens: blocks and head (of
    ``vocab`` rows: default the model's vocabulary, unpadded)."""
    tokens, h = sequences * seq_len, model.hidden_size
    blocks = sum(2 * block_matmul_params(model, i) for i in range(model.num_layers))
    core = 4 * seq_len * h * model.num_layers
    return tokens * (blocks + core + 2 * h * (vocab or model.vocab_size))


def model_flops(model: ModelSpec, sequences: int, seq_len: int) -> float:
    """Forward + backward (3 x forward): the FLOPs of MFU."""
    return 3 * forward_flops(model, sequences, seq_len)


def hardware_flops(model: ModelSpec, layout: PlanLayout) -> float:
    """What the GPUs execute for one step of ``layout``'s global batch, recomputation included,
    the head over the vocabulary padded for tp (its padding rows are multiplied too)."""
    b, s, h = layout.global_batch, layout.seq_len, model.hidden_size
    rows = model.vocab_rows(layout.tp)
    out = 3 * forward_flops(model, b, s, rows)
    if layout.activation_checkpointing == "full":
        out += forward_flops(model, b, s) - b * s * 2 * h * model.vocab_size  # blocks again
    elif layout.activation_checkpointing == "selective":
        out += b * s * 4 * s * h * model.num_layers  # the attention cores again
    return out


def gpt_model_flops(batch: int, layers: int, seq_len: int, hidden: int, vocab: int) -> float:
    """72 B L s h^2 (1 + s / (6 h) + V / (12 h L)), as the paper writes it."""
    correction = 1 + seq_len / (6 * hidden) + vocab / (12 * hidden * layers)
    return 72 * batch * layers * seq_len * hidden**2 * correction


def six_nd(num_params: float, tokens: float) -> float:
    """The 6 N D rule: 2 N D forward, 4 N D backward."""
    return 6 * num_params * tokens


def split_backward_flops(model: ModelSpec, layout: PlanLayout,
                         layers: Sequence[int]) -> Tuple[float, float, float]:
    """(F, B, W): FLOPs per token of one micro-batch through blocks ``layers``: the forward, the
    input gradient (B) and the weight gradient (W) of the zero-bubble schedules.

    A matmul y = x A costs 2 n k o in each of the three (x A; dy A^T; x^T dy), so a
    matmul-dominated block has F = B = W; the attention core (q k^T and the weighted sum,
    4 s h) has no weights: its backward, twice its forward, is all B. Recomputation runs in B
    (the first backward of a block rebuilds it): full adds the block's forward, selective the
    core's. The head and the embedding are left out (the stages of the closed-form bubbles are
    equal too); this repository's readable W also walks the input-gradient chain again
    (pipeline_runtime.py), which production W's (and these costs) do not.
    """
    matmul = sum(2.0 * block_matmul_params(model, i) for i in layers)
    core = 4.0 * layout.seq_len * model.hidden_size * len(layers)
    redo = {"selective": core, "full": matmul + core}.get(layout.activation_checkpointing, 0.0)
    return matmul + core, matmul + 2 * core + redo, matmul
