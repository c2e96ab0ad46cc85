"""Chapter 06's all-to-all split sizes, compared across the ranks before the backend sees them.

An all-to-all whose ranks disagree on how many rows go from i to j (rank i's input split for j
against rank j's output split for i) or pass a list that is not one size per rank makes gloo
raise its own words or wait forever. While the learner's dispatch_tokens or combine_tokens runs,
``agreed_splits`` puts a check before each all-to-all of dim-0 slices (``ProcessGroup``'s
all_to_all_single, whatever API issued it): the group's ranks gather each other's split sizes
(one all-gather, outside the ledger) and, if they disagree, all raise ``SplitSizes`` with the
same text: which rank passed what, what its peers send it and what the tables give.
"""

from contextlib import contextmanager
from typing import Any, Iterator, List

import torch
import torch.distributed as dist

CAP = 16  # split sizes per list gathered: no ep group of ours is larger


class SplitSizes(Exception):
    """Raised on every rank of the group when its all-to-all's split sizes do not fit."""


def _sums(table: List[List[int]]) -> List[int]:
    return [int(sum(row)) for row in table]


def _columns(table: List[List[int]]) -> List[int]:
    return [int(sum(col)) for col in zip(*table)]


def _row(out: List[int], inp: List[int], want_out: List[int], cols: List[int]) -> torch.Tensor:
    row = torch.full((2 + 4 * CAP, ), -1, dtype=torch.long)
    row[0], row[1] = len(out), len(inp)
    for k, values in enumerate((out, inp, want_out, cols)):
        values = values[:CAP]
        row[2 + k * CAP:2 + k * CAP + len(values)] = torch.tensor(values, dtype=torch.long)
    return row


def _lists(row: torch.Tensor) -> List[List[int]]:
    n_out, n_in = int(row[0]), int(row[1])
    cut = [min(n_out, CAP), min(n_in, CAP), CAP, CAP]
    return [[int(v) for v in row[2 + k * CAP:2 + k * CAP + cut[k]] if k < 2 or v >= 0]
            for k in range(4)]


def diagnosis(exercise: str, rows: List[List[List[int]]], when: str) -> str:
    """The first rank whose split sizes do not fit its peers' (``rows``: per group rank, [its
    output splits, its input splits, the tables' output splits, recv_table's column sums]),
    or "" if all fit."""
    n = len(rows)
    table = "recv_table" if exercise == "dispatch_tokens" else "send_table"
    for r, (out, inp, want, cols) in enumerate(rows):
        sent = [rows[j][1][r] if len(rows[j][1]) == n else None for j in range(n)]
        if len(out) == n and len(inp) == n and out == sent:
            continue
        text = (f"{exercise}'s all-to-all {when}: rank {r} passed output_split_sizes {out} and "
                f"input_split_sizes {inp} over a group of {n} ranks")
        if len(out) != n or len(inp) != n:
            return text + ": each list holds one size per rank of the group"
        text += (f"; the group's ranks send it {sent} rows (each one's input_split_sizes[{r}]), "
                 f"and the tables give {want} ({table}'s row sums, the rows from each rank)")
        if out == cols and cols != want:
            text += (f": its {out} are {table}'s column sums, the rows per local expert over "
                     f"all ranks, not per source rank")
        return text
    return ""


@contextmanager
def agreed_splits(exercise: str, send_table: List[List[int]], recv_table: List[List[int]],
                  when: str) -> Iterator[None]:
    """The block's all-to-alls checked for split sizes that fit across the group (above)."""
    cls = dist.ProcessGroup
    # torch's all_to_all_single calls the first (torch 2.13), older torch the second
    originals = {
        n: cls.__dict__[n]
        for n in ("all_to_all_single", "alltoall_base") if n in cls.__dict__
    }
    dispatch = exercise == "dispatch_tokens"
    arrive = recv_table if dispatch else send_table  # the rows from each rank: its row sums

    def wrap(method: Any) -> Any:

        def call(self: Any, output: Any, inp: Any, out_splits: Any, in_splits: Any, *args: Any,
                 **kwargs: Any) -> Any:
            n = self.size()
            out = [int(s) for s in out_splits] or [output.shape[0] // n] * n  # none: equal
            ins = [int(s) for s in in_splits] or [inp.shape[0] // n] * n
            mine = _row(out, ins, _sums(arrive), _columns(arrive))
            gathered = [torch.empty_like(mine) for _ in range(n)]
            self.allgather([gathered], [mine]).wait()
            text = diagnosis(exercise, [_lists(g) for g in gathered], when)
            if text:
                raise SplitSizes(text)
            return method(self, output, inp, out_splits, in_splits, *args, **kwargs)

        return call

    for name in originals:
        setattr(cls, name, wrap(getattr(cls, name)))
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(cls, name, method)
