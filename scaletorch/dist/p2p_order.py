"""NCCL's point-to-point order on gloo: a test mode that makes a hang on NCCL hang on the CPU.

torch's ``batch_isend_irecv`` over NCCL runs a batch on the group's communicator, on its one
CUDA stream: a rank's batches on a group complete in the order they were posted, each a
rendezvous (a send finishes once its peer's receive is running). A receive posted early
therefore holds every later batch of that rank on that group, sends to any peer included,
until its message arrives. Gloo runs each message on its own, so a posting order that hangs
on NCCL trains on the CPU.

In this mode (``SCALETORCH_P2P_ORDER=nccl`` in the environment, or ``set_in_order(True)``),
``comm.batch_isend_irecv`` hands each batch to the group's stream: one thread per group that
posts a batch only when the batches before it have completed, and returns one work for the
batch (as NCCL's coalesced batch returns one). A hang then ends at the process group's
timeout, with a RuntimeError on the rank that waited.
"""

import os
import queue
import threading
from typing import Dict, List, Optional

import torch.distributed as dist

ENV = "SCALETORCH_P2P_ORDER"  # "nccl": in order per group; unset or "gloo": as gloo runs
_forced: Optional[bool] = None


def set_in_order(on: Optional[bool]) -> None:
    """Turn the mode on or off for this process (None: follow the environment)."""
    global _forced
    _forced = on


def in_order() -> bool:
    """Is the NCCL-order mode on?"""
    if _forced is not None:
        return _forced
    return os.environ.get(ENV, "gloo").lower() == "nccl"


class BatchWork:
    """One posted batch: ``wait()`` returns when all its operations completed (or raises the
    error that stopped the stream, such as gloo's timeout)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: Optional[BaseException] = None

    def finish(self, error: Optional[BaseException]) -> None:
        self._error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        self._done.wait()
        if self._error is not None:
            raise RuntimeError(f"point-to-point batch failed in NCCL order ({ENV}=nccl): "
                               f"{self._error}") from self._error
        return True


class _Stream:
    """A group's point-to-point batches, run one after the other on a thread of their own."""

    def __init__(self) -> None:
        self.jobs: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self.error: Optional[BaseException] = None
        threading.Thread(target=self._run, daemon=True, name="p2p-stream").start()

    def post(self, ops: List[dist.P2POp]) -> BatchWork:
        work = BatchWork()
        self.jobs.put((ops, work))
        return work

    def _run(self) -> None:
        while True:
            ops, work = self.jobs.get()
            if self.error is None:  # a stream that failed runs nothing more, as NCCL's
                try:
                    for handle in dist.batch_isend_irecv(ops):
                        handle.wait()
                except BaseException as error:  # noqa: B902 - handed to the waiting rank
                    self.error = error
            work.finish(self.error)


_streams: Dict[object, _Stream] = {}  # group (None: the default group) -> its stream
_lock = threading.Lock()


def post_in_order(ops: List[dist.P2POp]) -> List[BatchWork]:
    """Queue ``ops`` (one batch, one group) on their group's stream; one work for the batch."""
    group = ops[0].group
    with _lock:
        stream = _streams.get(group)
        if stream is None:
            stream = _streams[group] = _Stream()
    return [stream.post(ops)]
