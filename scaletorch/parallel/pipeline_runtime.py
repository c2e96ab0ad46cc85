"""Chapter 04b's pipeline runtime: any schedule as data, the generalisation of 04's loops.

Each rank's plan is a list of steps, each a batch of point-to-point messages and one action
(``schedule/plans.py``). One executor runs afab, 1f1b, interleaved and, in a subclass
(split_backward.py), the zero-bubble schedules; where 04's loops run, bit for bit as they do.
"""

import time
from contextlib import ExitStack, nullcontext
from typing import Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from scaletorch.data import local_batch, split_micro_batches
from scaletorch.dist import ProcessGroupManager, comm
from scaletorch.dist.comm import average_over_group
from scaletorch.dist.timer import Spans
from scaletorch.models import loss_fn
from scaletorch.parallel.pipeline_parallel import LossFn, PipelineModel
from scaletorch.schedule.catalog import schedule_plan
from scaletorch.schedule.orders import Action
from scaletorch.schedule.plans import P2P
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
        v, self.m = len(pipe.chunks), num_micro_batches
        self.group, self.ranks = pgm.pipeline_model_parallel_group, pgm.group_ranks("pp")
        self.plan = schedule_plan(schedule, p, num_micro_batches, rank, v)
        # a chunk's data-parallel gradients sync in its last backward only (the last B wins)
        last_b = {a.chunk: i for i, (_, a) in enumerate(self.plan) if a and a.kind == "B"}
        self.syncs = set(last_b.values())
        # each action's start and end; time.time: one clock for every process of a host
        self.spans = Spans(next(pipe.parameters()).device, time.time)
        self.timeline_type, self.schedule, self.p, self.rank = Timeline, schedule, p, rank
        self.param_dtype = self.dtype = next(pipe.parameters()).dtype  # a hook may set .dtype

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
        self.spans.clear()
        self.held: Dict[tuple, tuple] = {}  # (mb, chunk) -> (stage input, output or loss)
        self.inbox: Dict[tuple, torch.Tensor] = {}  # (kind, mb, dst stage) -> received
        self.outbox: Dict[tuple, torch.Tensor] = {}  # (kind, mb, src stage) -> to send
        self.loss = torch.zeros((), device=inputs.device)
        for hooks in self.hooks:
            hooks.begin_step(self, inputs)

    def _finish(self) -> torch.Tensor:
        """End the chunks' data-parallel syncs; the global mean loss, the same on every rank."""
        for chunk in self.pipe.chunks:  # a data-parallel wrapper's last reduction, if any
            getattr(chunk, "finish_grad_sync", lambda: None)()
        for hooks in self.hooks:
            hooks.end_step(self)
        loss = self.loss.detach().clone()  # nonzero on the last stage only
        comm.all_reduce(loss, self.group)  # every stage gets it
        return average_over_group(loss, self.pgm.gradient_sync_group)

    # [core: plan-executor]
    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One training step: each step of the plan posts its messages, then runs its action."""
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

    # [end: plan-executor]

    def _forward(self, action: Action) -> None:
        stage, mb = self.pipe.stages[action.chunk], action.micro_batch
        if stage == 0:
            x = self.micro_batches[mb][0]  # (b, s) token ids
        else:  # (b, s, h), in the parameters' dtype, as the residual stream on one device
            x = self.inbox.pop(("act", mb, stage)).to(self.param_dtype).requires_grad_()
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
            self.outbox[("act", mb, stage)] = out.detach().to(self.dtype)
        self.held[(mb, action.chunk)] = (x, out)

    def _outputs_and_grads(self, action: Action) -> tuple:
        """(stage input, outputs, their gradients) of a micro-batch's forward through a chunk."""
        stage, mb = self.pipe.stages[action.chunk], action.micro_batch
        x, out = self.held.pop((mb, action.chunk))
        last = stage == self.pipe.num_stages - 1  # then out is the loss: its gradient is None (1)
        return x, [out], [None if last else self.inbox.pop(("grad", mb, stage)).to(out.dtype)]

    def _backward(self, action: Action, index: int) -> None:
        x, outputs, grads = self._outputs_and_grads(action)
        self._accumulate(action, index, outputs, grads)
        if self.pipe.stages[action.chunk] > 0:
            self.outbox[("grad", action.micro_batch, self.pipe.stages[action.chunk])] = \
                x.grad.to(self.dtype)

    def _accumulate(self, action: Action, index: int, outputs: list, grads: list,
                    inputs: Optional[List[Tensor]] = None) -> None:
        """Backpropagate into ``inputs`` (default: every leaf); the chunk's data-parallel
        gradients sync in the step's last one (``syncs``), the micro-batch's graph goes."""
        no_sync = getattr(self.pipe.chunks[action.chunk], "no_sync", None)
        with nullcontext() if index in self.syncs or no_sync is None else no_sync():
            torch.autograd.backward(outputs, grads, inputs=inputs)
        for hooks in self.hooks:
            hooks.release((action.micro_batch, action.chunk))
