"""Chapter 06b's planted mistakes (scripts/grading/balance.py grades them): the library's
biased_top_k and update_bias, each with one learner's mistake. scripts/grading/variants.py names
them all (``PLANTED``) and gives each one's ``Source``."""

from typing import Dict, Tuple

import torch

# ---- chapter 06b: biased_top_k -------------------------------------------------------------


def top_k_ignores_bias(probs: torch.Tensor, bias: torch.Tensor, k: int) -> tuple:
    weights, chosen = probs.topk(k, dim=-1)  # chapter 06's choice: the bias never read
    return weights, chosen


def top_k_bias_subtracted(probs: torch.Tensor, bias: torch.Tensor, k: int) -> tuple:
    chosen = (probs - bias).topk(k, dim=-1).indices
    return probs.gather(-1, chosen), chosen


def top_k_biased_weights(probs: torch.Tensor, bias: torch.Tensor, k: int) -> tuple:
    weights, chosen = (probs + bias).topk(k, dim=-1)  # the weights keep the bias
    return weights, chosen


def top_k_detached_weights(probs: torch.Tensor, bias: torch.Tensor, k: int) -> tuple:
    chosen = (probs + bias).topk(k, dim=-1).indices
    return probs.detach().gather(-1, chosen), chosen


# ---- chapter 06b: update_bias --------------------------------------------------------------


@torch.no_grad()
def update_toward_load(bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    bias.add_(rate * torch.sign(load - load.mean()))


@torch.no_grad()
def update_by_error(bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    bias.add_(rate * (load.mean() - load))  # the error itself, not its sign


@torch.no_grad()
def update_not_in_place(bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    bias = bias + rate * torch.sign(load.mean() - load)  # a new tensor: the layer's unchanged


# (chapter, exercise, variant) -> words its diagnosis must contain
CATALOGUE: Dict[Tuple[str, str, str], str] = {
    ("06b", "biased_top_k", "top_k_ignores_bias"):
    "biased_top_k's choices on all 4 tokens of the probe are those of the k largest of probs "
    "alone, not of the k largest of probs + bias: add the bias",
    ("06b", "biased_top_k", "top_k_bias_subtracted"):
    "biased_top_k's choices on all 4 tokens of the probe are those of the k largest of probs "
    "- bias",
    ("06b", "biased_top_k", "top_k_biased_weights"):
    "but its weights are probs + bias: take them from probs",
    ("06b", "biased_top_k", "top_k_detached_weights"):
    "biased_top_k's weights carry no gradient back to the router in the probe",
    ("06b", "update_bias", "update_toward_load"):
    "update_bias moved each bias toward the load in the probe",
    ("06b", "update_bias", "update_by_error"):
    "update_bias moved the bias by rate x (mean load - load) in the probe, [-0.4, 0.0, 0.3, "
    "0.1]: by rate x its sign, [-0.1, 0.0, 0.1, 0.1]",
    ("06b", "update_bias", "update_not_in_place"):
    "update_bias left the bias unchanged in the probe: change it in place",
}
