"""Chapter 11's tools: faults a learner injects into a data-parallel run, and what finds them.

    --fault skip       rank R's data ends after step K-1: it skips step K's all-reduces and
                       waits at the end of the run, while the others wait in step K (a hang)
    --fault shape      rank R's first gradient all-reduce of step K has one element more
    --fault straggler  rank R sleeps --fault-seconds before each step from step K on
    --fault raise      rank R raises at step K (one traceback: scripts/torchrun.py)
    --fault kill       rank R is killed (SIGKILL) at step K, as when a machine is lost

``FaultyStep`` wraps a ``forward_backward`` step (the trainer's): it injects the fault, times
each step, steps the profiler (``--profile STEPS``) and keeps what ``straggler_report`` needs:
each step's busy time, the step's time minus the time spent waiting for the gradients of the
other ranks (the bucketed DDP's timeline), so the straggler is the rank that waits least.
"""

import argparse
import os
import signal
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from scaletorch.dist import comm, get_ledger
from scaletorch.parallel.step import ForwardBackward

FAULTS = ("none", "skip", "shape", "straggler", "raise", "kill")
STRAGGLER = 0.10  # a rank whose busy time is this much over the median is reported


@dataclass(frozen=True)
class Fault:
    kind: str = "none"
    rank: int = 1
    step: int = 3
    seconds: float = 0.05  # the straggler's sleep per step

    def check(self, world_size: int, steps: int) -> None:
        """ValueError naming the values when this fault cannot happen in the run."""
        if self.kind == "none":
            return
        if world_size < 2:
            raise ValueError(f"--fault {self.kind} needs at least 2 ranks, got {world_size}")
        if not 0 <= self.rank < world_size:
            raise ValueError(f"--fault-rank {self.rank} is not a rank of a world of {world_size}")
        if not 0 <= self.step < steps:
            raise ValueError(f"--fault-step {self.step} is not a step of a run of {steps} "
                             f"steps (0 to {steps - 1})")
        if self.seconds <= 0:
            raise ValueError(f"--fault-seconds must be positive, got {self.seconds}")


def parse_fault_args(argv: Optional[Sequence[str]]) -> Tuple[Fault, int, List[str]]:
    """(fault, profile steps, the other arguments) from the command line."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=3)
    parser.add_argument("--fault-seconds", type=float, default=0.05)
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS")
    args, rest = parser.parse_known_args(argv)
    if args.profile < 0:
        raise SystemExit(f"error: --profile takes a number of steps >= 0, got {args.profile}")
    fault = Fault(args.fault, args.fault_rank, args.fault_step, args.fault_seconds)
    return fault, args.profile, rest


def steps_on_this_rank(fault: Fault, rank: int, steps: int) -> int:
    """--fault skip: rank R runs steps 0..K-1 only (its data ran out first)."""
    return fault.step if fault.kind == "skip" and rank == fault.rank else steps


@contextmanager
def one_element_more() -> Iterator[None]:
    """Inside the block, the next all-reduce issued through scaletorch.dist.comm carries one
    element more than asked (a rank whose tensor has another shape)."""
    original = comm.all_reduce
    done: List[bool] = []

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not done:
            done.append(True)
            tensor = torch.cat([tensor, tensor.new_zeros(1)])
        return original(tensor, *args, **kwargs)

    comm.all_reduce = all_reduce  # restored below
    try:
        yield
    finally:
        comm.all_reduce = original


class FaultyStep:
    """``forward_backward`` with ``fault`` injected on its rank, each step timed."""

    def __init__(self, forward_backward: ForwardBackward, model: nn.Module, fault: Fault, rank: int,
                 profiler: Optional[torch.profiler.profile] = None) -> None:
        self.forward_backward = forward_backward
        self.model = model
        self.fault = fault if rank == fault.rank else Fault()
        self.rank = rank
        self.profiler = profiler
        self.busy: List[float] = []  # seconds per step, without the wait for other ranks

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        step, f = get_ledger().step, self.fault  # the trainer sets the ledger's step
        if self.profiler is not None and step > 0:
            self.profiler.step()
        start = time.perf_counter()
        if f.kind == "straggler" and step >= f.step:
            time.sleep(f.seconds)
        if f.step == step and f.kind == "raise":
            raise RuntimeError(f"injected error on rank {self.rank} at step {step}")
        if f.step == step and f.kind == "kill":
            print(f"rank {self.rank}: injected kill (SIGKILL) at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if f.step == step and f.kind == "shape":
            with one_element_more():
                loss = self.forward_backward(inputs, targets)
        else:
            loss = self.forward_backward(inputs, targets)
        elapsed = time.perf_counter() - start
        timeline = getattr(self.model, "timeline", None)  # the bucketed DDP's last sync
        wait = timeline.t_wait_end - timeline.t_backward_end if timeline is not None else 0.0
        self.busy.append(elapsed - wait)
        return loss


def straggler_report(busy: List[float], world_size: int, device: torch.device,
                     threshold: float = STRAGGLER) -> Optional[str]:
    """Every rank calls this at the end of the run (an all-gather over the world). Rank 0 gets
    a line naming the slowest rank when its busy time per step (median over the steps after
    the first) is more than ``threshold`` over the median of the other ranks; None otherwise."""
    mine = statistics.median(busy[1:] or busy) if busy else 0.0  # step 0 warms up
    everyone = torch.zeros(world_size, dtype=torch.float64, device=device)  # NCCL: the GPU's
    with get_ledger().paused():  # a report, not training traffic
        comm.all_gather_into_tensor(everyone, everyone.new_tensor([mine]))
    times = everyone.tolist()
    slowest = max(range(world_size), key=lambda r: times[r])
    others = statistics.median(t for r, t in enumerate(times) if r != slowest)
    if comm.group_rank() != 0 or times[slowest] <= (1 + threshold) * others:
        return None
    spread = ", ".join(f"{t * 1e3:.1f}" for t in times)
    return (f"straggler: rank {slowest} is busy {times[slowest] * 1e3:.1f} ms a step, "
            f"{times[slowest] / others:.1f}x the median of the other ranks "
            f"({others * 1e3:.1f} ms); busy ms a step, rank 0 first: {spread}")


def profiler(run_path: str, rank: int, steps: int) -> Optional[torch.profiler.profile]:
    """A torch.profiler that records ``steps`` steps after one of warm-up and writes
    ``<run_path>/profile/rank_<r>.json`` (chrome://tracing, Perfetto); None if steps is 0."""
    if steps <= 0:
        return None
    directory = os.path.join(run_path, "profile")

    def export(prof: torch.profiler.profile) -> None:
        os.makedirs(directory, exist_ok=True)
        prof.export_chrome_trace(os.path.join(directory, f"rank_{rank}.json"))

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities, schedule=torch.profiler.schedule(wait=0, warmup=1, active=steps,
                                                                repeat=1), on_trace_ready=export)
