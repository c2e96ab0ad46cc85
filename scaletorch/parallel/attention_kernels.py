"""Ring attention's fused tile kernels (chapter 05): which one runs where, and their lse.

A tile kernel returns (out, lse) of its queries over its keys; its backward takes the *merged*
out and lse of the whole row. ``math`` (ring_attention.py) upcasts to fp32 and forms the s^2
scores. The kernels here run in q's dtype (bf16 or fp16 under autocast, else fp32) and return
the log-sum-exp in fp32; the ring merges and sums gradients in fp32 (doc/05_context_parallel.md):

    cpu   aten._scaled_dot_product_flash_attention_for_cpu (+ _backward)   fp32, bf16, fp16
    cuda  aten._scaled_dot_product_flash_attention (+ _backward)           bf16, fp16
    cuda  aten._scaled_dot_product_efficient_attention (+ _backward)       fp32, bf16, fp16

They want as many K/V heads as query heads: K/V are expanded here (never on the wire) and their
gradients folded back, in fp32.
"""

from typing import Tuple

import torch
import torch.nn.functional as F

A = torch.ops.aten
OPS = {  # kernel: (forward, backward); tests swap in fakes to run the CUDA wrappers on a CPU
    "cpu_flash": (A._scaled_dot_product_flash_attention_for_cpu,
                  A._scaled_dot_product_flash_attention_for_cpu_backward),
    "cuda_flash": (A._scaled_dot_product_flash_attention,
                   A._scaled_dot_product_flash_attention_backward),
    "cuda_efficient": (A._scaled_dot_product_efficient_attention,
                       A._scaled_dot_product_efficient_attention_backward),
}
# cutlass pads the efficient kernel's lse to a multiple of 32 queries; ROCm's AOTriton does not
LSE_ALIGN = {"cpu_flash": 1, "cuda_flash": 1, "cuda_efficient": 1 if torch.version.hip else 32}


def pick(kernel: str, device_type: str, q: torch.Tensor) -> str:
    """The tile kernel that runs for the asked ``kernel`` (auto, math, fused or a key of OPS)
    and q on ``device_type``: "math" or a key of OPS."""
    if kernel == "math" or kernel in OPS:  # named: forced (tests, benchmarks)
        return kernel
    if device_type == "cpu":  # auto: the readable fp32 path, the numbers the CPU tests check
        return "math" if kernel == "auto" else "cpu_flash"
    if device_type == "cuda":  # torch's own checks: GPU generation, dtype, head size, toggles
        sdpa = torch.backends.cuda
        try:
            params = sdpa.SDPAParams(q, q, q, None, 0.0, True, False)
        except TypeError:  # an older torch: no enable_gqa argument
            params = sdpa.SDPAParams(q, q, q, None, 0.0, True)  # type: ignore[call-arg]
        if q.dtype != torch.float32 and sdpa.can_use_flash_attention(params):
            return "cuda_flash"
        if sdpa.can_use_efficient_attention(params):
            return "cuda_efficient"
    return "math"  # mps, xpu, ...: no lse-returning kernel called here; or none takes q


def _rows(lse: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The kernels' lse (b, h, >= sq) fp32, padded or strided per kernel, as (b, h, sq)."""
    b, h, sq, _ = q.shape
    if lse.dim() != 3 or tuple(lse.shape[:2]) != (b, h) or lse.size(2) < sq:
        raise ValueError(f"kernel lse of shape {tuple(lse.shape)} for q {tuple(q.shape)}")
    return lse[..., :sq].float()


def forward(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
            scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    hq, op = q.size(1), OPS[kernel][0]
    q, k, v = q.contiguous(), _expand(k, hq), _expand(v, hq)
    if kernel == "cuda_efficient":
        out, lse = op(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
    else:  # cpu_flash: (out, lse); flash: (out, lse, cum_seq_q, cum_seq_k, max_q, ...)
        out, lse = op(q, k, v, 0.0, causal, scale=scale)[:2]
    return out, _rows(lse, q)


def backward(kernel: str, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, causal: bool,
             scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    (b, hkv, s, d), hq, sq, op = k.shape, q.size(1), q.size(2), OPS[kernel][1]
    lse = F.pad(lse, (0, -sq % LSE_ALIGN[kernel])).contiguous()  # as the kernel's forward wrote it
    dout, q, out, k, v = dout.contiguous(), q.contiguous(), out.contiguous(), _expand(k, hq), \
        _expand(v, hq)
    no_rng = torch.zeros((), dtype=torch.int64, device=q.device)  # dropout 0: never read
    if kernel == "cpu_flash":
        dq, dk, dv = op(dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    elif kernel == "cuda_flash":  # dense: no cumulative sequence lengths
        dq, dk, dv = op(dout, q, k, v, out, lse, None, None, sq, s, 0.0, causal, no_rng, no_rng,
                        scale=scale)
    else:  # no attn_bias; the gradients of q, k and v, not of a bias
        dq, dk, dv = op(dout, q, k, v, None, out, lse, no_rng, no_rng, 0.0,
                        [True, True, True, False], causal, scale=scale)[:3]
    fold = (dk.float().view(b, hkv, -1, s, d).sum(2), dv.float().view(b, hkv, -1, s, d).sum(2))
    return (dq, *fold)


def _expand(kv: torch.Tensor, hq: int) -> torch.Tensor:
    return kv.repeat_interleave(hq // kv.size(1), dim=1)
