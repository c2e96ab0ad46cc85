"""The multi-rank test harness: ``run_distributed(fn, world_size, *args, timeout=...)``.

It is ``scaletorch.dist.spawn``'s, the benchmarks' too, with the ranks forked from one
forkserver that imported torch and the library once per test run (``PRELOAD``), not started as
new Pythons that each import them again (spawn).
``value_error(fn)`` collects an error message inside a rank, for the parent to assert on;
``run_main(main, *argv)`` runs a script's ``main`` in the test's process. ``NCCL_CHECKS``:
the environment of the scripts the tests launch (tests/test_examples.py, the docs' ci runs).
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

import io
import os
import re
import sys
import tempfile
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch
import torch.multiprocessing as mp

from scaletorch.dist import spawn
from scaletorch.dist.spawn import free_port

__all__ = [
    "NCCL_CHECKS", "PROCESS_THREADS", "RANK_THREADS", "bit_exact", "free_port", "run_distributed",
    "run_main", "stderr_warnings", "value_error", "warning_lines"
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


def _with_threads(rank: int, world_size: int, threads: int, fn: Callable, *args: Any) -> Any:
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
