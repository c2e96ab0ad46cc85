"""Step timing shared by the benchmarks: alternate the implementations, keep the slowest rank.

Every benchmark trains its implementations side by side in one world. ``alternate`` runs rounds
of one step each, the order rotating every round, so that background load on a shared CPU hits
all alike; ``max_over_ranks`` turns each rank's step times into the slowest rank's; a row then
reports ``median_ms`` and ``paired_ratio`` (the median over rounds of ours / native, the steps
of a round having run back to back; ``versus`` makes that row), never an absolute time on its own.
``Delayed`` injects fixed sleeps into a layer's F, B and W, for pipeline bubbles that do not
depend on the CPU's load (the benchmarks and tests/test_pipeline_parallel.py, test_zero_bubble.py).
"""

import statistics
import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Sequence, Tuple

import torch

from scaletorch.dist import comm, get_ledger


def samples(args) -> int:
    """Timed rounds: ``--steps`` x ``--repeats``."""
    return getattr(args, "steps", 10) * getattr(args, "repeats", 3)


@contextmanager
def untracked() -> Iterator[None]:
    """Keep the benchmark's own collectives out of the ledger: they are not traffic."""
    with get_ledger().paused():
        yield


def alternate(names: Sequence[str], rounds: int, warmup: int, step: Callable[[str], None],
              read: Callable[[str], object]) -> Tuple[Dict[str, List[float]], Dict[str, object]]:
    """This rank's step times in seconds per name, and ``read(name)`` after its last step.

    ``warmup + rounds`` rounds, each one ``step(name)`` of every name, the order rotating every
    round; the warm-up rounds are not kept. Each step starts after a barrier over the default
    (world) group, with a cleared ledger that ``read`` may then total; ``read`` is not timed.
    """
    names = list(names)
    times: Dict[str, List[float]] = {name: [] for name in names}
    readings: Dict[str, object] = {}
    for r in range(warmup + rounds):
        for k in range(len(names)):
            name = names[(r + k) % len(names)]  # rotate who goes first
            comm.barrier()
            get_ledger().clear()
            start = time.perf_counter()
            step(name)
            elapsed = time.perf_counter() - start
            if r >= warmup:
                times[name].append(elapsed)
            readings[name] = read(name)
    return times, readings


def max_over_ranks(values: Dict[str, List[float]]) -> Dict[str, List[float]]:
    """Each value's maximum over the ranks of the default (world) group: one all-reduce MAX.

    For step times: the slowest rank's time of each step, which is the step's time.
    """
    flat = torch.tensor([v for vs in values.values() for v in vs], dtype=torch.float64)
    with untracked():
        comm.all_reduce(flat, op=torch.distributed.ReduceOp.MAX)
    parts = flat.split([len(vs) for vs in values.values()])
    return {name: part.tolist() for name, part in zip(values, parts)}


def median_ms(times: List[float]) -> float:
    """The median step time in milliseconds."""
    return statistics.median(times) * 1e3


def paired_ratio(a: List[float], b: List[float]) -> float:
    """Median over rounds of a / b: the two steps of a round ran back to back."""
    return statistics.median(x / y for x, y in zip(a, b))


def versus(name: str, ours: List[float], native: List[float], target: str, **common) -> dict:
    """The row of one comparison: median ``ours_ms`` and ``native_ms``, their paired ``ratio``,
    the ``target`` for that ratio, then the ``common`` columns."""
    return {
        "name": name,
        "ours_ms": median_ms(ours),
        "native_ms": median_ms(native),
        "ratio": paired_ratio(ours, native),
        "target": target,
        **common
    }


class _Sleep(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # once: a zero-bubble W walks this graph again (pipeline_runtime.py), B already slept
        time.sleep(ctx.backward_s)
        ctx.backward_s = 0.0
        return grad, None, None


class Delayed(torch.nn.Module):
    """A layer that also sleeps a fixed time in forward and backward: equal-cost stages whose
    cost is not CPU time, so the measured bubble does not depend on other processes.
    ``backward_s`` is slept on the way to the layer's input (B), ``weight_s`` when its first
    weight's gradient is made (W; a full backward sleeps both)."""

    def __init__(self, layer, forward_s: float, backward_s: float, weight_s: float = 0.0) -> None:
        super().__init__()
        self.layer, self.forward_s, self.backward_s = layer, forward_s, backward_s
        self.weight_s = weight_s
        next(layer.parameters()).register_hook(lambda grad: time.sleep(self.weight_s))

    def forward(self, x, cos, sin):
        return self.layer(_Sleep.apply(x, self.forward_s, self.backward_s), cos, sin)
