"""The multi-rank test harness: ``run_distributed(fn, world_size, *args, timeout=...)``.

It lives in ``scaletorch.dist.spawn`` so that the benchmarks use the same one.
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
from typing import Callable, Iterator, List, Optional, Tuple

from scaletorch.dist.spawn import free_port, run_distributed

__all__ = [
    "NCCL_CHECKS", "free_port", "run_distributed", "run_main", "stderr_warnings", "value_error",
    "warning_lines"
]

# Every script the tests launch runs in the test modes that make a GPU run's failures fail on
# gloo: NCCL's point-to-point order (dist/p2p_order.py), no host-made tensor in a collective
# (dist/device_check.py).
NCCL_CHECKS = {"SCALETORCH_P2P_ORDER": "nccl", "SCALETORCH_CHECK_DEVICES": "1"}


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
