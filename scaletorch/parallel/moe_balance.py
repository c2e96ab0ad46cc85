"""Load balance for a mixture of experts (chapter 06b), attached to chapter 06's layers from
outside through their ``select_fn`` and ``capacity_fn`` hooks (scaletorch/models/moe.py).

Two remedies besides the auxiliary loss (which chapter 06 has):

1. Auxiliary-loss-free balancing (DeepSeek-V3). Each layer keeps a bias b (E,), added to the
   router probabilities for the top-k choice only; the gate weights stay the probabilities:

       chosen_t = topk_e(p_te + b_e),   y_t = sum_{e in chosen_t} p_te * Expert_e(x_t)

   After each step b_e <- b_e + rate * sign(mean load - load_e), where load_e counts the
   step's assignments to e over every token of the global batch: the counts the layer already
   sums over "dp_cp" (the ranks with other tokens, ep x edp), so the update is the same
   integers and the same arithmetic on every rank, and b stays identical everywhere. b is a
   buffer (``expert_bias``), so it is saved and resumed with the model's state_dict.

2. Capacity with token dropping, on global statistics. Each expert serves at most
   C = ceil(factor x T k / E) assignments of the T tokens of the global batch, first choices
   before second choices, then in token order (moe.py's queue). Rank r's tokens are rows
   [r T/R, (r+1) T/R) of that queue's token order, so the place of its assignment (c, e) is
   its local place plus what is ahead of it elsewhere: every rank's choices before c for e,
   and the ranks before r's choice c for e. One all-gather of the (k, E) counts over "dp_cp"
   per layer (R k E integers) gives both, and each rank drops exactly what the single device
   drops. Chapter 06's rule (C of each rank's own T/R tokens) drops other tokens.
"""

from typing import Callable, Dict, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from scaletorch.dist import ProcessGroupManager
from scaletorch.dist.comm import Group
from scaletorch.dist.functional import gather_along_dim
from scaletorch.models.moe import MoE, capacity, queue_positions
from scaletorch.parallel.expert_parallel import moe_layers


# [core: bias-balancing]
class BiasedTopK:
    """A layer's ``select_fn``: top-k of probs + bias, weights from probs alone.

    probs (T, E) -> (weights, chosen), (T, k) each. The bias moves the choice, never the
    output's scale, so it needs no gradient and adds no term to the loss."""

    def __init__(self, layer: MoE) -> None:
        self.layer = layer

    def __call__(self, probs: torch.Tensor, k: int) -> tuple:
        return biased_top_k(probs, self.layer.get_buffer("expert_bias"), k)


def biased_top_k(probs: torch.Tensor, bias: torch.Tensor,
                 k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The top-k choice of DeepSeek-V3's balancing: probs (T, E), bias (E,) -> (weights,
    chosen), (T, k) each. The experts are the k largest of probs + bias; the weights are their
    probabilities, without the bias (and with probs' gradient to the router)."""
    chosen = (probs + bias).topk(k, dim=-1).indices  # (T, k): the biased choice
    return probs.gather(-1, chosen), chosen  # the weights: unbiased probabilities


class BiasBalancer:
    """DeepSeek-V3's balancing of every MoE layer of ``model``: ``update()`` after each step.

    ``rate``: the bias change per step (the paper's gamma). The load of a step is the sum of
    the layer's ``tokens_per_expert`` over the step's forwards (global counts, all ranks)."""

    def __init__(self, model: nn.Module, rate: float, persistent: bool = True) -> None:
        if not 0 < rate < float("inf"):  # (NaN fails too: a NaN bias routes to fixed experts)
            raise ValueError(f"the bias update rate must be a finite number > 0, got {rate}")
        self.rate, self.layers = rate, moe_layers(model)
        self.load: Dict[int, torch.Tensor] = {}  # layer index -> (E,) this step's assignments
        for i, layer in enumerate(self.layers):
            if "expert_bias" not in dict(layer.named_buffers()):
                layer.register_buffer(
                    "expert_bias", torch.zeros(layer.num_experts,
                                               device=layer.router.weight.device),
                    persistent=persistent)
            layer.select_fn = BiasedTopK(layer)
            layer.register_forward_hook(self._count(i))

    def _count(self, i: int) -> Callable:

        def hook(layer: MoE, args: tuple, out: torch.Tensor) -> None:
            counts = layer.tokens_per_expert  # (E,), summed over "dp_cp" by the layer
            if counts is not None:
                self.load[i] = self.load.get(i, 0) + counts.float()

        return hook

    @torch.no_grad()
    def update(self) -> None:
        """``update_bias`` of every layer by its step's load; clears the load."""
        for i, layer in enumerate(self.layers):
            if i in self.load:
                update_bias(layer.get_buffer("expert_bias"), self.load[i], self.rate)
        self.load.clear()


@torch.no_grad()
def update_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    """One step of DeepSeek-V3's bias update, in place: bias (E,), load (E,) the step's
    assignments per expert over the global batch. b_e += rate * sign(mean load - load_e): an
    overloaded expert's bias falls by rate, an underloaded one's rises, an expert at the mean
    keeps its own."""
    bias.add_(rate * torch.sign(load.mean() - load))


# [end: bias-balancing]


def bias_state(balancer: BiasBalancer) -> torch.Tensor:
    """(layers, E): a copy of every balanced layer's bias, for a checkpoint. Identical on every
    rank (global counts, same arithmetic), so any rank's copy is the run's."""
    return torch.stack(
        [layer.get_buffer("expert_bias").detach().cpu().clone() for layer in balancer.layers])


def load_bias_state(balancer: BiasBalancer, state: torch.Tensor, name: str) -> None:
    """Copy ``bias_state``'s (layers, E) into the balanced layers; ValueError naming ``name``
    (the checkpoint) if its shape is not this model's."""
    want = (len(balancer.layers), balancer.layers[0].num_experts if balancer.layers else 0)
    if tuple(state.shape) != want:
        raise ValueError(f"{name}: its routing bias is {tuple(state.shape)} (MoE layers, "
                         f"experts), this model's is {want}")
    with torch.no_grad():
        for layer, saved in zip(balancer.layers, state):
            layer.get_buffer("expert_bias").copy_(saved)


def biases(model: nn.Module) -> List[torch.Tensor]:
    """Each MoE layer's bias (E,) (zeros where the layer has none)."""
    return [
        dict(layer.named_buffers()).get("expert_bias", torch.zeros(layer.num_experts))
        for layer in moe_layers(model)
    ]


# [core: global-capacity]
class GlobalCapacity:
    """A layer's ``capacity_fn`` under data or expert parallel: the single device's rule on
    the global batch. chosen (T/R, k) of this rank -> keep (T/R, k).

    One all-gather over ``group`` ("dp_cp", R ranks; ``rank``: this rank's place in it, which
    is its shard of the batch) of each rank's (k, E) assignment counts."""

    def __init__(self, group: Group, rank: int) -> None:
        self.group, self.rank = group, rank

    def __call__(self, chosen: torch.Tensor, num_experts: int,
                 capacity_factor: float) -> torch.Tensor:
        k = chosen.size(1)
        mine = F.one_hot(chosen.t(), num_experts).sum(1)  # (k, E): my choice-c tokens for e
        every = gather_along_dim(mine.unsqueeze(0), 0, self.group)  # (R, k, E)
        total = every.sum(0)  # (k, E) over the batch
        # ahead of my (c, e): others' choices before c, and the ranks before me at choice c
        ahead = (total - mine).cumsum(0) - (total - mine) + every[:self.rank].sum(0)  # (k, E)
        place = queue_positions(chosen, num_experts) + ahead.gather(1, chosen.t()).t()  # (T/R,k)
        tokens = int(total[0].sum())  # every token has one first choice
        return place < capacity(capacity_factor, tokens, k, num_experts)


# [end: global-capacity]


def apply_global_capacity(model: nn.Module, pgm: ProcessGroupManager) -> nn.Module:
    """Every MoE layer's capacity decided on the global batch (``GlobalCapacity``) over
    "dp_cp"; returns ``model``. A layer whose capacity factor is 0 never calls it. Context
    parallel splits a sequence, not the batch's rows: the queue's token order would be
    another, so a factor > 0 with it is refused."""
    layers = moe_layers(model)
    if pgm.context_parallel_world_size > 1 and any(layer.capacity_factor > 0 for layer in layers):
        raise ValueError(f"global capacity needs context_parallel_size 1, got "
                         f"{pgm.context_parallel_world_size}: each rank must hold whole rows")
    rule = GlobalCapacity(pgm.gradient_sync_group, pgm.data_parallel_rank)
    for layer in layers:
        layer.capacity_fn = rule
    return model


def skew_router(model: nn.Module, offsets: Dict[int, float]) -> nn.Module:
    """A router that favours a few experts: each layer's router gets a learned bias, set to
    ``offsets[e]`` for expert e (0 elsewhere). Call before the optimizer is built (it adds
    parameters) and identically on the reference. Returns ``model``."""
    for layer in moe_layers(model):
        old = layer.router
        router = nn.Linear(old.in_features, old.out_features, bias=True, device=old.weight.device,
                           dtype=old.weight.dtype)
        with torch.no_grad():
            router.weight.copy_(old.weight)
            router.bias.zero_()
            for e, offset in offsets.items():
                router.bias[e] = offset
        layer.router = router
    return model
