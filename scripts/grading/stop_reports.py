"""What stopped a rank, in the learner's terms: its frame, the backend's words, a hang's head.

``runner.run_world`` reads each stopped rank's stack (faulthandler's dump or a traceback) and
error text; these turn them into the lines of the job's verdict: ``where_stopped`` (the frame in
the learner's file), ``plain`` (gloo's message without its internals), ``hang_head`` (the first
collective some ranks of a group wait in and others never issued, from the flight recorder,
scaletorch/dist/flight_recorder.py) and ``rank_order`` (which rank's account comes first).
"""

import os
import re
from typing import Dict, Optional, Sequence, Tuple

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
