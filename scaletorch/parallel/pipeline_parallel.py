"""Pipeline parallel: the layers are cut into stages over the "pp" group; micro-batches flow.

Stage s of S = p v holds consecutive layers (embedding on stage 0; norm, head and loss on stage
S - 1); rank r holds stages r, r + p, ... (v chunks per rank when interleaved). A micro-batch's
activation (b, s, h) goes from stage to stage and its gradient comes back, point to point:

    rank 0  [embed, layers 0-1] --act--> rank 1 [layers 2-3, norm, head, loss]
            <---------------- grad of act -------------

Cost per step and rank: m sends of b s h elements per chunk each way, none off the ends (at
most 2 m v; m for rank 0 at p = 2), no collective. The price: the bubble, (p-1)/(v m + p - 1)
of the step idle, and activations held from a micro-batch's forward to its backward (m with
AFAB, at most p - r with 1F1B). Schedules are plain data (scaletorch/schedule/orders.py); each
step of a rank's plan posts one ``batch_isend_irecv`` (shapes known in advance), then one
forward or backward. Micro-batch losses are divided by m; dp wrappers sync in a last backward.
"""

import time
from contextlib import nullcontext
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from scaletorch.data import local_batch, split_micro_batches
from scaletorch.dist import ProcessGroupManager, comm
from scaletorch.dist.comm import average_over_group
from scaletorch.dist.timer import Spans
from scaletorch.models import Llama, loss_fn
from scaletorch.schedule.orders import P2P, Action, Step, classic_units, comm_plan
from scaletorch.schedule.placement import split_layers, stage_index
from scaletorch.schedule.timeline import Timeline

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
State = Dict[str, torch.Tensor]


class PipelineChunk(nn.Module):
    """One stage: [embedding] -> its layers -> [final norm -> head]. Parameter names are the
    full model's (``layers`` is keyed by the layer's global index), so state dicts line up.

    forward: token ids (b, s) on stage 0, else hidden (b, s, h) (or (b, s/tp, h) under
    sequence parallel) -> hidden of the same shape, or logits (b, s, V) on the last stage.
    ``position_ids`` (s,): the tokens' true positions for RoPE (context parallel), else 0..s-1.
    """

    # The model's own code, bound to this chunk's modules: embed, rope (the rotary tables),
    # head (norm, lm_head). mypy types their self as a Llama, hence the ignore[misc] below.
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
    """This rank's v chunks (``chunks[c]`` is global stage ``stages[c]``) and where every full
    model key lives (``owner[key]`` = global stage)."""

    def __init__(self, chunks: List[PipelineChunk], stages: List[int], num_stages: int,
                 owner: Dict[str, int], hidden_size: int, v_shape: bool = False) -> None:
        super().__init__()
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
    if p > 1 and not v_shape and model.lm_head.weight is model.embed_tokens.weight:
        raise ValueError("tied embeddings need a copy on the first and the last stage: call "
                         "tied_embeddings.untie_across_stages(model) first (chapter 07)")
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
    return PipelineModel(chunks, stages, num_stages, owner, model.config.hidden_size, v_shape)


class PipelineSchedule:
    """The Trainer's ``forward_backward(inputs, targets) -> loss`` for a pipeline model.

    inputs, targets: the global batch (B, s); this rank takes its data-parallel slice (and with
    ``shard_sequence``, context parallel, its tokens) in m micro-batches. Returns the global
    mean loss on every rank (all-reduce over "pp", mean over "dp_cp"); ``timeline``: the last
    step's events. Later chapters attach from outside: ``aux_loss(chunk)`` (a chunk's own loss,
    MoE's: 06), ``wire_dtype(device_type)`` (the messages' dtype: 08), ``after_backward``
    (callables: 10) and ``meter`` (``saving(key)``, ``free(key)``: 04b).
    """

    def __init__(self, pipe: PipelineModel, pgm: ProcessGroupManager, schedule: str,
                 num_micro_batches: int, loss_fn: LossFn = loss_fn,
                 shard_sequence: Optional[Callable] = None) -> None:
        self.pipe, self.pgm, self.loss_fn, self.shard_sequence = pipe, pgm, loss_fn, shard_sequence
        self.aux_loss: Optional[Callable[[nn.Module], Any]] = None
        self.wire_dtype: Optional[Callable[[str], Optional[torch.dtype]]] = None
        self.after_backward: List[Callable[[], None]] = []
        self.meter: Optional[Any] = None
        p, rank = pgm.pipeline_model_parallel_world_size, pgm.pipeline_model_parallel_rank
        v, self.m = len(pipe.chunks), num_micro_batches
        self.group, self.ranks = pgm.pipeline_model_parallel_group, pgm.group_ranks("pp")
        self.plan = self.make_plan(schedule, p, rank, v)
        # a chunk's data-parallel gradients sync in its last backward only
        self.syncs = {
            max(i for i, (_, a) in enumerate(self.plan)
                if a is not None and a.kind == "B" and a.chunk == c)
            for c in range(v)
        }
        # each action's start and end; time.time: one clock for every process of a host
        self.spans = Spans(next(pipe.parameters()).device, time.time)
        self.timeline_type, self.schedule, self.p, self.rank = Timeline, schedule, p, rank
        # the stage inputs' dtype (the parameters'); the wire's is set per step (_start)
        self.param_dtype = self.dtype = next(pipe.parameters()).dtype

    def make_plan(self, schedule: str, p: int, rank: int, v: int) -> List[Step]:
        """This rank's steps: afab, 1f1b or interleaved (a subclass runs other orders)."""
        return comm_plan(classic_units(schedule, p, self.m, rank, v), rank, p, v)

    @property
    def timeline(self) -> Timeline:
        """The last step's actions on this rank, in seconds (on CUDA: read after the step)."""
        timeline = self.timeline_type(self.p, self.m, len(self.pipe.chunks), schedule=self.schedule)
        for action, start, end in self.spans.seconds():
            timeline.record(self.rank, action, start, end)
        return timeline

    def _start(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """This rank's micro-batches of the global batch, and the step's empty bookkeeping."""
        pgm = self.pgm
        inputs, targets, self.position_ids = local_batch(inputs, targets, pgm.data_parallel_rank,
                                                         pgm.data_parallel_world_size,
                                                         self.shard_sequence)
        self.micro_batches = split_micro_batches(inputs, targets, self.m)
        b, s = self.micro_batches[0][0].shape
        self.shape = (b, s // self.pipe.sequence_parallel_size, self.pipe.hidden_size)
        self.spans.clear()  # (a meter's peaks are the same every step: no reset)
        wire = self.wire_dtype(inputs.device.type) if self.wire_dtype else None
        self.dtype = wire or self.param_dtype
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
        for hook in self.after_backward:
            hook()
        loss = self.loss.detach().clone()  # nonzero on the last stage only
        comm.all_reduce(loss, self.group)  # every stage gets it
        return average_over_group(loss, self.pgm.data_parallel_group_with_context)

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self._start(inputs, targets)
        for i, (batch, action) in enumerate(self.plan):
            self._exchange(batch)
            if action is not None:
                with self.spans.time(action):
                    if action.kind == "F":
                        self._forward(action)
                    else:
                        self._backward(action, i)
        return self._finish()

    def _exchange(self, batch: Sequence[P2P]) -> None:
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
        else:  # (b, s, h), in the parameters' dtype, as the residual stream on one device
            x = self.inbox.pop(("act", mb, stage)).to(self.param_dtype).requires_grad_()
        chunk = self.pipe.chunks[action.chunk]
        with nullcontext() if self.meter is None else self.meter.saving((mb, action.chunk)):
            out = chunk(x) if self.position_ids is None else \
                chunk(x, position_ids=self.position_ids)
        aux = self.aux_loss(chunk) / self.m if self.aux_loss is not None else None
        aux = aux if torch.is_tensor(aux) else None  # a dense chunk's extra loss is 0.0
        if stage == self.pipe.num_stages - 1:
            out = self.loss_fn(out, self.micro_batches[mb][1]) / self.m  # out: the loss
            out = out if aux is None else out + aux
            self.loss += out.detach()
            aux = None
        else:
            self.outbox[("act", mb, stage)] = out.detach().to(self.dtype)
            if aux is not None:
                self.loss += aux.detach()
        # a middle stage backpropagates its own extra loss with its output
        self.held[(mb, action.chunk)] = (x, out, aux)

    def _outputs_and_grads(self, action: Action) -> tuple:
        """(stage input, outputs, their gradients) of a micro-batch's forward through a chunk."""
        stage, mb = self.pipe.stages[action.chunk], action.micro_batch
        x, out, aux = self.held.pop((mb, action.chunk))
        outputs: List[torch.Tensor] = [out]
        grads: List[Optional[torch.Tensor]] = [None]  # the last stage's out is the loss
        if stage < self.pipe.num_stages - 1:
            grads = [self.inbox.pop(("grad", mb, stage)).to(out.dtype)]
            if aux is not None:  # a stage's own extra loss: d aux / d aux = 1
                outputs, grads = [out, aux], grads + [torch.ones_like(aux)]
        return x, outputs, grads

    def _backward(self, action: Action, index: int) -> None:
        stage, mb = self.pipe.stages[action.chunk], action.micro_batch
        chunk = self.pipe.chunks[action.chunk]
        x, outputs, grads = self._outputs_and_grads(action)
        no_sync = getattr(chunk, "no_sync", None)
        with nullcontext() if index in self.syncs or no_sync is None else no_sync():
            torch.autograd.backward(outputs, grads)
        if self.meter is not None:
            self.meter.free((mb, action.chunk))
        if stage > 0:
            self.outbox[("grad", mb, stage)] = x.grad.to(self.dtype)


# ---- the timeline of every stage on pipeline rank 0, for the chart ----------------------------


def gather_timeline(timeline: Timeline, pgm: ProcessGroupManager) -> Optional[Timeline]:
    """Every stage's events of the last step on pipeline rank 0 (for the chart); None elsewhere."""
    events = [(e.action, e.start, e.end) for e in timeline.events]
    parts = comm.gather_objects(events, pgm.pipeline_model_parallel_group)
    if pgm.pipeline_model_parallel_rank != 0:
        return None
    full = type(timeline)(timeline.stages, timeline.micro_batches, timeline.virtual_stages,
                          schedule=timeline.schedule)
    for rank, part in enumerate(parts):
        for action, start, end in part:
            full.record(rank, action, start, end)
    return full
