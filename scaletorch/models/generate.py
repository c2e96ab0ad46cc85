"""Autoregressive generation with a key/value cache: greedy, temperature, top-k, top-p.

Without a cache every new token re-runs the whole prefix: O(s^2) block work for s tokens.
With one, the prompt runs once ("prefill") and each later step feeds only the newest token,
whose query attends to the cached keys and values of every earlier position ("decode"):

    prefill  ids (b, s0)   -> logits of the last position, cache k, v: (b, s0, hkv, d) per layer
    decode   token (b, 1)  -> append its k, v at position s0 + t, attend over (b, s0 + t + 1)

The cached path reuses the model's own modules (projections, norms, MLP, ``apply_rope``), so
it is the same function as ``Llama.forward``; tests check both give the same greedy tokens,
and the same tokens as ``transformers``' ``generate`` for a checkpoint loaded from it.
One device; the model is the plain reference ``Llama`` (load a consolidated checkpoint or an
HF directory into it first).
"""

import math
from typing import List, Optional, Tuple, cast

import torch
import torch.nn.functional as F

from scaletorch.models.llama import Llama, TransformerBlock, apply_rope
from scaletorch.rules.errors import clip
from scaletorch.rules.schema import seed_range

KVCache = List[Tuple[torch.Tensor, torch.Tensor]]  # per layer: k, v (b, s_cached, hkv, d)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of the last t positions over all T cached positions.

    q: (b, t, hq, d), k and v: (b, T, hkv, d) with T >= t; query i sits at position T - t + i.
    Returns (b, t, hq, d).
    """
    t, total, group = q.size(1), k.size(1), q.size(2) // k.size(2)
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (b, hq, ., d)
    scores = (q @ k.transpose(-2, -1)).float() / math.sqrt(q.size(-1))  # (b, hq, t, T)
    query_pos = torch.arange(total - t, total, device=q.device)[:, None]
    future = torch.arange(total, device=q.device)[None, :] > query_pos  # (t, T)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1).to(v.dtype)
    return (probs @ v).transpose(1, 2)


# [core: kv-cache]
def _block_with_cache(
    block: TransformerBlock, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    cache: Optional[Tuple[torch.Tensor, torch.Tensor]]
) -> Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """TransformerBlock.forward for new positions x (b, t, h), extending the layer's cache."""
    attn = block.self_attn
    b, t, _ = x.shape
    h = block.input_layernorm(x)
    q = attn.q_proj(h).view(b, t, -1, attn.head_dim)
    k = attn.k_proj(h).view(b, t, -1, attn.head_dim)
    v = attn.v_proj(h).view(b, t, -1, attn.head_dim)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cache is not None:
        k, v = torch.cat((cache[0], k), dim=1), torch.cat((cache[1], v), dim=1)
    x = x + attn.o_proj(_attend(q, k, v).reshape(b, t, -1))
    x = x + block.mlp(block.post_attention_layernorm(x))
    return x, (k, v)


def forward_with_cache(model: Llama, input_ids: torch.Tensor,
                       cache: Optional[KVCache]) -> Tuple[torch.Tensor, KVCache]:
    """Logits (b, t, vocab) of new tokens input_ids (b, t) after the cached ones, new cache."""
    start = 0 if cache is None else cache[0][0].size(1)
    positions = torch.arange(start, start + input_ids.size(1), device=input_ids.device)
    if positions[-1] >= model.config.max_seq_len:
        raise ValueError(f"position {int(positions[-1])} exceeds max_seq_len "
                         f"({model.config.max_seq_len})")
    cos, sin = model.rope(positions, input_ids.size(1), input_ids.device)
    x = model.embed(input_ids)
    new_cache = []
    for i, layer in enumerate(model.layers):
        block = cast(TransformerBlock, layer)  # torch types a ModuleList's items nn.Module
        x, layer_cache = _block_with_cache(block, x, cos, sin, None if cache is None else cache[i])
        new_cache.append(layer_cache)
    return model.head(x), new_cache


# [end: kv-cache]
def check_sampling(temperature: float, top_k: int, top_p: float, seed: int = 0) -> None:
    """ValueError unless temperature >= 0 (0: greedy), top_k >= 0 (0: all) and top_p in
    (0, 1], each finite, and the generator's ``seed`` in [0, 2**63) (``seed_range``: what
    ``torch.Generator.manual_seed`` takes)."""
    wrong = []  # each value that breaks its rule, named with the rule
    if not (math.isfinite(temperature) and temperature >= 0):
        wrong.append(f"temperature {temperature} (need a finite number >= 0)")
    if top_k < 0:
        wrong.append(f"top_k {top_k} (need >= 0)")
    if not 0 < top_p <= 1:
        wrong.append(f"top_p {top_p} (need 0 < top_p <= 1)")
    if wrong:
        raise ValueError("; ".join(wrong))
    if not seed_range().admits(seed):
        raise ValueError(f"need a seed {seed_range().allowed(int)} ({clip(seed)})")


def check_length(prompt_len: int, max_new_tokens: int, max_seq_len: int) -> None:
    """ValueError unless the prompt has a token (the first new token is sampled from the
    logits at its last position), max_new_tokens >= 0, and the prompt plus the new tokens fit
    the model's ``max_seq_len`` positions (RoPE was trained on those, the cache holds no more)."""
    if prompt_len < 1:
        raise ValueError(f"the prompt encodes to {prompt_len} tokens: generation continues a "
                         f"prompt of at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    total = prompt_len + max_new_tokens
    if total > max_seq_len:
        raise ValueError(f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) = "
                         f"{total} exceeds max_seq_len ({max_seq_len})")


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next tokens (b,) from last-position logits (b, V).

    temperature 0: greedy (argmax). Else softmax(logits / temperature) restricted to the top_k
    most likely tokens (0: all) and to the smallest set whose probability reaches top_p
    (nucleus sampling; 1.0: all), renormalised.
    """
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.size(-1):
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # (b, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop_sorted = cumulative - sorted_logits.softmax(dim=-1) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: Llama, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, generator: Optional[torch.Generator] = None,
             use_cache: bool = True, vocab_size: Optional[int] = None) -> torch.Tensor:
    """Continue prompts input_ids (b, s0) by max_new_tokens tokens -> (b, s0 + max_new_tokens).

    use_cache False re-runs ``model(ids)`` on the whole sequence each step (the reference the
    cache is tested against). vocab_size: sample only ids below it (a padded vocabulary's
    extra rows are never produced); default the model's vocabulary.
    """
    check_length(input_ids.size(1), max_new_tokens, model.config.max_seq_len)
    vocab_size = vocab_size or model.config.vocab_size
    was_training = model.training
    model.eval()
    ids, cache, new = input_ids, None, input_ids
    for _ in range(max_new_tokens):
        if use_cache:
            logits, cache = forward_with_cache(model, new, cache)
        else:
            logits = model(ids)
        new = sample_next(logits[:, -1, :vocab_size], temperature, top_k, top_p, generator)
        new = new.unsqueeze(-1)  # (b, 1)
        ids = torch.cat((ids, new), dim=1)
    model.train(was_training)
    return ids
