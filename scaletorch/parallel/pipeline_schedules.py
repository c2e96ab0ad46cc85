"""Chapter 04's schedules as plain loops: AFAB and 1F1B on one screen, over named messages.

Each pipeline rank holds one stage (``pipeline_parallel.PipelineChunk``). A micro-batch's
activation (b, s, h) goes from rank r to rank r + 1 (``send_forward`` / ``recv_forward``) and
its gradient comes back (``send_backward`` / ``recv_backward``), point to point over "pp".
``afab`` runs all forwards, then all backwards; ``one_f_one_b`` warms up with p - r - 1
forwards, then alternates one forward and one backward, then cools down with the last
backwards. The steady state pairs a send with the receive that answers it in one batch
(``send_forward_recv_backward``), so that on NCCL, whose sends and receives with a peer run
in the order they were posted, neither rank waits for the other.

``ScheduleTrace`` runs the same loops without ranks and writes down each call: what
``--show-schedule`` prints. The general runtime (interleaved, zero bubble) is chapter 04b's.
"""

import time
from contextlib import nullcontext
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from jaxtyping import Float, Int

from scaletorch.data import local_batch, split_micro_batches
from scaletorch.dist import ProcessGroupManager, comm
from scaletorch.dist.comm import average_over_group
from scaletorch.dist.timer import Spans
from scaletorch.models import loss_fn
from scaletorch.parallel.pipeline_parallel import LossFn, PipelineModel
from scaletorch.schedule.orders import Action, message
from scaletorch.schedule.timeline import Timeline

# What one pipeline rank holds (jaxtyping; tests/test_pipeline_shapes.py checks it at run time):
# b sequences of a micro-batch, s tokens (s/tp under sequence parallel), h hidden.
Hidden = Float[torch.Tensor, "b s h"]
Message = Optional[Hidden]  # a message; None where a stage has none (first, last)
TokenIds = Int[torch.Tensor, "b s"]
MicroBatches = List[Tuple[TokenIds, TokenIds]]  # m (inputs, targets)
GlobalBatch = Int[torch.Tensor, "B s"]  # B = b m dp
Scalar = Float[torch.Tensor, ""]

# [core: schedules]


def afab(this_rank: "PipelineRank", m: int) -> None:
    """All forwards, then all backwards (GPipe): every rank holds m activations at the peak."""
    # forward: receive the previous stage's activation, run this stage, pass its output on
    for mb in range(m):
        x = this_rank.recv_forward(mb)
        y = this_rank.forward(mb, x)
        this_rank.send_forward(mb, y)
    # backward, in the same order: the gradient of the output comes back, that of the input goes
    for mb in range(m):
        dy = this_rank.recv_backward(mb)
        dx = this_rank.backward(mb, dy)
        this_rank.send_backward(mb, dx)


def one_f_one_b(this_rank: "PipelineRank", m: int) -> None:
    """1F1B: rank r of p holds at most p - r activations (m >= p).

    Warm-up: p - r - 1 forwards. Steady state: one forward, one backward, each send posted
    with the receive that answers it. Cool-down: the last backwards. Messages are (b, s, h),
    the parameters' dtype, over "pp": activations to rank r + 1, gradients to rank r - 1.
    """
    warmup = min(this_rank.p - this_rank.rank - 1, m)
    # warm-up: forwards only, until the last stage can answer with a backward
    for mb in range(warmup):
        x = this_rank.recv_forward(mb)
        y = this_rank.forward(mb, x)
        this_rank.send_forward(mb, y)
    x = this_rank.recv_forward(warmup) if warmup < m else None
    # steady state: forward micro-batch warmup + i, then backward micro-batch i
    for i in range(m - warmup):
        y = this_rank.forward(warmup + i, x)
        dy = this_rank.send_forward_recv_backward(warmup + i, y, i)
        dx = this_rank.backward(i, dy)
        if warmup + i + 1 < m:  # the next forward's input comes back with this gradient
            x = this_rank.send_backward_recv_forward(i, dx, warmup + i + 1)
        else:
            this_rank.send_backward(i, dx)
    # cool-down: the backwards of the warm-up forwards
    for mb in range(m - warmup, m):
        dy = this_rank.recv_backward(mb)
        dx = this_rank.backward(mb, dy)
        this_rank.send_backward(mb, dx)


def micro_batch_loss(loss: Scalar, m: int) -> Scalar:
    """The last stage's loss of one micro-batch (fp32, the mean over its b x s tokens) as its
    share of the step's loss, / m: the m backwards add up to the gradient of the mean over
    the whole batch. No communication."""
    return loss / m


# [end: schedules]
SCHEDULES = {"afab": afab, "1f1b": one_f_one_b}


class PipelineRank:
    """Pipeline rank ``rank`` of p for one step: its chunk, its micro-batches, its messages.

    Messages are (b, s, h) tensors ((b, s/tp, h) under sequence parallel) of the parameters'
    dtype, over the "pp" group; the first stage receives no activation, the last sends none
    and receives no gradient (its output is the loss). ``forward`` and ``backward`` time each
    action for the timeline.
    """

    def __init__(self, pipe: PipelineModel, pgm: ProcessGroupManager, micro_batches: MicroBatches,
                 loss_fn: LossFn, spans: Spans) -> None:
        self.p, self.rank = pgm.pipeline_model_parallel_world_size, pgm.pipeline_model_parallel_rank
        self.first, self.last = self.rank == 0, self.rank == self.p - 1
        self.group, ranks = pgm.pipeline_model_parallel_group, pgm.group_ranks("pp")
        self.prev = None if self.first else ranks[self.rank - 1]  # global ranks
        self.next = None if self.last else ranks[self.rank + 1]
        self.chunk, self.micro_batches, self.loss_fn, self.spans = pipe.chunks[0], \
            micro_batches, loss_fn, spans
        b, s = micro_batches[0][0].shape
        self.shape = (b, s // pipe.sequence_parallel_size, pipe.hidden_size)
        self.dtype, self.device = next(pipe.parameters()).dtype, micro_batches[0][0].device
        self.held: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # mb -> (input, output)
        self.loss = torch.zeros((), device=self.device)  # the sum of m losses / m (last stage)
        self.backwards = 0

    # ---- the named point-to-point operations: one batch_isend_irecv each ------------------

    def recv_forward(self, mb: int) -> Message:
        """The activation (b, s, h) of micro-batch ``mb`` from the previous rank."""
        return self._batch("recv_forward", [], [(mb, self.prev)])

    def send_forward(self, mb: int, y: Message) -> None:
        """This stage's output (b, s, h) of micro-batch ``mb`` to the next rank."""
        self._batch("send_forward", [(mb, self.next, y)], [])

    def recv_backward(self, mb: int) -> Message:
        """The gradient (b, s, h) of this stage's output of ``mb`` from the next rank."""
        return self._batch("recv_backward", [], [(mb, self.next)])

    def send_backward(self, mb: int, dx: Message) -> None:
        """The gradient (b, s, h) of this stage's input of ``mb`` to the previous rank."""
        self._batch("send_backward", [(mb, self.prev, dx)], [])

    def send_forward_recv_backward(self, mb: int, y: Message, grad_mb: int) -> Message:
        """``send_forward(mb, y)`` and ``recv_backward(grad_mb)`` in one batch (next rank)."""
        return self._batch("send_forward_recv_backward", [(mb, self.next, y)],
                           [(grad_mb, self.next)])

    def send_backward_recv_forward(self, mb: int, dx: Message, act_mb: int) -> Message:
        """``send_backward(mb, dx)`` and ``recv_forward(act_mb)`` in one batch (previous rank)."""
        return self._batch("send_backward_recv_forward", [(mb, self.prev, dx)],
                           [(act_mb, self.prev)])

    def _batch(self, name: str, sends: List[Tuple[int, Optional[int], Message]],
               recvs: List[Tuple[int, Optional[int]]]) -> Message:
        """Post the sends and the receive (none to or from a missing neighbour) as one batch
        over "pp" and wait for them; the received tensor, or None. ``name``: for the trace."""
        ops, received = [], None
        for _, peer, y in sends:
            if peer is not None and y is not None:
                ops.append(dist.P2POp(dist.isend, y, peer, self.group))
        for _, peer in recvs:
            if peer is not None:
                received = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, received, peer, self.group))
        for work in comm.batch_isend_irecv(ops, self.group):
            work.wait()
        return received

    # ---- the computation ------------------------------------------------------------------

    def forward(self, mb: int, x: Message) -> Message:
        """Micro-batch ``mb`` through the chunk: token ids (b, s) on the first stage, else the
        received (b, s, h); returns the output (b, s, h), or None on the last stage (the loss
        is kept, divided by m)."""
        with self.spans.time(Action("F", mb)):
            inputs, targets = self.micro_batches[mb]
            x = inputs if x is None else x.requires_grad_()
            out = self.chunk(x)
            if self.last:
                out = micro_batch_loss(self.loss_fn(out, targets), len(self.micro_batches))
                self.loss += out.detach()
            self.held[mb] = (x, out)
        return None if self.last else out.detach().to(self.dtype)  # autocast may make it bf16

    def backward(self, mb: int, dy: Message) -> Message:
        """Backpropagate ``mb`` from the gradient of its output (None on the last stage: the
        loss); the gradient of its input (b, s, h), None on the first stage. Data-parallel
        gradients sync in the step's last backward only."""
        with self.spans.time(Action("B", mb)):
            x, out = self.held.pop(mb)
            self.backwards += 1
            no_sync = getattr(self.chunk, "no_sync", None)
            last = self.backwards == len(self.micro_batches)
            with nullcontext() if last or no_sync is None else no_sync():
                torch.autograd.backward(out, None if dy is None else dy.to(out.dtype))
        return None if self.first else x.grad


class PipelineLoop:
    """The Trainer's ``forward_backward(inputs, targets) -> loss`` running ``afab`` or
    ``one_f_one_b`` on a one-chunk ``PipelineModel``.

    inputs, targets: the global batch (B, s); this rank takes its data-parallel slice in m
    micro-batches. Returns the global mean loss on every rank (all-reduce over "pp", mean over
    "dp_cp"). ``timeline``: the last step's actions, timed.
    """

    def __init__(self, pipe: PipelineModel, pgm: ProcessGroupManager, schedule: str,
                 num_micro_batches: int, loss_fn: LossFn = loss_fn) -> None:
        if schedule not in SCHEDULES or len(pipe.chunks) != 1:
            raise ValueError(f"the plain pipeline loop runs {' and '.join(SCHEDULES)} on one "
                             f"chunk per rank, got {schedule!r} on {len(pipe.chunks)}: the "
                             f"general runtime is pipeline_runtime.PipelineSchedule (04b)")
        self.pipe, self.pgm, self.schedule, self.m = pipe, pgm, schedule, num_micro_batches
        self.loss_fn = loss_fn
        self.spans = Spans(next(pipe.parameters()).device, time.time)  # one clock per host

    def __call__(self, inputs: GlobalBatch, targets: GlobalBatch) -> Scalar:
        pgm = self.pgm
        inputs, targets, _ = local_batch(inputs, targets, pgm.data_parallel_rank,
                                         pgm.data_parallel_world_size)
        self.spans.clear()
        this_rank = PipelineRank(self.pipe, pgm, split_micro_batches(inputs, targets, self.m),
                                 self.loss_fn, self.spans)
        SCHEDULES[self.schedule](this_rank, self.m)
        finish = getattr(this_rank.chunk, "finish_grad_sync", None)  # data parallel: end the sync
        if finish is not None:
            finish()
        comm.all_reduce(this_rank.loss, this_rank.group)  # nonzero on the last stage only
        return average_over_group(this_rank.loss, pgm.gradient_sync_group)

    @property
    def timeline(self) -> Timeline:
        """The last step's actions on this rank, in seconds (on CUDA: read after the step)."""
        p, rank = self.pgm.pipeline_model_parallel_world_size, self.pgm.pipeline_model_parallel_rank
        timeline = Timeline(p, self.m, 1, schedule=self.schedule)
        for action, start, end in self.spans.seconds():
            timeline.record(rank, action, start, end)
        return timeline


class ScheduleTrace(PipelineRank):
    """A ``PipelineRank`` (rank ``rank`` of ``p``) that computes and sends nothing: it writes
    down each action and each named operation with its messages, in the order of the calls.
    ``lines``: one per action, followed by the operations it calls before the next action."""

    def __init__(self, p: int, rank: int) -> None:  # no process group, no model
        self.p, self.rank = p, rank
        self.first, self.last = rank == 0, rank == p - 1
        self.prev = None if self.first else rank - 1  # pipeline ranks
        self.next = None if self.last else rank + 1
        self.lines: List[str] = []

    def forward(self, mb: int, x: Message) -> Message:
        self.lines.append(f"rank {self.rank}: F{mb}")
        return None

    def backward(self, mb: int, dy: Message) -> Message:
        self.lines.append(f"rank {self.rank}: B{mb}")
        return None

    def _batch(self, name: str, sends: List[Tuple[int, Optional[int], Message]],
               recvs: List[Tuple[int, Optional[int]]]) -> Message:
        messages = [message(mb, peer, True) for mb, peer, _ in sends if peer is not None]
        messages += [message(mb, peer, False) for mb, peer in recvs if peer is not None]
        if messages:
            call = f"{name}({', '.join(messages)})"
            if self.lines:  # after the last action
                self.lines[-1] += f" {call}"
            else:  # before the first
                self.lines.append(f"rank {self.rank}: {call}")
        return None


def show_schedule(schedule: str, p: int, m: int) -> str:
    """Every pipeline rank's calls of ``afab`` or ``one_f_one_b``, traced (--show-schedule)."""
    lines = []
    for rank in range(p):
        trace = ScheduleTrace(p, rank)
        SCHEDULES[schedule](trace, m)
        lines += trace.lines
    return "\n".join(lines)
