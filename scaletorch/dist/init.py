"""Start and stop torch.distributed from torchrun's environment, on CPU or GPU.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT for every process.
Without them we run as one process and create no process group, so every script also runs
with a plain ``python examples/...``. The device and backend follow the hardware: NCCL and
``cuda:LOCAL_RANK`` when CUDA is present (``cuda:0`` when the launcher gives each process one
GPU of its own), gloo and the CPU otherwise.
"""

import datetime
import gc
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

from scaletorch.dist import device_check
from scaletorch.dist.pg_manager import startup_timeout

DEFAULT_TIMEOUT_SECONDS = 300.0
MEET_KEY = "scaletorch/ready"  # the store's count of the ranks that reached a first step


@dataclass(frozen=True)
class DistributedEnv:
    """What this process is: its ranks, the device it computes on and the backend."""
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device_and_backend(local_rank: int, local_world_size: Optional[int] = None,
                            cuda_available: Optional[bool] = None,
                            device_count: Optional[int] = None,
                            shared_devices: Optional[bool] = None) -> tuple[torch.device, str]:
    """CUDA + NCCL with GPU ``local_rank`` when a GPU is visible, CPU + gloo otherwise.

    Each rank of a node needs a GPU of its own: two ranks on one GPU make NCCL stop at
    communicator setup ("Duplicate GPU detected"), so that is a ValueError here instead.
    A process that sees exactly one GPU while the node's processes do not share their devices
    (``srun --gpus-per-task=1``: CUDA_VISIBLE_DEVICES names one GPU per task) computes on
    ``cuda:0``, its own GPU, whatever its LOCAL_RANK. ``shared_devices`` says whether the
    node's processes all see the same GPUs; it defaults to whether torchrun started this one
    (TORCHELASTIC_RUN_ID set): torchrun gives all its workers the same CUDA_VISIBLE_DEVICES.
    ``cuda_available`` and ``device_count`` default to what torch sees (tests inject them).
    """
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    if not cuda_available:
        return torch.device("cpu"), "gloo"
    if device_count is None:
        device_count = torch.cuda.device_count()
    if shared_devices is None:
        shared_devices = "TORCHELASTIC_RUN_ID" in os.environ
    if device_count == 1 and not shared_devices:
        return torch.device("cuda", 0), "nccl"  # one GPU per process: the one it sees
    # LOCAL_WORLD_SIZE (set by torchrun) lets every rank of the node refuse alike, not only
    # the ones past the last GPU
    needed = max(local_rank + 1, local_world_size or 0)
    if needed > device_count:
        ranks = (f"LOCAL_WORLD_SIZE={local_world_size}"
                 if local_world_size else "LOCAL_WORLD_SIZE unset")
        raise ValueError(
            f"local rank {local_rank} ({ranks}) needs a GPU of its own, but this node sees "
            f"{device_count} (torch.cuda.device_count()={device_count}); two ranks on one GPU "
            f"stop NCCL at communicator setup. Launch at most {device_count} processes per node "
            f"(--nproc-per-node {device_count}) or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    return torch.device("cuda", local_rank), "nccl"


def process_group_options(device: torch.device) -> Dict[str, Any]:
    """Extra ``init_process_group`` arguments: on CUDA, ``device_id`` binds the group to this
    rank's GPU (NCCL then sets up its communicator at once, on the right device, instead of
    guessing one at the first collective); the CPU and gloo need nothing."""
    return {"device_id": device} if device.type == "cuda" else {}


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def init_distributed(timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS) -> DistributedEnv:
    """Initialize the default process group from torchrun's variables (or run alone).

    ``timeout_seconds`` bounds every collective: a peer that never arrives makes the others
    raise after that long instead of hanging forever. If a process group already exists
    (the test harness creates one) it is reused.
    """
    if timeout_seconds <= 0:
        raise ValueError(f"timeout_seconds must be positive, got {timeout_seconds}")
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", 0)
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
    local_world_size = _env_int("LOCAL_WORLD_SIZE", 0) or None
    device, backend = pick_device_and_backend(local_rank, local_world_size)
    device_check.enable_from_env()  # SCALETORCH_CHECK_DEVICES=1: a test mode
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        backend = dist.get_backend()
    elif world_size > 1:
        timeout = datetime.timedelta(seconds=timeout_seconds)
        startup = startup_timeout(timeout)
        store, _, _ = next(rendezvous("env://", rank, world_size, timeout=startup))
        # torchrun keeps its key-value store across restarts (--max-restarts). The groups of a
        # restarted attempt would find the dead attempt's addresses under the same keys, so
        # every attempt gets keys of its own.
        store = dist.PrefixStore(f"scaletorch/attempt_{restart_count()}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=startup, **process_group_options(device))
        if startup != timeout:  # the world joined: now every collective gets the asked timeout
            dist.distributed_c10d._set_pg_timeout(timeout)
    return DistributedEnv(rank, local_rank, world_size, device, backend)


def meet_before_first_step(timeout_seconds: float) -> None:
    """Every rank of the world waits here for the others, up to the start-up timeout
    (``startup_timeout``), when ``timeout_seconds`` is shorter than it.

    The setup after the groups exist is not the same on every rank: rank 0 writes the run
    directory (an fsync), and each rank's first optimizer imports torch._dynamo (about 2 s of
    a core, many more on a busy host). Without this, the step's first collective would bound
    how far apart the ranks end it, and a 3 s timeout (chapter 11's tests) ends a healthy
    run at step 0. Through the world's store, not a collective: no group's collective numbers
    or flight-recorder entries change. A timeout as long as the start-up's needs nothing: the
    first collective waits as long."""
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return
    timeout = datetime.timedelta(seconds=timeout_seconds)
    startup = startup_timeout(timeout)
    if startup == timeout:
        return
    store = dist.distributed_c10d._get_default_store()
    world = dist.get_world_size()
    # one count for every meeting of this world (a test's world trains more than once): the
    # k-th meeting (from 0) is complete when the count reaches (k + 1) x world
    arrived = store.add(MEET_KEY, 1)
    meeting = (arrived - 1) // world
    done = f"{MEET_KEY}/{meeting}"
    if arrived == (meeting + 1) * world:
        store.set(done, "1")
    try:
        store.wait([done], startup)
    except RuntimeError as err:  # DistStoreError: a rank failed or is stuck before its first step
        raise RuntimeError(f"rank {dist.get_rank()}: the other ranks did not reach the first step "
                           f"within {startup.total_seconds():.0f} s") from err


def destroy_distributed() -> None:
    """Tear down the default process group, if any.

    ``gc.collect()`` first: dropping DDP's reducer inside destroy occasionally aborts the
    process on gloo (see doc/cpu_and_gloo.md); collecting it before avoids that.
    """
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def restart_count() -> int:
    """How many times torchrun has restarted this job (``--max-restarts``); 0 on the first try."""
    return _env_int("TORCHELASTIC_RESTART_COUNT", 0)
