"""A collective's wire bytes: what one rank sends over a ring for one call.

The communication ledger (scaletorch/dist/ledger.py) records every call with these bytes, and
the planner (scaletorch/plan/traffic.py) predicts them, so the two agree by construction.
"""


def wire_bytes(op: str, nbytes: int, group_size: int) -> float:
    """Bytes one rank sends for ``op`` on ``nbytes`` over a ring of ``group_size`` ranks.

    all-reduce: reduce-scatter then all-gather, each passing (N-1)/N of the data, so
    2 (N-1)/N x nbytes; all-gather, reduce-scatter: (N-1)/N x nbytes; a receive sends
    nothing; anything else (send, broadcast, all-to-all) sends its whole buffer.
    """
    n = group_size
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * nbytes
    if op == "recv":
        return 0.0
    return float(nbytes)
