"""The world every chapter's grading runs in: its ranks, its limits, each job graded on its own.

``run_world`` starts the ranks with a short collective timeout (``COLLECTIVE_TIMEOUT``) and
torch's flight recorder, and grades every job on its own: each rank writes each job's result as
it finishes it (``streamed``), so a rank that hangs (no result for ``STALL_LIMIT`` s, whatever
timeout the backend would wait out), computes without end (``JOB_CPU_LIMIT`` s of CPU), dies
(a segfault: faulthandler writes its Python stack; a SIGKILL leaves none: the job's function is
named), ends its process (``os._exit``: the rank writes where first) or raises (``sys.exit()``
too) costs only the job it was in. That job's
verdict names the rank, what stopped it and the learner's frame it was in, the cause first (a
rank that died, computed without end, or stood outside any collective while the others timed out
waiting for it), the others' waits after it (stop_reports.account; else, for a collective that
timed out, the flight recorder's account of the ranks and their collectives,
scaletorch/dist/flight_recorder.py); a new world grades the jobs after it. The learner's
functions and their errors are learner.py's; a job's verdict from its results, verdicts.py's;
what a job leaves in its rank (torch's settings, its printed lines), job_state.py's.
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
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scaletorch.dist import flight_recorder
from scaletorch.dist.spawn import free_port
from scripts.grading.job_state import STARTING, children, die_with_parent, end_job, end_orphans
from scripts.grading.job_state import start as start_jobs
from scripts.grading.learner import (LEARNER_ERRORS, SOURCE_FILES, UNWRITTEN, Source, carried,
                                     failure, innermost, is_hang, is_unwritten, source_file)
from scripts.grading.stop_reports import Stop, account, plain, rank_order, where_stopped

# seconds a collective waits (every group of the world): a world of tiny ranks never waits this
# long unless hung; below STALL_LIMIT, so that a hung rank dumps its flight recorder first
COLLECTIVE_TIMEOUT = 25.0
# seconds the parent waits while no rank finishes a job and the ranks together use less than
# CPU_PROGRESS s of CPU (they wait, not work: a loaded machine only slows them) before it stops
# the world, whatever timeout the backend would wait out (gloo's receives wait 120 s)
STALL_LIMIT = 30.0
CPU_PROGRESS = 1.0
JOB_LIMIT = 300.0  # seconds of a job however busy its ranks
# seconds of CPU one rank may spend in one of the learner's jobs: a loop that never ends is
# stopped after it, at any load, where the wall clock's JOB_LIMIT would wait minutes. The
# library's heaviest job took 3.6 s of a rank's CPU here (chapter 01, idle); a loaded machine's
# shared caches slow a rank's work too, hence the margin
JOB_CPU_LIMIT = 20.0
STARTUP_LIMIT = 600.0  # seconds for the ranks to start (import torch, meet) on a loaded machine
GRACE = 3.0  # seconds the other ranks get to finish a job once one rank has left early
# How the ranks start: new Pythons (spawn); the test suite forks them from its forkserver, which
# imported torch and the library once (tests/harness.py)
START_METHOD = "spawn"
# (module, name) of each limit the ranks read: a world sends them the parent's values, which a
# rank would not see otherwise (a new Python, or one forked from a server that imported the
# modules earlier). A chapter's module adds its own (pipeline.py's HANG_TIMEOUT); the test
# suite shortens them for its hang tests.
RANK_LIMITS: List[Tuple[str, str]] = [(__name__, "COLLECTIVE_TIMEOUT")]


class Streamed(list):
    """A rank's results, each written to the world's directory as it is appended, so that the
    parent keeps every job a rank finished even if the rank dies or hangs in the next one."""

    def __init__(self, directory: str, rank: int) -> None:
        super().__init__()
        self.directory, self.rank = directory, rank

    def append(self, item: Any) -> None:
        item = end_job(item)  # torch's settings put back for the next job (job_state.py)
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
    die_with_parent()
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
    start_jobs(rank)  # a job's printed lines capped, its settings put back after it
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
    before = children()
    # the ranks ignore Ctrl-C (the grader's own ends them): a spawned Python keeps SIG_IGN
    # through exec and does not install its handler, so no rank prints a KeyboardInterrupt
    # (only the main thread may set a handler: --mutants grades worlds in threads)
    main = threading.current_thread() is threading.main_thread()
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        with STARTING:  # each rank known to multiprocessing before any world ends orphans
            for proc in procs:
                proc.start()
    finally:
        if main:
            signal.signal(signal.SIGINT, handler)
    total = lead + len(jobs)
    counts, progress, left, signalled = [0] * world, time.monotonic(), None, False
    started, spent = time.monotonic(), 0.0
    finished = started  # when a rank last finished a job
    job_cpu = [0.0] * world  # each rank's CPU when it last finished a job
    busy: List[int] = []  # ranks past JOB_CPU_LIMIT in one of the learner's jobs
    spent_in_job = [0.0] * world
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        ready = [os.path.exists(os.path.join(directory, f"ready_{r}")) for r in range(world)]
        if not all(ready) and now - started < STARTUP_LIMIT:
            progress = finished = now  # a rank still importing torch (a new Python) is not stalled
        fresh = [_count(directory, r) for r in range(world)]
        cpu = sum(_cpu_seconds(p.pid) for p in procs if p.is_alive())
        spent = min(spent, cpu)  # a rank that left takes its CPU time with it
        each = [_cpu_seconds(p.pid) for p in procs]
        for r in range(world):  # a rank's job clock starts when it is ready or ends a job
            if not ready[r] or fresh[r] != counts[r] or not job_cpu[r]:
                job_cpu[r] = each[r]
        spent_in_job = [max(0.0, c - j) for c, j in zip(each, job_cpu)]
        busy = [
            r for r in range(world)
            if procs[r].is_alive() and fresh[r] >= lead and spent_in_job[r] > JOB_CPU_LIMIT
        ]
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
        stalled = now - progress > STALL_LIMIT or now - finished > JOB_LIMIT or bool(busy)
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
    end_orphans(before | {p.pid for p in procs if p.pid is not None})  # what the ranks forked
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
    stops: Dict[int, Stop] = {}
    for r, proc in enumerate(procs):
        if counts[r] > first:
            continue
        stack = _read(directory, f"stack_{r}")
        where = where_stopped(stack, files, exercise, unknown=unknown)
        said, ended = _read(directory, f"stopped_{r}"), _read(directory, f"ended_{r}")
        code = proc.exitcode if proc.exitcode is not None else 0
        if ended:
            where = where_stopped(ended, files, exercise, recent_first=False, unknown=unknown)
            stop = Stop(f"rank {r} ended its process with {ended.splitlines()[0]} in {where}",
                        "ended", where)
        elif said:
            where = where_stopped(said, files, exercise, recent_first=False)
            message = plain(said.splitlines()[0].split(": ", 1)[-1])
            waited = re.search("imed out|timeout", said.splitlines()[0])  # not a peer that left
            stop = Stop(f"rank {r} stopped in {where}, in a collective: {message}",
                        "timed out" if waited else "hang", where) if said.startswith("hang: ") \
                else Stop(f"rank {r} failed in {where}: {message}", "failed", where)
        elif code < 0 and -code != signal.SIGUSR1 and r not in killed:
            stop = Stop(f"rank {r} died of {signal.Signals(-code).name} in {where}", "died", where)
        elif signalled and busy and spent_in_job[r] > JOB_CPU_LIMIT / 2:  # not a waiting rank
            stop = Stop(
                f"rank {r} was still computing in {where} after {spent_in_job[r]:.0f} s of CPU "
                f"in this job (the grader's limit: {JOB_CPU_LIMIT:.0f} s on any rank): a loop "
                f"that never ends?", "computing", where)
        elif signalled:
            stop = Stop(
                f"rank {r} made no progress (the grader's limit: {STALL_LIMIT:.0f} s waiting, "
                f"{JOB_LIMIT:.0f} s a job), stopped in {where}", "no progress", where, stack,
                spent_in_job[r])
        elif r in killed:
            stop = Stop(f"rank {r} was stopped in {where}, after another rank had left", "stopped",
                        where, stack, spent_in_job[r])
        else:
            stop = Stop(f"rank {r} ended with exit status {code}, without a result, in {where}",
                        "exit", where)
        stops[r] = stop
    # the cause first, the others' waits after it (stop_reports.py)
    return results, account(stops,
                            flight_recorder.load(directory) if dumps else {}, files, exercise)


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
                         for r in sorted(stopped, key=lambda r: rank_order(stopped[r], r)))
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
    come); an error's ``result`` (a dict, learner.carried) joins its job's result. A hang is
    raised: the world cannot go on (``run_world`` reports it)."""
    out = streamed()
    for job in jobs:
        (exercise, source), = job.items()
        try:
            out.append({"exercise": exercise, **measure(exercise, source)})
        except LEARNER_ERRORS as err:  # a diagnosis, sys.exit() too
            if is_hang(err):
                raise
            # what the chapter measured before the error (an error's ``result`` dict), with it
            out.append({"exercise": exercise, "error": failure(err), **carried(err)})
            if not is_unwritten(err):
                break
    return out
