"""What an uneven router costs under expert parallel, measured per step, layer and rank
(chapter 06b).

When the router sends most tokens to a few experts, the ep ranks holding them receive more
rows in the dispatch, compute longer, and every other rank waits for them in the combine:

    rank 0 (hot)   |count|dispatch|==== experts: 3/4 of the tokens ====|combine|
    rank 1 (cold)  |count|dispatch|= experts =|..... waits ...........|combine|

``LoadMeter`` times every MoE layer's forward on each rank (its dispatcher becomes a
``TimedDispatcher``) and after each step keeps, per layer: the global tokens per expert (the
aux loss's counts), the tokens this rank's experts computed, the token bytes this rank sent
in the dispatch and in the combine (from the ledger; a rank sends back in the combine what it
received in the dispatch), the seconds of its experts and its wait from their end to the
combine's end, and the assignments its capacity dropped. ``gather`` brings every rank's
numbers to rank 0 (ledger off: a report, not training traffic).
"""

from typing import Any, Callable, List, Optional, cast

import torch
from torch import nn

from scaletorch.dist import ProcessGroupManager, get_ledger
from scaletorch.dist.functional import gather_along_dim
from scaletorch.dist.timer import Mark, Timer, seconds
from scaletorch.models.moe import Experts, MoE
from scaletorch.parallel.expert_parallel import AllToAllDispatcher, _dispatcher, moe_layers


class _TimedExperts:
    """The experts, with a mark before and after their call (the dispatcher calls them)."""

    def __init__(self, experts: Experts, timer: Timer) -> None:
        self.experts, self.timer = experts, timer
        self.num_experts = experts.num_experts
        self.start: Optional[Mark] = None
        self.end: Optional[Mark] = None

    def __call__(self, x: torch.Tensor, counts: List[int]) -> torch.Tensor:
        self.start = self.timer.mark()
        out = self.experts(x, counts)
        self.end = self.timer.mark()
        return out


class TimedDispatcher(AllToAllDispatcher):
    """Chapter 06's dispatcher, timed: per call (experts' start, their end, the call's end)."""

    def __init__(self, base: AllToAllDispatcher, timer: Timer) -> None:
        super().__init__(base.group)
        self.host_tables, self.timer, self.base = base.host_tables, timer, base
        self.marks: List[tuple] = []  # per call: (experts' start, experts' end, combined)
        self.computed = 0  # rows this rank's experts computed since the last ``take``

    def __call__(self, experts: Any, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        timed = _TimedExperts(experts, self.timer)
        out = super().__call__(cast(Experts, timed), routed, counts)  # it has what they have
        self.marks.append((timed.start, timed.end, self.timer.mark()))
        self.computed += int(self.received.sum()) if self.received is not None else 0
        return out

    def outgoing(self, routed: torch.Tensor) -> torch.Tensor:
        return self.base.outgoing(routed)  # as the timed dispatcher sends them

    def take(self) -> List[float]:
        """[rows computed, expert seconds, seconds waited at the combine] since the last take."""
        expert = sum(seconds(e) - seconds(s) for s, e, _ in self.marks)
        wait = sum(seconds(d) - seconds(e) for _, e, d in self.marks)
        out = [float(self.computed), expert, wait]
        self.marks, self.computed = [], 0
        return out


# per layer and step: E global tokens per expert, then these columns
COLUMNS = ["computed", "expert_s", "wait_s", "sent_bytes", "received_bytes", "dropped", "ep_rank"]


class LoadMeter:
    """Times every MoE layer of ``model`` (already ``shard_experts``-ed) on this rank;
    ``after_step()`` after each step's backward keeps the step's row per layer. Build it just
    before training: it clears the ledger, whose records of an earlier run would mix in."""

    def __init__(self, model: nn.Module, pgm: ProcessGroupManager) -> None:
        self.pgm, self.layers = pgm, moe_layers(model)
        timer = Timer(self.layers[0].router.weight.device)
        self.dispatchers = []
        for layer in self.layers:
            layer.dispatch_fn = TimedDispatcher(_dispatcher(layer), timer)
            self.dispatchers.append(layer.dispatch_fn)
        self.tokens: List[torch.Tensor] = [torch.zeros(0)] * len(self.layers)
        self.dropped = [0] * len(self.layers)
        for i, layer in enumerate(self.layers):
            layer.register_forward_hook(self._count(i))
        self.rows: List[List[List[float]]] = []  # [step][layer] -> E + len(COLUMNS) numbers
        # the ledger files records by step number, which restarts with each run of a process
        get_ledger().clear()

    def _count(self, i: int) -> Callable:

        def hook(layer: MoE, args: tuple, out: torch.Tensor) -> None:
            counts = layer.tokens_per_expert
            if counts is not None:  # the step's forwards add up (micro-batches)
                self.tokens[i] = counts if not self.tokens[i].numel() else self.tokens[i] + counts
            self.dropped[i] += layer.dropped

        return hook

    def after_step(self) -> None:
        """Keep this step's numbers. The step's all-to-alls over "ep" come per micro-batch in a
        fixed order: forward, per layer i (counts, dispatch, combine), then backward (two per
        layer); the bytes of the forward's dispatch and combine are what this rank sent."""
        records = get_ledger().select("all_to_all", "ep", get_ledger().step)
        n = len(self.layers)
        if len(records) % (5 * n):
            raise RuntimeError(f"{len(records)} all-to-alls over ep this step: expected 5 per "
                               f"MoE layer ({n}) per micro-batch")
        forwards = [records[j:j + 3 * n] for j in range(0, len(records), 5 * n)]
        step = []
        for i, d in enumerate(self.dispatchers):
            sent = sum(f[3 * i + 1].bytes for f in forwards)
            received = sum(f[3 * i + 2].bytes for f in forwards)
            step.append(self.tokens[i].tolist() + d.take() + [
                float(sent),
                float(received),
                float(self.dropped[i]),
                float(self.pgm.expert_model_parallel_rank)
            ])
            self.tokens[i], self.dropped[i] = torch.zeros(0), 0
        self.rows.append(step)

    def gather(self) -> Optional[torch.Tensor]:
        """(world, steps, layers, E + len(COLUMNS)) on global rank 0, None elsewhere.
        Collective over the world."""
        mine = torch.tensor(self.rows, dtype=torch.float64)
        with get_ledger().paused():
            every = gather_along_dim(mine.unsqueeze(0), 0, None)
        return every if self.pgm.rank == 0 else None


def measured_step(step: Callable, *after: Callable[[], None]) -> Callable:
    """``step`` (inputs, targets) -> loss, then each of ``after`` (a meter's ``after_step``, a
    balancer's ``update``): the chapter's step with its bookkeeping, for the Trainer."""

    def run(inputs: torch.Tensor, targets: torch.Tensor) -> Any:
        loss = step(inputs, targets)
        for fn in after:
            fn()
        return loss

    return run


def imbalance(computed: torch.Tensor) -> torch.Tensor:
    """max over mean of the rows computed by each rank: (..., ranks) -> (...)."""
    return computed.max(-1).values / computed.mean(-1).clamp(min=1e-9)


def format_load(every: torch.Tensor, num_experts: int, start: int = 0) -> str:
    """The meter's table (``every``: ``LoadMeter.gather``'s, of steps ``start`` on: a resumed
    run's). Per layer: the global tokens per expert at the first and last step; per rank,
    medians over the steps after the first (it warms up; the first alone if it is the only
    one): rows its experts computed, dispatch KB sent and received (the ledger), expert and
    combine-wait milliseconds; the imbalance is max over mean of the median rows."""
    e, steps = num_experts, every.shape[1]
    later = every[:, 1:] if steps > 1 else every
    over = (f"medians over steps {start + 1}-{start + steps - 1}"
            if steps > 1 else f"step {start} alone: no step after the warm-up")
    lines = []
    for layer in range(every.shape[2]):
        first, last = (" ".join(str(int(t)) for t in every[0, s, layer, :e].tolist())
                       for s in (0, steps - 1))
        median = later[:, :, layer, e:].median(1).values  # (world, columns)
        lines.append(f"MoE layer {layer}: tokens per expert, step {start} [{first}], step "
                     f"{start + steps - 1} [{last}]; imbalance (max/mean rows per rank) "
                     f"{float(imbalance(median[:, 0])):.2f}")
        lines.append(f"  {'rank':>4} {'ep':>3} {'rows':>6} {'sent_KB':>8} {'recv_KB':>8} "
                     f"{'expert_ms':>9} {'wait_ms':>8}   ({over})")
        for r in range(median.shape[0]):
            computed, expert, wait, sent, received, _, ep_rank = median[r].tolist()
            lines.append(f"  {r:>4} {int(ep_rank):>3} {int(computed):>6} {sent / 1e3:>8.1f} "
                         f"{received / 1e3:>8.1f} {expert * 1e3:>9.2f} {wait * 1e3:>8.2f}")
    return "\n".join(lines)
