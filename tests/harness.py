"""The multi-rank test harness: ``run_distributed(fn, world_size, *args, timeout=...)``.

It lives in ``scaletorch.dist.spawn`` so that the benchmarks use the same one.
``value_error(fn)`` collects an error message inside a rank, for the parent to assert on.
"""

from typing import Callable

from scaletorch.dist.spawn import free_port, run_distributed

__all__ = ["free_port", "run_distributed", "value_error"]


def value_error(fn: Callable[[], object]) -> str:
    """The message of the ValueError ``fn()`` raises, or "no error" (picklable, unlike the
    exception's traceback)."""
    try:
        fn()
    except ValueError as err:
        return str(err)
    return "no error"
