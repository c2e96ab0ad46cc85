"""Exercises of chapter 06b (doc/06b_load_balance.md): DeepSeek-V3's balancing by a routing bias.

Each is scaletorch/parallel/moe_balance.py's function with its body removed. Write one, then

    python scripts/grade.py 06b

runs chapter 06b's run on 2 gloo ranks (ep 2, 4 experts, top-2, the router collapsed onto
experts 0 and 1) with the bias on and your function in place of the library's. Each call is
compared with the library's on the same inputs, after a probe that tells the mistakes apart;
it says "passed" or what is wrong, and names the function to write next. No collective: the
load a step's update reads is already the global batch's (the layer sums it over "dp_cp").
"""

from typing import Tuple

import torch


def biased_top_k(probs: torch.Tensor, bias: torch.Tensor,
                 k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The top-k choice of DeepSeek-V3's balancing: probs (T, E), bias (E,) -> (weights,
    chosen), (T, k) each. The experts are the k largest of probs + bias; the weights are their
    probabilities, without the bias (and with probs' gradient to the router)."""
    raise NotImplementedError


@torch.no_grad()
def update_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    """One step of DeepSeek-V3's bias update, in place: bias (E,), load (E,) the step's
    assignments per expert over the global batch. b_e += rate * sign(mean load - load_e): an
    overloaded expert's bias falls by rate, an underloaded one's rises, an expert at the mean
    keeps its own."""
    raise NotImplementedError
