"""Expert parallel: the E experts of every MoE layer are split over the "ep" group.

Expert parallel is carved out of the data x context ranks ("MoE parallel folding", see
pg_manager): the P ranks of an "ep" group see different tokens and each holds E/P experts,
rank j the experts [j E/P, (j+1) E/P). No rank computes a token twice; each token travels to
the rank of each expert it chose and back:

      rank 0 (experts 0 1)                        rank 1 (experts 2 3)
    route, sort by expert: [0 0 1 | 2 3 3]      [0 1 | 2 2 3]
    1. counts all-to-all:  send [2 1 | 1 2]     send [1 1 | 2 1]     (E ints: per expert)
    2. dispatch all-to-all --- [2 3 3] -->      <-- [0 1] ---        (tokens x h, variable)
       received: [0 0 1 | 0 1]  (from 0 | 1)    [2 3 3 | 2 2 3]
    3. regroup by local expert, run the SwiGLU experts, undo the regrouping
    4. combine all-to-all: the reverse splits, each result back to its token's rank
    5. weight by the router probability, scatter-add into the token's row (MoE.forward)

Both all-to-alls are differentiable (``all_to_all.all_to_all``: backward = the all-to-all with
the splits swapped), so per MoE layer a step moves, per rank, h x (tokens sent to other ranks
+ tokens received from them) elements in forward and the same in backward.

Gradients. Every rank's loss is the mean over its T/R tokens (R = data x context ranks);
the reference's loss is the mean over all T tokens = (1/R) sum_r loss_r. So every gradient
must end up as (1/R) sum_r d loss_r / dW:

- dense weights (attention, norms, embeddings, routers): each rank has its own
  d loss_r / dW -> all-reduce over "dp_cp" (R ranks), divide by R (plain data parallel);
- experts: the backward all-to-all already brought every token's gradient of the ep group
  home, so rank j holds sum over its ep group of d loss_r / dW_e; the ranks holding the same
  experts ("edp", R/P of them) add the other ep groups' -> all-reduce over "edp", and divide
  by R too (not by R/P: the sum covers all R ranks' losses).

The aux loss uses global statistics: the token counts per expert are summed over "dp_cp" (one
all-reduce of E+1 numbers per layer), so f_e is the fraction over the whole batch; P_e stays
local, and the mean over ranks of coeff E sum_e f_e P_e^r is the reference's loss, value and
gradient. (With num_micro_batches > 1 "the whole batch" is one micro-batch of every rank,
which is not the reference's micro-batch: parity is exact with one micro-batch.)
Capacity (``moe_capacity_factor`` > 0) is applied per rank on its own T/R tokens, so with
dropping on the run is not the reference's (which caps over all T tokens): parity needs 0.
Chapter 06b's global rule (moe_balance.py) fixes that; chapter 07's ``parallelize`` applies it.
"""

from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple, cast

import torch
from jaxtyping import Float
from torch import nn

from scaletorch.dist import ProcessGroupManager, comm, get_ledger
from scaletorch.dist.all_to_all import all_to_all
from scaletorch.dist.comm import Group
from scaletorch.dist.full_state import gather_tensor_parallel_state_dict
from scaletorch.dist.functional import all_reduce_sum, gather_along_dim
from scaletorch.dist.layout_check import validate_expert_parallel
from scaletorch.models.moe import Experts, MoE
from scaletorch.parallel.grad_norm import clip_grads_, replica_count, world_grad_norm
from scaletorch.parallel.wrapper import ModuleWrapper


def by_local_expert(recv_table: List[List[int]], device: torch.device) -> torch.Tensor:
    """The order that groups received rows by local expert: rows arrive by (source rank i,
    local expert e), recv_table[i][e] of each; returns (M,) indices, expert 0's rows first,
    each expert's rows in source-rank order (no communication)."""
    starts, rows = [], 0  # starts[i][e]: the first row from rank i for expert e
    for counts in recv_table:
        starts.append([rows + sum(counts[:e]) for e in range(len(counts))])
        rows += sum(counts)
    local = len(recv_table[0]) if recv_table else 0
    order = [
        starts[i][e] + k for e in range(local) for i in range(len(recv_table))
        for k in range(recv_table[i][e])
    ]
    return torch.tensor(order, dtype=torch.long, device=device)


# What one ep rank holds (jaxtyping; tests/test_ddp_and_expert_shapes.py checks it at run time):
Routed = Float[torch.Tensor, "N h"]  # N rows: each token of this rank once per expert it chose
ForMyExperts = Float[torch.Tensor, "M h"]  # M rows for this rank's experts, from every ep rank


# [core: dispatch-and-combine]
def dispatch_tokens(routed: Routed, send_table: List[List[int]], recv_table: List[List[int]],
                    group: Group) -> ForMyExperts:
    """Send each routed token to the ep rank of its expert: routed (N, h), grouped by global
    expert, so send_table[j][l] rows (j, l in order) are for expert l of ep rank j;
    recv_table[i][l]: rows ep rank i sends to my local expert l. One differentiable all-to-all
    over ``group`` ("ep", P ranks; backward: the reverse), then the received rows regrouped
    by local expert: returns (M, h), M = sum of recv_table, expert 0's rows first."""
    send_splits = [sum(row) for row in send_table]  # rows for each ep rank
    recv_splits = [sum(row) for row in recv_table]  # rows from each ep rank
    received = all_to_all(routed, recv_splits, send_splits, group, "ep")  # (M, h)
    return received[by_local_expert(recv_table, routed.device)]  # by (source rank) -> by expert


def combine_tokens(out: ForMyExperts, send_table: List[List[int]], recv_table: List[List[int]],
                   group: Group) -> Routed:
    """Bring each expert output back to its token's rank: out (M, h), grouped by local expert
    as ``dispatch_tokens`` returned the tokens; the regrouping undone (rows by source rank
    again), then the reverse all-to-all over ``group`` ("ep", differentiable): returns (N, h),
    row n the output for routed row n of this rank."""
    by_rank = torch.argsort(by_local_expert(recv_table, out.device))  # undo the regrouping
    send_splits = [sum(row) for row in send_table]
    recv_splits = [sum(row) for row in recv_table]
    return all_to_all(out[by_rank], send_splits, recv_splits, group, "ep")  # (N, h)


# [end: dispatch-and-combine]


class AllToAllDispatcher:
    """``MoE.dispatch_fn`` under expert parallel: send tokens to their experts' ranks and back.

    After each call: ``sent`` (P,) tokens this rank sent to each ep rank (itself included),
    ``received`` (P, E/P) tokens from each ep rank for each local expert, ``row_elements`` and
    ``element_size`` of one token row (h elements). The rows cross as ``outgoing`` returns
    them: as routed here; a later chapter's subclass may narrow them.
    """

    def __init__(self, group: Group) -> None:
        self.group = group
        self.sent: Optional[torch.Tensor] = None
        self.received: Optional[torch.Tensor] = None
        self.row_elements = self.element_size = 0
        # (send, recv, routed rows) -> the count tables on the host: the layer's one wait for
        # the device (a run without values replaces it with tables of its own)
        self.host_tables: Callable[[torch.Tensor, torch.Tensor, int], List[List[List[int]]]] = \
            lambda send, recv, rows: torch.stack((send, recv)).tolist()

    def __call__(self, experts: Experts, routed: torch.Tensor,
                 counts: torch.Tensor) -> torch.Tensor:
        """routed (N, h) grouped by global expert, counts (E,) -> expert outputs (N, h)."""
        world, local = comm.group_size(self.group), experts.num_experts
        if counts.numel() != world * local:
            raise ValueError(f"{counts.numel()} experts routed to, but {world} ranks hold "
                             f"{local} each")
        send_counts = counts.view(world, local)  # [j, l]: my tokens for expert l of rank j
        recv_counts = torch.empty_like(send_counts)  # [i, l]: rank i's tokens for my expert l
        comm.all_to_all_single(recv_counts, send_counts, group=self.group, name="ep")
        # both tables to the host at once (the splits and the experts' counts are their sums)
        send_table, recv_table = self.host_tables(send_counts, recv_counts, routed.size(0))
        routed = self.outgoing(routed)
        received = dispatch_tokens(routed, send_table, recv_table, self.group)  # (M, h)
        out = experts(received, [sum(col) for col in zip(*recv_table)])  # (M, h)
        combined = combine_tokens(out, send_table, recv_table, self.group)  # (N, h)
        self.sent, self.received = send_counts.sum(1).detach(), recv_counts.detach()
        self.row_elements, self.element_size = routed.shape[1], routed.element_size()
        return combined

    def outgoing(self, routed: Routed) -> Routed:
        """The routed rows (N, h) as they leave for their experts' ranks: unchanged here."""
        return routed

    def remote_tokens(self, rank: int) -> Tuple[int, int]:
        """(tokens sent to other ranks, tokens received from them) in the last forward."""
        if self.sent is None or self.received is None:
            raise RuntimeError("no tokens dispatched yet: run a forward first")
        sent = int(self.sent.sum() - self.sent[rank])
        received = int(self.received.sum() - self.received[rank].sum())
        return sent, received


def _dispatcher(layer: MoE) -> AllToAllDispatcher:
    """The all-to-all dispatcher that ``shard_experts`` gave ``layer``."""
    if not isinstance(layer.dispatch_fn, AllToAllDispatcher):
        raise ValueError("the MoE layer dispatches locally: shard its experts first "
                         "(shard_experts)")
    return layer.dispatch_fn


def _is_expert(param: torch.Tensor) -> bool:
    return getattr(param, "expert_parallel", False)


def _all_reduce_mean(params: List[nn.Parameter], group: Group, divisor: int,
                     name: Optional[str] = None) -> None:
    """grad <- sum over ``group`` of grad / divisor, one coalesced all-reduce for all params
    (``name``: the ledger's label when the group serves another role too, comm.py).

    A parameter without a gradient contributes zeros: every rank must send the same sizes.
    """
    if not params or (comm.group_size(group) == 1 and divisor == 1):
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group, name=name)
    flat.div_(divisor)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad = g.view_as(p).clone()


class ExpertParallel(ModuleWrapper, nn.Module):
    """The converted model plus its two gradient reductions.

    ``finish_grad_sync`` (called by the trainer's step after the last backward): dense
    gradients averaged over "dp_cp", expert gradients summed over "edp" and divided by the
    same R = |dp_cp| (see the module docstring). ``state_dict`` is the wrapped model's; the
    expert shards carry the ``expert_parallel`` tag, by which ``expert_copies`` counts their
    copies and ``gather_expert_parallel_state_dict`` gathers them over "ep" (dim 0).
    """

    def __init__(self, module: nn.Module, pgm: ProcessGroupManager) -> None:
        super().__init__()
        self.module = module
        self.pgm = pgm
        params = list(module.parameters())
        self.expert_params = [p for p in params if _is_expert(p)]
        self.dense_params = [p for p in params if not _is_expert(p)]
        self.num_token_shards = pgm.gradient_sync_world_size  # R

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def finish_grad_sync(self) -> None:
        pgm, r = self.pgm, self.num_token_shards
        _all_reduce_mean(self.dense_params, pgm.gradient_sync_group, r)
        _all_reduce_mean(self.expert_params, pgm.expert_data_parallel_group, r, "edp")


def moe_layers(model: nn.Module) -> List[MoE]:
    """The MoE layers of ``model``, in order (through wrappers)."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def shard_experts(model: nn.Module, pgm: ProcessGroupManager) -> nn.Module:
    """Shard every MoE layer's experts over "ep" in place; returns ``model``.

    Rank j of its ep group keeps experts [j E/P, (j+1) E/P) (copied from the full weights, so
    the run starts from the reference), its MoE layers dispatch through the all-to-alls, and
    their routing statistics are summed over "dp_cp". Dense weights stay whole (or as tensor
    parallel left them). The gradients' sync is ``ExpertParallel``'s, wrapped around the model
    last (after tensor parallel).
    """
    layers = moe_layers(model)
    ep = pgm.expert_model_parallel_world_size
    validate_expert_parallel(layers[0].num_experts if layers else 0, ep,
                             pgm.gradient_sync_world_size)
    rank, group = pgm.expert_model_parallel_rank, pgm.expert_model_parallel_group
    stats_fn: Callable = partial(all_reduce_sum, group=pgm.gradient_sync_group)
    for moe in layers:
        local = moe.num_experts // ep
        for name in ("gate_proj", "up_proj", "down_proj"):
            full = getattr(moe.experts, name)
            shard = nn.Parameter(full.detach()[rank * local:(rank + 1) * local].clone())
            setattr(shard, "expert_parallel", True)  # a tag: reduced over "edp", gathered over "ep"
            setattr(moe.experts, name, shard)
        moe.dispatch_fn = AllToAllDispatcher(group)
        moe.global_stats_fn = stats_fn
    return model


def apply_expert_parallel(model: nn.Module, pgm: ProcessGroupManager) -> ExpertParallel:
    """Chapter 06 on its own: ``shard_experts``, then the wrapper that syncs the gradients
    (dense over "dp_cp", experts over "edp"); the wrapper is what the trainer drives."""
    return ExpertParallel(shard_experts(model, pgm), pgm)


def expert_copies(param: torch.Tensor, pgm: ProcessGroupManager) -> int:
    """Ranks of the world holding an identical copy of ``param``'s gradient: an expert shard is
    held by its "edp" group on every tp rank (the MoE runs whole under tensor parallel), any
    other weight as grad_norm.py counts it."""
    if _is_expert(param):
        return pgm.expert_data_parallel_world_size * pgm.tensor_model_parallel_world_size
    return replica_count(param, pgm)


def expert_parallel_clip_grad_norm(model: nn.Module,
                                   pgm: ProcessGroupManager) -> Callable[[float], torch.Tensor]:
    """The Trainer's ``clip_grad_norm``: grad_norm.py's rule (each element's square divided by
    its copies, ``expert_copies``), one all-reduce of one number over the world."""
    params = list(model.parameters())
    replicas = [(p, expert_copies(p, pgm)) for p in params]

    def clip(max_norm: float) -> torch.Tensor:
        return clip_grads_(params, max_norm, world_grad_norm(replicas, params[0].device))

    return clip


def gather_expert_parallel_state_dict(
        model: nn.Module, pgm: ProcessGroupManager) -> Optional[Dict[str, torch.Tensor]]:
    """Collective over "ep", then "tp": the reference-keyed full weights on global rank 0, None
    elsewhere. Expert shards are all-gathered along dim 0 (rank j of "ep" holds experts
    [j E/P, (j+1) E/P)); the dense weights are chapter 03's gather."""
    experts = {}
    with get_ledger().paused():  # a check, not training traffic
        for name, t in model.state_dict(keep_vars=True).items():
            if _is_expert(t):
                experts[name] = gather_along_dim(t.detach(), 0,
                                                 pgm.expert_model_parallel_group).float()
    full = gather_tensor_parallel_state_dict(model, pgm)
    return None if full is None else {**full, **experts}


def all_to_all_elements(model: nn.Module, pgm: ProcessGroupManager) -> int:
    """Token elements this rank's all-to-alls carried for the last forward and its backward:
    per MoE layer 2 directions x h x (tokens sent to other ep ranks + received from them)."""
    total = 0
    for layer in moe_layers(model):
        dispatch = _dispatcher(layer)
        sent, received = dispatch.remote_tokens(pgm.expert_model_parallel_rank)
        total += 2 * dispatch.row_elements * (sent + received)
    return total


def format_routing(model: nn.Module, pgm: ProcessGroupManager) -> str:
    """What the last forward routed, per MoE layer and rank (collective; text on rank 0).

    Per layer: the global tokens per expert (the aux loss's statistics), then per rank the
    tokens its local experts computed, the tokens it sent to / received from the other ep
    ranks and the bytes of the dispatch and combine all-to-alls (forward; backward the same).
    Gathered over the world with the ledger off: a report, not training traffic.
    """
    layers = moe_layers(model)
    if not layers or layers[0].tokens_per_expert is None:
        return ""
    ep, rank_in_ep = pgm.expert_model_parallel_world_size, pgm.expert_model_parallel_rank
    local = layers[0].num_experts // ep
    rows = []
    for layer in layers:  # (local experts' tokens..., sent, received, bytes per token row)
        d = _dispatcher(layer)
        sent, received = d.remote_tokens(rank_in_ep)  # (it checked that a forward set them)
        per_expert = cast(torch.Tensor, d.received).sum(0).tolist()
        rows.append(per_expert + [sent, received, d.row_elements * d.element_size])
    mine = torch.tensor(rows, dtype=torch.long, device=layers[0].router.weight.device)
    with get_ledger().paused():
        every = gather_along_dim(mine.unsqueeze(0), 0, None).cpu()  # (world, layers, local + 3)
        ep_ranks = gather_along_dim(torch.tensor([[rank_in_ep]], device=mine.device), 0, None)
    if pgm.rank != 0:
        return ""
    lines = [
        f"routing of the last forward: {layers[0].num_experts} experts, top-"
        f"{layers[0].top_k}, over ep {ep} ({local} experts per rank)"
    ]
    for i, layer in enumerate(layers):
        stats = cast(torch.Tensor, layer.tokens_per_expert)  # every layer's forward set it
        counts = " ".join(f"{int(c)}" for c in stats.tolist())
        lines.append(f"MoE layer {i}: tokens per expert over all ranks [{counts}]")
        lines.append(f"  {'rank':>4} {'experts':>8} {'tokens per local expert':>24} "
                     f"{'sent':>6} {'recv':>6} {'dispatch KB':>12} {'combine KB':>11}")
        for r in range(every.shape[0]):
            *computed, sent, received, row_bytes = every[r, i].tolist()
            first = int(ep_ranks[r, 0]) * local
            lines.append(f"  {r:>4} {f'{first}-{first + local - 1}':>8} "
                         f"{str(computed):>24} {sent:>6} {received:>6} "
                         f"{sent * row_bytes / 1e3:>12.2f} {received * row_bytes / 1e3:>11.2f}")
    return "\n".join(lines)


def ep_report(model: nn.Module, pgm: ProcessGroupManager, step: int, micro_batches: int = 1) -> str:
    """What chapter 06 prints after training. Collective over the world (the routing table
    gathers every rank's counts); the text on global rank 0, "" elsewhere: where the tokens
    went, the ledger's table of ``step``, and rank 0's all-to-all token elements of the last
    micro-batch (the routing is the last forward's) next to the formula 2 directions x h x
    (sent + received) summed over MoE layers."""
    routing, ledger = format_routing(model, pgm), get_ledger()
    if pgm.rank != 0:
        return ""
    # token rows: every all_to_all over ep but the exchange of int64 counts; each micro-batch
    # issues as many, one after the other: the last micro-batch's are the last 1/m of them
    rows = [
        r.elements for r in ledger.select("all_to_all", "ep", step, "compute")
        if r.bytes != 8 * r.elements
    ]
    moved = sum(rows[len(rows) - len(rows) // micro_batches:])
    formula = all_to_all_elements(model, pgm)
    which = "" if micro_batches == 1 else f" (its last micro-batch of {micro_batches})"
    return "\n".join([
        routing,
        ledger.table(step=step),
        f"rank 0, step {step}{which}: all-to-all token elements over ep {moved:,} = 2 "
        f"directions x h x (sent + received) summed over layers {formula:,} "
        f"({'OK' if moved == formula else 'MISMATCH'})"
    ])
