"""The multi-rank test harness: ``run_distributed(fn, world_size, *args, timeout=...)``.

It lives in ``scaletorch.dist.spawn`` so that the benchmarks use the same one.
"""

from scaletorch.dist.spawn import free_port, run_distributed

__all__ = ["free_port", "run_distributed"]
