"""The communication ledger: every collective scaletorch issues is written down here.

Each record says which operation ran, over which group (by its short name: "tp", "dp", ...),
how many elements it carried (``elements``, ``bytes``: the tensor of the call) and how many
bytes this rank sends for it (``wire_bytes``) with the textbook ring algorithms:

    all_reduce                        2 (N-1)/N x bytes
    all_gather, reduce_scatter          (N-1)/N x bytes of the full (gathered) tensor
    broadcast, send                               bytes
    all_to_all                     bytes sent to other ranks
    recv                                          0   (a receive sends nothing)

Wire bytes are what a rank sends, so summed over all ranks they are the bytes that crossed the
network: a point-to-point message counts once (at its sender; the receiver's "recv" row shows
its size in ``bytes``), a ring collective over N ranks N times its per-rank volume.

Each record also has a phase: "compute" for the step's own forward, backward and optimizer,
"recompute" for what activation checkpointing issues again when it re-runs a block's forward
in backward (real traffic, reported on its own lines so that it does not silently double the
forward's). ``with ledger.in_phase("recompute"):`` sets it.

The ledger stays flat over a long run: it keeps the records of the last ``keep_steps`` steps
that communicated (scripts print the last step, the Trainer reports each step as it ends) and,
for the whole run, only sums per (op, group, group size, phase). ``total(step=s)`` reads the
sums of step ``s``; it does not scan the run.

Scripts print ``ledger.table(step=...)``; tests compare ``ledger.total(...)`` with formulas.
"""

import weakref
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch.distributed as dist

from scaletorch.rules.wire import wire_bytes

# Weak keys: a name must not keep its group alive. A destroyed gloo group whose object lived on
# here kept its threads (3 a group, 21 a pg_manager rebuild) until the process ended.
_GROUP_NAMES: "weakref.WeakKeyDictionary[dist.ProcessGroup, str]" = weakref.WeakKeyDictionary()

PHASES = ("compute", "recompute")
FIELDS = ("calls", "elements", "bytes", "wire_bytes")


def name_group(group: dist.ProcessGroup, name: str) -> None:
    """Give a process group the short name that ledger tables show ("tp", "dp", ...)."""
    _GROUP_NAMES[group] = name


def forget_group(group: dist.ProcessGroup) -> None:
    """Drop ``group``'s name (when it is destroyed); a group without a name is a no-op."""
    _GROUP_NAMES.pop(group, None)


def group_name(group: Optional[dist.ProcessGroup]) -> str:
    if group is not None and group in _GROUP_NAMES:
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
    phase: str = "compute"


Key = Tuple[str, str, int, str]  # (op, group, group size, phase)


class _Sums:
    """Per (op, group, group size, phase): [calls, elements, bytes, wire bytes]."""
    __slots__ = ("rows", )

    def __init__(self) -> None:
        self.rows: Dict[Key, List[float]] = {}

    def add(self, r: CommRecord) -> None:
        row = self.rows.setdefault((r.op, r.group, r.group_size, r.phase), [0, 0, 0, 0.0])
        row[0] += 1
        row[1] += r.elements
        row[2] += r.bytes
        row[3] += r.wire_bytes

    def total(self, op: Optional[str], group: Optional[str], phase: Optional[str],
              column: int) -> float:
        return sum(row[column] for (o, g, _, p), row in self.rows.items()
                   if (op is None or o == op) and (group is None or g == group) and (
                       phase is None or p == phase))


class _Step:
    """One step's records, and their sums."""
    __slots__ = ("records", "sums")

    def __init__(self) -> None:
        self.records: List[CommRecord] = []
        self.sums = _Sums()


class CommLedger:
    """The records of the last ``keep_steps`` steps, and per-(op, group, phase) sums of the run
    since the last ``clear()``, tagged with the current training step and phase."""

    def __init__(self, keep_steps: int = 8) -> None:
        if keep_steps < 1:
            raise ValueError(f"keep_steps must be at least 1, got {keep_steps}")
        self.keep_steps = keep_steps
        self.step = 0
        self.phase = "compute"
        self.enabled = True
        self.last: Optional[CommRecord] = None  # the last collective issued (for error messages)
        self._steps: "OrderedDict[int, _Step]" = OrderedDict()
        self._run = _Sums()
        self._dropped: Optional[int] = None  # the newest step whose records were dropped

    def set_step(self, step: int) -> None:
        """Tag what follows with training step ``step``. A step number at or below the dropped
        ones starts a new count (another run in the same process, e.g. --check's reference)."""
        if self._dropped is not None and step <= self._dropped:
            self._dropped = None
        self.step = step

    def clear(self) -> None:
        self._steps.clear()
        self._run = _Sums()
        self._dropped = None
        self.last = None

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Record nothing inside the block (a check or a report, not training traffic); the
        previous state comes back however the block ends."""
        enabled, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = enabled

    @contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        """Tag what is recorded inside the block with ``phase`` ("compute" or "recompute")."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    def record(self, op: str, group: Optional[dist.ProcessGroup], group_size: int, elements: int,
               element_size: int, name: Optional[str] = None) -> None:
        """One call: ``name`` labels it (the role it serves: "cp", "ep", ...), else the group's
        own name (``name_group``); pg_manager shares one group among roles with the same
        ranks, so a call for a role other than the group's first says which."""
        if not self.enabled:
            return
        nbytes = elements * element_size
        r = CommRecord(self.step, op, name or group_name(group), group_size, elements, nbytes,
                       wire_bytes(op, nbytes, group_size), self.phase)
        entry = self._steps.get(r.step)
        if entry is None:
            entry = self._steps[r.step] = _Step()
            while len(self._steps) > self.keep_steps:
                dropped, _ = self._steps.popitem(last=False)
                self._dropped = dropped if self._dropped is None else max(self._dropped, dropped)
        entry.records.append(r)
        entry.sums.add(r)
        self._run.add(r)
        self.last = r

    @property
    def steps(self) -> List[int]:
        """The steps whose records are kept (at most ``keep_steps``)."""
        return list(self._steps)

    @property
    def records(self) -> List[CommRecord]:
        """Every kept record, oldest first (the last ``keep_steps`` steps only)."""
        return [r for entry in self._steps.values() for r in entry.records]

    def _step(self, step: int) -> _Step:
        if step not in self._steps and self._dropped is not None and step <= self._dropped:
            raise ValueError(f"step {step} is no longer in the ledger: it keeps the last "
                             f"{self.keep_steps} steps ({self.steps}); raise keep_steps")
        return self._steps.get(step, _Step())

    def select(self, op: Optional[str] = None, group: Optional[str] = None,
               step: Optional[int] = None, phase: Optional[str] = None) -> List[CommRecord]:
        """The kept records that match (all kept steps when ``step`` is None)."""
        records = self.records if step is None else self._step(step).records
        return [
            r for r in records if (op is None or r.op == op) and (
                group is None or r.group == group) and (phase is None or r.phase == phase)
        ]

    def total(self, op: Optional[str] = None, group: Optional[str] = None,
              step: Optional[int] = None, field: str = "elements",
              phase: Optional[str] = None) -> float:
        """Sum ``field`` (calls, elements, bytes or wire_bytes) over the matching calls: of
        ``step``, or of the whole run since ``clear()`` when ``step`` is None; both phases
        unless ``phase`` is given."""
        if field not in FIELDS:
            raise ValueError(f"field must be one of {FIELDS}, got {field!r}")
        sums = self._run if step is None else self._step(step).sums
        return sums.total(op, group, phase, FIELDS.index(field))

    def table(self, step: Optional[int] = None) -> str:
        """One row per (op, group): calls, elements, MB of the calls' tensors and wire MB (what
        this rank sends); what recomputation re-issued on rows of its own."""
        sums = self._run if step is None else self._step(step).sums
        title = "all steps" if step is None else f"step {step}"
        lines = [
            f"communication per rank ({title})",
            f"{'op':<16}{'group':<8}{'N':>4}{'calls':>8}{'elements':>14}{'MB':>10}"
            f"{'wire MB':>10}",
        ]
        for phase in PHASES:
            rows = sorted((k, v) for k, v in sums.rows.items() if k[3] == phase)
            if rows and phase == "recompute":
                lines.append("recompute (activation checkpointing re-runs the blocks' forward):")
            for (op, group, size, _), (calls, elements, nbytes, wire) in rows:
                lines.append(f"{op:<16}{group:<8}{size:>4}{calls:>8}{elements:>14,}"
                             f"{nbytes / 1e6:>10.3f}{wire / 1e6:>10.3f}")
        if not sums.rows:
            lines.append("(no communication)")
        return "\n".join(lines)


_LEDGER = CommLedger()


def get_ledger() -> CommLedger:
    """The process-wide ledger that scaletorch.dist.comm writes to."""
    return _LEDGER
