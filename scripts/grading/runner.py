"""What every chapter's grading shares: the learner's functions, the patch, the world, a hang.

A function to grade is named by its ``Source``, (file or module, attribute), so that each spawned
rank loads it itself: ``examples/exercises/01_ddp.py`` is a file (its name starts with a digit,
no import reaches it), a planted variant is a module of the tests. ``run_world`` starts the
ranks with a short collective timeout (``COLLECTIVE_TIMEOUT``) and torch's flight recorder, and
grades every job on its own: each rank writes each job's result as it finishes it
(``streamed``), so a rank that hangs (no result for ``STALL_LIMIT`` s, whatever timeout the
backend would wait out), dies (a segfault: faulthandler writes its Python stack; a SIGKILL
leaves none: the job's function is named), ends its process (``os._exit``: the rank writes
where first) or raises (``sys.exit()`` too) costs only the job it was in. That job's verdict
names the rank, what stopped it and the learner's frame it was in (and, for a collective that
timed out, the flight recorder's account of the ranks and their collectives,
scaletorch/dist/flight_recorder.py); a new world grades the jobs after it.
"""

import datetime
import faulthandler
import gc
import importlib
import importlib.util
import os
import re
import signal
import tempfile
import time
import traceback
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scaletorch.dist import flight_recorder
from scaletorch.dist.spawn import free_port

Source = Tuple[str, str]  # (a .py file or a module name, the function's name in it)
# seconds a collective waits (every group of the world): a world of tiny ranks never waits this
# long unless hung; below STALL_LIMIT, so that a hung rank dumps its flight recorder first
COLLECTIVE_TIMEOUT = 25.0
# seconds the parent waits while no rank finishes a job and the ranks together use less than
# CPU_PROGRESS s of CPU (they wait, not work: a loaded machine only slows them) before it stops
# the world, whatever timeout the backend would wait out (gloo's receives wait 120 s)
STALL_LIMIT = 30.0
CPU_PROGRESS = 1.0
JOB_LIMIT = 300.0  # seconds of a job however busy its ranks (a learner's endless loop)
STARTUP_LIMIT = 600.0  # seconds for the ranks to start (import torch, meet) on a loaded machine
GRACE = 3.0  # seconds the other ranks get to finish a job once one rank has left early
SOURCE_FILES: Set[str] = set()  # inside a rank: the files of the functions graded
# How the ranks start: new Pythons (spawn); the test suite forks them from its forkserver, which
# imported torch and the library once (tests/harness.py)
START_METHOD = "spawn"
UNWRITTEN = "NotImplementedError"
# What a learner's function may raise, each a verdict of its job: sys.exit() and exit() raise
# SystemExit, which ``except Exception`` lets through to end the rank with no word of it
LEARNER_ERRORS = (Exception, SystemExit, KeyboardInterrupt)
# (module, name) of each limit the ranks read: a world sends them the parent's values, which a
# rank would not see otherwise (a new Python, or one forked from a server that imported the
# modules earlier). A chapter's module adds its own (pipeline.py's HANG_TIMEOUT); the test
# suite shortens them for its hang tests.
RANK_LIMITS: List[Tuple[str, str]] = [(__name__, "COLLECTIVE_TIMEOUT")]


@dataclass
class Verdict:
    """One exercise's grade: ``passed``, and the line the learner reads."""
    exercise: str
    passed: bool
    text: str

    def line(self) -> str:
        return f"{self.exercise:22s} {self.text}"


def load(source: Source) -> Callable:
    """The function ``source`` names: from a file by its path, or from an importable module."""
    where, name = source
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"exercise_{abs(hash(where))}", where)
        if spec is None or spec.loader is None:
            raise ValueError(f"cannot load {where!r}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


@contextmanager
def patched(patches: Sequence[Tuple[object, str, object]]) -> Iterator[None]:
    """Set each (owner, attribute, value) for the block, then put the old values back."""
    with ExitStack() as stack:
        for owner, attr, value in patches:
            old = getattr(owner, attr)
            setattr(owner, attr, value)
            stack.callback(setattr, owner, attr, old)
        yield


def _chain(err: BaseException) -> List[BaseException]:
    """``err`` and what caused it (the Trainer re-raises a step's error as a RuntimeError)."""
    out: List[BaseException] = []
    while err is not None and err not in out:
        out.append(err)
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    return out


def innermost(err: BaseException) -> BaseException:
    """The first error of ``err``'s chain: the one raised where it went wrong."""
    return _chain(err)[-1]


def caused_by(err: BaseException, kind: type) -> Optional[BaseException]:
    """The first error of type ``kind`` in ``err``'s chain, or None."""
    return next((e for e in _chain(err) if isinstance(e, kind)), None)


def is_unwritten(err: BaseException) -> bool:
    return any(isinstance(e, NotImplementedError) for e in _chain(err))


def is_hang(err: BaseException) -> bool:
    """A collective that timed out, or whose peer left: the world cannot go on."""
    return not is_unwritten(err) and any(
        isinstance(e, dist.DistError) or re.search(r"imed out|peer|gloo", str(e)) is not None
        for e in _chain(err))


def failure(err: BaseException) -> str:
    """What a job's error was, for the parent: "NotImplementedError" for an unwritten stub,
    else the first exception's type, message and the line of the exercise that raised it."""
    if is_unwritten(err):
        return UNWRITTEN
    first = _chain(err)[-1]
    frames = traceback.extract_tb(first.__traceback__)
    mine = [f for f in frames if os.path.abspath(f.filename) in SOURCE_FILES]
    where = (mine or frames)[-1]
    line = f": {where.line}" if where.line else ""
    said = f"{type(first).__name__}: {first}" if str(first) else type(first).__name__
    return f"{said} (at {os.path.basename(where.filename)}:{where.lineno}{line})"


class Streamed(list):
    """A rank's results, each written to the world's directory as it is appended, so that the
    parent keeps every job a rank finished even if the rank dies or hangs in the next one."""

    def __init__(self, directory: str, rank: int) -> None:
        super().__init__()
        self.directory, self.rank = directory, rank

    def append(self, item: Any) -> None:
        super().append(item)
        path = os.path.join(self.directory, f"result_{self.rank}_{len(self) - 1}")
        torch.save(item, path + ".tmp")
        os.replace(path + ".tmp", path)  # the parent never reads half a file


_STREAM: Optional[Streamed] = None


def streamed() -> List[Any]:
    """Inside a rank: the list each chapter's ``rank_jobs`` appends its results to (one per
    job, in order); outside ``run_world`` a plain list."""
    return _STREAM if _STREAM is not None else []


def rank_limits() -> Dict[Tuple[str, str], float]:
    """{(module, name): value} of ``RANK_LIMITS`` in this process: what a world's ranks set."""
    return {(m, n): getattr(importlib.import_module(m), n) for m, n in RANK_LIMITS}


def _worker(rank: int, world: int, port: int, fn: Callable, jobs: Sequence[Dict[str, Source]],
            directory: str, limits: Dict[Tuple[str, str], float]) -> None:
    """One rank: the parent's ``limits`` set, gloo with the grader's timeout, faulthandler
    writing the Python stack on a crash (SIGSEGV, SIGABRT) and on SIGUSR1 (the parent's "where
    are you?" before it stops a hung rank), then ``fn(rank, world, jobs)`` streaming its
    results."""
    global _STREAM
    for (module, name), value in limits.items():
        setattr(importlib.import_module(module), name, value)
    os.environ.update({
        flight_recorder.BUFFER_ENV: os.environ.get(flight_recorder.BUFFER_ENV, "2000"),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port)
    })
    torch.set_num_threads(1)  # the ranks share the cores
    stack = open(os.path.join(directory, f"stack_{rank}"), "w")  # noqa: SIM115 - to exit
    faulthandler.enable(stack)
    faulthandler.register(signal.SIGUSR1, stack, all_threads=False)
    SOURCE_FILES.update(source_file(s) for job in jobs for s in job.values())
    _STREAM = Streamed(directory, rank)
    exit_now = os._exit

    def ended(code: int) -> None:  # a learner's os._exit: say where, then end as asked
        with open(os.path.join(directory, f"ended_{rank}"), "w") as f:
            f.write(f"os._exit({code})\n" + "".join(traceback.format_stack()[:-1]))
        exit_now(code)

    os._exit = ended
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=collective_timeout()))
        open(os.path.join(directory, f"ready_{rank}"), "w").close()  # the stall clock starts
        fn(rank, world, jobs)
    except LEARNER_ERRORS as err:  # a hang, or the grader's own error: for the parent
        if is_hang(err):
            flight_recorder.dump(directory, rank)
            # the backend's own words (plain() translates them): the Trainer's wrapper names
            # the last collective of comm's ledger, which a torch.distributed call never reached
            err = innermost(err)
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        with open(os.path.join(directory, f"stopped_{rank}"), "w") as f:
            f.write(("hang: " if is_hang(err) else "error: ") + text + "\n" +
                    traceback.format_exc())
    finally:
        os._exit = exit_now  # multiprocessing ends the rank with it
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def collective_timeout() -> float:
    """Seconds a rank's collectives wait: ``COLLECTIVE_TIMEOUT`` as the parent set it."""
    return COLLECTIVE_TIMEOUT


def source_file(source: Source) -> str:
    """The file that holds ``source``'s function: a learner's .py, or a module's file."""
    where = source[0]
    if where.endswith(".py"):
        return os.path.abspath(where)
    spec = importlib.util.find_spec(where)
    return os.path.abspath(spec.origin) if spec is not None and spec.origin else where


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


def _cpu_seconds(pid: Optional[int]) -> float:
    """The CPU time process ``pid`` has used (Linux /proc; 0 elsewhere): a rank that waits in a
    collective uses none, a rank slowed by a loaded machine still adds some."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _count(directory: str, rank: int) -> int:
    n = 0
    while os.path.exists(os.path.join(directory, f"result_{rank}_{n}")):
        n += 1
    return n


def _read(directory: str, name: str) -> str:
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read()


def _one_world(fn: Callable, world: int, jobs: Sequence[Dict[str, Source]], lead: int,
               directory: str) -> Tuple[List[List[Any]], Dict[int, str]]:
    """One world over ``jobs``: (each rank's results, the ranks that did not finish the first
    unfinished job: rank -> what stopped it). The parent waits at most ``STALL_LIMIT`` s for a
    rank to add a result, and ``GRACE`` s for the others once one rank has left early."""
    ctx: Any = mp.get_context(START_METHOD)
    port, limits = free_port(), rank_limits()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, fn, list(jobs), directory, limits),
                    daemon=True) for r in range(world)
    ]
    for proc in procs:
        proc.start()
    total = lead + len(jobs)
    counts, progress, left, signalled = [0] * world, time.monotonic(), None, False
    started, spent = time.monotonic(), 0.0
    finished = started  # when a rank last finished a job
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        ready = [os.path.exists(os.path.join(directory, f"ready_{r}")) for r in range(world)]
        if not all(ready) and now - started < STARTUP_LIMIT:
            progress = finished = now  # a rank still importing torch (a new Python) is not stalled
        fresh = [_count(directory, r) for r in range(world)]
        cpu = sum(_cpu_seconds(p.pid) for p in procs if p.is_alive())
        spent = min(spent, cpu)  # a rank that left takes its CPU time with it
        if fresh != counts:
            counts, progress, finished = fresh, now, now
        elif cpu > spent + CPU_PROGRESS:
            progress, spent = now, cpu
        if min(counts) >= total:
            break  # every job done: a rank may still be tearing its groups down
        early = [
            r for r, p in enumerate(procs)
            if (not p.is_alive() and counts[r] < total) or _read(directory, f"stopped_{r}")
        ]
        if early and left is None:
            left = now
        stalled = now - progress > STALL_LIMIT or now - finished > JOB_LIMIT
        if (left is not None and now - left > GRACE) or stalled:
            signalled = stalled
            for r, proc in enumerate(procs):  # where each is: faulthandler writes its stack
                if ready[r] and proc.is_alive() and proc.pid is not None:
                    os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(0.5)
            break
        time.sleep(0.05)
    deadline = time.monotonic() + 5  # seconds for the ranks to leave by themselves
    killed = set()  # the ranks this parent ended: a SIGKILL of another's is the rank's own
    for r, proc in enumerate(procs):
        proc.join(max(0.0, deadline - time.monotonic()) if min(counts) >= total else 0)
        if proc.is_alive():
            proc.kill()
            killed.add(r)
        proc.join(5)
    counts = [_count(directory, r) for r in range(world)]
    results = [[
        torch.load(os.path.join(directory, f"result_{r}_{i}"), weights_only=True)
        for i in range(counts[r])
    ] for r in range(world)]
    first = min(counts)
    # a rank whose last result is an error (not a stub's) has left its jobs (run_jobs stops
    # there): one the parent stopped while it tore its groups down (on a loaded machine, more
    # than GRACE s after the first rank left) lost no job either
    left_jobs = [
        first > lead and "error" in results[r][first - 1]
        and not _read(directory, f"stopped_{r}") + _read(directory, f"ended_{r}")
        and (proc.exitcode == 0 or r in killed and results[r][first - 1]["error"] != UNWRITTEN)
        for r, proc in enumerate(procs)
    ]
    raised = all(left_jobs)
    if first >= total or raised:  # done, or every rank left after a job raised: no one to blame
        return results, {}
    files = [source_file(s) for job in jobs for s in job.values()]
    exercise = next(iter(jobs[first - lead])) if first >= lead else "the reference run"
    # the function the job ran, named where no Python frame is left to say (a SIGKILL)
    unknown = "{} ({}, no Python stack)".format(
        *((jobs[first - lead][exercise][1],
           os.path.basename(files[first - lead])) if first >= lead else ("the reference run",
                                                                         "the library")))
    dumps = [d for d in os.listdir(directory) if d.startswith(flight_recorder.PREFIX)]
    recorder = flight_recorder.analyze(flight_recorder.load(directory)) if dumps else []
    stopped: Dict[int, str] = {}
    for r, proc in enumerate(procs):
        if counts[r] > first:
            continue
        where = where_stopped(_read(directory, f"stack_{r}"), files, exercise, unknown=unknown)
        said, ended = _read(directory, f"stopped_{r}"), _read(directory, f"ended_{r}")
        code = proc.exitcode if proc.exitcode is not None else 0
        if ended:
            where = where_stopped(ended, files, exercise, recent_first=False, unknown=unknown)
            text = f"rank {r} ended its process with {ended.splitlines()[0]} in {where}"
        elif said:
            where = where_stopped(said, files, exercise, recent_first=False)
            message = plain(said.splitlines()[0].split(": ", 1)[-1])
        if ended:
            pass
        elif said.startswith("hang: "):
            text = f"rank {r} stopped in {where}, in a collective: {message}"
        elif said:
            text = f"rank {r} failed in {where}: {message}"
        elif code < 0 and -code != signal.SIGUSR1 and r not in killed:
            text = f"rank {r} died of {signal.Signals(-code).name} in {where}"
        elif signalled:
            text = (f"rank {r} made no progress (the grader's limit: {STALL_LIMIT:.0f} s waiting, "
                    f"{JOB_LIMIT:.0f} s a job), stopped in {where}")
        elif r in killed:
            text = f"rank {r} was stopped in {where}, after another rank had left"
        else:
            text = f"rank {r} ended with exit status {code}, without a result, in {where}"
        stopped[r] = text
    if recorder and stopped:  # once, after the first rank's line
        first_rank = min(stopped, key=lambda r: _rank_order(stopped[r], r))
        stopped[first_rank] += "; the flight recorder says\n    " + "\n    ".join(recorder)
        # no rank died, ended or raised: a hang, headed by the collective some ranks never met
        if all(_rank_order(t, r)[0] >= 3 for r, t in stopped.items()):
            head = _hang_head(flight_recorder.load(directory), files, exercise)
            if head:
                stopped[first_rank] = f"{head}; {stopped[first_rank]}"
    return results, stopped


def _hang_head(traces: Dict[int, dict], files: Sequence[str], exercise: str = "") -> Optional[str]:
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


def _rank_order(text: str, rank: int) -> Tuple[int, int]:
    """Which rank's account comes first: one that died, ended or failed, then one that hung
    (its wait timed out), then the ranks stopped because of it (their peer left)."""
    causes = ("died of", "ended its process", "failed in", "made no progress", "no peer answered",
              "in a collective")  # a peer that left is the last
    return next((k for k, c in enumerate(causes) if c in text), len(causes)), rank


def run_world(fn: Callable, world: int, jobs: Sequence[Dict[str, Source]],
              lead: int = 0) -> List[List[Any]]:
    """``fn(rank, world, jobs)`` on ``world`` gloo ranks, each appending its results (``lead``
    of its own, then one per job) to ``streamed()``: every rank's ``lead + len(jobs)`` results.

    Each job is graded on its own: when a rank hangs (no new result for ``STALL_LIMIT`` s, or a
    collective timed out), dies (a segfault) or leaves early (an error), the job it was in gets
    {"exercise", "lost": what stopped which rank, where} on the ranks without a result, and a
    new world grades the jobs after it."""
    out: List[List[Any]] = [[] for _ in range(world)]
    start = 0
    while start < len(jobs):
        with tempfile.TemporaryDirectory() as directory:
            results, stopped = _one_world(fn, world, jobs[start:], lead, directory)
        skip = 0 if start == 0 else lead  # a restarted world's own reference is dropped
        first = min(len(r) for r in results)
        for r in range(world):
            out[r].extend(results[r][skip:first])
        if not stopped:  # every job done, or the ranks left after one raised: a new world
            start += first - lead
            continue
        text = "; ".join(stopped[r]
                         for r in sorted(stopped, key=lambda r: _rank_order(stopped[r], r)))
        if first < lead:  # the reference run itself: nothing can be graded
            for r in range(world):
                out[r].extend({
                    "exercise": "the reference run",
                    "lost": text
                } for _ in range(lead - first + len(jobs) - start))
            break
        exercise = next(iter(jobs[start + first - lead]))
        for r in range(world):
            out[r].append(results[r][first] if len(results[r]) > first else {
                "exercise": exercise,
                "lost": text
            })
        start += first - lead + 1
    return out


def run_jobs(jobs: Sequence[Dict[str, Source]],
             measure: Callable[[str, Source], Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Inside a rank: ``measure(exercise, source)`` of each job in turn, as {"exercise": ...,
    **measured}; a learner's error becomes {"exercise", "error": failure(err)}, and any error
    but an unwritten stub ends the jobs (the ranks may now disagree on the collectives to
    come). A hang is raised: the world cannot go on (``run_world`` reports it)."""
    out = streamed()
    for job in jobs:
        (exercise, source), = job.items()
        try:
            out.append({"exercise": exercise, **measure(exercise, source)})
        except LEARNER_ERRORS as err:  # a diagnosis, sys.exit() too
            if is_hang(err):
                raise
            out.append({"exercise": exercise, "error": failure(err)})
            if not is_unwritten(err):
                break
    return out


def cloned(args: Sequence[Any]) -> Tuple[Any, ...]:
    """``args`` with each tensor cloned (in the autograd graph still, gradients flow back to
    the original): the function under test gets inputs of its own, so in-place work on them,
    wherever the contract allows it, cannot change what the library's call reads."""
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a)


def error_verdict(exercise: str, runs: List[dict]) -> Optional[Verdict]:
    """The verdict of a job that raised on some rank: "write <function> next" for a stub, else
    the error and where; None if every rank finished it."""
    errors = [(r, run["error"]) for r, run in enumerate(runs) if "error" in run]
    if any(e == UNWRITTEN for _, e in errors):
        return Verdict(exercise, False, f"write {exercise} next")
    if errors:
        rank, error = errors[0]
        return Verdict(exercise, False, f"{exercise} raised on rank {rank}: {error}")
    lost = [run["lost"] for run in runs if "lost" in run]
    if lost:
        return Verdict(exercise, False, f"{exercise}: {lost[0]}")
    return None


def per_job(jobs: Sequence[Dict[str, Source]], results: List[List[Any]],
            verdict: Callable[[str, List[Dict[str, Any]]], Verdict]) -> List[Verdict]:
    """Each job's verdict from every rank's result of it (``run_world``'s): its error or what
    stopped it, else ``verdict(exercise, runs)``."""
    verdicts = []
    for i, job in enumerate(jobs):
        (exercise, _), = job.items()
        runs = [r[i] for r in results]
        verdicts.append(error_verdict(exercise, runs) or verdict(exercise, runs))
    return verdicts


def found_verdict(exercise: str, runs: List[Dict[str, Any]]) -> Verdict:
    """"passed" if no rank found a call that differed from the library's, else the first."""
    failed = error_verdict(exercise, runs)
    if failed is not None:
        return failed
    texts = [t for run in runs for t in run["found"]]
    return Verdict(exercise, not texts, texts[0] if texts else "passed")


def grade_found(rank_jobs: Callable, world: int, jobs: List[Dict[str, Source]]) -> List[Verdict]:
    """Every job graded in one world of ``world`` ranks, by ``rank_jobs`` whose measure returns
    {"found": the diagnoses of the calls that differed from the library's} (05 and 03 grade so)."""
    return per_job(jobs, run_world(rank_jobs, world, jobs), found_verdict)
