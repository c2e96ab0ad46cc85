"""Pipeline parallel: the layers are cut into stages over the "pp" group; micro-batches flow.

Stage s of S = p v holds consecutive layers (embedding on stage 0; final norm, head and loss on
stage S - 1). Rank r of the pipeline holds stages r, r + p, ... (v "virtual stages" or model
chunks per rank when interleaved). A micro-batch's activation (b, s, h) goes forward from
stage to stage and its gradient comes back, point to point:

    rank 0  [embed, layers 0-1] --act--> rank 1 [layers 2-3, norm, head, loss]
            <---------------- grad of act -------------

Cost per step and rank: 2 m v messages of b s h elements each way (forward + backward), no
collective in between; the price is the bubble, (p-1)/(v m + p - 1) of the step idle, and the
memory of the activations held between a micro-batch's forward and its backward (m with AFAB,
at most p - r with 1F1B). The schedules are plain data in ``pipeline_schedules.py``; here
they run: every step of a rank's plan posts one ``batch_isend_irecv`` (paired sends and recvs,
shapes known in advance) and then computes one forward or backward.

The loss of each micro-batch is divided by m, so the accumulated gradients are those of the
rank's mean loss; data-parallel wrappers of the chunks sync only in the chunk's last backward.
A mixture-of-experts chunk adds its layers' load-balancing losses (/ m) where they arise: each
stage backpropagates its own with its activation gradient, and the reported loss sums them.

Tied embeddings (Megatron's way): the first stage holds the embedding, the last a copy of it as
the output layer; after backward one all-reduce over the embedding group (pg_manager: the
pipeline's first and last rank) sums the two copies' gradients, so both stay equal. In a V
(zbv, dualpipev) both stages are rank 0's chunks: they share the one parameter, as on one
device, and its two uses accumulate into its one ``.grad`` (no copy, no embedding group).

Longer than 300 lines on purpose: the cut into stages, the runtime that executes a schedule's
actions with its point-to-point messages, and PyTorch's pipelining beside it are read together;
the schedules themselves are data (pipeline_schedules.py, zero_bubble.py).
"""

from contextlib import nullcontext
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from scaletorch.data import split_micro_batches
from scaletorch.dist import ProcessGroupManager, comm, get_ledger
from scaletorch.models import Llama, MoE, loss_fn, moe_aux_loss
from scaletorch.parallel.data_parallel import TorchDataParallel, apply_data_parallel
from scaletorch.parallel.mixed_precision import DynamicLossScaler, compute_dtype
from scaletorch.parallel.pipeline_schedules import (P2P, ZERO_BUBBLE, Action, Timeline,
                                                    TimelineRecorder, rank_of_stage,
                                                    schedule_actions, schedule_plan, stage_index,
                                                    validate_schedule)
from scaletorch.parallel.step import average_over_group, local_batch
from scaletorch.parallel.zero_bubble import ActivationMeter
# which layers each stage holds: layout arithmetic, with the planner (scaletorch/plan)
from scaletorch.plan.pipeline import split_layers

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
State = Dict[str, torch.Tensor]


class PipelineChunk(nn.Module):
    """One stage: [embedding] -> its layers -> [final norm -> head]. Parameter names are the
    full model's (``layers`` is keyed by the layer's global index), so state dicts line up.

    forward: token ids (b, s) on stage 0, else hidden (b, s, h) (or (b, s/tp, h) under
    sequence parallel) -> hidden of the same shape, or logits (b, s, V) on the last stage.
    ``position_ids`` (s,): the tokens' true positions for RoPE (context parallel), else 0..s-1.
    """

    # The model's own pieces, the same code bound to this chunk's share of the modules:
    # embed (the embedding), rope (the rotary tables of the positions), head (norm, lm_head).
    # mypy types their self as a Llama, hence an ignore[misc] where forward calls them.
    embed, rope, head = Llama.embed, Llama.rope, Llama.head

    def __init__(self, model: Llama, layer_ids: List[int], first: bool, last: bool,
                 sequence_parallel_size: int = 1) -> None:
        super().__init__()
        self.config = model.config
        self.sequence_parallel_size = sequence_parallel_size  # tokens of x = s / this
        self.embed_tokens = model.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        first = self.embed_tokens is not None
        seq_len = x.size(1) * (1 if first else self.sequence_parallel_size)
        if first:
            x = self.embed(x)  # type: ignore[misc]  # (b, s) -> (b, s, h)
        cos, sin = self.rope(position_ids, seq_len, x.device)  # type: ignore[misc]
        for layer in self.layers.values():  # as Llama.forward, on this stage's layers
            x = layer(x, cos, sin)
        if self.lm_head is not None:
            x = self.head(x)  # type: ignore[misc]  # (b, s, V)
        return x


class PipelineModel(nn.Module):
    """This rank's v chunks (``chunks[c]`` is global stage c p + rank, or in a V stages rank
    and 2p - 1 - rank), and where every full model key lives (``owner[key]`` = global stage).
    ``tied_embeddings``: the first and last stage each hold a copy of the tied embedding (in a
    V: rank 0's two chunks hold the one parameter)."""

    def __init__(self, chunks: List[PipelineChunk], stages: List[int], num_stages: int,
                 owner: Dict[str, int], hidden_size: int, v_shape: bool = False,
                 tied_embeddings: bool = False) -> None:
        super().__init__()
        self.tied_embeddings = tied_embeddings  # a copy on the first and on the last stage
        self.chunks = nn.ModuleList(chunks)
        self.stages, self.num_stages, self.owner = stages, num_stages, owner
        self.v_shape = v_shape
        self.hidden_size = hidden_size
        self.sequence_parallel_size = chunks[0].sequence_parallel_size


def apply_pipeline_parallel(model: Llama, pgm: ProcessGroupManager, virtual_stages: int = 1,
                            layer_split: Optional[Sequence[int]] = None,
                            sequence_parallel: bool = False,
                            v_shape: bool = False) -> PipelineModel:
    """Keep this pipeline rank's stages of ``model`` (already tensor-parallel, if any).

    ``layer_split``: layers per global stage (p v entries), default an even split.
    ``sequence_parallel``: activations between stages are (b, s/tp, h) (chapter 03).
    ``v_shape``: two chunks, stages rank and 2p - 1 - rank (the zbv and dualpipev schedules).
    """
    p, rank = pgm.pipeline_model_parallel_world_size, pgm.pipeline_model_parallel_rank
    if virtual_stages > 1 and p == 1:
        raise ValueError(f"virtual_pipeline_stages ({virtual_stages}) needs a pipeline: "
                         f"pipeline_model_parallel_size is 1")
    if model.config.tie_word_embeddings and p > 1 and not v_shape:
        untie_across_stages(model)  # a V keeps the tie: both ends are chunks of rank 0
    num_stages = p * virtual_stages
    layers = split_layers(model.config.num_layers, num_stages, layer_split)
    stage_of_layer = {i: s for s, ids in enumerate(layers) for i in ids}
    owner = {}
    for key in model.state_dict():
        if key.startswith("layers."):
            owner[key] = stage_of_layer[int(key.split(".")[1])]
        else:  # embed_tokens on the first stage; norm and lm_head on the last
            owner[key] = 0 if key.startswith("embed_tokens.") else num_stages - 1
    sp = pgm.tensor_model_parallel_world_size if sequence_parallel else 1
    stages = [stage_index(rank, c, p, v_shape) for c in range(virtual_stages)]
    chunks = [PipelineChunk(model, layers[s], s == 0, s == num_stages - 1, sp) for s in stages]
    # NCCL wants the first call on a group to involve all its ranks, and p2p is partial.
    comm.barrier(pgm.pipeline_model_parallel_group)
    return PipelineModel(chunks, stages, num_stages, owner, model.config.hidden_size, v_shape,
                         tied_embeddings=model.config.tie_word_embeddings and p > 1)


# ---- tied embeddings: a copy on the last stage, gradients summed over the embedding group ----


def untie_across_stages(model: Llama) -> None:
    """Megatron's way for ``tie_word_embeddings`` under a pipeline: the embedding (first stage)
    and the output layer (last stage) live on different ranks, so the last stage gets its own
    copy of the tied weight, and ``sync_tied_embedding_grads`` sums the two copies' gradients
    over the embedding group (pg_manager) after backward: each copy then has the gradient of
    the one tied weight (embedding use + head use), and the same AdamW update keeps them equal.

    Same init without communication: every rank built the whole model from one seed, so the
    copy is the clone of bit-identical values. Both copies are tagged ``shared_embedding``
    (the sync finds them by it; the clip counts them as 2 replicas; ZeRO gives the copy its own
    unit); the copy keeps the tensor-parallel tags, as the vocabulary rows are split alike.
    """
    weight = model.embed_tokens.weight
    weight.shared_embedding = True  # type: ignore[attr-defined]
    copy = nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad)
    copy.__dict__.update(weight.__dict__)  # tensor_model_parallel, partition_dim, vocab_padding
    model.lm_head.weight = copy


def tied_embedding_params(module: nn.Module) -> List[torch.Tensor]:
    """The copies of a tied embedding that ``module`` holds (after any wrapper: ZeRO tags the
    shard of the unit that holds one)."""
    return [p for p in module.parameters() if getattr(p, "shared_embedding", False)]


def sync_tied_embedding_grads(params: Sequence[torch.Tensor], pgm: ProcessGroupManager) -> None:
    """Sum the gradients of the tied embedding's two copies over the embedding group (first and
    last pipeline rank): one all-reduce of V x h / tp elements (or a ZeRO shard of them) per
    step, after the data-parallel sync. ``params``: this rank's copies, none on a middle
    stage (then nothing to do: it is in no embedding group)."""
    for param in params:
        if param.grad is None:  # a copy with no use this step still joins the sum
            param.grad = torch.zeros_like(param)
        comm.all_reduce(param.grad, pgm.embedding_group, name="embd")


def apply_data_parallel_to_chunks(pipe: PipelineModel, pgm: ProcessGroupManager,
                                  impl: str = "scaletorch",
                                  bucket_size_mb: float = 25.0) -> PipelineModel:
    """Wrap each chunk for data parallel over "dp_cp" (chapter 01); state dict keys unchanged.

    impl "scaletorch": bucketed DDP; "torch": torch DDP, with find_unused_parameters=True,
    which torch.distributed.pipelining needs in torch 2.13: without it the reducer's bucket
    rebuild asserts after the first step, and static_graph=True gives wrong gradients.
    """
    if pgm.data_parallel_world_size_with_context == 1:
        return pipe
    if pipe.v_shape and pipe.tied_embeddings:
        # validation.py refuses it first for parallelize (and ZeRO's or experts' wrappers)
        raise ValueError(f"tie_word_embeddings with a V-shaped schedule (zbv, dualpipev) and data "
                         f"parallel over dp_cp ({pgm.data_parallel_world_size_with_context}): "
                         f"rank 0's two chunks share the tied weight, and each chunk's wrapper "
                         f"would sync it on its own; run the V with dp_cp 1, or use afab, 1f1b, "
                         f"interleaved or zb-h1")
    device = next(pipe.parameters()).device

    def wrap(chunk: nn.Module) -> nn.Module:
        if impl != "torch":
            return apply_data_parallel(chunk, pgm, impl, bucket_size_mb)
        return TorchDataParallel(chunk, device_ids=None if device.type == "cpu" else [device.index],
                                 process_group=pgm.data_parallel_group_with_context,
                                 bucket_cap_mb=bucket_size_mb, find_unused_parameters=True)

    pipe.chunks = nn.ModuleList(wrap(chunk) for chunk in pipe.chunks)
    return pipe


class PipelineSchedule:
    """The Trainer's ``forward_backward(inputs, targets) -> loss`` for a pipeline model.

    inputs, targets: the global batch (B, s); this rank takes its data-parallel slice and
    splits it into m micro-batches. Returns the global mean loss, the same on every rank
    (all-reduce over "pp", then mean over "dp_cp"). ``timeline`` holds the last step's events.
    ``shard_sequence(inputs, targets) -> (inputs, targets, position_ids)`` then keeps this
    rank's tokens of each sequence (context parallel, as in ``make_data_parallel_step``).
    ``scaler`` (fp16): the backward starts from the loss x ``scaler.scale`` (the last stage's
    loss and a stage's own MoE loss; the rest arrives scaled); the returned loss is unscaled.
    """

    def __init__(self, pipe: PipelineModel, pgm: ProcessGroupManager, schedule: str,
                 num_micro_batches: int, loss_fn: LossFn = loss_fn,
                 shard_sequence: Optional[Callable] = None,
                 scaler: Optional[DynamicLossScaler] = None) -> None:
        self.pipe, self.pgm, self.loss_fn = pipe, pgm, loss_fn
        self.shard_sequence, self.scaler = shard_sequence, scaler
        p, rank = pgm.pipeline_model_parallel_world_size, pgm.pipeline_model_parallel_rank
        v = len(pipe.chunks)
        validate_schedule(schedule, p, num_micro_batches, v)
        self.m, self.group = num_micro_batches, pgm.pipeline_model_parallel_group
        self.ranks = pgm.group_ranks("pp")  # pipeline rank -> global rank
        self.plan = schedule_plan(schedule, p, num_micro_batches, rank, v)
        actions = schedule_actions(schedule, p, num_micro_batches, rank, v)
        # a chunk's data-parallel gradients sync in its last backward only
        self.syncs = {
            max(i for i, a in enumerate(actions) if a.kind == "B" and a.chunk == c)
            for c in range(v)
        }
        self.recorder = TimelineRecorder(rank, p, num_micro_batches, v,
                                         device=next(pipe.parameters()).device)
        self.meter = ActivationMeter(list(pipe.parameters()))  # the last step's activations
        # The stage inputs' dtype (the parameters'), and what activations and their gradients
        # cross the wire in: the compute dtype under autocast (chapter 08), set per step.
        self.param_dtype = self.dtype = next(pipe.parameters()).dtype
        self.tied = tied_embedding_params(pipe)  # a tied embedding's copy on this rank, if any

    @property
    def timeline(self) -> Timeline:
        return self.recorder.timeline

    def _start(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """This rank's micro-batches of the global batch, and the step's empty bookkeeping."""
        pgm = self.pgm
        inputs, targets, self.position_ids = local_batch(inputs, targets, pgm.data_parallel_rank,
                                                         pgm.data_parallel_world_size,
                                                         self.shard_sequence)
        self.micro_batches = split_micro_batches(inputs, targets, self.m)
        b, s = self.micro_batches[0][0].shape
        self.shape = (b, s // self.pipe.sequence_parallel_size, self.pipe.hidden_size)
        self.recorder.reset()
        self.meter.reset()
        self.dtype = compute_dtype(inputs.device.type) or self.param_dtype  # the wire's
        self.held: Dict[tuple, tuple] = {}  # (mb, chunk) -> (stage input, output or loss)
        self.inbox: Dict[tuple, torch.Tensor] = {}  # (kind, mb, dst stage) -> received
        self.outbox: Dict[tuple, torch.Tensor] = {}  # (kind, mb, src stage) -> to send
        self.loss = torch.zeros((), device=inputs.device)

    def _finish(self) -> torch.Tensor:
        """End the chunks' data-parallel syncs; the global mean loss, the same on every rank."""
        for chunk in self.pipe.chunks:
            finish = getattr(chunk, "finish_grad_sync", None)
            if finish is not None:
                finish()
        sync_tied_embedding_grads(self.tied, self.pgm)  # first and last stage (embedding group)
        loss = self.loss.detach().clone()  # nonzero on the last stage only
        comm.all_reduce(loss, self.group)  # every stage gets it
        return average_over_group(loss, self.pgm.data_parallel_group_with_context)

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self._start(inputs, targets)
        for i, (batch, action) in enumerate(self.plan):
            self._exchange(batch)
            if action is not None:
                with self.recorder.time(action):
                    if action.kind == "F":
                        self._forward(action)
                    else:
                        self._backward(action, i)
        return self._finish()

    def _exchange(self, batch: Iterable[P2P]) -> None:
        """Post this step's sends and recvs as one batch over "pp" and wait for all of them."""
        ops = []
        for op in batch:
            peer = self.ranks[op.peer]
            if op.op == "send":
                tensor = self.outbox.pop((op.kind, op.micro_batch, op.src))
                ops.append(dist.P2POp(dist.isend, tensor, peer, self.group))
            else:
                tensor = torch.empty(self.shape, dtype=self.dtype, device=self.loss.device)
                self.inbox[(op.kind, op.micro_batch, op.dst)] = tensor
                ops.append(dist.P2POp(dist.irecv, tensor, peer, self.group))
        for work in comm.batch_isend_irecv(ops, self.group):
            work.wait()

    def _forward(self, action: Action) -> None:
        stage, mb = self.pipe.stages[action.chunk], action.micro_batch
        if stage == 0:
            x = self.micro_batches[mb][0]  # (b, s) token ids
        else:
            # (b, s, h), back in the stage's dtype: the residual stream stays fp32 as on one
            # device; its gradient leaves in the wire's (_backward)
            x = self.inbox.pop(("act", mb, stage)).to(self.param_dtype).requires_grad_()
        chunk = self.pipe.chunks[action.chunk]
        with self.meter.saving((mb, action.chunk)):
            out = chunk(x) if self.position_ids is None else \
                chunk(x, position_ids=self.position_ids)
        aux = moe_aux_loss(chunk) / self.m  # this chunk's MoE layers' losses; 0.0 if dense
        if stage == self.pipe.num_stages - 1:
            out = self.loss_fn(out, self.micro_batches[mb][1]) / self.m + aux  # out: the loss
            self.loss += out.detach()
        else:
            self.outbox[("act", mb, stage)] = out.detach().to(self.dtype)
            if torch.is_tensor(aux):
                self.loss += aux.detach()
        # a middle stage backpropagates its own MoE loss with its output (None: dense)
        self.held[(mb, action.chunk)] = (x, out, aux if torch.is_tensor(aux) else None)

    def _outputs_and_grads(self, action: Action) -> tuple:
        """(stage input, outputs, their gradients) of a micro-batch's forward through a chunk."""
        stage, mb = self.pipe.stages[action.chunk], action.micro_batch
        x, out, aux = self.held.pop((mb, action.chunk))
        outputs: List[torch.Tensor] = [out]
        # d (scale x loss) / d loss = scale (fp16); the gradients that arrive are scaled already
        scale = 1.0 if self.scaler is None else self.scaler.scale
        grads: List[Optional[torch.Tensor]] = [
            None if scale == 1.0 else torch.full_like(out, scale)
        ]
        if stage < self.pipe.num_stages - 1:
            grads = [self.inbox.pop(("grad", mb, stage)).to(out.dtype)]
            if aux is not None:  # a stage's own MoE loss: d (scale x aux) / d aux = scale
                outputs, grads = [out, aux], grads + [torch.full_like(aux, scale)]
        return x, outputs, grads

    def _backward(self, action: Action, index: int) -> None:
        stage, mb = self.pipe.stages[action.chunk], action.micro_batch
        chunk = self.pipe.chunks[action.chunk]
        x, outputs, grads = self._outputs_and_grads(action)
        no_sync = getattr(chunk, "no_sync", None)
        with nullcontext() if index in self.syncs or no_sync is None else no_sync():
            torch.autograd.backward(outputs, grads)
        self.meter.free((mb, action.chunk))
        if stage > 0:
            self.outbox[("grad", mb, stage)] = x.grad.to(self.dtype)


class TorchPipelineSchedule:
    """The same contract with torch.distributed.pipelining (the native reference):
    ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble (for
    zb-h1), ScheduleZBVZeroBubble or ScheduleDualPipeV over this rank's chunks. Its messages
    bypass our ledger. Gradients are scaled by 1/m (scale_grads) as ours."""

    def __init__(self, pipe: PipelineModel, pgm: ProcessGroupManager, schedule: str,
                 num_micro_batches: int, loss_fn: LossFn = loss_fn) -> None:
        from torch.distributed import pipelining

        if any(isinstance(m, MoE) for m in pipe.modules()):
            raise ValueError("torch.distributed.pipelining runs dense models only here (it "
                             "would drop the MoE load-balancing losses); use impl scaletorch")
        if pipe.tied_embeddings:
            raise ValueError("tie_word_embeddings true with torch.distributed.pipelining: its "
                             "stages do not share parameters across ranks (no embedding group "
                             "sums the first and the last stage's copies); use impl scaletorch "
                             "under a pipeline")
        p = pgm.pipeline_model_parallel_world_size
        validate_schedule(schedule, p, num_micro_batches, len(pipe.chunks))
        self.pipe, self.pgm, self.m = pipe, pgm, num_micro_batches
        device = next(pipe.parameters()).device
        stages = [
            pipelining.PipelineStage(chunk, s, pipe.num_stages, device,
                                     group=pgm.pipeline_model_parallel_group)
            for chunk, s in zip(pipe.chunks, pipe.stages)
        ]
        multi = {
            "interleaved": pipelining.ScheduleInterleaved1F1B,
            "zb-h1": pipelining.ScheduleInterleavedZeroBubble,  # ZB-H1 with one stage per rank
            "zbv": pipelining.ScheduleZBVZeroBubble,
            "dualpipev": pipelining.ScheduleDualPipeV,
        }
        self.schedule: Union[pipelining.schedules.PipelineScheduleMulti,
                             pipelining.schedules.PipelineScheduleSingle]
        if schedule in multi:
            # torch types the stages list[_PipelineStageBase], its private base (list is invariant)
            runtime = multi[schedule]
            self.schedule = runtime(stages, self.m, loss_fn=loss_fn)  # type: ignore[arg-type]
        else:
            cls = pipelining.ScheduleGPipe if schedule == "afab" else pipelining.Schedule1F1B
            self.schedule = cls(stages[0], num_micro_batches, loss_fn=loss_fn)

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pgm, pipe = self.pgm, self.pipe
        inputs, targets, _ = local_batch(inputs, targets, pgm.data_parallel_rank,
                                         pgm.data_parallel_world_size)
        last = pipe.num_stages - 1 in pipe.stages
        losses: List[torch.Tensor] = []
        args = (inputs, ) if 0 in pipe.stages else ()
        self.schedule.step(*args, target=targets if last else None, losses=losses if last else None)
        zero = torch.zeros((), device=inputs.device)
        loss = torch.stack(losses).mean().detach() if last else zero
        comm.all_reduce(loss, pgm.pipeline_model_parallel_group)
        return average_over_group(loss, pgm.data_parallel_group_with_context)


def _gather_to_first_stage(pgm: ProcessGroupManager, payload: torch.Tensor,
                           sizes: Sequence[int]) -> List[torch.Tensor]:
    """Pipeline rank 0 receives ``payload`` (``sizes[q]`` elements) from every stage q and
    returns them in stage order; other ranks send theirs and get []. Not in the ledger: it is
    for checks and charts, not training traffic."""
    group, ranks = pgm.pipeline_model_parallel_group, pgm.group_ranks("pp")
    with get_ledger().paused():
        if pgm.pipeline_model_parallel_rank != 0:
            out, ops = [], [dist.P2POp(dist.isend, payload, ranks[0], group)]
        else:
            out = [payload] + [payload.new_empty(n) for n in sizes[1:]]
            ops = [dist.P2POp(dist.irecv, t, ranks[q], group) for q, t in enumerate(out) if q]
        for work in comm.batch_isend_irecv(ops, group):
            work.wait()
    return out


def gather_pipeline_state_dict(pipe: PipelineModel, pgm: ProcessGroupManager,
                               state: State) -> Optional[State]:
    """Every stage's tensors (fp32, full-model names) on pipeline rank 0; None elsewhere.

    ``state``: this rank's stages' tensors, already un-sharded (``ParamMap.gather`` passes them,
    gathered over tp, ep and ZeRO's dp_cp). Shapes travel first, then the values.
    """
    p, rank = pgm.pipeline_model_parallel_world_size, pgm.pipeline_model_parallel_rank
    keys = [[k for k in pipe.owner if rank_of_stage(pipe.owner[k], p, pipe.v_shape) == q]
            for q in range(p)]
    if sorted(state) != sorted(keys[rank]):
        raise ValueError(f"state keys {sorted(state)} are not this stage's {keys[rank]}")
    device = next(pipe.parameters()).device
    # per tensor: ndim, then up to 4 sizes padded with 1s
    dims = torch.ones(len(keys[rank]), 5, dtype=torch.long, device=device)
    for i, k in enumerate(keys[rank]):
        dims[i, 0] = state[k].dim()
        dims[i, 1:1 + state[k].dim()] = torch.tensor(state[k].shape)
    shapes = [
        d.view(-1, 5)
        for d in _gather_to_first_stage(pgm, dims.flatten(), [5 * len(k) for k in keys])
    ]
    mine = torch.cat([state[k].detach().float().flatten() for k in keys[rank]])
    values = _gather_to_first_stage(pgm, mine, [int(d[:, 1:].prod(1).sum()) for d in shapes])
    if rank != 0:
        return None
    full = {}
    for q in range(p):
        flats = values[q].split(shapes[q][:, 1:].prod(1).tolist())
        for k, flat, d in zip(keys[q], flats, shapes[q].tolist()):
            full[k] = flat.view(d[1:1 + d[0]]).clone()
    if pipe.tied_embeddings:  # two equal copies: one tensor under both names, as on one device
        full["lm_head.weight"] = full["embed_tokens.weight"]
    return full


def gather_timeline(timeline: Timeline, pgm: ProcessGroupManager,
                    device: torch.device) -> Optional[Timeline]:
    """Every stage's events of the last step on pipeline rank 0 (for the chart); None elsewhere."""
    p, m, v = timeline.stages, timeline.micro_batches, timeline.virtual_stages
    rows = [["FBW".index(e.action.kind), e.action.micro_batch, e.action.chunk, e.start, e.end]
            for e in timeline.events]
    payload = torch.tensor(rows, dtype=torch.float64, device=device).flatten()
    counts = [2 * m * v] * p  # actions per rank: F and B of each micro-batch and chunk
    if timeline.schedule in ZERO_BUBBLE:  # and the W's split off
        counts = [len(schedule_actions(timeline.schedule, p, m, q, v)) for q in range(p)]
    parts = _gather_to_first_stage(pgm, payload, [5 * n for n in counts])
    if pgm.pipeline_model_parallel_rank != 0:
        return None
    full = Timeline(p, m, v, schedule=timeline.schedule)
    for rank, part in enumerate(parts):
        for kind, mb, chunk, start, end in part.view(-1, 5).tolist():
            full.record(rank, Action("FBW"[int(kind)], int(mb), int(chunk)), start, end)
    return full
