"""What one job may leave behind in a rank, put back before the next job starts.

A rank grades the chapter's jobs one after another in one process. A learner's function that
changes torch's process-wide settings (``torch.set_default_dtype``, ``torch.set_grad_enabled``)
would change every job after it: a correct ``update_bias`` failed after a ``biased_top_k`` that
set float64. ``end_job`` (called as each job's result is written, runner.Streamed) puts the
settings back and marks the job that changed them, which fails with what it left.

A function that prints a great deal would bury the verdicts under the ranks' lines: each rank
shows at most ``SHOWN_LINES`` lines of a job and then says how many more it printed, and in
which exercise.
"""

import ctypes
import io
import signal
import sys
from typing import Any, Dict, Optional, TextIO

import torch

SHOWN_LINES = 20  # of each job, on each rank


def _settings() -> Dict[str, Any]:
    return {"default dtype": torch.get_default_dtype(), "grad mode": torch.is_grad_enabled()}


def _restore(settings: Dict[str, Any]) -> None:
    torch.set_default_dtype(settings["default dtype"])
    torch.set_grad_enabled(settings["grad mode"])


class CappedOutput(io.TextIOBase):
    """A rank's stdout or stderr: the first ``SHOWN_LINES`` lines of each job pass, the rest
    are counted (``hidden``) and named when the job ends."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self.stream, self.lines, self.hidden = stream, 0, 0

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if self.lines < SHOWN_LINES:
            self.stream.write(text)
        else:
            self.hidden += text.count("\n")
        self.lines += text.count("\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


class JobState:
    """One rank's settings as its world started them, and its capped output."""

    def __init__(self, rank: int) -> None:
        self.rank, self.settings = rank, _settings()
        self.out, self.err = CappedOutput(sys.stdout), CappedOutput(sys.stderr)
        sys.stdout, sys.stderr = self.out, self.err  # type: ignore[assignment]

    def end_job(self, item: Dict[str, Any]) -> Dict[str, Any]:
        """``item`` (a job's result), with {"settings_left": ...} when the job changed a
        setting; the settings put back, the output's count of hidden lines said and restarted."""
        exercise = item.get("exercise", "the job")
        for stream in (self.out, self.err):
            if stream.hidden:
                stream.stream.write(f"(rank {self.rank}: {stream.hidden} more lines printed in "
                                    f"{exercise}, not shown)\n")
            stream.lines = stream.hidden = 0
        now = _settings()
        changed = [
            f"torch's {k} at {now[k]} (it was {v})" for k, v in self.settings.items() if now[k] != v
        ]
        _restore(self.settings)
        if not changed or "error" in item or "lost" in item:
            return item
        return {
            **item, "settings_left":
            f"{exercise} left {' and '.join(changed)}: every job after it, "
            f"the library's too, would run with it (put back for them)"
        }


_STATE: Optional[JobState] = None


def start(rank: int) -> None:
    """In a rank, before its first job; on Linux the rank also ends when the process that
    started it does (a grader ended by a timeout or Ctrl-C leaves no rank spinning in a
    learner's endless loop)."""
    global _STATE
    _STATE = JobState(rank)
    try:  # prctl(PR_SET_PDEATHSIG, SIGKILL)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the grader's own kill at its limits stays
        pass


def end_job(item: Dict[str, Any]) -> Dict[str, Any]:
    """``JobState.end_job`` in a rank that ``start``-ed; ``item`` as it is elsewhere."""
    return _STATE.end_job(item) if _STATE is not None else item
