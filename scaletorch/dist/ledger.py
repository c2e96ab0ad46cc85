"""The communication ledger: every collective scaletorch issues is written down here.

Each record says which operation ran, over which group (by its short name: "tp", "dp", ...),
how many elements it carried and how many bytes each rank puts on the wire for it with the
textbook ring algorithms (DESIGN.md):

    all_reduce                        2 (N-1)/N x bytes
    all_gather, reduce_scatter          (N-1)/N x bytes of the full (gathered) tensor
    broadcast, send, recv                         bytes
    all_to_all                     bytes sent to other ranks

Scripts print ``ledger.table()`` per step; tests compare ``ledger.total(...)`` with formulas.
"""

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch.distributed as dist

_GROUP_NAMES: Dict[object, str] = {}


def name_group(group: Optional[dist.ProcessGroup], name: str) -> None:
    """Give a process group the short name that ledger tables show ("tp", "dp_cp", ...)."""
    _GROUP_NAMES[group] = name


def group_name(group: Optional[dist.ProcessGroup]) -> str:
    if group in _GROUP_NAMES:
        return _GROUP_NAMES[group]
    return "world" if group is None or group is dist.group.WORLD else "group"


@dataclass(frozen=True)
class CommRecord:
    step: int
    op: str
    group: str
    group_size: int
    elements: int
    bytes: int
    wire_bytes: float


def wire_bytes(op: str, nbytes: int, group_size: int) -> float:
    """Bytes one rank sends for ``op`` on ``nbytes`` over a ring of ``group_size`` ranks."""
    n = group_size
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * nbytes
    return float(nbytes)


class CommLedger:
    """An append-only list of CommRecords, tagged with the current training step."""

    def __init__(self) -> None:
        self.records: List[CommRecord] = []
        self.step = 0
        self.enabled = True

    def set_step(self, step: int) -> None:
        self.step = step

    def clear(self) -> None:
        self.records.clear()

    def record(self, op: str, group: Optional[dist.ProcessGroup], group_size: int, elements: int,
               element_size: int) -> None:
        if not self.enabled:
            return
        nbytes = elements * element_size
        self.records.append(
            CommRecord(self.step, op, group_name(group), group_size, elements, nbytes,
                       wire_bytes(op, nbytes, group_size)))

    def select(self, op: Optional[str] = None, group: Optional[str] = None,
               step: Optional[int] = None) -> List[CommRecord]:
        return [
            r for r in self.records if (op is None or r.op == op) and (
                group is None or r.group == group) and (step is None or r.step == step)
        ]

    def total(self, op: Optional[str] = None, group: Optional[str] = None,
              step: Optional[int] = None, field: str = "elements") -> float:
        """Sum ``field`` (elements, bytes or wire_bytes) over the matching records."""
        return sum(getattr(r, field) for r in self.select(op, group, step))

    def table(self, step: Optional[int] = None) -> str:
        """One row per (op, group): calls, elements, bytes and wire bytes per rank."""
        rows: Dict[tuple, List[float]] = defaultdict(lambda: [0, 0, 0, 0.0])
        for r in self.select(step=step):
            row = rows[(r.op, r.group, r.group_size)]
            row[0] += 1
            row[1] += r.elements
            row[2] += r.bytes
            row[3] += r.wire_bytes
        title = "all steps" if step is None else f"step {step}"
        lines = [
            f"communication per rank ({title})",
            f"{'op':<16}{'group':<8}{'N':>4}{'calls':>8}{'elements':>14}{'MB':>10}"
            f"{'wire MB':>10}",
        ]
        for (op, group, size), (calls, elements, nbytes, wire) in sorted(rows.items()):
            lines.append(f"{op:<16}{group:<8}{size:>4}{calls:>8}{elements:>14,}"
                         f"{nbytes / 1e6:>10.3f}{wire / 1e6:>10.3f}")
        if not rows:
            lines.append("(no communication)")
        return "\n".join(lines)


_LEDGER = CommLedger()


def get_ledger() -> CommLedger:
    """The process-wide ledger that scaletorch.dist.comm writes to."""
    return _LEDGER
