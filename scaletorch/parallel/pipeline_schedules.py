"""Pipeline schedules as plain data: what each stage computes, in which order, what it sends.

Nothing here touches a process group, so every schedule is checked in milliseconds: the order
of forwards (F) and backwards (B) per rank, the peak number of live activations, that the
point-to-point messages pair up, that no rank ever waits for itself (no deadlock), and the
bubble of the resulting timeline (``simulate`` with equal-cost stages).

p = pipeline ranks, m = micro-batches, v = model chunks (virtual stages) per rank. Rank r holds
the global stages r, r + p, ..., r + (v - 1) p (Megatron's interleaved assignment).
Simulated with F = 1 slot and B = 2 slots per stage (a, b, ...: forward of micro-batch 0, 1,
...; A, B, ...: its backward; ".": idle), p = 4, m = 4:

    AFAB (GPipe)                  1F1B
    stage 0 |abcd.........AABBCCDD|   stage 0 |abcd......AA.BB.CC.DD|
    stage 1 |.abcd......AABBCCDD..|   stage 1 |.abc....AAdBB.CC.DD..|
    stage 2 |..abcd...AABBCCDD....|   stage 2 |..ab..AAcBBdCC.DD....|
    stage 3 |...abcdAABBCCDD......|   stage 3 |...aAAbBBcCCdDD......|

Both idle (p-1)/(m+p-1) of the time (the bubble); 1F1B holds at most p - r micro-batches of
activations on rank r instead of m, because each backward frees one as soon as it can.
Interleaving v chunks per rank (each 1/v of the work) shrinks the bubble to
(p-1)/(v m + p - 1) at the price of v times more point-to-point messages. The zero-bubble
schedules (``zb-h1``, ``zbv``, ``dualpipev``: ``zero_bubble.py``) split each backward into B
(input gradient) and W (weight gradient) and use the W's to fill the bubble.

Longer than 300 lines on purpose: the three classic schedules, their validation and the
simulator that draws them are read together (each schedule is a short generator of per-rank
action lists; the timeline chart and the theory sit beside them).
"""

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from scaletorch.dist.timer import Clock, Mark, Timer, seconds
# the formula and the placement of the stages live with the planner (scaletorch/plan), which
# predicts step times and memory with them; ZERO_BUBBLE: zero_bubble.py's schedules,
# V_SHAPED: two chunks per rank, stages r and 2p - 1 - r
from scaletorch.plan.layout import V_SHAPED, ZERO_BUBBLE
from scaletorch.plan.pipeline import rank_of_stage, stage_index, theoretical_bubble

SCHEDULES = ("afab", "1f1b", "interleaved") + ZERO_BUBBLE


@dataclass(frozen=True)
class Action:
    """One unit of work on one rank: the forward ("F") or backward ("B") of a micro-batch
    through the rank's model chunk ``chunk`` (0 unless interleaved or V-shaped). In the
    zero-bubble schedules B is the input gradient only and "W" the weight gradient."""
    kind: str
    micro_batch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}" + (f".{self.chunk}" if self.chunk else "")


def validate_schedule(schedule: str, stages: int, micro_batches: int,
                      virtual_stages: int = 1) -> None:
    """Raise ValueError for a schedule that cannot run with these numbers."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {', '.join(SCHEDULES)}, "
                         f"got {schedule!r}")
    sizes = {
        "pipeline_model_parallel_size": stages,
        "num_micro_batches": micro_batches,
        "virtual_pipeline_stages": virtual_stages
    }
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")
    if virtual_stages > 1 and stages == 1:
        raise ValueError(f"virtual_pipeline_stages ({virtual_stages}) needs a pipeline: "
                         f"pipeline_model_parallel_size is 1 (set --pp)")
    if schedule in ZERO_BUBBLE:
        # their own module imports Action from here, so it is imported when needed
        from scaletorch.parallel.zero_bubble import validate_zero_bubble
        validate_zero_bubble(schedule, stages, micro_batches, virtual_stages)
        return
    if virtual_stages > 1 and schedule != "interleaved":
        raise ValueError(f"virtual_pipeline_stages ({virtual_stages}) > 1 needs the "
                         f"interleaved schedule, got {schedule!r} (set --schedule interleaved)")
    if schedule == "1f1b" and micro_batches < stages:
        raise ValueError(f"1F1B needs num_micro_batches ({micro_batches}) >= "
                         f"pipeline_model_parallel_size ({stages}) to fill the pipeline: set "
                         f"--micro-batches {stages} or more, or --schedule afab")
    if schedule == "interleaved" and micro_batches % stages != 0:
        raise ValueError(f"interleaved 1F1B needs num_micro_batches ({micro_batches}) "
                         f"divisible by pipeline_model_parallel_size ({stages}): set "
                         f"--micro-batches to a multiple of {stages}")


def afab_actions(stages: int, micro_batches: int, rank: int) -> List[Action]:
    """GPipe: all forwards, then all backwards (in the same micro-batch order)."""
    forwards = [Action("F", i) for i in range(micro_batches)]
    return forwards + [Action("B", i) for i in range(micro_batches)]


def one_f_one_b_actions(stages: int, micro_batches: int, rank: int) -> List[Action]:
    """1F1B: p - rank - 1 warm-up forwards, then alternate F and B, then the last Bs."""
    warmup = min(stages - rank - 1, micro_batches)
    actions = [Action("F", i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        actions += [Action("F", warmup + i), Action("B", i)]
    return actions + [Action("B", i) for i in range(micro_batches - warmup, micro_batches)]


def interleaved_units(stages: int, micro_batches: int, rank: int,
                      virtual_stages: int) -> List[List[Action]]:
    """Interleaved 1F1B (Megatron): the k-th forward runs micro-batch group k // (p v) in
    chunk (k // p) % v, p micro-batches per chunk before moving on; backwards visit the
    chunks in reverse. Warm-up is 2 (p - rank - 1) + (v - 1) p forwards; in the steady state
    each unit is a forward and a backward (their p2p goes out together, see comm_plan)."""
    p, v = stages, virtual_stages
    total = micro_batches * v

    def unit(k: int, forward: bool) -> Action:
        group, j = divmod(k, p * v)
        chunk = j // p
        return Action("F" if forward else "B", group * p + j % p,
                      chunk if forward else v - 1 - chunk)

    warmup = min(2 * (p - rank - 1) + (v - 1) * p, total)
    units = [[unit(k, True)] for k in range(warmup)]
    units += [[unit(warmup + k, True), unit(k, False)] for k in range(total - warmup)]
    return units + [[unit(k, False)] for k in range(total - warmup, total)]


def schedule_units(schedule: str, stages: int, micro_batches: int, rank: int,
                   virtual_stages: int = 1) -> List[List[Action]]:
    """The work of pipeline rank ``rank`` for one step, in units whose p2p is batched."""
    validate_schedule(schedule, stages, micro_batches, virtual_stages)
    if schedule == "afab":
        return [[a] for a in afab_actions(stages, micro_batches, rank)]
    if schedule == "1f1b":
        return [[a] for a in one_f_one_b_actions(stages, micro_batches, rank)]
    if schedule == "interleaved":
        return interleaved_units(stages, micro_batches, rank, virtual_stages)
    from scaletorch.parallel.zero_bubble import zero_bubble_units
    return zero_bubble_units(schedule, stages, micro_batches, rank)


def schedule_actions(schedule: str, stages: int, micro_batches: int, rank: int,
                     virtual_stages: int = 1) -> List[Action]:
    """The ordered work of pipeline rank ``rank`` for one optimizer step."""
    units = schedule_units(schedule, stages, micro_batches, rank, virtual_stages)
    return [action for unit in units for action in unit]


def peak_live_activations(actions: Sequence[Action],
                          chunk_sizes: Optional[Sequence[float]] = None) -> float:
    """Most micro-batch chunks whose forward ran and whose backward has not (held activations).
    A B whose W comes later keeps them (W walks the same graph): they go at the W. With
    ``chunk_sizes`` each live chunk c weighs ``chunk_sizes[c]`` (the planner's bytes)."""
    deferred = {(a.micro_batch, a.chunk) for a in actions if a.kind == "W"}
    live: float = 0
    peak: float = 0
    for action in actions:
        size = 1 if chunk_sizes is None else chunk_sizes[action.chunk]
        if action.kind == "F":
            live += size
        elif action.kind == "W" or (action.micro_batch, action.chunk) not in deferred:
            live -= size
        peak = max(peak, live)
    return peak


# ---- point-to-point plan ------------------------------------------------------------------


@dataclass(frozen=True)
class P2P:
    """One send or recv of an activation ("act", forward) or a gradient ("grad", backward)
    of ``micro_batch`` between global stages ``src`` and ``dst``, to/from pipeline rank
    ``peer``."""
    op: str
    peer: int
    kind: str
    micro_batch: int
    src: int
    dst: int


Step = Tuple[Tuple[P2P, ...], Optional[Action]]


def action_p2p(action: Action, rank: int, stages: int, virtual_stages: int,
               v_shape: bool = False) -> Tuple[Optional[P2P], Optional[P2P]]:
    """(the recv the action needs before it runs, the send it makes after), or None.

    F receives the previous stage's output and sends its own to the next stage; B receives
    the gradient of its output from the next stage and sends its input's gradient back; W
    talks to nobody. A neighbour stage on this same rank (the turn of a V) is no message: the
    executor hands the tensor over locally.
    """
    p = stages
    s = stage_index(rank, action.chunk, p, v_shape)
    last = p * virtual_stages - 1
    mb = action.micro_batch

    def op(kind: str, tensor: str, src: int, dst: int) -> Optional[P2P]:
        peer = rank_of_stage(dst if kind == "send" else src, p, v_shape)
        return None if peer == rank else P2P(kind, peer, tensor, mb, src, dst)

    recv = send = None
    if action.kind == "F":
        recv = op("recv", "act", s - 1, s) if s > 0 else None
        send = op("send", "act", s, s + 1) if s < last else None
    elif action.kind == "B":
        recv = op("recv", "grad", s + 1, s) if s < last else None
        send = op("send", "grad", s, s - 1) if s > 0 else None
    return recv, send


def comm_plan(units: Sequence[Sequence[Action]], rank: int, stages: int, virtual_stages: int = 1,
              v_shape: bool = False) -> List[Step]:
    """Steps of (p2p batch, action): post the batch, wait for it, then run the action.

    The batch before a unit pairs the sends of the previous unit with the recvs the unit
    needs. With one action per unit (AFAB, 1F1B), the 1F1B steady state sends an activation
    and receives a gradient together (and the reverse), meeting the neighbour's matching
    pair. Interleaved steady-state units are a forward and a backward, so each batch has up
    to four ops (Megatron's send_forward_backward_recv_forward_backward): interleaving wraps
    the last rank's output around to rank 0, the p2p pattern is a ring and every rank must
    be in the same phase. ``simulate`` proves each plan deadlock-free.
    """
    steps: List[Step] = []
    pending: List[P2P] = []
    for unit in units:
        ops = [action_p2p(a, rank, stages, virtual_stages, v_shape) for a in unit]
        steps.append((tuple(pending + [recv for recv, _ in ops if recv]), unit[0]))
        steps += [((), a) for a in unit[1:]]
        pending = [send for _, send in ops if send]
    steps.append((tuple(pending), None))
    return steps


def schedule_plan(schedule: str, stages: int, micro_batches: int, rank: int,
                  virtual_stages: int = 1) -> List[Step]:
    """``comm_plan`` of ``schedule_units``: what the executor of rank ``rank`` runs."""
    units = schedule_units(schedule, stages, micro_batches, rank, virtual_stages)
    return comm_plan(units, rank, stages, virtual_stages, schedule in V_SHAPED)


# ---- timelines ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    """An action that ran on pipeline rank ``rank`` from ``start`` to ``end`` (seconds or
    slots), on global stage ``stage``."""
    rank: int
    action: Action
    stage: int
    start: float
    end: float


@dataclass
class Timeline:
    """Events of one step, per pipeline rank; the chart and the bubble are computed from them."""
    stages: int
    micro_batches: int
    virtual_stages: int = 1
    events: List[Event] = field(default_factory=list)
    schedule: str = ""  # set for the zero-bubble schedules: their theory and V placement

    def record(self, rank: int, action: Action, start: float, end: float) -> None:
        stage = stage_index(rank, action.chunk, self.stages, self.schedule in V_SHAPED)
        self.events.append(Event(rank, action, stage, start, end))

    def to_json(self) -> dict:
        """Plain data for timeline.json (scripts/plot.py draws it): events as
        [rank, kind, micro_batch, chunk, start, end]."""
        events = [[e.rank, e.action.kind, e.action.micro_batch, e.action.chunk, e.start, e.end]
                  for e in self.events]
        return dict(stages=self.stages, micro_batches=self.micro_batches,
                    virtual_stages=self.virtual_stages, schedule=self.schedule, events=events)

    def ranks(self) -> List[int]:
        return sorted({e.rank for e in self.events})

    def of(self, rank: int) -> List[Event]:
        return sorted((e for e in self.events if e.rank == rank), key=lambda e: e.start)

    def order(self, rank: int) -> List[str]:
        """The recorded sequence on ``rank``, e.g. ["F0", "F1", "B0", ...]."""
        return [str(e.action) for e in self.of(rank)]

    def peak_live(self, rank: int) -> int:
        return int(peak_live_activations([e.action for e in self.of(rank)]))

    def span(self) -> Tuple[float, float]:
        return min(e.start for e in self.events), max(e.end for e in self.events)

    def busy_fraction(self, rank: int) -> float:
        start, end = self.span()
        return sum(e.end - e.start for e in self.of(rank)) / (end - start)

    def bubble_fraction(self) -> float:
        """Measured idle share: 1 - (busy time summed over ranks) / (ranks x step span)."""
        ranks = self.ranks()
        return 1.0 - sum(self.busy_fraction(r) for r in ranks) / len(ranks)

    def theory(self) -> float:
        """(p-1)/(v m + p - 1); a zero-bubble schedule's simulated bubble with F = B = W."""
        if self.schedule in ZERO_BUBBLE:
            return simulate(self.schedule, self.stages, self.micro_batches, self.virtual_stages,
                            1.0, 1.0, 1.0).bubble_fraction()
        return theoretical_bubble(self.stages, self.micro_batches, self.virtual_stages)

    def chart(self, width: int = 96, unit: Optional[float] = None) -> str:
        """ASCII picture: one row per rank, a cell = ``unit`` of time (default: span/width).

        Forward of micro-batch i is drawn with the letter "abc..."[i], its backward in upper
        case, its weight gradient W (zero-bubble schedules) as the digit i % 10, idle as ".".
        A cell shows the event covering most of it.
        """
        start, end = self.span()
        unit = unit or (end - start) / width
        cells = max(1, round((end - start) / unit))
        lines = []
        for rank in self.ranks():
            row = ["."] * cells
            cover = [0.0] * cells
            for e in self.of(rank):
                letter = chr(ord("a") + e.action.micro_batch % 26)
                letter = letter if e.action.kind == "F" else letter.upper()
                letter = str(e.action.micro_batch % 10) if e.action.kind == "W" else letter
                first = int((e.start - start) / unit)
                last = min(cells - 1, int((e.end - start) / unit - 1e-9))
                for c in range(first, last + 1):
                    lo, hi = start + c * unit, start + (c + 1) * unit
                    overlap = min(hi, e.end) - max(lo, e.start)
                    if overlap > cover[c]:
                        row[c], cover[c] = letter, overlap
            lines.append(f"stage {rank} |{''.join(row)}| busy {self.busy_fraction(rank):4.0%}, "
                         f"peak live {self.peak_live(rank)}")
        return "\n".join(lines)

    def summary(self) -> str:
        p, m, v = self.stages, self.micro_batches, self.virtual_stages
        formula = f"(p-1)/(v m+p-1) with p={p}, v={v}, m={m}" if v > 1 else \
            f"(p-1)/(m+p-1) with p={p}, m={m}"
        if self.schedule in ZERO_BUBBLE:
            formula = f"{self.schedule} simulated with F = B = W, p={p}, m={m}"
        return (f"bubble: measured {self.bubble_fraction():.3f}, theory {self.theory():.3f} "
                f"= {formula}; peak live activations per stage "
                f"{[self.peak_live(r) for r in self.ranks()]}")


class TimelineRecorder:
    """Times each action of one rank: ``with recorder.time(action): ...``; ``reset()`` per step.

    The marks come from a ``Timer`` on the stage's ``device``: on the CPU the clock, on CUDA
    events in the stream, so a time is when the work ran on the GPU (and a stage that waits
    for a receive shows the wait as idle), not when it was queued.
    """

    def __init__(self, rank: int, stages: int, micro_batches: int, virtual_stages: int = 1,
                 clock: Clock = time.time, device: Optional[torch.device] = None,
                 schedule: str = "") -> None:
        # time.time: one clock for every process of a host (perf_counter's origin is not).
        self.rank, self.shape = rank, (stages, micro_batches, virtual_stages)
        self.schedule = schedule
        self.timer = Timer(device or torch.device("cpu"), clock)
        self.marks: List[Tuple[Action, Mark, Mark]] = []

    def reset(self) -> None:
        self.marks.clear()

    @contextmanager
    def time(self, action: Action) -> Iterator[None]:
        start = self.timer.mark()
        yield
        self.marks.append((action, start, self.timer.mark()))

    @property
    def timeline(self) -> Timeline:
        """This step's events in seconds (on CUDA reading waits for their events, so read it
        after the step, not inside it)."""
        timeline = Timeline(*self.shape, schedule=self.schedule)
        for action, start, end in self.marks:
            timeline.record(self.rank, action, seconds(start), seconds(end))
        return timeline


# ---- simulation: equal-cost stages, strict rendezvous sends --------------------------------


class PipelineDeadlock(RuntimeError):
    pass


def simulate(schedule: str, stages: int, micro_batches: int, virtual_stages: int = 1,
             forward_cost: float = 1.0, backward_cost: float = 2.0,
             weight_cost: Optional[float] = None) -> Timeline:
    """The slot timeline of ``schedule`` with equal-cost stages (see ``simulate_plans``). The
    zero-bubble schedules' runtime sends asynchronously: ``zero_bubble.simulate_async`` (W
    costs ``weight_cost``, default as much as B)."""
    if schedule in ZERO_BUBBLE:
        from scaletorch.parallel.zero_bubble import simulate_async
        weight = backward_cost if weight_cost is None else weight_cost
        return simulate_async(schedule, stages, micro_batches, virtual_stages, forward_cost,
                              backward_cost, weight)
    plans = [
        schedule_plan(schedule, stages, micro_batches, r, virtual_stages) for r in range(stages)
    ]
    return simulate_plans(plans, micro_batches, virtual_stages, forward_cost, backward_cost)


def simulate_plans(plans: Sequence[List[Step]], micro_batches: int, virtual_stages: int = 1,
                   forward_cost: float = 1.0, backward_cost: float = 2.0) -> Timeline:
    """Run every rank's plan (``plans[r]``) with instant messages and fixed compute costs.

    A send completes only when its peer has posted the matching recv (and vice versa) - the
    strictest semantics (NCCL's), so a plan that finishes here cannot deadlock on gloo or
    NCCL. Messages on each (src, dst) pair are matched in posting order, and both sides must
    name the same (kind, micro-batch, stages), or ValueError. Raises PipelineDeadlock when
    ranks wait for each other in a cycle. Returns the timeline in slots.
    """
    p = len(plans)
    timeline = Timeline(p, micro_batches, virtual_stages)
    pos, clock = [0] * p, [0.0] * p
    # (src, dst, "send" | "recv") -> [(op, post time)] in posting order: the k-th send on a
    # channel meets the k-th recv
    channels: Dict[Tuple[int, int, str], List[Tuple[P2P, float]]] = {}
    posted: Dict[int, List[Tuple[Tuple[int, int, str], int]]] = {}  # rank -> its open ops

    def post(r: int, batch: Sequence[P2P]) -> None:
        posted[r] = []
        for op in batch:
            key = (r, op.peer, "send") if op.op == "send" else (op.peer, r, "recv")
            channels.setdefault(key, []).append((op, clock[r]))
            posted[r].append((key, len(channels[key]) - 1))

    def completion(r: int) -> Optional[float]:
        """When rank r's posted batch completes, or None if a peer has not posted yet."""
        done = clock[r]
        for (src, dst, side), k in posted[r]:
            other = channels.get((src, dst, "recv" if side == "send" else "send"), [])
            if k >= len(other):
                return None
            mine, theirs = channels[(src, dst, side)][k][0], other[k][0]
            if (mine.kind, mine.micro_batch, mine.src, mine.dst) != \
                    (theirs.kind, theirs.micro_batch, theirs.src, theirs.dst):
                raise ValueError(f"message {k} from rank {src} to rank {dst} is {mine} on one "
                                 f"side and {theirs} on the other")
            done = max(done, other[k][1])
        return done

    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(plans[r]):
                batch, action = plans[r][pos[r]]
                if r not in posted:
                    post(r, batch)
                done = completion(r)
                if done is None:
                    break
                del posted[r]
                clock[r] = done
                if action is not None:
                    cost = forward_cost if action.kind == "F" else backward_cost
                    timeline.record(r, action, done, done + cost)
                    clock[r] = done + cost
                pos[r] += 1
                progress = True
    stuck = {r: str(plans[r][pos[r]][1]) for r in range(p) if pos[r] < len(plans[r])}
    if stuck:
        raise PipelineDeadlock(f"p={p} m={micro_batches} v={virtual_stages}: ranks wait for "
                               f"each other at {stuck}")
    return timeline
