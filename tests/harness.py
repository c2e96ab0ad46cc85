"""The multi-rank test harness: ``run_distributed(fn, world_size, *args, timeout=...)``.

It is ``scaletorch.dist.spawn``'s, the benchmarks' too, with the ranks forked from one
forkserver that imported torch and the library once per test run (``PRELOAD``), not started as
new Pythons that each import them again (spawn).
``value_error(fn)`` collects an error message inside a rank, for the parent to assert on;
``run_main(main, *argv)`` runs a script's ``main`` in the test's process. ``NCCL_CHECKS``:
the environment of the scripts the tests launch (tests/test_examples.py, the docs' ci runs).
``warning_lines(text)`` and ``stderr_warnings()``: what a run printed that a learner would
have to learn to ignore (the suite and the scripts print none).
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
    "NCCL_CHECKS", "free_port", "run_distributed", "run_main", "stderr_warnings", "value_error",
    "warning_lines"
]

# Imported once, in the forkserver: a rank that imports them itself (spawn) spends about 3 s of a
# core on it (1.4 s for torch alone), 12 s of the two cores' time for a world of 8 ranks.
PRELOAD = ["torch", "torch.distributed", "scaletorch.parallel.parallelize", "scaletorch.trainer"]
mp.get_context("forkserver").set_forkserver_preload(PRELOAD)


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120) -> List[Any]:
    """``scaletorch.dist.spawn.run_distributed`` with the ranks forked from the forkserver."""
    return spawn.run_distributed(fn, world_size, *args, timeout=timeout, start_method="forkserver")


# Every script the tests launch runs in the test modes that make a GPU run's failures fail on
# gloo: NCCL's point-to-point order (dist/p2p_order.py), no host-made tensor in a collective
# (dist/device_check.py).
# Also what launch.sh sets on a machine without a GPU (OMP_NUM_THREADS=1), set here so that it
# does not start a Python to ask torch for every launch (it asks only when the variable is unset).
NCCL_CHECKS = {
    "SCALETORCH_P2P_ORDER": "nccl",
    "SCALETORCH_CHECK_DEVICES": "1",
    **({} if torch.cuda.is_available() else {
           "OMP_NUM_THREADS": "1"
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
