"""Traffic per group per step, in the communication ledger's definition of wire bytes.

A rank's step is a list of collectives (``Collective``: group, op, elements, element size,
phase), each the call the strategies make (scaletorch/parallel); ``wire_bytes`` turns a call
into the bytes this rank sends with the textbook ring algorithms:

    all_reduce                        2 (N-1)/N x bytes
    all_gather, reduce_scatter          (N-1)/N x bytes of the full (gathered) tensor
    broadcast, send                               bytes
    all_to_all                     bytes sent to other ranks
    recv                                          0   (a receive sends nothing)

Per step and rank (T tokens = micro-batch b x local sequence s/cp, m micro-batches, L_r the
rank's blocks, P its parameters, h hidden), and the calls that carry it (``Collective.calls``,
one ledger record each):

    dp_cp  DDP: all-reduce P, a call per bucket of each pipeline chunk (DDP's
           ``data_parallel.ddp_buckets``); MoE (ExpertParallel): one call per chunk;
           ZeRO-1/2: reduce-scatter and all-gather P' (padded), a call per unit each; ZeRO-3:
           all-gather 2 m P' (each unit for its forward and its backward), reduce-scatter P'
           (a call per unit). The reported loss: 1 call; MoE: E + 1 routing statistics per
           MoE block and micro-batch (a call each)
           (the ledger calls this group "dp" at cp = 1, where it is the dp group)
    edp    all-reduce of the expert gradients (expert parallel), a call per chunk with experts
    tp     4 all-reduces of T h per dense block per micro-batch (2 for an MoE block), the
           embedding's and the head input's T h, 3 T for the vocab-parallel loss (2 calls: the
           max, then [sum exp, target logit]); sequence parallel: all-gather + reduce-scatter
           of the same, and the norms' weight gradients (h, a call per norm and micro-batch)
    pp     per micro-batch an activation (forward) or gradient (backward) of T h (/ tp under
           sequence parallel) across each stage boundary the rank sends over (1F1B: one per
           rank; interleaved: 2v - 1 on the ends, 2v between; a V: 2 on the ends (rank p - 1
           turns the V locally), 4 between), one send each, and as many recvs; 1 for the loss
    cp     ring: (3 cp - 2) K/V messages of 2 T kv_local per block and micro-batch (a send and
           a recv each); Ulysses: 8 all-to-alls per block and micro-batch (q, k, v, out;
           forward and backward), (cp-1)/cp of each to other ranks
    ep     per MoE block and micro-batch 4 all-to-alls (dispatch, combine; forward, backward)
           of k T h, (ep-1)/ep of them to other ranks with balanced routing, and 1 of the E
           counts (forward only): 5 calls however the router splits the tokens
    world  1 (the gradient norm's sum of squares) unless every rank holds every gradient

Recomputation (activation checkpointing) repeats a block's forward collectives under the
phase "recompute", up to its last saved tensor (torch.utils.checkpoint stops there): full,
every block's but its last tp collective, an MoE block's all-to-alls and routing statistics
too; selective (the attention core), Ulysses' all-to-alls of q, k and v (full: and the
output's) and the ring's K/V passes.
"""

from collections import defaultdict
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from scaletorch.plan.layout import (ACTIVATION_BYTES, PRECISION_BYTES, V_SHAPED, ZERO_BUBBLE,
                                    PlanLayout)
from scaletorch.plan.memory import Unit, has_tied_copy, rank_units
from scaletorch.plan.model import ModelSpec
from scaletorch.plan.pipeline import holds_ends, rank_layers, rank_stages, split_backwards
from scaletorch.rules.buckets import ddp_buckets
from scaletorch.rules.wire import wire_bytes
from scaletorch.schedule.placement import rank_of_stage, stage_index


def zero_comm_elements(zero_stage: int, numel: int, num_micro_batches: int = 1) -> Dict[str, int]:
    """Elements each ZeRO collective carries per step (the full flat size, as the ledger records).

    A ring moves (N-1)/N of them per rank. Stages 1, 2: reduce-scatter + all-gather of Psi;
    stage 3: all-gather 2 m Psi (forward and backward of m micro-batches) + reduce-scatter Psi.
    """
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"zero_stage must be 1, 2 or 3, got {zero_stage}")
    gathers = 2 * num_micro_batches if zero_stage == 3 else 1
    return {"all_gather": gathers * numel, "reduce_scatter": numel}


def _tp_sites(config: Any, layers: Optional[Sequence[int]], first: bool,
              last: bool) -> Tuple[int, int, int]:
    """Per micro-batch on one tp rank: (activation collectives: 4 per dense block, 2 per MoE
    block, the embedding's, the head input's; RMSNorm weights whose gradient sequence parallel
    all-reduces: 2 per dense block, 1 per MoE block, the final norm; loss all-reduces: 2)."""
    layers = range(config.num_layers) if layers is None else layers
    moe = sum(1 for i in layers if config.is_moe_layer(i))
    return (4 * (len(layers) - moe) + 2 * moe + first + last, 2 * len(layers) - moe + last,
            2 * last)


def tp_comm_elements(config: Any, tokens: int, sequence_parallel: bool, num_micro_batches: int = 1,
                     layers: Optional[Sequence[int]] = None, first: bool = True,
                     last: bool = True) -> Dict[str, int]:
    """Elements each rank sends through collectives over "tp" per optimizer step, by op, as the
    ledger counts them (the full tensor of an all-gather or reduce-scatter), tp > 1.

    tokens = b x s summed over the rank's micro-batches; ``layers`` the rank's blocks (default
    all), ``first`` / ``last``: whether it holds the embedding / the head; hidden size h:
        blocks        4 tokens h per dense block, 2 per MoE block (2 forward + 2 backward;
                      the experts are not split over tp)
        embedding       tokens h      (forward: sum of the vocab shards' rows)
        head input      tokens h      (backward: f before the vocab-parallel head)
        loss          3 tokens        (max, then [sum exp, target logit])
        sp norms      h m per norm    (RMSNorm weight gradients, per micro-batch; sp only)
    Without sequence parallel all are all-reduces; with it the activation terms become an
    all-gather and a reduce-scatter each (the same bytes on the wire). The grad norm's one
    number is all-reduced over the world, not "tp" (grad_norm.py). ``tp_comm_calls``: the
    calls that carry them.
    """
    sites, norms, _ = _tp_sites(config, layers, first, last)
    activations = sites * tokens * config.hidden_size
    scalars = 3 * tokens if last else 0
    if not sequence_parallel:
        return {"all_reduce": activations + scalars}
    norms *= config.hidden_size * num_micro_batches
    return {"all_gather": activations, "reduce_scatter": activations, "all_reduce": scalars + norms}


def tp_comm_calls(config: Any, sequence_parallel: bool, num_micro_batches: int = 1,
                  layers: Optional[Sequence[int]] = None, first: bool = True,
                  last: bool = True) -> Dict[str, int]:
    """Calls over "tp" per optimizer step, by op, that carry ``tp_comm_elements``: per
    micro-batch one per activation term (a block's f and f-bar: 4 per dense block, 2 per MoE
    block; the embedding's; the head input's), two for the loss (the max; [sum exp, target
    logit]) and under sequence parallel one per norm weight (its all-reduce in backward)."""
    sites, norms, loss = _tp_sites(config, layers, first, last)
    m = num_micro_batches
    if not sequence_parallel:
        return {"all_reduce": (sites + loss) * m}
    return {"all_gather": sites * m, "reduce_scatter": sites * m, "all_reduce": (loss + norms) * m}


def unit_params(model: ModelSpec, tp: int, unit: Unit) -> List[int]:
    """The elements of each parameter of ``unit`` on one tp rank, in registration order
    (llama.py; a GPT block: LayerNorm weight and bias, biased fused qkv and projections)."""
    h, t = model.hidden_size, tp
    norm = [h, h] if model.kind == "gpt" else [h]
    if unit.name == "head":  # the final norm, then the output layer unless tied to the input
        return norm + ([unit.dense - sum(norm)] if unit.dense > sum(norm) else [])
    if not unit.name.startswith("layers."):  # the embedding, or a tied copy of it
        return [unit.dense]
    f, kv, i = model.intermediate_size, model.kv_size, int(unit.name.split(".")[1])
    if model.kind == "gpt":
        return norm + [3 * h * h // t, 3 * h // t, h * h // t, h] + norm + \
            [f * h // t, f // t, h * f // t, h]
    mlp = [h * model.num_experts] if model.is_moe_layer(i) else [f * h // t] * 3
    return norm + [h * h // t, kv * h // t, kv * h // t, h * h // t] + norm + mlp


class Collective(NamedTuple):
    group: str
    size: int
    op: str
    elements: int
    element_size: int
    phase: str = "compute"
    calls: int = 1  # how many calls carry it (each pays the latency)

    @property
    def wire(self) -> float:
        return wire_bytes(self.op, self.elements * self.element_size, self.size)


def _pipeline_sends(layout: PlanLayout, pp_rank: int) -> int:
    """Stage boundaries rank ``pp_rank`` sends across per micro-batch: an activation from each of
    its stages but the last, a gradient from each but the first, unless the neighbour stage is
    on this rank (the turn of a V: stages p - 1 and p on rank p - 1; none otherwise)."""
    p, stages = layout.pp, layout.pp * layout.virtual_stages
    v_shape = layout.schedule in V_SHAPED
    sends = 0
    for g in rank_stages(p, layout.virtual_stages, pp_rank, layout.schedule):
        for neighbour in (g + 1, g - 1):
            if 0 <= neighbour < stages and rank_of_stage(neighbour, p, v_shape) != pp_rank:
                sends += 1
    return sends


def w_repeats(model: ModelSpec, layout: PlanLayout, pp_rank: int) -> Tuple[int, int, int]:
    """(dense blocks, MoE blocks, heads) whose backward this repository's W runs again on
    ``pp_rank``, per step: a zero-bubble schedule's W walks the input-gradient chain a second
    time to reach the weights (pipeline_runtime.py), once for each backward it splits. Their
    collectives are sent again: tp 2 T h per dense block and 1 per MoE block, T h for the
    head's input (under SP reduce-scatters and, for the blocks, all-gathers; the embedding's
    backward sends nothing more); the cp ring's 2 cp - 1 backward K/V messages per block
    (Ulysses: the backward's all-to-alls). Expert parallel's are not counted."""
    lay = layout
    if lay.schedule not in ZERO_BUBBLE or lay.pp == 1:
        return 0, 0, 0
    v_shape, last = lay.schedule in V_SHAPED, lay.pp * lay.virtual_stages - 1
    chunks = rank_layers(model.num_layers, lay.pp, lay.virtual_stages, lay.layer_split,
                         lay.schedule)[pp_rank]
    splits = split_backwards(lay.schedule, lay.pp, lay.num_micro_batches, lay.virtual_stages,
                             pp_rank)
    dense = moe = head = 0
    for c, (layers, n) in enumerate(zip(chunks, splits)):
        experts = sum(1 for i in layers if model.is_moe_layer(i))
        dense, moe = dense + n * (len(layers) - experts), moe + n * experts
        head += n * (stage_index(pp_rank, c, lay.pp, v_shape) == last)
    return dense, moe, head


def collectives(model: ModelSpec, layout: PlanLayout, pp_rank: int = 0) -> List[Collective]:
    """Every collective a rank of pipeline rank ``pp_rank`` issues in one step."""
    lay, out = layout, []
    m, b, s = lay.num_micro_batches, lay.micro_batch_size, lay.seq_len // lay.cp
    h, t, T = model.hidden_size, lay.tp, b * s  # T: tokens of one micro-batch on this rank
    act = ACTIVATION_BYTES[lay.precision]
    grad = PRECISION_BYTES[lay.precision][1]
    param = PRECISION_BYTES[lay.precision][0]
    if lay.framework == "torchtitan":  # FSDP2 gathers bf16 copies (fp8 ones under float8's)
        param = 1 if lay.fp8 == "matmul+all-gather" else 2
    chunks = rank_layers(model.num_layers, lay.pp, lay.virtual_stages, lay.layer_split,
                         lay.schedule)
    layers = [i for c in chunks[pp_rank] for i in c]
    moe = sum(1 for i in layers if model.is_moe_layer(i))
    first, last = holds_ends(lay, pp_rank)
    units = rank_units(model, lay, pp_rank)
    dense, expert = sum(u.dense for u in units), sum(u.expert for u in units)
    n, edp, v = lay.dp_cp, lay.dp_cp // lay.ep, len(chunks[pp_rank])
    grads = lay.gradient_group  # the dp_cp group's name: "dp" at cp 1, "dp_cp" once cp > 1

    def add(group: str, size: int, op: str, elements: int, esize: int, phase: str = "compute",
            calls: int = 1) -> None:
        if size > 1 and elements > 0:
            out.append(Collective(group, size, op, elements, esize, phase, calls))

    # data parallel (over dp x cp), each pipeline chunk wrapped on its own: the gradients,
    # the reported loss, MoE statistics
    if lay.zero_stage == 0 and model.num_experts:  # ExpertParallel: one flat all-reduce each
        add(grads, n, "all_reduce", dense, grad, calls=v)
    elif lay.zero_stage == 0:  # DDP: one all-reduce per bucket
        params = [[p for u in units if u.chunk == c for p in unit_params(model, t, u)]
                  for c in range(v)]
        # DDP's own bucket rule (chapter 01's data_parallel.py; imported here, where it is
        # needed, so that the planner imports without torch)
        add(grads, n, "all_reduce", dense, grad,
            calls=sum(len(ddp_buckets(chunk, lay.bucket_size_mb)) for chunk in params))
    else:
        padded = sum(-(-u.dense // n) * n for u in units)
        ops = zero_comm_elements(lay.zero_stage, padded, m)
        gathers = len(units) * (2 * m if lay.zero_stage == 3 else 1)
        add(grads, n, "all_gather", ops["all_gather"], param, calls=gathers)
        add(grads, n, "reduce_scatter", ops["reduce_scatter"], grad, calls=len(units))
    add(grads, n, "all_reduce", 1 + moe * (model.num_experts + 1) * m, 4, calls=1 + moe * m)
    full = lay.activation_checkpointing == "full"
    if full:  # each MoE forward again: its routing statistics again
        add(grads, n, "all_reduce",
            moe * (model.num_experts + 1) * m, 4, "recompute", calls=moe * m)
    add("edp", edp, "all_reduce", expert, grad, calls=len({u.chunk for u in units if u.expert}))
    # tensor parallel
    if t > 1:
        ops = tp_comm_elements(model, T * m, lay.sequence_parallel, m, layers, first, last)
        calls = tp_comm_calls(model, lay.sequence_parallel, m, layers, first, last)
        for op, elements in ops.items():
            add("tp", t, op, elements, act, calls=calls[op])
        again, again_moe, again_head = w_repeats(model, lay, pp_rank)
        blocks = (2 * again + again_moe) * T * h
        if lay.sequence_parallel:
            add("tp", t, "all_gather", blocks, act, calls=2 * again + again_moe)
            add("tp", t, "reduce_scatter", blocks + again_head * T * h, act,
                calls=2 * again + again_moe + again_head)
        else:
            add("tp", t, "all_reduce", blocks + again_head * T * h, act,
                calls=2 * again + again_moe + again_head)
        if full:  # the forward again, but its last collective (an MoE block's is attention's)
            redone = len(layers) * m
            if lay.sequence_parallel:  # (no MoE: sequence parallel refuses it)
                add("tp", t, "all_gather", 2 * redone * T * h, act, "recompute", calls=2 * redone)
                add("tp", t, "reduce_scatter", redone * T * h, act, "recompute", calls=redone)
            else:
                add("tp", t, "all_reduce", redone * T * h, act, "recompute", calls=redone)
    # pipeline: activations forward, gradients backward; the loss from the last stage
    if lay.pp > 1:
        message = T * h // (t if lay.sequence_parallel else 1)
        messages = _pipeline_sends(lay, pp_rank) * m  # as many received as sent
        add("pp", lay.pp, "send", messages * message, act, calls=messages)
        add("pp", lay.pp, "recv", messages * message, act, calls=messages)
        add("pp", lay.pp, "all_reduce", 1, 4)
        if has_tied_copy(model, lay) and (first or last):  # the two copies' gradients
            copy = model.vocab_rows(t) * h // t  # this tp rank's rows, padding included
            add("embd", 2, "all_reduce", copy if lay.zero_stage == 0 else -(-copy // n), grad)
    # context parallel: the ring passes K and V
    if lay.cp > 1:
        kv = 2 * T * model.kv_size // t  # one K/V message: this tp rank's kv heads
        again = sum(w_repeats(model, lay, pp_rank)[:2])  # blocks whose backward runs twice
        if lay.cp_variant == "ring":
            for phase, count in (("compute",
                                  (3 * lay.cp - 2) * len(layers) * m + (2 * lay.cp - 1) * again),
                                 ("recompute", (lay.cp - 1) * len(layers) * m)):
                if phase == "recompute" and lay.activation_checkpointing == "none":
                    continue
                add("cp", lay.cp, "send", count * kv, act, phase, calls=count)
                add("cp", lay.cp, "recv", count * kv, act, phase, calls=count)
        else:  # Ulysses: q, k, v and the output, forward and backward, (cp-1)/cp sent
            qkvo = 2 * T * h // t + kv
            both, w = 2 * qkvo * (lay.cp - 1) // lay.cp, qkvo * (lay.cp - 1) // lay.cp
            add("cp", lay.cp, "all_to_all",
                both * len(layers) * m + w * again, act, calls=8 * len(layers) * m + 4 * again)
            if lay.activation_checkpointing != "none":  # the forward's again: q, k, v (and out)
                redo, per_block = (qkvo, 4) if full else (qkvo - T * h // t, 3)
                add("cp", lay.cp, "all_to_all",
                    redo * (lay.cp - 1) // lay.cp * len(layers) * m, act, "recompute",
                    calls=per_block * len(layers) * m)
    # expert parallel: the routed tokens there and back, forward and backward (balanced)
    if lay.ep > 1 and moe:
        tokens = T * model.moe_top_k * h * (lay.ep - 1) // lay.ep
        add("ep", lay.ep, "all_to_all", 4 * tokens * moe * m, act, calls=4 * moe * m)
        counts = model.num_experts * (lay.ep - 1) // lay.ep  # int64, forward only
        add("ep", lay.ep, "all_to_all", counts * moe * m, 8, calls=moe * m)
        if full:  # the forward again: dispatch, combine and the counts
            add("ep", lay.ep, "all_to_all", 2 * tokens * moe * m, act, "recompute",
                calls=2 * moe * m)
            add("ep", lay.ep, "all_to_all", counts * moe * m, 8, "recompute", calls=moe * m)
    # the gradient norm: one number over the world, unless every rank holds every gradient
    if lay.tp > 1 or lay.pp > 1 or lay.zero_stage > 0 or (lay.ep > 1 and expert):
        add("world", lay.world, "all_reduce", 1, 4)
    return out


def wire_bytes_per_group(model: ModelSpec, layout: PlanLayout, pp_rank: int = 0,
                         phase: Optional[str] = None) -> Dict[str, float]:
    """{group: bytes this rank sends per step}, over both phases unless ``phase`` is given."""
    totals: Dict[str, float] = defaultdict(float)
    for c in collectives(model, layout, pp_rank):
        if phase is None or c.phase == phase:
            totals[c.group] += c.wire
    return dict(totals)
