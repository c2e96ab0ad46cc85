"""Chapter 01's ``average_gradients`` called on its own (scripts/grading/ddp.py grades it): did
it touch a tensor while that tensor's all-reduce was in flight?

An async all-reduce (``async_op=True``) reads and writes its tensor until its work is done;
dividing that tensor before ``wait()`` races with the sum: the gradients come out some mix of
the mean and the sum, by factors that differ between ranks and between runs (and, when the
division happens to land wholly before or after, right). So the run's gradients cannot name it,
but this can: the function is called on gradients of known values over the data-parallel group,
``TRIES`` times, each time with one group rank's all-reduces started ``HOLD`` s late (the other
ranks' then stay in flight at least that long, whatever the machine's speed), and every
in-place operation on a tensor (``/=``, ``div_``, ``copy_`` into it, ...) or ``copy_`` out of it
while an all-reduce it was given is neither waited for nor complete is written down.
"""

import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from scaletorch.dist import comm
from scaletorch.parallel.gradient_sync import average_gradients as library_average

HOLD = 0.05  # s: how late the held rank starts its all-reduces
SHAPES = [(3, 4), (5, )]


class _Watch(TorchFunctionMode):
    """Records what touched a tensor whose all-reduce (``flight``: its storages, its work) is
    neither waited for (``waited``) nor complete."""

    def __init__(self) -> None:
        super().__init__()
        self.flight: List[Tuple[List[Tuple[int, int]], Any]] = []
        self.waited: List[Any] = []  # the works wait() was called on (kept: ids stay unique)
        self.seen: List[str] = []

    def _live(self) -> List[Tuple[int, int]]:
        live: List[Tuple[int, int]] = []
        for spans, work in self.flight:
            if any(work is w for w in self.waited):
                continue
            try:
                done = bool(work.is_completed())
            except RuntimeError:
                done = False
            live += [] if done else spans
        return live

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = getattr(func, "__name__", "")
        writes = name == "__setitem__" or name.startswith("__i") or \
            (name.endswith("_") and not name.startswith("__"))
        if self.flight and (writes or name == "copy_") and args:
            live = self._live()
            first = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            if writes and any(_meets(t, live) for t in first):
                self.seen.append(f"{name} on a tensor")
            elif name == "copy_" and len(args) > 1 and _meets(args[1], live):
                self.seen.append("copy_ from a tensor")
        return func(*args, **(kwargs or {}))


def _span(t: Any) -> Optional[Tuple[int, int]]:
    """The bytes ``t`` covers, [start, end), or None for what is not a tensor or is empty."""
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return None
    last = sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _meets(t: Any, live: List[Tuple[int, int]]) -> bool:
    span = _span(t)
    return span is not None and any(span[0] < end and start < span[1] for start, end in live)


@contextmanager
def _watched(hold: bool) -> Iterator[_Watch]:
    """The block's all-reduces (whatever API: ProcessGroup's methods) and waits recorded, each
    all-reduce started ``HOLD`` s late if ``hold``; the classes' own entries put back after."""
    watch = _Watch()
    pg, work_cls = dist.ProcessGroup, dist.Work
    launches = {n: pg.__dict__[n] for n in ("allreduce", "allreduce_coalesced") if n in pg.__dict__}
    wait_entry, wait = work_cls.__dict__["wait"], work_cls.wait

    def launch(method: Callable) -> Callable:

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            if hold:
                time.sleep(HOLD)
            work = method(self, *args, **kwargs)
            tensors = args[0] if args and isinstance(args[0], (list, tuple)) else []
            spans = [_span(t) for t in tensors]
            watch.flight.append(([sp for sp in spans if sp is not None], work))
            return work

        return call

    def waiting(self: Any, *args: Any, **kwargs: Any) -> Any:
        watch.waited.append(self)
        return wait(self, *args, **kwargs)

    for n in launches:
        setattr(pg, n, launch(getattr(pg, n)))
    work_cls.wait = waiting
    try:
        with watch:
            yield watch
    finally:
        for n, entry in launches.items():
            setattr(pg, n, entry)
        work_cls.wait = wait_entry


def _values(rank: int) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(*shape, generator=gen) + rank for shape in SHAPES]


def race_probe(fn: Callable, group: Any) -> Optional[str]:
    """``fn`` over ``group`` once per group rank held late (every rank makes every call: the
    collectives stay in step); what this rank saw touched in flight, or None."""
    n, me = comm.group_size(group), comm.group_rank(group)
    seen: List[Tuple[int, str, bool]] = []
    for held in range(min(n, 2)):
        grads = _values(dist.get_rank())
        want = [g.clone() for g in grads]
        library_average(want, group)
        with _watched(held == me) as watch:
            fn(grads, group)
        right = all(torch.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(grads, want))
        seen += [(held, s, right) for s in watch.seen[:1]]
    if not seen:
        return None
    _, what, right = seen[0]
    return (f"average_gradients called {what} on rank {dist.get_rank()} while that tensor's "
            f"all-reduce was in flight (launched with async_op=True, its work not yet waited "
            f"for){'' if right else ', and the gradients came out wrong'}: the all-reduce reads "
            f"and writes its tensor until it is done, so the two raced; wait() for the work, "
            f"then divide or copy")


def race_text(runs: Sequence[Dict[str, Any]]) -> Optional[str]:
    """The first rank's race, from the runs' ``race`` (``race_probe``'s), or None."""
    return next((run["race"] for run in runs if run.get("race")), None)
