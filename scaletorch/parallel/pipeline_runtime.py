"""Chapter 04b's pipeline runtime: one executor for any schedule, each rank's list of actions
(``schedule/catalog.py``). For one micro-batch through one chunk, with autograd's ``inputs``:

    out = chunk(x)                                               # F
    dx, = torch.autograd.grad(out, x, dout, retain_graph=True)   # B: send dx at once
    torch.autograd.backward(out, dout, inputs=params)            # W, later: the weights' .grad

A B with no W after it is the whole backward (afab, 1f1b, interleaved: bit for bit as 04's
loops). Sends do not wait for the peer; messages go out in ``posting_program``'s order.
"""

import time
from contextlib import ExitStack, nullcontext
from typing import Any, Callable, ContextManager, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from scaletorch.data import local_batch, split_micro_batches
from scaletorch.dist import ProcessGroupManager, comm
from scaletorch.dist.comm import average_over_group
from scaletorch.dist.timer import Spans
from scaletorch.models import loss_fn
from scaletorch.parallel.pipeline_parallel import LossFn, PipelineChunk, PipelineModel
from scaletorch.schedule.catalog import P2P, schedule_actions
from scaletorch.schedule.orders import Action
from scaletorch.schedule.placement import ZERO_BUBBLE
from scaletorch.schedule.simulate import Batch, ZeroBubbleTimeline, posting_program
from scaletorch.schedule.timeline import Timeline


class StageHooks:
    """A later chapter's additions to each step, from its own module: ``schedule.hooks.append``.
    Here each does nothing. ``key``: (micro-batch, chunk)."""

    def begin_step(self, schedule: "PipelineSchedule", inputs: Tensor) -> None:
        """Before the step's first message (e.g. set ``schedule.dtype``, the messages')."""

    def forward(self, key: Tuple[int, int]) -> ContextManager[Any]:
        return nullcontext()  # around a chunk's forward of one micro-batch

    def output(self, schedule: "PipelineSchedule", chunk: nn.Module, out: Tensor) -> Tensor:
        return out  # a chunk's output (logits on the last stage), before it is sent or scored

    def release(self, key: Tuple[int, int]) -> None:
        """After a micro-batch's last backward through a chunk: its graph is gone."""

    def end_step(self, schedule: "PipelineSchedule") -> None:
        """After the chunks' data-parallel syncs, before the loss is reported."""


class PipelineSchedule:
    """The Trainer's ``forward_backward(inputs, targets) -> loss`` for a pipeline model.

    inputs, targets: the global batch (B, s); this rank takes its data-parallel slice (and with
    ``shard_sequence``, context parallel, its tokens) in m micro-batches. Returns the global
    mean loss on every rank (all-reduce over "pp", mean over "dp_cp"); ``timeline``: the last
    step's events. Later chapters attach ``StageHooks`` to ``hooks``, from their own modules.
    """

    def __init__(self, pipe: PipelineModel, pgm: ProcessGroupManager, schedule: str,
                 num_micro_batches: int, loss_fn: LossFn = loss_fn,
                 shard_sequence: Optional[Callable] = None) -> None:
        self.pipe, self.pgm, self.loss_fn, self.shard_sequence = pipe, pgm, loss_fn, shard_sequence
        self.hooks: List[StageHooks] = []
        p, rank = pgm.pipeline_model_parallel_world_size, pgm.pipeline_model_parallel_rank
        v, self.m, self.schedule, self.p, self.rank = len(pipe.chunks), num_micro_batches, \
            schedule, p, rank
        self.group, self.ranks = pgm.pipeline_model_parallel_group, pgm.group_ranks("pp")
        actions = schedule_actions(schedule, p, num_micro_batches, rank, v)
        self.split = {(a.micro_batch, a.chunk) for a in actions if a.kind == "W"}  # B, then W
        # a chunk's data-parallel gradients sync in its last B or W, the last that makes them (a
        # split B makes none, and its W comes later)
        self.syncs = set({a.chunk: i for i, a in enumerate(actions) if a.kind != "F"}.values())
        # per action: the batches to post first, the action, the receive it waits for
        self.program = posting_program(schedule, p, num_micro_batches, rank, v)
        # what W differentiates: the weights each chunk's forward reads (07 sets ZeRO's units')
        self.params: List[List[Tensor]] = [[w for w in c.parameters() if w.requires_grad]
                                           for c in pipe.chunks]
        # each action's start and end; time.time: one clock for every process of a host
        self.spans = Spans(next(pipe.parameters()).device, time.time)
        self.param_dtype = self.dtype = next(pipe.parameters()).dtype  # a hook may set .dtype
        # stage 0's B has no input to send: it stops at the embedding's output (taken by a hook)
        self.embedded: Optional[torch.Tensor] = None
        for module in pipe.modules():
            if isinstance(module, PipelineChunk) and module.embed_tokens is not None:
                module.embed_tokens.register_forward_hook(
                    lambda _, args, out: setattr(self, "embedded", out))

    @property
    def timeline(self) -> Timeline:
        """The last step's actions on this rank, in seconds (on CUDA: read after the step)."""
        kind = ZeroBubbleTimeline if self.schedule in ZERO_BUBBLE else Timeline  # its theory
        timeline = kind(self.p, self.m, len(self.pipe.chunks), schedule=self.schedule)
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
        self.spans.clear()
        self.held: Dict[tuple, tuple] = {}  # (mb, chunk) -> (stage input, output or loss)
        # (kind, mb, dst stage) -> a message to send, received, or for a stage of this rank
        self.box: Dict[tuple, torch.Tensor] = {}
        self.receiving: Dict[P2P, tuple] = {}  # receive -> (buffer, its batch's works)
        self.posted: List[tuple] = []  # (tensors, works) of every batch, until the end
        self.loss = torch.zeros((), device=inputs.device)
        for hooks in self.hooks:
            hooks.begin_step(self, inputs)

    # [core: plan-executor]
    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One training step: post the batches due, wait for the action's input, run it."""
        self._start(inputs, targets)
        for i, (batches, action, recv) in enumerate(self.program):
            for batch in batches:
                self._post(batch)
            if action is None:
                break
            if recv is not None:  # waiting here is the bubble; the rest is the action's time
                buffer, works = self.receiving.pop(recv)
                for work in works:
                    work.wait()
                works.clear()  # waited (a gloo receive waited twice waits for another message)
                self.box[(recv.kind, recv.micro_batch, recv.dst)] = buffer
            with self.spans.time(action):
                if action.kind == "F":
                    self._forward(action)
                elif action.kind == "W":
                    self._weight(action, i)
                else:
                    self._backward(action, i)
        for _, works in self.posted:  # the sends, which no action waited for
            for work in works:
                work.wait()
        return self._finish()

    def _post(self, batch: Batch) -> None:
        """Post one batch of the program: its sends (outputs computed already) and receives."""
        ops, tensors = [], []
        for op in batch:
            send = op.op == "send"
            tensor = self.box.pop((op.kind, op.micro_batch, op.dst)) if send else \
                torch.empty(self.shape, dtype=self.dtype, device=self.loss.device)
            ops.append(
                dist.P2POp(dist.isend if send else dist.irecv, tensor, self.ranks[op.peer],
                           self.group))
            tensors.append(tensor)
        works = list(comm.batch_isend_irecv(ops, self.group))
        self.posted.append((tensors, works))
        self.receiving.update({op: (t, works) for op, t in zip(batch, tensors) if op.op == "recv"})

    # [end: plan-executor]

    def _finish(self) -> torch.Tensor:
        """End the chunks' data-parallel syncs; the global mean loss, the same on every rank."""
        for chunk in self.pipe.chunks:  # a data-parallel wrapper's last reduction, if any
            getattr(chunk, "finish_grad_sync", lambda: None)()
        for hooks in self.hooks:
            hooks.end_step(self)
        loss = self.loss.detach().clone()  # nonzero on the last stage only
        comm.all_reduce(loss, self.group)  # every stage gets it
        return average_over_group(loss, self.pgm.gradient_sync_group)

    def _forward(self, action: Action) -> None:
        stage, mb = self.pipe.stages[action.chunk], action.micro_batch
        if stage == 0:
            x = self.micro_batches[mb][0]  # (b, s) token ids
        else:  # (b, s, h), in the parameters' dtype, as the residual stream on one device
            x = self.box.pop(("act", mb, stage)).to(self.param_dtype).requires_grad_()
        chunk = self.pipe.chunks[action.chunk]
        kwargs = {} if self.position_ids is None else {"position_ids": self.position_ids}
        with ExitStack() as stack:
            for hooks in self.hooks:
                stack.enter_context(hooks.forward((mb, action.chunk)))
            out = chunk(x, **kwargs)
        for hooks in self.hooks:
            out = hooks.output(self, chunk, out)
        if stage == self.pipe.num_stages - 1:
            out = self.loss_fn(out, self.micro_batches[mb][1]) / self.m  # out: the loss
            self.loss += out.detach()
        else:
            self.box[("act", mb, stage + 1)] = out.detach().to(self.dtype)
        # B's input: what the forward took in, on stage 0 the embedding's output
        self.held[(mb, action.chunk)] = (self.embedded if stage == 0 else x, out)

    def _backward(self, action: Action, index: int) -> None:
        """B: the gradient of the chunk's input, sent at once. Split (a W follows), the graph
        stays for W; else the weights' gradients too, and the graph goes."""
        stage, mb, key = self.pipe.stages[action.chunk], action.micro_batch, \
            (action.micro_batch, action.chunk)
        x, out = self.held.pop(key)
        last = stage == self.pipe.num_stages - 1  # then out is the loss: its gradient is None (1)
        grads = [None if last else self.box.pop(("grad", mb, stage)).to(out.dtype)]
        outputs = [out]
        if key in self.split:
            dx, = torch.autograd.grad(outputs, [x], grads, retain_graph=True)
            self.held[key] = (outputs, grads)
        else:
            self._accumulate(action, index, outputs, grads)
        if stage > 0:  # x.grad: the whole backward's (x is a leaf, stage 0's is not)
            self.box[("grad", mb, stage - 1)] = (dx if key in self.split else x.grad).to(self.dtype)

    def _weight(self, action: Action, index: int) -> None:
        """W: the weights' gradients into .grad (data-parallel sync in the chunk's last W)."""
        outputs, grads = self.held.pop((action.micro_batch, action.chunk))
        self._accumulate(action, index, outputs, grads, self.params[action.chunk])

    def _accumulate(self, action: Action, index: int, outputs: list, grads: list,
                    inputs: Optional[List[Tensor]] = None) -> None:
        """Backpropagate into ``inputs`` (default: every leaf); the chunk's data-parallel
        gradients sync in the step's last one (``syncs``), the micro-batch's graph goes."""
        no_sync = getattr(self.pipe.chunks[action.chunk], "no_sync", None)
        with nullcontext() if index in self.syncs or no_sync is None else no_sync():
            torch.autograd.backward(outputs, grads, inputs=inputs)
        for hooks in self.hooks:
            hooks.release((action.micro_batch, action.chunk))
