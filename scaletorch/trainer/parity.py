"""The proof: run the single-device reference on the same seed and data, and compare.

Every numbered script's ``--check`` ends with ``report_parity``, whose last line reads
``parity: max |loss - reference| = 3.1e-07 over 10 steps (tolerance 1e-05): OK``.
"""

import copy
from typing import Dict, List, Sequence, Tuple

import torch
from torch import nn

from scaletorch.models import build_model
from scaletorch.trainer.config import Config

TOLERANCE = 1e-5  # fp32, K >= 5 steps: see DESIGN.md, "The correctness contract"


def run_reference(cfg: Config, device: torch.device = torch.device("cpu"),
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


def max_weight_diff(state: Dict[str, torch.Tensor], reference: Dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two full state dicts with the same keys."""
    if set(state) != set(reference):
        raise ValueError(f"state dict keys differ: {sorted(set(state) ^ set(reference))}")
    return max((state[k].detach().cpu().float() - reference[k].detach().cpu().float()
                ).abs().max().item() for k in state)


def report_parity(losses: Sequence[float], reference: Sequence[float],
                  tolerance: float = TOLERANCE) -> bool:
    """Print the parity line and return whether it passed."""
    diff = max_loss_diff(losses, reference)
    ok = diff <= tolerance
    print(f"parity: max |loss - reference| = {diff:.1e} over {len(losses)} steps "
          f"(tolerance {tolerance:.0e}): {'OK' if ok else 'FAIL'}", flush=True)
    return ok
