"""The multi-rank test harness: ``run_distributed(fn, world_size, *args, timeout=...)``.

It is ``scaletorch.dist.spawn``'s, the benchmarks' too, with the ranks forked from one
forkserver that imported torch and the library once per test run (``PRELOAD``), not started as
new Pythons that each import them again (spawn).
``value_error(fn)`` collects an error message inside a rank, for the parent to assert on;
``run_main(main, *argv)`` runs a script's ``main`` in the test's process;
``launch_forked(script, nproc, *args)`` runs a script on ``nproc`` ranks forked from the same
forkserver, as torchrun would start them but without three new Pythons;
``run_forked(script, *args)`` is ``subprocess.run([python, script, *args])`` forked from it.
``NCCL_CHECKS``: the environment of the scripts the tests launch (tests/test_examples.py, the
docs' ci runs).
``warning_lines(text)`` and ``stderr_warnings()``: what a run printed that a learner would
have to learn to ignore (the suite and the scripts print none).

Threads. Floats added in another order round differently, and a CPU kernel may split its sums
by thread, so the suite fixes the thread counts instead of taking the machine's core count:
the test process runs ``PROCESS_THREADS`` intra-op threads, each spawned rank and each
launched script ``RANK_THREADS`` (ranks share the cores). ``python run_tests.py --threads N``
sets both to N (through ``SCALETORCH_TEST_THREADS``). ``@bit_exact`` marks a test that compares
results bit for bit; ``python run_tests.py --bit-exact`` runs only those, and CI runs them at 1
and at 2 threads, so a comparison that holds by luck of the summation order shows up.
"""

import atexit
import gc
import io
import os
import re
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.multiprocessing as mp

from scaletorch.dist import spawn
from scaletorch.dist.spawn import free_port

__all__ = [
    "NCCL_CHECKS", "PROCESS_THREADS", "RANK_THREADS", "bit_exact", "free_port", "launch_forked",
    "run_distributed", "run_forked", "run_main", "stderr_warnings", "value_error", "warning_lines"
]

THREADS_VARIABLE = "SCALETORCH_TEST_THREADS"


def _threads() -> Tuple[int, int]:
    """(threads of the test process, threads of each rank): 2 and 1, or N and N when
    SCALETORCH_TEST_THREADS=N."""
    value = os.environ.get(THREADS_VARIABLE, "")
    if not value:
        return 2, 1
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{THREADS_VARIABLE}={value!r}: expected a whole number of threads >= 1")
    return int(value), int(value)


PROCESS_THREADS, RANK_THREADS = _threads()
torch.set_num_threads(PROCESS_THREADS)


def bit_exact(test: Callable) -> Callable:
    """Mark a test that compares two results bit for bit. Such a comparison is sound only when
    both sides run the same operations in the same order on the same machine (a resumed run
    against the uninterrupted one, a save and a load, replicas of one update), so CI runs these
    tests at two thread counts too (``run_tests.py --bit-exact --threads N``)."""
    test.bit_exact = True  # type: ignore[attr-defined]
    return test


def under_torchrun(test: Callable) -> Callable:
    """Mark a test whose ranks torchrun starts as new Pythons and then kills, restarts or
    signals: a kill and its restart, two launchers as two nodes, SIGTERM and Ctrl-C through
    the launcher, a raise that torchrun ends and reports. Each new rank spends about 5 s of a
    core importing torch before its first step, so ``python run_tests.py`` leaves them to
    ``python run_tests.py --torchrun``, a CI phase of their own; what they resume is proven in
    the suite's own worlds (InWorldResume, test_dcp, the stops of one process)."""
    test.under_torchrun = True  # type: ignore[attr-defined]
    return test


# Imported once, in the forkserver: a rank that imports them itself (spawn) spends about 3 s of a
# core on it (1.4 s for torch alone), 12 s of the two cores' time for a world of 8 ranks. The
# library imports PyTorch's DTensor, FSDP2, pipelining and DCP only where a run uses them, and
# torch's optimizers import torch._dynamo (0.8 s) when the first one is built: all named here.
PRELOAD = [
    "torch", "torch.distributed", "torch._dynamo", "torch.distributed.tensor",
    "torch.distributed.fsdp", "torch.distributed.pipelining", "torch.distributed.checkpoint",
    "scaletorch.parallel.parallelize", "scaletorch.parallel.native", "scaletorch.trainer",
    "scaletorch.trainer.dcp_async"
]
mp.get_context("forkserver").set_forkserver_preload(PRELOAD)


def freeze_imports() -> None:
    """In a process forked from the forkserver, at its start: the objects that exist then (torch
    and the library as the forkserver imported them, the test module) leave the cyclic garbage
    collector's view (``gc.freeze``); refcounting still frees them. Every ``gc.collect()`` after
    it (``destroy_pg_manager``'s before each run's groups go, the rank's last one) and every
    automatic full collection then scans only the run's own objects. A collect over torch's
    300,000 objects took 0.25 to 0.5 s of a core (at a load of 15-30), in every rank of every
    run that ends: after the freeze, under 0.01 s (doc/cpu_and_gloo.md). Only a cycle among
    those first objects, dropped later, stays in memory until the process exits."""
    gc.freeze()


def _with_threads(rank: int, world_size: int, threads: int, fn: Callable, *args: Any) -> Any:
    freeze_imports()
    torch.set_num_threads(threads)
    return fn(rank, world_size, *args)


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120) -> List[Any]:
    """``scaletorch.dist.spawn.run_distributed`` with the ranks forked from the forkserver, each
    running ``RANK_THREADS`` intra-op threads."""
    return spawn.run_distributed(_with_threads, world_size, RANK_THREADS, fn, *args,
                                 timeout=timeout, start_method="forkserver")


# Every script the tests launch runs in the test modes that make a GPU run's failures fail on
# gloo: NCCL's point-to-point order (dist/p2p_order.py), no host-made tensor in a collective
# (dist/device_check.py).
# Also the threads of a launched script: launch.sh sets OMP_NUM_THREADS=1 on a machine without a
# GPU; set here (RANK_THREADS) so that it does not start a Python to ask torch for every launch
# (it asks only when the variable is unset).
NCCL_CHECKS = {
    "SCALETORCH_P2P_ORDER": "nccl",
    "SCALETORCH_CHECK_DEVICES": "1",
    **({} if torch.cuda.is_available() else {
           "OMP_NUM_THREADS": str(RANK_THREADS)
       })
}

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script_rank(rank: int, nproc: int, port: int, script: str, argv: List[str],
                 env: Dict[str, str], output: str) -> None:
    """One rank of ``launch_forked``, in a process forked from the forkserver: torchrun's
    environment, the script as ``__main__``, its exit status as the process's."""
    freeze_imports()
    fd = os.open(output, os.O_WRONLY | os.O_APPEND)  # both ranks append, line by line
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(ROOT)
    os.environ.update({
        **env, "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port)
    })
    # torch.distributed read TORCH_DISTRIBUTED_DEBUG when the forkserver imported it: read again
    # from this rank's environment, as a new Python would (DETAIL's collective checks)
    torch.distributed.set_debug_level_from_env()
    torch.set_num_threads(RANK_THREADS)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script` does
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: B902 - reported as Python reports it, status 1
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # a forked process leaves with os._exit: the script's atexit work
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launch_forked_ranks(script: str, nproc: int, *args: str, env: Optional[Dict[str, str]] = None,
                        timeout: float = 300) -> Tuple[str, List[int]]:
    """``script args`` on ``nproc`` ranks (gloo, this host) forked from the forkserver, each
    with torchrun's variables (RANK, WORLD_SIZE, MASTER_PORT, ...), ``NCCL_CHECKS`` and
    ``env``: (what the ranks printed, interleaved; each rank's exit status, negative for the
    signal that ended it).

    The ranks run the same code as under ``scripts/launch.sh`` (whose own work, the pre-flight,
    the command line and torchrun's error report, tests/test_launch.py and
    tests/test_layout_errors.py check), without starting torchrun and ``nproc`` Pythons that
    import torch again (about 3 s of a core each). When a rank fails, the others are ended
    after 10 s, as torchrun ends them; after ``timeout`` s, all of them (AssertionError)."""
    ctx = mp.get_context("forkserver")
    port = free_port()
    with tempfile.NamedTemporaryFile("r", suffix=".out") as output:
        rank_env = {**NCCL_CHECKS, **(env or {})}
        procs = [
            ctx.Process(target=_script_rank,
                        args=(rank, nproc, port, script, list(args), rank_env, output.name))
            for rank in range(nproc)
        ]
        for proc in procs:
            proc.start()
        start, failed_at = time.time(), None
        while any(p.is_alive() for p in procs):
            now = time.time()
            if failed_at is None and any(p.exitcode for p in procs):
                failed_at = now
            if now - start > timeout or (failed_at is not None and now - failed_at > 10):
                for proc in procs:
                    if proc.is_alive():
                        os.kill(proc.pid, signal.SIGKILL)
                if now - start > timeout:
                    running = [r for r, p in enumerate(procs) if p.is_alive()]
                    for proc in procs:
                        proc.join()
                    # the ranks last: a log cut in the middle still shows which ones hung
                    raise AssertionError(f"{script} {' '.join(args)} on {nproc} forked ranks "
                                         f"did not finish in {timeout} s:\n"
                                         f"{output.read()[-3000:]}\n[harness] ranks still "
                                         f"running after {timeout} s: {running}")
            procs[0].join(0.05)
        for proc in procs:
            proc.join()
        return output.read(), [p.exitcode or 0 for p in procs]


def launch_forked(script: str, nproc: int, *args: str, env: Optional[Dict[str, str]] = None,
                  timeout: float = 300) -> Tuple[str, int]:
    """``launch_forked_ranks``: (what the ranks printed; the first non-zero status or 0)."""
    output, codes = launch_forked_ranks(script, nproc, *args, env=env, timeout=timeout)
    return output, next((c for c in codes if c), 0)


def describe_exit(rank: int, code: int) -> str:
    """``rank 1 exited -11 (SIGSEGV)``: a negative status is the signal that ended it."""
    name = f" ({signal.Signals(-code).name})" if code < 0 else ""
    return f"rank {rank} exited {code}{name}"


def value_error(fn: Callable[[], object]) -> str:
    """The message of the ValueError ``fn()`` raises, or "no error" (picklable, unlike the
    exception's traceback)."""
    try:
        fn()
    except ValueError as err:
        return str(err)
    return "no error"


def run_main(main: Callable[[Optional[List[str]]], int], *argv: str) -> Tuple[int, str, str]:
    """A script's ``main(argv)`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        status = main(list(argv))
    return status, out.getvalue(), err.getvalue()


# Python's warnings ("UserWarning: ..."), torch's C++ TORCH_WARN ("[W... reducer.cpp:1529]
# Warning: ..."), logging's "WARNING" records
WARNING = re.compile(r"warning", re.IGNORECASE)


def warning_lines(text: str) -> List[str]:
    """The lines of ``text`` that say warning."""
    return [line for line in text.splitlines() if WARNING.search(line)]


@contextmanager
def stderr_warnings() -> Iterator[List[str]]:
    """Inside a rank: the warning lines written to this process's stderr while the block runs,
    at the file descriptor (torch's C++ warnings bypass ``sys.stderr``); the list fills when
    the block ends. What the block writes to stderr is written on afterwards."""
    found: List[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield found
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode(errors="replace")
            sys.stderr.write(text)
            found.extend(warning_lines(text))


def _script_process(script: str, argv: List[str], env: Dict[str, str], cwd: str, stdout: str,
                    stderr: str) -> None:
    """The process of ``run_forked``, forked from the forkserver: what ``python script argv``
    would be at its first line, then the script as ``__main__`` and Python's own ending (an
    uncaught exception through ``sys.excepthook``, status 1; ``SystemExit``'s code)."""
    freeze_imports()
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()  # the test's environment now, not the forkserver's at its start
    os.environ.update(env)
    os.chdir(cwd)
    # a fresh Python's handlers: Ctrl-C raises KeyboardInterrupt, SIGTERM ends the process,
    # SIGPIPE is ignored (a closed pipe is an OSError)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    if env.get("OMP_NUM_THREADS", "").isdigit():  # torch read it at its import, in the server
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [script, *argv]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script` does
    sys.excepthook = sys.__excepthook__
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
    except BaseException as err:  # noqa: B902 - reported as Python reports it, status 1
        tb = err.__traceback__  # from the script's first frame on, without this function's
        while tb is not None and tb.tb_frame.f_code.co_filename != script:
            tb = tb.tb_next
        err.__traceback__ = tb or err.__traceback__  # Python prints the exception's own
        sys.excepthook(type(err), err, err.__traceback__)  # the script's hook, if it set one
        code = 1
    atexit._run_exitfuncs()  # a forked process leaves with os._exit: the script's atexit work
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def start_forked(script: str, *args: str, stdout: str, stderr: str, env: Dict[str, str],
                 cwd: str = ROOT) -> Any:
    """``python script args`` in ``cwd``, its stdout and stderr opened at the paths ``stdout``
    and ``stderr`` (a file, a FIFO the caller reads, /dev/full): ``run_forked``'s process,
    started and returned without waiting for it (a test that signals it, or reads as it
    writes)."""
    proc = mp.get_context("forkserver").Process(target=_script_process,
                                                args=(script, list(args), env, cwd, stdout, stderr))
    proc.start()
    return proc


def run_forked(script: str, *args: str, env: Optional[Dict[str, str]] = None,
               cwd: Optional[str] = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
    cwd=cwd or ROOT, env=env or os.environ)``, in one process forked from the forkserver
    instead of a new Python that imports torch and the library again (about 3 s of a core):
    the same CompletedProcess (stdout, stderr, exit status: ``SystemExit``'s code, 1 with the
    traceback for an uncaught exception, -N when killed by signal N).

    Where it differs from a fresh Python: the modules of ``PRELOAD`` were imported in the
    forkserver, so what they read from the environment at import (torch's OMP_NUM_THREADS,
    set again here when ``env`` gives it; TORCH_* variables read at import) comes from the
    suite's environment; everything read at run time (every SCALETORCH_* variable, RANK, the
    config) sees ``env``. The forkserver never starts a process group, and the process gets
    a fresh Python's signal handlers (SIGINT, SIGTERM, SIGPIPE), ``sys.argv``, ``sys.path[0]``
    (the script's folder) and working directory. stdin is /dev/null. After ``timeout`` s the
    process is killed (AssertionError)."""
    with tempfile.NamedTemporaryFile("r", suffix=".out") as out, \
            tempfile.NamedTemporaryFile("r", suffix=".err") as err:
        proc = start_forked(script, *args, stdout=out.name, stderr=err.name,
                            env=dict(os.environ if env is None else env), cwd=cwd or ROOT)
        proc.join(timeout)
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()
            raise AssertionError(f"{script} {' '.join(args)} (forked) did not finish in "
                                 f"{timeout} s:\n{out.read()[-2000:]}{err.read()[-2000:]}")
        return subprocess.CompletedProcess([sys.executable, script, *args], proc.exitcode,
                                           out.read(), err.read())
