"""DDP's gradient buckets: which parameters share one all-reduce.

The bucketed data-parallel wrapper (scaletorch/parallel/data_parallel.py) fills its buckets by
this rule, and the planner (scaletorch/plan/traffic.py) counts its calls by it.
"""

from typing import List, Sequence

FIRST_BUCKET_MB = 1.0  # torch DDP's default first bucket: communication starts early


def ddp_buckets(numels: Sequence[int], bucket_size_mb: float) -> List[List[int]]:
    """Gradient buckets as indices into ``numels`` (a module's parameters in registration
    order), filled in reverse order (backward meets the last layers first), fp32 elements up to
    ``bucket_size_mb`` MiB each, the first up to ``FIRST_BUCKET_MB``; a parameter larger than a
    bucket fills one alone. Each bucket is one all-reduce per gradient sync."""
    first = min(FIRST_BUCKET_MB, bucket_size_mb)
    caps = [max(1, int(mb * 2**20) // 4) for mb in (first, bucket_size_mb)]  # fp32 elements
    buckets: List[List[int]] = []
    ids: List[int] = []
    size = 0
    for i in reversed(range(len(numels))):
        if ids and size + numels[i] > caps[min(len(buckets), 1)]:
            buckets.append(ids)
            ids, size = [], 0
        ids.append(i)
        size += numels[i]
    return buckets + [ids] if ids else buckets
