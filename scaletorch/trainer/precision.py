"""Which precision a run computes in, and how close ``--check`` may then ask it to be.

``resolve_precision`` is the one place that decides: the training loop's autocast and the
parity check's reference both call it, so a parallel run and its reference always compute in
the same precision.

    training.precision   without --check            with --check
    fp32                 fp32                       fp32, tolerance 1e-5 (or 32 x the
                                                    floor measured above it: parity.py)
    bf16                 bf16 autocast              bf16 autocast for both, tolerance 2^-5
    fp16                 fp16 autocast              fp16 autocast for both, tolerance 2^-5
    auto                 bf16 on a GPU with         fp32 (the check proves fp32 parity)
                         native bf16, else fp32

Why 2^-5 under bf16. bf16 keeps 8 significant bits: its unit roundoff is u = 2^-8 = 3.9e-3,
the largest relative error of one rounding. The parallel run and the reference do the same
math in another order (tp's partial sums, dp's split batch, a pipeline's micro-batches), and
autocast rounds every matmul output to bf16, so their activations differ by about u
relative, not by fp32's 6e-8: the loss (about 4 nats) by up to a few u x 4 nats. AdamW
normalizes every update to about lr, so an element whose tiny gradient the rounding flips
moves by up to about 2 lr per step the other way: weight deviations of order lr. Measured on
CPU against the bf16 reference (chapters 01-05 and 07 tp2 x pp2, 20-50 steps, lr 1e-3 to
1e-2): at most 2.5e-3 in the loss and 9.5e-3 in the weights. The tolerance is 8u = 2^-5 =
3.1e-2, three times the largest measured. It proves less than fp32's 1e-5 (a deviation
below 3.1e-2 passes): prove a strategy in fp32, check the bf16 path with bf16. fp16 keeps
11 significant bits (u = 2^-11), so the same argument bounds it by bf16's tolerance.

``resolve_precision`` lives with the config (scaletorch/config.py); chapter 08's
``mixed_precision.policy_for`` turns the config into the ``MixedPrecisionPolicy`` the strategies
read (fp32 master weights and optimizer state always, ``parallel.param_dtype``,
``parallel.reduce_dtype``).
"""

from contextlib import nullcontext
from typing import ContextManager

import torch

from scaletorch.config import Config, resolve_precision

__all__ = [
    "NORM_TOLERANCES", "TOLERANCES", "activation_element_size", "autocast", "parity_tolerance",
    "precision_note", "resolve_precision"
]

BF16_UNIT_ROUNDOFF = 2.0**-8  # 8 significant bits (7 stored + 1 implicit)
TOLERANCES = {
    "fp32": 1e-5,  # K >= 5 steps in fp32: reduction order only; above it parity.py's floor
    "bf16": 8 * BF16_UNIT_ROUNDOFF,  # 2^-5 = 3.1e-2, derived in the module docstring
    "fp16": 8 * BF16_UNIT_ROUNDOFF,  # fp16 rounds finer (2^-11): bf16's bound holds
}
# Each step's global grad norm (before clipping), relative to the reference's. In fp32 the norm
# sums the squares of every gradient element in another order than one device: rounding reached
# 2.5e-5 relative (vocab 50257, tp2 x dp2, step 4) while losses and weights held 1e-5, so 1e-4.
# A uniform error of 1e-3 on the gradients of a part that holds a share q of the squared norm
# moves it by about q x 1e-3: AdamW hides such an error from the weights, the norm shows it.
# Under bf16 and fp16 the norm is a sum of gradients each a few roundings off, as the loss is:
# the same 8u bound, relative.
NORM_TOLERANCES = {"fp32": 1e-4, "bf16": 8 * BF16_UNIT_ROUNDOFF, "fp16": 8 * BF16_UNIT_ROUNDOFF}
# the autocast dtype; None: no autocast
DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def parity_tolerance(cfg: Config, device_type: str) -> float:
    """The largest loss and weight deviation ``--check`` accepts for this run's precision."""
    return TOLERANCES[resolve_precision(cfg, device_type)]


def precision_note(cfg: Config, device_type: str) -> str:
    """The one line a ``--check`` run prints about its precision."""
    precision = resolve_precision(cfg, device_type)
    if cfg.training.precision == "auto":
        return (f"precision: training.precision auto is {precision} under --check, for the run "
                f"and the reference (without --check a GPU with native bf16 computes in bf16); "
                f"--training.precision bf16 checks bf16")
    return (f"precision: {precision} for the run and the reference, parity tolerance "
            f"{TOLERANCES[precision]:.1e}")


def autocast(cfg: Config, device: torch.device) -> ContextManager:
    """Autocast to the resolved precision's dtype on ``device`` (nothing for fp32)."""
    dtype = DTYPES[resolve_precision(cfg, device.type)]
    return nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def activation_element_size(cfg: Config, device_type: str) -> int:
    """Bytes of one activation element as the run computes it: 2 under bf16 or fp16 autocast,
    fp32's 4 without (chapter 03's report prices its wire with it)."""
    dtype = DTYPES[resolve_precision(cfg, device_type)]
    return 4 if dtype is None else dtype.itemsize
