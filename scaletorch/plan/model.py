"""What the planner needs to know about a model: its shapes, and its parameters per piece.

Two kinds. ``llama`` is this repository's model (scaletorch/models/llama.py): RMSNorm (weight
only), RoPE (no parameters), grouped-query attention without biases, SwiGLU MLP (gate, up,
down), untied head unless asked, optional mixture-of-experts blocks (a router h x E and E
SwiGLU experts). ``gpt`` is the model of the papers the planner is checked against (Megatron's
GPT: LayerNorm with bias, biased projections, a 4h GELU MLP); its block has 12 h^2 + 13 h
parameters, the "12 L h^2" of Korthikanti et al. and of the 72 B L s h^2 FLOPs formula.

A model comes from this repository's ``LlamaConfig`` (``from_config``), a preset (``preset``:
the Llama 3 shapes and the paper's GPT configurations), or a parameter count alone
(``from_params``: a Llama with Llama 3's proportions). Pure Python: no torch.
"""

import math
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Tuple

from scaletorch.rules.schema import MAX_LAYERS
from scaletorch.rules.vocab import padded_vocab_size


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a decoder-only transformer. h = hidden, f = MLP width, V = vocabulary."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    kind: str = "llama"  # llama | gpt
    name: str = "model"
    tie_word_embeddings: bool = False
    num_experts: int = 0
    moe_top_k: int = 2
    moe_layer_freq: int = 1
    moe_intermediate_size: int = 0
    vocab_pad_to: int = 128  # tensor parallel pads V to a multiple of this x tp (Megatron)
    # parameters added to the head's unit so that a model has an exact count (``exact``): for
    # formula work (ZeRO's Table 1 is of Psi = 7.5e9 exactly), not a layer of a real model
    extra_params: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("llama", "gpt"):
            raise ValueError(f"model kind must be llama or gpt, got {self.kind!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model {name} must be positive, got {getattr(self, name)}")
        if self.extra_params < 0:
            raise ValueError(f"model extra_params must not be negative, got {self.extra_params}")
        if self.hidden_size % self.num_attention_heads or \
                self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}), num_attention_heads "
                             f"({self.num_attention_heads}) and num_key_value_heads "
                             f"({self.num_key_value_heads}) must divide in that order")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_size(self) -> int:
        """Width of k (and of v): key-value heads x head_dim."""
        return self.num_key_value_heads * self.head_dim

    @property
    def expert_size(self) -> int:
        return self.moe_intermediate_size or self.intermediate_size

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i % self.moe_layer_freq == 0

    # ---- parameters, by piece (the units ZeRO shards, tensor parallel splits) --------------
    def attention_params(self) -> int:
        h = self.hidden_size
        if self.kind == "gpt":
            return 4 * h * h + 4 * h  # qkv and output projections, with biases
        return 2 * h * h + 2 * h * self.kv_size  # q, o: h x h; k, v: h x kv

    def mlp_params(self) -> int:
        h, f = self.hidden_size, self.intermediate_size
        return 2 * h * f + f + h if self.kind == "gpt" else 3 * h * f

    def norm_params(self) -> int:
        """One norm: RMSNorm has a weight, LayerNorm a weight and a bias."""
        return 2 * self.hidden_size if self.kind == "gpt" else self.hidden_size

    def expert_params(self) -> int:
        """All experts of one MoE block (E x 3 h f_e); the router is dense (``router_params``)."""
        return self.num_experts * 3 * self.hidden_size * self.expert_size

    def router_params(self) -> int:
        return self.hidden_size * self.num_experts

    def layer_params(self, i: int) -> Tuple[int, int]:
        """(dense, expert) parameters of block ``i``."""
        dense = self.attention_params() + 2 * self.norm_params()
        if self.is_moe_layer(i):
            return dense + self.router_params(), self.expert_params()
        return dense + self.mlp_params(), 0

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def vocab_rows(self, tp: int = 1) -> int:
        """Rows of the embedding and the head as the trainer holds them under tensor parallel
        ``tp``: the vocabulary padded when tp does not divide it (``padded_vocab_size``)."""
        return padded_vocab_size(self.vocab_size, tp, self.vocab_pad_to)

    def head_params(self) -> int:
        """The final norm and the output projection (0 for a head tied to the embedding)."""
        return self.norm_params() + (0 if self.tie_word_embeddings else
                                     self.embedding_params()) + self.extra_params

    def num_parameters(self) -> int:
        return self.embedding_params() + self.head_params() + sum(
            sum(self.layer_params(i)) for i in range(self.num_layers))

    def active_parameters(self) -> int:
        """Parameters a token goes through: an MoE block counts k of its E experts."""
        total = self.num_parameters()
        for i in range(self.num_layers):
            if self.is_moe_layer(i):
                total -= self.expert_params() * (self.num_experts - self.moe_top_k) \
                    // self.num_experts
        return total


def from_config(config: Any) -> ModelSpec:
    """The planner's view of this repository's ``LlamaConfig`` (read by attribute name)."""
    return ModelSpec(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                     num_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
                     num_key_value_heads=config.num_key_value_heads,
                     intermediate_size=config.intermediate_size, kind="llama", name="config",
                     tie_word_embeddings=config.tie_word_embeddings, num_experts=config.num_experts,
                     moe_top_k=config.moe_top_k, moe_layer_freq=config.moe_layer_freq,
                     moe_intermediate_size=config.moe_intermediate_size,
                     vocab_pad_to=config.vocab_pad_to)


def _llama3(name: str, layers: int, hidden: int, heads: int, ffn: int) -> ModelSpec:
    return ModelSpec(vocab_size=128256, hidden_size=hidden, num_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=8, intermediate_size=ffn,
                     name=name)


def _gpt(name: str, layers: int, hidden: int, heads: int) -> ModelSpec:
    return ModelSpec(vocab_size=51200, hidden_size=hidden, num_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=heads,
                     intermediate_size=4 * hidden, kind="gpt", name=name)


# Llama 3 (public configs: vocabulary 128256, 8 key-value heads); Mixtral; GPT: Korthikanti et
# al. 2022, Table 3 (vocabulary 51200).
PRESETS: Dict[str, ModelSpec] = {
    "llama3-8b":
    _llama3("llama3-8b", 32, 4096, 32, 14336),
    "llama3-70b":
    _llama3("llama3-70b", 80, 8192, 64, 28672),
    "llama3-405b":
    _llama3("llama3-405b", 126, 16384, 128, 53248),
    # Mixtral 8x7B's public config: 8 SwiGLU experts of width 14336 in every block, top 2
    "mixtral-8x7b":
    ModelSpec(vocab_size=32000, hidden_size=4096, num_layers=32, num_attention_heads=32,
              num_key_value_heads=8, intermediate_size=14336, name="mixtral-8x7b", num_experts=8,
              moe_top_k=2),
    "gpt-22b":
    _gpt("gpt-22b", 48, 6144, 64),
    "gpt-175b":
    _gpt("gpt-175b", 96, 12288, 96),
    "gpt-530b":
    _gpt("gpt-530b", 105, 20480, 128),
    "gpt-1t":
    _gpt("gpt-1t", 128, 25600, 160),
}


def preset(name: str) -> ModelSpec:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]


def from_params(num_params: float, vocab_size: int = 128256) -> ModelSpec:
    """A Llama of about ``num_params`` parameters with Llama 3's proportions: head_dim 128,
    8 key-value heads, MLP width 3.5 h (rounded to 256), about h / 128 layers (depth and width
    grow together, as from 8B to 405B). The shape with the nearest count is returned, of at
    most MAX_LAYERS layers (the schema's bound on a model's depth); ValueError naming
    --params for a count that is not a positive finite number or needs more layers."""
    if not (math.isfinite(num_params) and num_params > 0):  # nan fails every comparison
        raise ValueError(f"--params must be positive and finite, got {num_params:g}")
    best: List[Tuple[float, ModelSpec]] = []
    for heads in range(8, 257, 8):
        h = 128 * heads
        ffn = 256 * round(3.5 * h / 256)
        spec = _llama3(f"llama-{num_params / 1e9:g}b", 1, h, heads, ffn)
        spec = replace(spec, vocab_size=vocab_size)
        per_layer = sum(spec.layer_params(0))
        layers = max(1, round((num_params - 2 * spec.embedding_params()) / per_layer))
        if layers > MAX_LAYERS:  # the planner walks a model's layers one by one
            continue
        spec = replace(spec, num_layers=layers)
        count = spec.embedding_params() + spec.head_params() + layers * per_layer  # dense
        # prefer about 128 hidden per layer (Llama 3: 128, 102, 130) among near counts
        error = abs(math.log(count / num_params)) + \
            0.05 * abs(math.log(h / (128 * layers)))
        best.append((error, spec))
    if not best:
        raise ValueError(f"--params {num_params:g} needs more than {MAX_LAYERS} layers at every "
                         f"width this planner shapes (hidden up to 32768): give a smaller count")
    return min(best, key=lambda e: e[0])[1]


def exact(spec: ModelSpec, num_params: float) -> ModelSpec:
    """``spec`` with ``extra_params`` making its count exactly ``num_params`` (rounded to an
    integer): for formula work where the count, not the shape, is given. Only upward: a
    count below the shape's raises ValueError naming both."""
    target = round(num_params)
    have = spec.num_parameters() - spec.extra_params
    if target < have:
        raise ValueError(f"--exact-params: {target:,} parameters is below the {have:,} of "
                         f"{spec.name}'s shape; give a smaller model")
    return replace(spec, extra_params=target - have)
