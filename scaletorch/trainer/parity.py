"""The proof: run the single-device reference on the same seed and data, and compare.

Every numbered script's ``--check`` ends with ``check_against_reference``, which prints
``parity: max |loss - reference| = 3.1e-07 over 10 steps (tolerance 1e-05): OK`` and the same
for the weights, when the strategy can gather them. The reference computes in the run's
precision (precision.py decides it for both) and the tolerance is that precision's: 1e-5 in
fp32, 2^-5 under bf16 autocast (``(tolerance 3.1e-02, bf16)`` on the line).
"""

import copy
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from scaletorch.config import Config
from scaletorch.dist import comm, get_ledger
from scaletorch.models import build_model
from scaletorch.trainer.precision import TOLERANCES, parity_tolerance, resolve_precision

TOLERANCE = TOLERANCES["fp32"]  # K >= 5 steps in fp32; bf16's is derived in precision.py


def run_reference(
        cfg: Config,
        device: torch.device = torch.device("cpu"),
) -> Tuple[List[float], nn.Module]:
    """Train the unsharded model on one device for ``cfg.training.steps`` steps.

    Touches no process group, writes no file, loads no checkpoint. Returns (losses, model).
    """
    from scaletorch.trainer.trainer import Trainer  # the trainer imports this module's users

    cfg = copy.deepcopy(cfg)
    cfg.checkpoint.every, cfg.checkpoint.resume = 0, None
    model = build_model(cfg.model, seed=cfg.training.model_seed).to(device)
    result = Trainer(cfg, model, pgm=None, device=device, verbose=False).train()
    return result.losses, model


def max_loss_diff(losses: Sequence[float], reference: Sequence[float]) -> float:
    if len(losses) != len(reference):
        raise ValueError(f"{len(losses)} losses vs {len(reference)} reference losses")
    return max(abs(a - b) for a, b in zip(losses, reference))


State = Dict[str, torch.Tensor]


def weight_diffs(state: State, reference: State) -> Dict[str, float]:
    """{name: largest absolute difference} of two full state dicts with the same keys."""
    if set(state) != set(reference):
        raise ValueError(f"state dict keys differ: {sorted(set(state) ^ set(reference))}")
    diffs = {}
    for k in state:
        diff = state[k].detach().cpu().float() - reference[k].detach().cpu().float()
        diffs[k] = diff.abs().max().item()
    return diffs


def max_weight_diff(state: Dict[str, torch.Tensor], reference: Dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two full state dicts with the same keys."""
    return max(weight_diffs(state, reference).values())


def tolerance_text(tolerance: float, precision: str = "fp32") -> str:
    """"tolerance 1e-05" in fp32; "tolerance 3.1e-02, bf16" under a lower precision."""
    if precision == "fp32":
        return f"tolerance {tolerance:.0e}"
    return f"tolerance {tolerance:.1e}, {precision}"


def report_parity(losses: Sequence[float], reference: Sequence[float], tolerance: float = TOLERANCE,
                  precision: str = "fp32") -> bool:
    """Print the parity line and return whether it passed."""
    diff = max_loss_diff(losses, reference)
    ok = diff <= tolerance
    print(
        f"parity: max |loss - reference| = {diff:.1e} over {len(losses)} steps "
        f"({tolerance_text(tolerance, precision)}): {'OK' if ok else 'FAIL'}", flush=True)
    return ok


def report_weight_parity(state: State, reference: State, steps: int, tolerance: float = TOLERANCE,
                         precision: str = "fp32") -> bool:
    """Print the weights' parity line (the worst parameter named) and return whether it passed."""
    diffs = weight_diffs(state, reference)
    worst = max(diffs, key=lambda name: diffs[name])
    diff, limit = diffs[worst], tolerance_text(tolerance, precision)
    print(
        f"parity: max |weight - reference| = {diff:.1e} after {steps} steps, in {worst} "
        f"({limit}): {'OK' if diff <= tolerance else 'FAIL'}", flush=True)
    return diff <= tolerance


def check_against_reference(cfg: Config, losses: Sequence[float], device: torch.device,
                            full_state: Optional[Dict[str, torch.Tensor]] = None,
                            start_step: int = 0, tolerance: Optional[float] = None) -> bool:
    """``--check`` for every script: rank 0 runs the reference and prints the verdict.

    ``losses`` are the parallel run's per-step losses from ``start_step``; ``full_state`` is
    its gathered, unsharded state dict (on rank 0; None to skip the weight comparison). The
    reference runs in the same precision (``resolve_precision``); ``tolerance`` defaults to
    that precision's. The verdict is broadcast so that every rank returns the same answer
    (and exit code).
    """
    precision = resolve_precision(cfg, device.type)
    if tolerance is None:
        tolerance = parity_tolerance(cfg, device.type)
    ok = torch.ones(1, device=device)
    if comm.group_rank() == 0:
        reference, ref_model = run_reference(cfg, device)
        passed = report_parity(losses, reference[start_step:], tolerance, precision)
        if full_state is not None:
            passed = report_weight_parity(full_state, ref_model.state_dict(), cfg.training.steps,
                                          tolerance, precision) and passed
        if not passed:  # a wrong layout, or a run too sensitive to rounding for this many steps
            print(
                f"parity: do two single-device runs agree for {cfg.training.steps} steps? "
                f"python scripts/parity_floor.py CONFIG --steps {cfg.training.steps} "
                f"(doc/10_real_model.md, 'How long parity holds')", flush=True)
        ok.fill_(float(passed))
    with get_ledger().paused():  # the verdict is not part of the strategy's traffic
        comm.broadcast(ok, src=0)
    return bool(ok.item())
