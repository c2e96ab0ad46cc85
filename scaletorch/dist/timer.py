"""Timelines that show when work ran, on the CPU and on a GPU: one ``Timer`` for both.

On the CPU an operation has run when its call returns, so a mark is simply the clock's reading
(``time.perf_counter()``, or ``time.time()`` to compare processes of one host). On CUDA a call
returns once its kernels are queued: the clock would show launch times, i.e. no communication
and no pipeline bubble. There a mark is a ``torch.cuda.Event`` recorded on the current stream;
it fires when the device reaches it, and its time is read (``elapsed_time`` from an origin
event whose host time is known) only when the timeline is read, after the step, so marking
never stalls the host::

    timer = Timer(device)
    start = timer.mark()           # CPU: a float now; CUDA: an event in the stream
    ...                            # work issued here
    end = timer.mark()
    seconds(end) - seconds(start)  # CUDA: waits for the event, then reads it

Other devices (e.g. "mps") use the clock, as the CPU does.
"""

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Tuple, Union

import torch


class CudaMark:
    """A point of the current CUDA stream, in seconds on the host clock of its timer."""

    def __init__(self, origin: "torch.cuda.Event", origin_time: float) -> None:
        self.origin, self.origin_time = origin, origin_time
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record()  # the current stream: the mark fires after the work issued before

    def seconds(self) -> float:
        self.event.synchronize()  # this event only: the host waits for nothing else
        return self.origin_time + self.origin.elapsed_time(self.event) / 1e3  # ms -> s


Mark = Union[float, CudaMark]
Clock = Callable[[], float]


class Timer:
    """Marks points of the work of one process on ``device``; read them with ``seconds``.

    ``clock`` gives the host time (seconds) that CPU marks read and CUDA marks are placed on:
    the origin event is recorded and waited for once, here, so the device's time of the
    origin is the host's ``clock()`` right after (to within the wake-up, microseconds).
    """

    def __init__(self, device: torch.device, clock: Clock = time.perf_counter) -> None:
        self.clock = clock
        self.origin = None
        if device.type == "cuda":
            with torch.cuda.device(device):
                self.origin = torch.cuda.Event(enable_timing=True)
                self.origin.record()
                self.origin.synchronize()
        self.origin_time = clock()

    def mark(self) -> Mark:
        """Now on the CPU; on CUDA, when the current stream reaches this point."""
        return self.clock() if self.origin is None else CudaMark(self.origin, self.origin_time)


def seconds(mark: Mark) -> float:
    """A mark's time in seconds on its timer's clock (on CUDA: waits for that event)."""
    return mark.seconds() if isinstance(mark, CudaMark) else mark


class Spans:
    """Labelled spans of one process's work, timed by a ``Timer`` on ``device``::

        spans = Spans(device)
        with spans.time("F0"):     # any label: the pipeline's actions, say
            ...
        spans.seconds()            # [("F0", start, end)]; on CUDA: read after the work
    """

    def __init__(self, device: torch.device, clock: Clock = time.perf_counter) -> None:
        self.timer = Timer(device, clock)
        self.marks: List[Tuple[Any, Mark, Mark]] = []

    @contextmanager
    def time(self, label: Any) -> Iterator[None]:
        start = self.timer.mark()
        yield
        self.marks.append((label, start, self.timer.mark()))

    def clear(self) -> None:
        self.marks.clear()

    def seconds(self) -> List[Tuple[Any, float, float]]:
        return [(label, seconds(start), seconds(end)) for label, start, end in self.marks]
