"""Chapter 05's ring messages with bounded waits: a hang named by the rank that never came.

While the learner's ``ring_forward`` runs, every send and receive that reaches a process group
(our ``comm``, ``torch.distributed``, a batch of p2p ops) is written down with its peer, and
each wait on a work gives up after ``message_limit()`` s, below the parent's stall limit
(runner.STALL_LIMIT), and at most the world's collective timeout: the rank that waited
raises ``RingHang``, whose result ({"stuck": ...}: the message, its peer, the learner's line,
what the call had exchanged) joins its job's (runner.run_jobs), and leaves the world. The
parent stops the ranks still running after the others left (runner.py); a rank stopped so,
while the others waited for its messages, never reached its send or receive: ``hang_text``
says so first, then what the others waited in.
"""

import datetime
import os
import re
import time
import traceback
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional

import torch.distributed as dist

from scripts.grading.learner import SOURCE_FILES
from scripts.grading.runner import RANK_LIMITS, collective_timeout
from scripts.grading.stop_reports import where_stopped

# Seconds a ring message waits before the grader calls it a hang: one K/V message of a tiny
# model arrives in milliseconds; the limit grows with the load per core, to at most
# LOAD_STRETCH x, staying below the parent's 30 s without progress
WAIT_LIMIT = 10.0
LOAD_STRETCH = 2.5
RANK_LIMITS.append((__name__, "WAIT_LIMIT"))  # the ranks wait the parent's (runner.py)


def message_limit() -> float:
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    return WAIT_LIMIT * min(max(load, 1.0), LOAD_STRETCH)


class RingHang(Exception):
    """A ring message's wait that gave up: an error of the job (not the backend's timeout:
    the rank leaves the world), carrying what it waited in as its ``result``."""

    def __init__(self, text: str, result: Dict[str, Any]) -> None:
        super().__init__(text)
        self.result = result


@contextmanager
def bounded(exercise: str, when: str) -> Iterator[None]:
    """The block's sends and receives written down, each wait bounded; a wait that gives up
    raises ``RingHang`` carrying {"stuck": ...}. ``when``: "step 0", "a probe"."""
    pg, work_cls = dist.ProcessGroup, dist.Work
    originals = {n: pg.__dict__[n] for n in ("send", "recv")}
    wait = work_cls.__dict__["wait"]
    posted: List[list] = []  # [work, "send"/"recv", peer's global rank, completed]

    def wrap(name: str, method: Any) -> Any:

        def call(self: Any, tensors: Any, peer: int, *args: Any, **kwargs: Any) -> Any:
            work = method(self, tensors, peer, *args, **kwargs)
            posted.append([work, name, dist.get_global_rank(self, peer), False])
            return work

        return call

    def bounded_wait(self: Any, *args: Any) -> Any:
        if args:
            return wait(self, *args)
        # at most the world's collective timeout: the backend's own wait would end there
        limit, since = min(message_limit(), collective_timeout()), time.perf_counter()
        mine = next((p for p in posted if p[0] is self), None)
        gave_up = False
        try:
            done = wait(self, datetime.timedelta(seconds=limit))
        except RuntimeError:  # raised outside: the backend's timeout is no cause of RingHang
            gave_up = True
        if gave_up:
            stuck = _stuck(exercise, when, mine, posted, time.perf_counter() - since)
            raise RingHang(f"waited {limit:.0f} s in {stuck['call']}", {"stuck": stuck})
        if mine is not None:
            mine[3] = True
        return done

    for name in originals:
        setattr(pg, name, wrap(name, getattr(pg, name)))
    setattr(work_cls, "wait", bounded_wait)
    try:
        yield
    finally:
        for name, method in originals.items():
            setattr(pg, name, method)
        setattr(work_cls, "wait", wait)


def _stuck(exercise: str, when: str, mine: Optional[list], posted: List[list],
           waited: float) -> Dict[str, Any]:
    """What this rank waited in: the message, the learner's line, what it exchanged."""
    where = where_stopped("".join(traceback.format_stack()[:-2]), list(SOURCE_FILES), exercise,
                          recent_first=False)
    call = "a wait on a work it did not post" if mine is None else \
        f"its {'send to' if mine[1] == 'send' else 'receive from'} rank {mine[2]}"
    return {
        "when": when,
        "call": call,
        "peer": None if mine is None else mine[2],
        "where": where,
        "waited": waited,
        "sent": sum(p[1] == "send" and p[3] for p in posted),
        "received": sum(p[1] == "recv" and p[3] for p in posted)
    }


# the parent's words for a rank it stopped after the others left, or that made no progress
# (runner.py): where it was
STOPPED = re.compile(r"rank (\d+) (?:was stopped in (.+?\)), after another rank had left|"
                     r"made no progress \([^)]*\), stopped in (.+?\)))")


def hang_text(runs: List[Dict[str, Any]]) -> Optional[str]:
    """A job some ranks gave up waiting in: the rank that never came first (stopped outside
    any send or receive while the others waited for its messages), then the waits; None if no
    rank waited."""
    stuck = {r: run["stuck"] for r, run in enumerate(runs) if "stuck" in run}
    if not stuck:
        return None
    others = {}
    for run in runs:
        for m in STOPPED.finditer(run.get("lost", "")):
            others[int(m.group(1))] = m.group(2) or m.group(3)
    when = next(iter(stuck.values()))["when"]
    parts = []
    for r, where in sorted(others.items()):
        # a message to or from r that never completed, while r waited in none: r never posted it
        owed = [("its send to" if s["call"].startswith("its receive") else "its receive from") +
                f" rank {k}" for k, s in sorted(stuck.items()) if s["peer"] == r]
        if owed:
            whom = [k for k, s in sorted(stuck.items()) if s["peer"] == r]
            parts.append(f"rank {r} never issued {' and '.join(owed)}: it was still in {where}, "
                         f"outside any send or receive, when {_ranks(whom)} gave up waiting "
                         f"for it")
        else:
            parts.append(f"rank {r} was in {where}")
    waits = [
        f"rank {r} waited {s['waited']:.0f} s in {s['call']} at {s['where']} ({s['sent']} "
        f"sends and {s['received']} receives of this call had completed)"
        for r, s in sorted(stuck.items())
    ]
    return f"hang in {when}: " + "; ".join(parts + waits)


def _ranks(ranks: List[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else \
        f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"
