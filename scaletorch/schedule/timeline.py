"""A pipeline step's timeline: which rank ran which action when, its chart and its bubble.

The runtime records one (scaletorch/parallel/pipeline_parallel.py, in seconds), the simulators
build one (simulate.py, analysis.py: in slots); both are drawn and measured the same way.
"""

from dataclasses import dataclass, field
from typing import List, Tuple

from scaletorch.schedule.orders import Action, peak_live_activations
from scaletorch.schedule.placement import V_SHAPED, stage_index, theoretical_bubble


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
    pp: int
    micro_batches: int
    virtual_stages: int = 1
    events: List[Event] = field(default_factory=list)
    schedule: str = ""  # set for the V-shaped schedules: their placement

    def record(self, rank: int, action: Action, start: float, end: float) -> None:
        stage = stage_index(rank, action.chunk, self.pp, self.schedule in V_SHAPED)
        self.events.append(Event(rank, action, stage, start, end))

    def to_json(self) -> dict:
        """Plain data for timeline.json (scripts/plot.py draws it): events as
        [rank, kind, micro_batch, chunk, start, end]."""
        events = [[e.rank, e.action.kind, e.action.micro_batch, e.action.chunk, e.start, e.end]
                  for e in self.events]
        return dict(pp=self.pp, micro_batches=self.micro_batches,
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
        """(p-1)/(v m + p - 1), the bubble with equal-cost stages."""
        return theoretical_bubble(self.pp, self.micro_batches, self.virtual_stages)

    def formula(self) -> str:
        p, m, v = self.pp, self.micro_batches, self.virtual_stages
        return f"(p-1)/(v m+p-1) with p={p}, v={v}, m={m}" if v > 1 else \
            f"(p-1)/(m+p-1) with p={p}, m={m}"

    def chart(self, width: int = 96, unit: float = 0.0) -> str:
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
            lines.append(f"rank {rank} |{''.join(row)}| busy {self.busy_fraction(rank):4.0%}, "
                         f"peak live {self.peak_live(rank)}")
        return "\n".join(lines)

    def summary(self) -> str:
        return (f"bubble: measured {self.bubble_fraction():.3f}, theory {self.theory():.3f} "
                f"= {self.formula()}; peak live activations per stage "
                f"{[self.peak_live(r) for r in self.ranks()]}")
