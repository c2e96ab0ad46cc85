"""The classic pipeline schedules as plain data: what each rank computes, in which order.

No process group here: every schedule is checked in milliseconds (the order of forwards F
and backwards B, the live activations, that the messages pair up, no deadlock: analysis.py).
p = pipeline ranks, m = micro-batches, v = model chunks per rank (placement.py). Simulated
with F = 1 slot and B = 2 (a, b, ...: forward of micro-batch 0, 1, ...; A, B, ...: its
backward; ".": idle), p = 4, m = 4:

    AFAB (GPipe)                  1F1B
    stage 0 |abcd.........AABBCCDD|   stage 0 |abcd......AA.BB.CC.DD|
    stage 1 |.abcd......AABBCCDD..|   stage 1 |.abc....AAdBB.CC.DD..|
    stage 2 |..abcd...AABBCCDD....|   stage 2 |..ab..AAcBBdCC.DD....|
    stage 3 |...abcdAABBCCDD......|   stage 3 |...aAAbBBcCCdDD......|

Both idle (p-1)/(m+p-1) of the time (the bubble); 1F1B holds at most p - r micro-batches of
activations on rank r instead of m, because each backward frees one as soon as it can.
Chapter 04 runs these two as loops (scaletorch/parallel/pipeline_schedules.py). Interleaving
v chunks per rank (catalog.py, chapter 04b) shrinks the bubble to (p-1)/(v m + p - 1) at the
price of v times more point-to-point messages.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence


@dataclass(frozen=True)
class Action:
    """One action of one rank: the forward ("F") or backward ("B") of a micro-batch
    through the rank's model chunk ``chunk`` (0 unless interleaved or V-shaped). In the
    zero-bubble schedules B is the input gradient only and "W" the weight gradient."""
    kind: str
    micro_batch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}" + (f".{self.chunk}" if self.chunk else "")


def afab_actions(pp: int, micro_batches: int, rank: int) -> List[Action]:
    """GPipe: all forwards, then all backwards (in the same micro-batch order)."""
    forwards = [Action("F", i) for i in range(micro_batches)]
    return forwards + [Action("B", i) for i in range(micro_batches)]


def one_f_one_b_actions(pp: int, micro_batches: int, rank: int) -> List[Action]:
    """1F1B: p - rank - 1 warm-up forwards, then alternate F and B, then the last Bs."""
    warmup = min(pp - rank - 1, micro_batches)
    actions = [Action("F", i) for i in range(warmup)]
    for i in range(micro_batches - warmup):
        actions += [Action("F", warmup + i), Action("B", i)]
    return actions + [Action("B", i) for i in range(micro_batches - warmup, micro_batches)]


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


def message(micro_batch: int, peer: int, outgoing: bool) -> str:
    """A point-to-point message as ``--show-schedule`` prints it: "mb 0 -> rank 1" (sent to
    pipeline rank 1) or "mb 0 <- rank 0" (received from pipeline rank 0)."""
    return f"mb {micro_batch} {'->' if outgoing else '<-'} rank {peer}"
