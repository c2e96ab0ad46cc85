"""Run a function on N gloo processes on this machine and bring the results back.

The test suite and the benchmarks use this to start a world without torchrun: it starts
``world_size`` CPU processes, initializes a gloo process group on a free localhost port in
each, calls ``fn(rank, world_size, *args)``, and returns the list of per-rank return values.
A test class spawns one world in ``setUpClass`` and asserts on the results in several test
methods, since starting ranks costs seconds on a 2-core machine.
"""

import datetime
import gc
import io
import os
import random
import socket
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_DRAW = random.SystemRandom()  # not the random module's state, which a test may have seeded


def _ephemeral_start() -> int:
    """The first port of the range the OS hands out for bind(port 0) and outgoing connections
    (Linux: /proc/sys/net/ipv4/ip_local_port_range, 32768 by default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free on localhost right now, below the OS's ephemeral range.

    The port is released before the ranks bind it. A port from the ephemeral range could be
    handed, in that moment, to another world's gloo connection or listener (two test workers
    start worlds side by side): its rank 0 then fails with "address already in use". Below the
    range, only a process that names the port itself can take it, so a random one is drawn
    (and checked by binding it)."""
    top = min(_ephemeral_start(), 65536)
    for _ in range(50):
        port = _DRAW.randrange(20000, top) if top > 21000 else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use: draw again
            return sock.getsockname()[1]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # any the OS gives
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, timeout: float, fn: Callable, payload: bytes,
            queue: Any, env: Dict[str, str]) -> None:
    os.environ.update({
        **env,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    })
    # Two cores are shared by all ranks: more threads per rank only fight each other.
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        # Our own bytes (run_distributed's arguments), so a full unpickle is safe here.
        args = torch.load(io.BytesIO(payload), weights_only=False)
        result = fn(rank, world_size, *args)
        # Plain bytes, not tensors: torch would share tensor storage through file
        # descriptors, which vanish when this process exits before the parent reads them.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: B902 - every failure must reach the parent with its rank
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        # gc before destroy avoids a rare SIGABRT at exit after DDP (doc/cpu_and_gloo.md).
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120,
                    start_method: str = "spawn", env: Optional[Dict[str, str]] = None) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes.

    ``fn`` must be a module-level function (it is pickled for spawn) and return something
    picklable (tensors are fine). Returns the per-rank results in rank order. Raises
    RuntimeError with the rank and traceback of the first failure, or if the world does not
    finish within ``timeout`` seconds (collectives also time out after ``timeout``).
    ``start_method``: "spawn" starts each rank as a new Python that imports torch again;
    "forkserver" forks each from one server process that imported its preload list once
    (``set_forkserver_preload``; the test suite's harness uses it). ``env``: environment
    variables set in each rank before its process group starts (a forkserver's ranks inherit
    the server's environment, not the caller's).
    """
    ctx: Any = mp.get_context(start_method)  # spawn or forkserver: both make Processes
    # The arguments as plain bytes too: tensors among them would go to each rank as file
    # descriptors, and a forkserver passes at most 256 of those to a new process.
    buffer = io.BytesIO()
    torch.save(args, buffer)
    queue = ctx.SimpleQueue()
    port = free_port()
    rank_env = env or {}
    procs = [
        ctx.Process(target=_worker,
                    args=(rank, world_size, port, timeout, fn, buffer.getvalue(), queue, rank_env),
                    daemon=True) for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict = {}
    errors: list = []
    deadline = timeout + 60  # process start-up plus the collective timeout
    start = datetime.datetime.now()
    while len(results) + len(errors) < world_size:
        if (datetime.datetime.now() - start).total_seconds() > deadline:
            break
        if queue.empty():
            if all(not p.is_alive() for p in procs) and queue.empty():
                break
            procs[0].join(0.05)
            continue
        rank, status, payload = queue.get()
        if status == "ok":
            # Not a checkpoint: bytes our own worker processes just pickled (results may be
            # objects such as a pipeline Timeline), so a full unpickle is safe here.
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        else:
            errors.append((rank, payload))
            break  # the first failure is the interesting one; peers may now hang
    for proc in procs:
        proc.join(5 if not errors else 1)
        if proc.is_alive():
            proc.kill()
    if errors:
        rank, tb = errors[0]
        raise RuntimeError(f"rank {rank} of {world_size} failed:\n{tb}")
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        codes = [p.exitcode for p in procs]
        raise RuntimeError(f"ranks {missing} of {world_size} returned nothing within "
                           f"{deadline:.0f} s (exit codes {codes})")
    return [results[r] for r in range(world_size)]
