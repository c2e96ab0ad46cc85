"""What stopped a rank, in the learner's terms: its frame, the backend's words, a hang's head.

``runner.run_world`` reads each stopped rank's stack (faulthandler's dump or a traceback) and
error text; these turn them into the lines of the job's verdict: ``where_stopped`` (the frame in
the learner's file), ``plain`` (gloo's message without its internals), ``hang_head`` (the first
collective some ranks of a group wait in and others never issued, from the flight recorder,
scaletorch/dist/flight_recorder.py), ``rank_order`` (which rank's account comes first) and
``account`` (the job's ranks together: the cause first, the others' waits after it).
"""

import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from scaletorch.dist import flight_recorder

# a frame of faulthandler's dump ('File "x.py", line 12 in name', most recent first) or of a
# traceback ('File "x.py", line 12, in name', most recent last)
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+),? in (?P<name>\S+)')


def where_stopped(stack: str, files: Sequence[str], exercise: str, recent_first: bool = True,
                  unknown: str = "no Python frame") -> str:
    """The frame a rank's stack (faulthandler's dump, or a traceback) says it was in, in the
    learner's terms: the most recent frame in the graded function's file, else the exercise's
    function, else ours."""
    block = stack.split("Current thread")[-1] if "Current thread" in stack else stack
    frames = [m.groupdict() for m in _FRAME.finditer(block)]
    frames = frames if recent_first else frames[::-1]
    pick = next((f for f in frames if os.path.abspath(f["file"]) in files), None) or \
        next((f for f in frames if f["name"] == exercise), None) or \
        next((f for f in frames if re.search(r"scaletorch|scripts", f["file"])), None)
    if pick is None:
        return unknown
    return f"{pick['name']} ({os.path.basename(pick['file'])}:{pick['line']})"


def plain(message: str) -> str:
    """A backend's error in the learner's terms: gloo's source locations dropped, its "Connection
    closed by peer" a peer that left, its "Timed out waiting Nms" a wait of N / 1000 s."""
    message = re.sub(r"\[[^\]]*gloo[^\]]*\]\s*", "", message)
    message = re.sub(r"Connection closed by peer.*", "a peer rank had left (its connection closed)",
                     message)
    message = re.sub(r"Application timeout caused pair closure.*",
                     "no peer answered within the grader's timeout (its connection closed)",
                     message)
    message = re.sub(
        r"Timed out waiting (\d+)ms for (\w+) operation to complete",
        lambda m: f"no peer answered its {m.group(2)} within "
        f"{int(m.group(1)) / 1000:.0f} s", message)
    return message if len(message) < 240 else message[:240] + "..."


def hang_head(traces: Dict[int, dict], files: Sequence[str], exercise: str = "") -> Optional[str]:
    """The first collective some ranks of its group wait in and others never issued: which
    ranks, the op, the group (its ranks) and the learner's line that issued it (else the frame
    of the function graded: the grader's reference call of it); None if none."""
    for call, there, ranks in flight_recorder.disagreements(traces):
        missing = [r for r in ranks if r not in there]
        if not missing or len(missing) == len(ranks):
            continue
        frames = [f.rsplit(" ", 1) for f in call.stack]
        named = [(f"{name} ({os.path.basename(at)})", at, name) for at, name in frames]
        mine = next((n for n, at, _ in named if os.path.abspath(at.rsplit(":", 1)[0]) in files),
                    None) or next((n for n, _, name in named if name == exercise), call.where)
        waiting = [r for r in ranks if r in there]
        after = []
        for r in missing:  # where the rank went instead: its last collective
            last = flight_recorder.calls(r, traces[r])[-1:] if r in traces else []
            after += [
                f"rank {r}'s last is {x.op} #{x.seq} of group '{x.group}' at {x.where}"
                for x in last
            ]
        return (f"hang: rank {', '.join(map(str, waiting))} wait(s) in {call.op} #{call.seq} of "
                f"group '{call.group}' (ranks {ranks}), issued at {mine}; rank "
                f"{', '.join(map(str, missing))} of that group never issued it" +
                (f" ({'; '.join(after)})" if after else ""))
    return None


def rank_order(text: str, rank: int) -> Tuple[int, int]:
    """Which rank's account comes first: one that died, ended or failed, then one that hung
    (its wait timed out), then the ranks stopped because of it (their peer left)."""
    causes = ("died of", "ended its process", "failed in", "made no progress", "no peer answered",
              "in a collective")  # a peer that left is the last
    return next((k for k, c in enumerate(causes) if c in text), len(causes)), rank


@dataclass
class Stop:
    """What the parent measured of one rank that did not finish the job: its sentence, its
    kind ("died", "ended", "failed", "timed out" (its collective's wait ran out), "hang" (its
    peer left), "computing", "no progress", "stopped" (by the parent, after another rank had
    left), "exit"), the learner's terms of where it was, and faulthandler's dump of its stack
    ("" if it wrote none), the CPU it spent in the job."""
    text: str
    kind: str
    where: str
    stack: str = ""
    cpu: float = 0.0  # seconds of CPU it spent in the job


# torch.distributed's calls that wait for the other ranks of their group
_COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "reduce", "gather",
    "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single", "barrier",
    "monitored_barrier", "send", "recv", "_all_gather_base", "_reduce_scatter_base"
}
# ... and those every rank of the world must call, whichever ranks the group they make holds
_WORLD_CALLS = ("new_group", "new_subgroups", "new_subgroups_by_enumeration")
_TORCH = re.compile(r"[/\\]torch[/\\]")


def torch_call(stack: str) -> Tuple[Optional[str], Optional[str]]:
    """(the file of a faulthandler dump's innermost frame outside torch, the torch function that
    frame was in: "all_reduce", "new_group"; None where it called none, a C function alone)."""
    block = stack.split("Current thread")[-1]
    callee = None
    for m in _FRAME.finditer(block):
        if not _TORCH.search(m["file"]):
            return m["file"], callee
        if m["name"] != "wrapper":  # torch's logging wrapper of each collective
            callee = m["name"]
    return None, callee


def in_collective(stack: str) -> bool:
    """Whether a rank's dump shows it waiting in a collective: a torch.distributed call that
    waits for its group, or the library's collectives (scaletorch/dist)."""
    caller, callee = torch_call(stack)
    return callee in _COLLECTIVES or bool(caller and re.search(r"scaletorch[/\\]dist[/\\]", caller))


def place(text: str) -> str:
    """" in <frame>" of a rank's stop text, else ""."""
    found = re.search(r" in (\S+ \([^)]*\))", text)
    return f" in {found.group(1)}" if found else ""


def account(stops: Dict[int, Stop], traces: Dict[int, dict], files: Sequence[str],
            exercise: str) -> Dict[int, str]:
    """{rank: its part of the job's verdict}: the cause first (a rank that died or ended in the
    learner's code, one still computing, one outside any collective that ranks timed out
    waiting for), the others after it in brief; else each rank's own account, the flight
    recorder's once (``traces``: the dumps of the ranks whose collectives timed out)."""
    texts = {r: s.text for r, s in stops.items()}
    mine = [r for r, s in stops.items() if any(f"({os.path.basename(f)}" in s.where for f in files)]
    # a rank that died or ended in the learner's code: the others' errors and disagreements
    # followed it, not a second cause (a rank aborted inside a mismatched collective is not one)
    dead = [r for r in mine if stops[r].kind in ("died", "ended")]
    if dead:
        return _led(dead, texts, "what followed", lambda r: f"rank {r} stopped{place(texts[r])}",
                    " (their peer was gone)")
    # a rank that computed past the grader's limit: the others waited for it
    computing = [r for r, s in stops.items() if s.kind == "computing"]
    if computing:
        return _led(computing, texts, "the others waited for it",
                    lambda r: f"rank {r}{place(texts[r])}")
    absent = _absent(stops, traces, mine)
    if absent:
        waits = _waits(stops, traces)
        for r in absent:
            texts[r] = f"rank {r} {_outside(stops[r])}, while the others waited for it"
        return _led(absent, texts, "what they waited in",
                    lambda r: waits.get(r) or f"rank {r}{place(texts[r])}")
    recorder = flight_recorder.analyze(traces) if traces else []
    if recorder and texts:  # once, after the first rank's line
        first = min(texts, key=lambda r: rank_order(texts[r], r))
        texts[first] += "; the flight recorder says\n    " + "\n    ".join(recorder)
        # no rank died, ended or raised: a hang, headed by the collective some ranks never met
        if all(rank_order(t, r)[0] >= 3 for r, t in texts.items()):
            head = hang_head(traces, files, exercise)
            if head:
                texts[first] = f"{head}; {texts[first]}"
    return texts


def _led(causes: List[int], texts: Dict[int, str], how: str, each: Callable[[int], str],
         after: str = "") -> Dict[int, str]:
    """The causes' own sentences, the last followed by "<how>: <each other rank>"."""
    out = {r: texts[r] for r in causes}
    others = [r for r in sorted(texts) if r not in causes]
    if others:  # after the cause told last (runner.run_world orders them by rank_order)
        last = max(causes, key=lambda r: rank_order(texts[r], r))
        out[last] += f"; {how}: " + ", ".join(each(r) for r in others) + after
    return out


def _timed_out(stops: Dict[int, Stop], traces: Dict[int, dict]) -> Dict[int, Any]:
    """{rank whose collective timed out: its last collective, as its dump records it}."""
    out = {}
    for k, s in stops.items():
        last = flight_recorder.calls(k, traces[k])[-1:] if k in traces else []
        if s.kind == "timed out" and last:
            out[k] = last[0]
    return out


def _waits(stops: Dict[int, Stop], traces: Dict[int, dict]) -> Dict[int, str]:
    """{rank whose collective timed out: "rank k timed out in <op> #<n> of group '<g>' (ranks
    [...])"}."""
    members = flight_recorder._members(traces) if traces else {}
    return {
        k:
        f"rank {k} timed out in {c.op} #{c.seq} of group '{c.group}' (ranks "
        f"{members.get(c.group_id, '?')})"
        for k, c in _timed_out(stops, traces).items()
    }


def _absent(stops: Dict[int, Stop], traces: Dict[int, dict], mine: List[int]) -> List[int]:
    """The ranks the parent stopped, outside any collective (in the learner's code, or writing
    no stack at all), that a rank whose collective timed out waited for (its group holds them):
    none while a rank died, ended or failed on its own."""
    if any(s.kind in ("died", "ended", "failed") for s in stops.values()):
        return []
    members = flight_recorder._members(traces) if traces else {}
    waited: Set[int] = set()
    for k, c in _timed_out(stops, traces).items():
        waited.update(r for r in members.get(c.group_id, []) if r != k)
    return [
        r for r, s in sorted(stops.items())
        if r in waited and r not in traces and s.kind in ("stopped", "no progress") and (
            not s.stack.strip() or r in mine and not in_collective(s.stack))
    ]


def _outside(stop: Stop) -> str:
    """Where a rank outside any collective was, and what torch call it was in."""
    if not stop.stack.strip():
        return f"stopped in {stop.where}: it did not even write its stack when the grader asked"
    _, callee = torch_call(stop.stack)
    package = "torch.distributed" if callee and re.search(
        rf'torch[/\\]distributed[/\\][^"]*", line \d+ in {re.escape(callee)}\n', stop.stack) \
        else "torch"
    call = f", in {package}'s {callee}" if callee else ""
    if callee in _WORLD_CALLS:
        call += " (every rank of the world must call it, whatever ranks the group holds)"
    busy = f" after {stop.cpu:.0f} s of CPU in this job" if stop.cpu >= 1 else ""
    return f"was stopped in {stop.where}{call}, outside any collective{busy}"
