"""What one job may leave behind in a rank, put back before the next job starts.

A rank grades the chapter's jobs one after another in one process. A learner's function that
changes a process-wide setting (``torch.set_default_dtype``, ``torch.set_default_device``,
``torch.set_grad_enabled``, an ``inference_mode`` entered and never left, torch's threads,
anomaly detection or deterministic algorithms, the working directory, the recursion limit,
``sys.stdout``, a function of torch or of the library replaced) would change every job after
it: a correct ``update_bias`` failed after a ``biased_top_k`` that set float64. ``end_job``
(called as each job's result is written, runner.Streamed) puts the settings back and marks the
job that changed them, which fails with what it left.

A function that prints a great deal would bury the verdicts under the ranks' lines: each rank
shows at most ``SHOWN_LINES`` lines of a job and then says how many more it printed, and in
which exercise.
"""

import ctypes
import io
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import signal
import sys
import threading
import types
import warnings
from typing import Any, Dict, List, Optional, Set, TextIO, Tuple

import torch

SHOWN_LINES = 20  # of each job, on each rank, stdout and stderr together
SHOWN_CHARS = 4000  # of each job, on each rank: a line of millions is not shown


def _settings() -> Dict[str, Any]:
    return {
        "torch's default dtype": torch.get_default_dtype(),
        "torch's default device": torch.get_default_device(),
        "torch's inference mode": torch.is_inference_mode_enabled(),
        "torch's grad mode": torch.is_grad_enabled(),
        "torch's number of threads": torch.get_num_threads(),
        "torch's anomaly detection": torch.is_anomaly_enabled(),
        "torch's deterministic algorithms": torch.are_deterministic_algorithms_enabled(),
        "the working directory": os.getcwd(),
        "the recursion limit": sys.getrecursionlimit(),
    }


_GUARDS: List[Any] = []  # inference-mode guards entered to undo a learner's, never left


def _set_device(device: torch.device) -> None:
    torch.set_default_device(None if device == torch.device("cpu") else device)


def _set_inference_mode(on: bool) -> None:
    # a learner's ``torch.inference_mode().__enter__()`` is a guard held open: a guard of ours,
    # held open too, sets the mode back (it also sets grad mode: put back after it)
    guard = torch._C._InferenceMode(on)
    guard.__enter__()
    _GUARDS.append(guard)


# each setting's setter, in the order they are put back; each called only for a setting changed
# (torch.use_deterministic_algorithms takes 10 s the first time: it imports torch's compiler)
_SETTERS = {
    "torch's inference mode": _set_inference_mode,
    "torch's default dtype": torch.set_default_dtype,
    "torch's default device": _set_device,
    "torch's grad mode": torch.set_grad_enabled,
    "torch's number of threads": torch.set_num_threads,
    "torch's anomaly detection": torch.set_anomaly_enabled,
    "torch's deterministic algorithms": torch.use_deterministic_algorithms,
    "the working directory": os.chdir,
    "the recursion limit": sys.setrecursionlimit,
}


def _restore(settings: Dict[str, Any]) -> None:
    for name, setter in _SETTERS.items():
        if _settings()[name] != settings[name]:
            setter(settings[name])


# where a learner may replace a function that the jobs after theirs call (``dist.all_reduce =
# counting``); the library's modules too, each ``scaletorch.*`` the rank has imported
WATCHED = ("torch", "torch.distributed", "torch.distributed.distributed_c10d",
           "torch.nn.functional", "torch.autograd")
_CLASSES = (("torch.Tensor", torch.Tensor), ("torch.nn.Module", torch.nn.Module))
# (id(owner), attribute) set by the grader's own learner.patched for a job: not the learner's
GRADERS: List[Tuple[int, str]] = []
_FUNCTION = (types.FunctionType, types.BuiltinFunctionType, type)


def _functions() -> Dict[Tuple[str, str], Tuple[Any, Any]]:
    """(where, name) -> (owner, value): each function and class of the watched namespaces."""
    spaces = [(n, sys.modules[n]) for n in WATCHED if n in sys.modules] + list(_CLASSES) + \
        [(n, m) for n, m in list(sys.modules.items()) if n.startswith("scaletorch.") and m]
    with warnings.catch_warnings():  # a deprecated name (dist.reduce_op) warns when looked at
        warnings.simplefilter("ignore")
        return {
            (where, name): (owner, value)
            for where, owner in spaces
            for name, value in list(vars(owner).items())
            if isinstance(value, _FUNCTION) and not name.startswith("__")
        }


def _put_back_functions(start: Dict[Tuple[str, str], Tuple[Any, Any]]) -> List[str]:
    """Each function replaced (or a method added to torch.Tensor or nn.Module) since ``start``,
    put back; what was replaced, in the learner's words. A wrapper of the function it replaced
    (``__wrapped__``) is torch's own (importing torch._dynamo wraps torch.manual_seed): it
    stays, and ``start`` takes it."""
    replaced = []
    for (where, name), (owner, value) in list(start.items()):
        now = vars(owner).get(name)
        if now is value or (id(owner), name) in GRADERS:
            continue
        if getattr(now, "__wrapped__", None) is value:
            start[(where, name)] = (owner, now)
            continue
        replaced.append(f"{where}.{name} replaced")
        setattr(owner, name, value)
    for where, cls in _CLASSES:
        for name in [n for n in vars(cls) if (where, n) not in start and not n.startswith("__")]:
            if isinstance(vars(cls)[name], _FUNCTION) and (id(cls), name) not in GRADERS:
                replaced.append(f"{where}.{name} added")
                delattr(cls, name)
    return replaced


class Shown:
    """A rank's lines of the current job, stdout and stderr together (``hidden``: past the
    first ``SHOWN_LINES``, or past ``SHOWN_CHARS`` characters without a line's end)."""

    def __init__(self) -> None:
        self.lines = self.chars = self.hidden = self.hidden_chars = 0
        self.ended = True  # the last character shown ended a line


class CappedOutput(io.TextIOBase):
    """A rank's stdout or stderr: what ``shown`` allows passes, the rest is counted."""

    def __init__(self, stream: TextIO, shown: Shown) -> None:
        super().__init__()
        self.stream, self.shown = stream, shown

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        shown = self.shown
        if shown.lines < SHOWN_LINES and shown.chars + len(text) <= SHOWN_CHARS:
            self.stream.write(text)
            shown.chars += len(text)
            shown.ended = text.endswith("\n") if text else shown.ended
        else:
            shown.hidden += text.count("\n")
            shown.hidden_chars += len(text)
        shown.lines += text.count("\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


class JobState:
    """One rank's settings as its world started them, and its capped output."""

    def __init__(self, rank: int) -> None:
        self.rank, self.settings, self.shown = rank, _settings(), Shown()
        self.functions = _functions()
        self.out = CappedOutput(sys.stdout, self.shown)
        self.err = CappedOutput(sys.stderr, self.shown)
        sys.stdout, sys.stderr = self.out, self.err  # type: ignore[assignment]

    def end_job(self, item: Dict[str, Any]) -> Dict[str, Any]:
        """``item`` (a job's result), with {"settings_left": ...} when the job changed a
        setting (an error's words start with it: it may be the error's cause); the settings
        put back, the output's count of hidden lines said and restarted."""
        exercise = item.get("exercise", "the job")
        shown = self.shown
        end = "" if shown.ended else "\n"  # the verdicts start on a line of their own
        if shown.hidden_chars:
            more = (f"{shown.hidden} more lines"
                    if shown.hidden else f"{shown.hidden_chars} more characters")
            self.out.stream.write(f"{end}(rank {self.rank}: {more} printed in {exercise}, not "
                                  f"shown)\n")
        elif end:
            self.out.stream.write(end)
        self.out.stream.flush()
        self.shown.__init__()  # type: ignore[misc]
        now = _settings()
        changed = [f"{k} at {now[k]} (it was {v})" for k, v in self.settings.items() if now[k] != v]
        for name, ours in (("stdout", self.out), ("stderr", self.err)):
            if getattr(sys, name) is not ours:  # replaced: its lines would go uncounted
                changed.append(f"sys.{name} replaced by {type(getattr(sys, name)).__name__}")
                setattr(sys, name, ours)
        _restore(self.settings)  # first: torch.set_default_dtype sets torch.Storage too
        changed += _put_back_functions(self.functions)
        # ``with torch.device(...)`` entered and never left is a mode set_default_device can't pop
        put_back = ("put back for them" if _settings() == self.settings else
                    "it could not be put back: the jobs after it may fail for it")
        if not changed or "lost" in item:
            return item
        left = (f"{exercise} left {' and '.join(changed)}: every job after it, the library's "
                f"too, would run with it ({put_back})")
        if "error" in item:
            return {**item, "error": f"{left}; then: {item['error']}"}
        return {**item, "settings_left": left}


_STATE: Optional[JobState] = None


def start(rank: int) -> None:
    """In a rank, before its first job."""
    global _STATE
    _STATE = JobState(rank)


def die_with_parent() -> None:
    """Linux: this rank ends when the process that started it does (a grader ended by a timeout
    or Ctrl-C leaves no rank spinning in a learner's endless loop); a rank whose grader ended
    while it imported torch ends at once."""
    try:  # prctl(PR_SET_PDEATHSIG, SIGKILL)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the grader's own kill at its limits stays
        return
    parent = multiprocessing.parent_process()
    if os.getppid() == 1 and parent is not None and parent.pid != 1:  # adopted: the grader is gone
        os._exit(1)


_ADOPTING: List[bool] = []  # the grader's command adopts; a test process that grades does not


def adopt_orphans() -> None:
    """Linux, in the grader: a process a rank forked (``os.fork``, ``multiprocessing``, even
    after ``setsid``) becomes the grader's child when its rank ends, not init's, so that
    ``end_orphans`` can end it (PR_SET_CHILD_SUBREAPER)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1)
        _ADOPTING.append(True)
    except (OSError, AttributeError):
        pass


def children() -> Set[int]:
    """This process's children (Linux: /proc; elsewhere none are found)."""
    found = set()
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return found
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
            found.add(pid)
    return found


# held while a world starts its ranks and while orphans are ended: --mutants runs worlds in
# threads, and a rank just forked must be known to multiprocessing before it can be told apart
STARTING = threading.Lock()


def end_orphans(before: Set[int]) -> List[int]:
    """End (SIGKILL, then reap) this process's children that are neither in ``before`` nor a
    rank multiprocessing started (this world's or another thread's): what ranks forked and left
    running (multiprocessing's resource tracker and forkserver stay: --mutants forks its ranks
    from a forkserver). The pids ended."""
    if not _ADOPTING:
        return []
    with STARTING:
        ranks = {p.pid for p in multiprocessing.active_children()}
        tracker = getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None)
        server = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
        ended = sorted(children() - before - ranks - {tracker, server})
        for pid in ended:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
    return ended


def end_job(item: Dict[str, Any]) -> Dict[str, Any]:
    """``JobState.end_job`` in a rank that ``start``-ed; ``item`` as it is elsewhere."""
    return _STATE.end_job(item) if _STATE is not None else item
