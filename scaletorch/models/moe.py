"""Mixture of experts: a top-k softmax router in front of E SwiGLU experts (single device).

Each token x_t picks its k most probable experts and sums their outputs weighted by the
router probabilities (not renormalized, so the router also learns from the main loss when
k = 1):

    p_t = softmax(W_r x_t)                       (E,)  router probabilities, fp32
    y_t = sum_{e in topk(p_t)} p_te * Expert_e(x_t),   Expert_e = SwiGLU (gate, up, down)

Load balancing (Switch Transformer / GShard auxiliary loss), added to the training loss:

    L_aux = coeff * E * sum_e f_e * P_e,   f_e = tokens routed to e / (T k),  P_e = mean_t p_te

It is ``coeff`` when routing is uniform and grows as it collapses onto few experts. f_e is a
count (no gradient), P_e carries the gradient. Capacity (off by default, ``capacity_factor``
0): each expert takes at most C = ceil(capacity_factor * T k / E) assignments per forward;
first choices are served before second choices, then in token order; a dropped assignment
contributes nothing (the block's residual carries the token on).

Two more hooks let chapter 06b attach load balancing from outside: ``select_fn`` (probs,
k) -> (weights, chosen), the top-k choice, and ``capacity_fn`` (chosen, E, capacity_factor)
-> keep (T, k), which assignments fit (``queue_positions`` is the queue both rules use).

The layer knows nothing of parallelism. Expert parallel replaces two hooks per layer:
``global_stats_fn`` (sum the routing statistics over the ranks that see different tokens, so
f_e is the global fraction) and ``dispatch_fn`` (send each token to the rank holding its
expert and bring the result back), and keeps only its slice of the stacked expert weights.

Shapes: T = tokens in this call (b * s), E = experts, k = top_k, h = hidden, f = expert
intermediate size, N = routed (token, expert) assignments (T k without dropping).
"""

import math
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn


class Experts(nn.Module):
    """E SwiGLU MLPs with stacked weights: expert e is ``down[e](silu(gate[e] x) * up[e] x)``.

    gate_proj, up_proj: (E, f, h); down_proj: (E, h, f) -- each slice [e] is laid out like the
    weight of the matching ``nn.Linear`` of a dense MLP. Stacking lets expert parallel keep a
    contiguous slice [r E/P, (r+1) E/P) of every tensor.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        e, h, f = num_experts, hidden_size, intermediate_size
        self.gate_proj = nn.Parameter(torch.empty(e, f, h))
        self.up_proj = nn.Parameter(torch.empty(e, f, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, f))

    @property
    def num_experts(self) -> int:
        """Experts held here (all of them on one device, E/P under expert parallel)."""
        return self.gate_proj.shape[0]

    @torch.no_grad()
    def init_weights(self, std: float, residual_std: float) -> None:
        """Same init as the dense MLP: down_proj writes into the residual stream."""
        nn.init.normal_(self.gate_proj, mean=0.0, std=std)
        nn.init.normal_(self.up_proj, mean=0.0, std=std)
        nn.init.normal_(self.down_proj, mean=0.0, std=residual_std)

    def forward(self, x: torch.Tensor, counts: Union[torch.Tensor, List[int]]) -> torch.Tensor:
        """x (N, h): tokens grouped by expert, ``counts[e]`` rows for expert e -> (N, h).
        ``counts`` on the host already (a list) saves the layer a wait for the device."""
        sizes = counts.tolist() if isinstance(counts, torch.Tensor) else counts
        if len(sizes) != self.num_experts:
            raise ValueError(f"{len(sizes)} token counts for {self.num_experts} experts")
        outs = []
        for e, chunk in enumerate(torch.split(x, sizes)):
            hidden = F.silu(F.linear(chunk, self.gate_proj[e])) * F.linear(chunk, self.up_proj[e])
            outs.append(F.linear(hidden, self.down_proj[e]))  # (n_e, h)
        return torch.cat(outs)


def run_local_experts(experts: Experts, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The single-device ``dispatch_fn``: every expert is here, so just run them."""
    return experts(routed, counts)


def local_stats(stats: torch.Tensor) -> torch.Tensor:
    """The single-device ``global_stats_fn``: this rank's tokens are all the tokens."""
    return stats


def top_k_by_probability(probs: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The default ``select_fn``: probs (T, E) -> (weights, chosen), (T, k) each."""
    weights, chosen = probs.topk(k, dim=-1)
    return weights, chosen


def queue_positions(chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """chosen (T, k) -> (T, k): each assignment's place in its expert's queue, which serves
    every first choice (in token order), then every second choice, and so on."""
    one_hot = F.one_hot(chosen.t(), num_experts)  # (k, T, E), choice-major
    before = one_hot.flatten(0, 1).cumsum(0).view_as(one_hot) - one_hot  # earlier, same expert
    return (before * one_hot).sum(-1).t()  # (T, k)


def capacity(capacity_factor: float, num_tokens: int, k: int, num_experts: int) -> int:
    """C = ceil(capacity_factor * T k / E): the assignments each expert takes per forward."""
    return math.ceil(capacity_factor * num_tokens * k / num_experts)


def within_capacity(chosen: torch.Tensor, num_experts: int, capacity_factor: float) -> torch.Tensor:
    """The default ``capacity_fn``: chosen (T, k) -> (T, k), True where the assignment's queue
    place is below C of this call's T tokens (under ep: each rank's own, see 06b)."""
    c = capacity(capacity_factor, chosen.size(0), chosen.size(1), num_experts)
    return queue_positions(chosen, num_experts) < c


class MoE(nn.Module):
    """Router + experts, a drop-in replacement for the dense MLP: (b, s, h) -> (b, s, h).

    After each forward: ``aux_loss`` (0-dim, differentiable, coefficient included; collected
    by ``moe_aux_loss``), ``tokens_per_expert`` (E,) routed assignments per expert before
    dropping, summed over ``global_stats_fn``'s ranks, and ``dropped`` (assignments dropped
    on this rank by the capacity limit).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int = 2,
                 aux_loss_coeff: float = 0.01, capacity_factor: float = 0.0) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k ({top_k}) must be between 1 and num_experts "
                             f"({num_experts})")
        if capacity_factor < 0 or aux_loss_coeff < 0:
            raise ValueError(f"capacity_factor ({capacity_factor}) and aux_loss_coeff "
                             f"({aux_loss_coeff}) must be >= 0")
        self.num_experts, self.top_k = num_experts, top_k
        self.aux_loss_coeff, self.capacity_factor = aux_loss_coeff, capacity_factor
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden_size, intermediate_size)
        # Hooks that expert parallel replaces (see the module docstring).
        self.dispatch_fn: Callable[[Experts, torch.Tensor, torch.Tensor],
                                   torch.Tensor] = run_local_experts
        self.global_stats_fn: Callable[[torch.Tensor], torch.Tensor] = local_stats
        # Hooks of load balancing (chapter 06b: scaletorch/parallel/moe_balance.py).
        self.select_fn: Callable[[torch.Tensor, int], Tuple[torch.Tensor,
                                                            torch.Tensor]] = top_k_by_probability
        self.capacity_fn: Callable[[torch.Tensor, int, float], torch.Tensor] = within_capacity
        self.aux_loss: Optional[torch.Tensor] = None
        self.tokens_per_expert: Optional[torch.Tensor] = None
        self.dropped = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # (T, h)
        num_tokens, num_experts, k = tokens.size(0), self.num_experts, self.top_k
        probs = self.router(tokens).float().softmax(dim=-1)  # (T, E)
        weights, chosen = self.select_fn(probs, k)  # (T, k) each

        # (E,) this rank's assignments per expert; a scatter-add, not bincount: the same
        # integers, and it runs on the meta device too (a dry run, trainer/dry_run.py)
        flat = chosen.flatten()
        counts = torch.zeros(num_experts, dtype=torch.int64,
                             device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        stats = torch.cat([counts.float(), probs.new_tensor([num_tokens])])  # before capacity

        # Assignments choice-major (every first choice, then every second choice, ...), then
        # grouped by expert; the stable sort keeps that priority inside each expert's group.
        flat_expert = chosen.t().reshape(-1)  # (k T,)
        flat_token = torch.arange(num_tokens, device=x.device).repeat(k)
        flat_weight = weights.t().reshape(-1)
        order = torch.sort(flat_expert, stable=True).indices  # (k T,)
        if self.capacity_factor > 0:
            keep = self.capacity_fn(chosen, num_experts, self.capacity_factor)  # (T, k)
            keep = keep.t().reshape(-1)[order]  # choice-major, then by expert, like order
            self.dropped = int((~keep).sum())
            order = order[keep]
            counts = torch.zeros_like(counts).scatter_add_(0, flat_expert[order],
                                                           torch.ones_like(order))
        token_index = flat_token[order]  # (N,)
        routed = tokens[token_index]  # (N, h), grouped by expert
        out = self.dispatch_fn(self.experts, routed, counts)  # (N, h), same order

        # Load-balancing loss on the statistics of every token of the (global) batch; after
        # the dispatch, so that expert parallel's first collective is its all-to-all
        stats = self.global_stats_fn(stats)  # (E + 1,): summed over ranks with other tokens
        self.tokens_per_expert = stats[:num_experts].detach()
        fraction = self.tokens_per_expert / (stats[num_experts] * k)  # f_e, no gradient
        self.aux_loss = self.aux_loss_coeff * num_experts * (fraction * probs.mean(0)).sum()

        out = out * flat_weight[order].unsqueeze(-1).to(out.dtype)
        y = torch.zeros_like(tokens).index_add(0, token_index, out.to(tokens.dtype))
        return y.view(shape)


def moe_aux_loss(model: nn.Module) -> Union[torch.Tensor, float]:
    """Sum of the auxiliary losses of the last forward of every MoE layer in ``model``.

    Each layer's loss is handed out once (then cleared), so a stale value from an earlier
    forward never leaks into a later loss. 0.0 for a dense model. Works through wrappers
    (``model.modules()`` reaches the layers).
    """
    total: Union[torch.Tensor, float] = 0.0
    for module in model.modules():
        if isinstance(module, MoE) and module.aux_loss is not None:
            total = total + module.aux_loss
            module.aux_loss = None
    return total
