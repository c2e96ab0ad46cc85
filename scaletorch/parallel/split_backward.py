"""The split backward and the asynchronous runtime of the zero-bubble schedules (chapter 04b;
their orders are data in scaletorch/schedule/zero_bubble_orders.py). For one micro-batch
through one chunk, with autograd's explicit ``inputs``:

    out = chunk(x)                                               # F
    dx, = torch.autograd.grad(out, x, dout, retain_graph=True)   # B: send dx at once
    torch.autograd.backward(out, dout, inputs=params)            # W, later: the weights' .grad

The activations live from F to W (B frees none). Sends do not wait for the peer, and the
messages go out in ``posting_program``'s order, which cannot hang on NCCL.
"""

from typing import Any, Dict, List, Optional, Tuple, Type

import torch
import torch.distributed as dist
from torch import nn

from scaletorch.dist import ProcessGroupManager, comm
from scaletorch.parallel.pipeline_parallel import PipelineChunk, PipelineModel
from scaletorch.parallel.pipeline_runtime import PipelineSchedule
from scaletorch.schedule.catalog import schedule_actions
from scaletorch.schedule.orders import Action
from scaletorch.schedule.placement import ZERO_BUBBLE, rank_of_stage
from scaletorch.schedule.plans import P2P
from scaletorch.schedule.posting import Batch, posting_program
from scaletorch.schedule.simulate import ZeroBubbleTimeline


def weight_leaves(chunk: nn.Module) -> List[torch.Tensor]:
    """The trainable weights a chunk's forward reads, which W differentiates: its parameters,
    or a ZeRO wrapper's full unit parameters (W over its shards would reach no weight)."""
    units = getattr(chunk, "units", None)  # a ZeRO wrapper's FlatUnits
    params = chunk.parameters() if units is None else [t for u in units for t in u.tensors]
    return [p for p in params if p.requires_grad]


class ZeroBubbleSchedule(PipelineSchedule):
    """``PipelineSchedule``'s contract for any schedule, with asynchronous sends: F, B (the
    input gradient only when a W of its micro-batch and chunk follows, else the full
    backward) and W, which frees the micro-batch's activations (``StageHooks.release``)."""

    def __init__(self, pipe: PipelineModel, pgm: ProcessGroupManager, schedule: str,
                 num_micro_batches: int, *args: Any, **kwargs: Any) -> None:
        super().__init__(pipe, pgm, schedule, num_micro_batches, *args, **kwargs)
        p, rank, v, self.timeline_type = self.p, self.rank, len(pipe.chunks), ZeroBubbleTimeline
        actions = schedule_actions(schedule, p, num_micro_batches, rank, v)
        self.split = {(a.micro_batch, a.chunk) for a in actions if a.kind == "W"}
        # a chunk's data-parallel gradients sync in the last action that makes them
        last = {
            a.chunk: i
            for i, a in enumerate(actions)
            if a.kind == "W" or (a.kind == "B" and (a.micro_batch, a.chunk) not in self.split)
        }
        self.syncs = set(last.values())
        # per action: the batches to post first, the action, the receive it waits for
        self.program = posting_program(schedule, p, num_micro_batches, rank, v)
        self.params = [weight_leaves(chunk) for chunk in pipe.chunks]  # what W differentiates
        # stage 0's B has no input to send: it stops at the embedding's output (taken by a hook)
        self.embedded: Optional[torch.Tensor] = None
        for module in pipe.modules():
            if isinstance(module, PipelineChunk) and module.embed_tokens is not None:
                module.embed_tokens.register_forward_hook(self._keep_embedded)

    def _keep_embedded(self, module: nn.Module, inputs: Tuple[Any, ...],
                       output: torch.Tensor) -> None:
        self.embedded = output

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self._start(inputs, targets)
        self.receiving: Dict[P2P, tuple] = {}  # receive -> (buffer, its batch's works)
        self.posted: List[tuple] = []  # (tensors, works) of every batch, until the end
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
                self.inbox[(recv.kind, recv.micro_batch, recv.dst)] = buffer
            with self.spans.time(action):
                if action.kind == "F":
                    self._forward(action)
                elif action.kind == "W":
                    self._weight(action, i)
                elif (action.micro_batch, action.chunk) in self.split:
                    self._backward_input(action)
                else:
                    self._backward(action, i)
                self._keep_local(action)
        for _, works in self.posted:
            for work in works:
                work.wait()
        return self._finish()

    def _post(self, batch: Batch) -> None:
        """Post one batch of the program: its sends (outputs computed already) and receives."""
        ops, tensors = [], []
        for op in batch:
            send = op.op == "send"
            tensor = self.outbox.pop((op.kind, op.micro_batch, op.src)) if send else \
                torch.empty(self.shape, dtype=self.dtype, device=self.loss.device)
            ops.append(
                dist.P2POp(dist.isend if send else dist.irecv, tensor, self.ranks[op.peer],
                           self.group))
            tensors.append(tensor)
        works = list(comm.batch_isend_irecv(ops, self.group))
        self.posted.append((tensors, works))
        self.receiving.update({op: (t, works) for op, t in zip(batch, tensors) if op.op == "recv"})

    def _keep_local(self, action: Action) -> None:
        """An output for a stage on this rank (the turn of a V) goes to its inbox directly."""
        for kind, mb, stage in [key for key in self.outbox if key[1] == action.micro_batch]:
            dst = stage + 1 if kind == "act" else stage - 1
            if rank_of_stage(dst, self.p, self.pipe.v_shape) == self.rank:
                self.inbox[(kind, mb, dst)] = self.outbox.pop((kind, mb, stage))

    def _forward(self, action: Action) -> None:
        super()._forward(action)
        if self.pipe.stages[action.chunk] == 0:  # B's input: the embedding's output
            x, out = self.held[(action.micro_batch, action.chunk)]
            self.held[(action.micro_batch, action.chunk)] = (self.embedded, out)

    def _backward_input(self, action: Action) -> None:
        """B: the gradient of the chunk's input, sent at once; the graph stays for W."""
        x, outputs, grads = self._outputs_and_grads(action)
        dx, = torch.autograd.grad(outputs, [x], grads, retain_graph=True)
        if self.pipe.stages[action.chunk] > 0:
            self.outbox[("grad", action.micro_batch, self.pipe.stages[action.chunk])] = \
                dx.to(self.dtype)
        self.held[(action.micro_batch, action.chunk)] = (outputs, grads)

    def _weight(self, action: Action, index: int) -> None:
        """W: the weights' gradients into .grad (data-parallel sync in the chunk's last W)."""
        outputs, grads = self.held.pop((action.micro_batch, action.chunk))
        self._accumulate(action, index, outputs, grads, self.params[action.chunk])


def runtime_class(schedule: str) -> Type[PipelineSchedule]:
    """``ZeroBubbleSchedule`` for zb-h1, zbv and dualpipev, else ``PipelineSchedule``."""
    return ZeroBubbleSchedule if schedule in ZERO_BUBBLE else PipelineSchedule
