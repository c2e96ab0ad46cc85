"""What an uneven router adds to an expert-parallel step (chapter 06b). Pure Python.

The planner's expert-parallel traffic and compute assume balanced routing: each of the P ep
ranks computes the mean T_r k rows per MoE layer (T_r tokens per rank, top-k). With a measured
or assumed imbalance rho = max over mean rows per rank, the hot rank computes rho T_r k rows.
Its experts hold the fraction rho / P of all assignments, and its own tokens go there in the
same proportion, so it keeps rho T_r k / P of its own rows and receives the rest:

    hot rows          = rho x T_r k
    hot received rows = rho x T_r k x (P - 1) / P

Every rank waits for the hot one at the combine, so the layer takes rho times the balanced
layer's expert compute and dispatch receive: (rho - 1) x (expert + receive) seconds extra.
"""

from scaletorch.plan.layout import ACTIVATION_BYTES, PlanLayout
from scaletorch.plan.model import ModelSpec


def _check(imbalance: float, ep: int) -> None:
    if not 1.0 <= imbalance <= ep:
        raise ValueError(f"imbalance (max/mean rows per rank) {imbalance} must be between 1 "
                         f"(even) and ep ({ep}, one rank computes everything)")


def hot_rank_rows(tokens_per_rank: int, top_k: int, ep: int, imbalance: float) -> float:
    """Rows the hot rank's experts compute in one MoE layer's forward."""
    _check(imbalance, ep)
    return imbalance * tokens_per_rank * top_k


def hot_rank_received_rows(tokens_per_rank: int, top_k: int, ep: int, imbalance: float) -> float:
    """Rows the hot rank receives from the other ep ranks in one dispatch (and sends back in
    the combine)."""
    return hot_rank_rows(tokens_per_rank, top_k, ep, imbalance) * (ep - 1) / ep


def imbalance_extra_seconds(expert_seconds: float, receive_seconds: float, imbalance: float,
                            ep: int) -> float:
    """Seconds an imbalance adds to one MoE layer, given the balanced layer's expert compute
    and dispatch-receive seconds (forward, backward or both, as the inputs are)."""
    _check(imbalance, ep)
    return (imbalance - 1.0) * (expert_seconds + receive_seconds)


def hot_rank_line(model: ModelSpec, layout: PlanLayout) -> str:
    """The hot ep rank at ``layout.moe_imbalance``, one line for the dry run: its router has no
    values (meta tensors), so the wire rows it measures are a balanced router's."""
    tokens = layout.micro_batch_size * layout.seq_len // layout.cp  # a dp_cp rank's
    k, ep, rho = model.moe_top_k, layout.ep, layout.moe_imbalance
    kb = model.hidden_size * ACTIVATION_BYTES[layout.precision] / 1e3  # a row's
    received = hot_rank_received_rows(tokens, k, ep, rho)
    return (f"MoE imbalance {rho:g} (max/mean rows per ep rank, assumed): per MoE layer and "
            f"micro-batch the hot rank computes {hot_rank_rows(tokens, k, ep, rho):,.0f} rows "
            f"(balanced {tokens * k:,}) and receives {received:,.0f} ({received * kb:,.1f} kB; "
            f"balanced {received / rho * kb:,.1f} kB); the dispatch rows below are balanced")
