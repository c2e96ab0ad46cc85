"""A small Llama: RMSNorm, rotary position embeddings, grouped-query attention, SwiGLU.

The model knows nothing about parallelism. Parallel strategies rewrite it in place, so a few
choices here exist to make that surgery easy:

- ``Attention.forward`` infers the local head count from the projection weights
  (``.view(b, s, -1, head_dim)``), so tensor parallel can shrink q/k/v/o and nothing else.
- ``Attention.attention_fn`` is an attribute, so context parallel can swap in ring attention
  per module.
- Rotary cos/sin are computed in ``forward`` from explicit ``position_ids``; context parallel
  passes the (non-contiguous, zigzag) positions of its local chunk.
- ``Llama.forward`` is split into ``embed``, ``rope``, the layers and ``head`` so pipeline
  stages can run just their part.

With ``num_experts > 0`` the MLP of every ``moe_layer_freq``-th block is a mixture of experts
(``moe.py``); the trainer adds its auxiliary load-balancing loss to the training loss.

Shapes: b = batch, s = sequence, h = hidden, hq / hkv = query / key-value heads, d = head_dim.
"""

import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from scaletorch.models.moe import Experts, MoE
from scaletorch.rules.schema import (MAX_LAYERS, PRINTED, REFUSED, at_least, check_fields, checked,
                                     count, positive, unless)


@dataclass
class LlamaConfig:
    vocab_size: int = checked(256, positive(), resume=REFUSED)
    hidden_size: int = checked(64, positive(), resume=REFUSED)
    intermediate_size: int = checked(128, positive(), resume=REFUSED)
    num_layers: int = checked(2, count(MAX_LAYERS), resume=REFUSED)
    num_attention_heads: int = checked(4, positive(), resume=REFUSED)
    num_key_value_heads: int = checked(2, positive(), resume=REFUSED)
    max_seq_len: int = checked(64, positive(), resume=REFUSED)
    rope_theta: float = checked(10000.0, positive(), resume=REFUSED)
    norm_eps: float = checked(1e-5, positive(), resume=REFUSED)
    tie_word_embeddings: bool = checked(False, resume=REFUSED)
    init_std: float = checked(0.02, positive(), resume=PRINTED)
    # Tensor parallel splits embedding and head by vocabulary rows; a vocabulary tp does not
    # divide is padded by chapter 10 (parallel/vocab_padding.py) to a multiple of vocab_pad_to
    # x tp (Megatron's make-vocab-size-divisible-by), with the padded logits masked. This model
    # is never padded; without tensor parallel (tp 1, the run's key below) nothing reads it.
    vocab_pad_to: int = checked(128, unless(positive(), "parallel.tensor_model_parallel_size", 1),
                                resume=REFUSED)
    # Mixture of experts (moe.py); num_experts 0 = a dense model, which reads no moe_* field.
    num_experts: int = checked(0, at_least(0), resume=REFUSED)
    # experts per token
    moe_top_k: int = checked(2, unless(positive(), "num_experts", 0), resume=REFUSED)
    # block i is MoE when i % moe_layer_freq == 0 (1: every block)
    moe_layer_freq: int = checked(1, unless(positive(), "num_experts", 0), resume=REFUSED)
    # each expert's SwiGLU width; 0: intermediate_size
    moe_intermediate_size: int = checked(0, unless(at_least(0), "num_experts", 0), resume=REFUSED)
    # weight of the load-balancing loss in the training loss
    moe_aux_loss_coeff: float = checked(0.01, unless(at_least(0), "num_experts", 0), resume=PRINTED)
    # > 0: drop assignments beyond capacity; 0: never drop
    moe_capacity_factor: float = checked(0.0, unless(at_least(0), "num_experts", 0), resume=PRINTED)
    # > 0: DeepSeek-V3's routing bias, moved by this much per step (the Trainer attaches it,
    # parallel/moe_balance.py); 0: the top-k of the probabilities alone
    moe_bias_rate: float = checked(0.0, unless(at_least(0), "num_experts", 0), resume=PRINTED)

    def __post_init__(self) -> None:
        check_fields(self)  # every field's type and range (the rules above)
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(f"hidden_size ({self.hidden_size}) is not divisible by "
                             f"num_attention_heads ({self.num_attention_heads})")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) is not divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2 != 0:
            # RoPE rotates pairs of channels.
            raise ValueError(f"head_dim = hidden_size ({self.hidden_size}) / num_attention_heads "
                             f"({self.num_attention_heads}) = {self.head_dim} must be even for "
                             f"rotary embeddings")
        if self.num_experts > 0 and not 1 <= self.moe_top_k <= self.num_experts:
            raise ValueError(f"moe_top_k ({self.moe_top_k}) must be between 1 and num_experts "
                             f"({self.num_experts})")

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether block ``layer_idx`` has a mixture of experts instead of the dense MLP."""
        return self.num_experts > 0 and layer_idx % self.moe_layer_freq == 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, over the last dim (size ``dim``)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 so bf16 runs do not lose precision in the mean of squares.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def rope_cos_sin(position_ids: torch.Tensor, head_dim: int,
                 theta: float = 10000.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables for the given positions.

    position_ids: (s,) or (b, s) integer positions, in any order (context parallel passes a
    zigzag subset). Returns cos, sin of shape (*position_ids.shape, head_dim), fp32.
    """
    inv_freq = 1.0 / (theta**(
        torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim))
    angles = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq  # (..., s, d/2)
    # Channel i is paired with channel i + d/2 (the "rotate half" layout used by Llama).
    angles = torch.cat((angles, angles), dim=-1)  # (..., s, d)
    return angles.cos(), angles.sin()


# [core: rotate-half]
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (b, s, heads, d) by cos/sin of shape (s, d) or (b, s, d)."""
    cos = cos.unsqueeze(-2)  # broadcast over heads
    sin = sin.unsqueeze(-2)
    out = x.float() * cos + _rotate_half(x.float()) * sin
    return out.to(x.dtype)


# [end: rotate-half]
def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention with grouped-query heads.

    q: (b, s, hq, d), k and v: (b, s, hkv, d) with hq a multiple of hkv.
    Returns (b, s, hq, d). Token i attends to tokens 0..i of this call's sequence.
    """
    num_q_heads, num_kv_heads, head_dim = q.size(2), k.size(2), q.size(3)
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"query heads ({num_q_heads}) not divisible by key/value heads ({num_kv_heads})")
    # GQA: query head j uses kv head j // group, so consecutive query heads share a kv head
    # (and a contiguous tensor-parallel shard of q heads matches its shard of kv heads).
    group = num_q_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)

    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, hq, s, d)
    scores = (q @ k.transpose(-2, -1)).float() / math.sqrt(head_dim)  # (b, hq, s, s)
    seq_len = q.size(2)
    future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype)
    out = probs @ v  # (b, hq, s, d)
    return out.transpose(1, 2)  # (b, s, hq, d)


class Attention(nn.Module):

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, config.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * d, h, bias=False)
        # (q, k, v) -> out. Context parallel replaces this with ring attention on each module.
        self.attention_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                                    torch.Tensor] = causal_attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (b, s, h) -> (b, s, h). cos/sin: (s, d) or (b, s, d)."""
        b, s, _ = x.shape
        # -1: the head count follows the weights, so tensor-parallel shards work unchanged.
        q = self.q_proj(x).view(b, s, -1, self.head_dim)  # (b, s, hq, d)
        k = self.k_proj(x).view(b, s, -1, self.head_dim)  # (b, s, hkv, d)
        v = self.v_proj(x).view(b, s, -1, self.head_dim)  # (b, s, hkv, d)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.attention_fn(q, k, v)  # (b, s, hq, d)
        return self.o_proj(out.reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def build_moe(config: LlamaConfig) -> MoE:
    """The mixture of experts that replaces a block's MLP (``config.num_experts > 0``)."""
    return MoE(config.hidden_size, config.moe_intermediate_size or config.intermediate_size,
               config.num_experts, config.moe_top_k, config.moe_aux_loss_coeff,
               config.moe_capacity_factor)


class TransformerBlock(nn.Module):

    def __init__(self, config: LlamaConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = build_moe(config) if config.is_moe_layer(layer_idx) else MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (b, s, h) -> (b, s, h), pre-norm residual blocks."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class Llama(nn.Module):

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 init from the global RNG: N(0, init_std), residual outputs scaled down.

        o_proj and down_proj write into the residual stream, which sums 2 * num_layers of
        them, so their std is init_std / sqrt(2 * num_layers) to keep its variance flat.
        """
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.num_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                is_residual = name.endswith(("o_proj", "down_proj"))
                nn.init.normal_(module.weight, mean=0.0, std=residual_std if is_residual else std)
            elif isinstance(module, Experts):
                module.init_weights(std, residual_std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(b, s) token ids -> (b, s, h)."""
        return self.embed_tokens(input_ids)

    def rope(self, position_ids: Optional[torch.Tensor], seq_len: int,
             device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for ``position_ids`` ((s,) or (b, s)), or for arange(seq_len) if None."""
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=device)
        return rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """(b, s, h) -> logits (b, s, vocab)."""
        return self.lm_head(self.norm(x))

    def forward(self, input_ids: torch.Tensor,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """input_ids (b, s), position_ids (s,) or (b, s) -> logits (b, s, vocab)."""
        seq_len = input_ids.size(1)
        if seq_len > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds max_seq_len ({self.config.max_seq_len})")
        x = self.embed(input_ids)
        cos, sin = self.rope(position_ids, seq_len, input_ids.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.head(x)

    def num_parameters(self) -> int:
        """Number of distinct parameters (tied embeddings count once)."""
        return sum(p.numel() for p in self.parameters())


def build_model(config: LlamaConfig, seed: int) -> Llama:
    """Build the full model with weights that depend only on ``seed``.

    Every rank calls this with the same seed and gets the same reference weights, whatever
    the global RNG state was; that state is restored afterwards. Built on CPU, move it after.
    """
    # fork_rng restores the CPU RNG on exit; seeding only the CPU generator leaves any CUDA
    # RNG untouched (torch.manual_seed would reseed CUDA too).
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        return Llama(config)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all tokens, in fp32. logits (b, s, V), targets (b, s)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
