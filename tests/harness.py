"""The multi-rank test harness: ``run_distributed(fn, world_size, *args, timeout=...)``.

It lives in ``scaletorch.dist.spawn`` so that the benchmarks use the same one.
``value_error(fn)`` collects an error message inside a rank, for the parent to assert on;
``run_main(main, *argv)`` runs a script's ``main`` in the test's process. ``NCCL_CHECKS``:
the environment of the scripts the tests launch (tests/test_examples.py, the docs' ci runs).
"""

import io
from contextlib import redirect_stderr, redirect_stdout
from typing import Callable, List, Optional, Tuple

from scaletorch.dist.spawn import free_port, run_distributed

__all__ = ["NCCL_CHECKS", "free_port", "run_distributed", "run_main", "value_error"]

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
