"""The peak host memory a block of code adds to this process, from Linux's own counters.

``with PeakHostMemory() as meter: ...`` then ``meter.peak_bytes``: the process's resident
memory at its highest during the block (VmHWM, reset at entry through /proc/self/clear_refs)
less what it held at entry (VmRSS). It counts every byte the process touches: tensor storages,
the file bytes and pickles a checkpoint's storage layer holds, Python objects. Two habits of
glibc's malloc would hide memory, so they are turned off: a freed block kept for reuse (its
pages would count once, then not again), and a threshold for fresh pages that grows with use
(``mallopt(M_MMAP_THRESHOLD)`` pins it: every block above 128 KiB gets new pages and returns
them when freed). Host memory only: on a GPU, ``torch.cuda.max_memory_allocated`` measures
the device. Linux only (it reads /proc).
"""

import ctypes
import ctypes.util
import os
from types import TracebackType
from typing import Optional, Type

MMAP_THRESHOLD = -3  # glibc's M_MMAP_THRESHOLD for mallopt
THRESHOLD_BYTES = 128 * 1024  # glibc's default, fixed: no longer raised by frees


def _status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}: this meter needs Linux")


class PeakHostMemory:
    """Context manager: ``peak_bytes``, the most resident memory the block added at once."""

    def __init__(self) -> None:
        if not os.path.exists("/proc/self/clear_refs"):
            raise OSError("PeakHostMemory reads Linux's /proc/self: not available here")
        self._libc = ctypes.CDLL(ctypes.util.find_library("c"))
        self.start = 0
        self.peak_bytes = 0

    def __enter__(self) -> "PeakHostMemory":
        self._libc.mallopt(MMAP_THRESHOLD, THRESHOLD_BYTES)
        self._libc.malloc_trim(0)  # freed blocks go back: using them again counts again
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark restarts from the current resident size
        self.start = _status_bytes("VmRSS")
        return self

    def __exit__(self, kind: Optional[Type[BaseException]], err: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.peak_bytes = max(_status_bytes("VmHWM") - self.start, 0)
