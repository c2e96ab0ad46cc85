"""Chapter 11's tools: faults a learner injects into a data-parallel run, and what finds them.

    --fault skip       rank R's data ends after step K-1: it skips step K's all-reduces and
                       waits at the end of the run, while the others wait in step K (a hang)
    --fault shape      rank R's first gradient all-reduce of step K has one element more
    --fault straggler  rank R sleeps --fault-seconds before each step from step K on
    --fault raise      rank R raises at step K (one traceback: scripts/torchrun.py)
    --fault kill       rank R is killed (SIGKILL) at step K, as when a machine is lost

``FaultyStep`` wraps a ``forward_backward`` step (the trainer's) and injects the fault. What
finds a straggler is the Trainer's, in every run: at each log line, each rank's busy time (a
step's time less its waits in collectives) all-gathered (scaletorch/dist/straggler.py).
"""

import os
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch

from scaletorch.dist import comm, get_ledger
from scaletorch.parallel.step import ForwardBackward
from scaletorch.rules.errors import OneLineParser

FAULTS = ("none", "skip", "shape", "straggler", "raise", "kill")


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


def parse_fault_args(argv: Optional[Sequence[str]]) -> Tuple[Fault, List[str]]:
    """(fault, the other arguments) from the command line."""
    parser = OneLineParser(add_help=False)
    parser.add_argument("--fault", choices=FAULTS, default="none")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-step", type=int, default=3)
    parser.add_argument("--fault-seconds", type=float, default=0.05)
    args, rest = parser.parse_known_args(argv)
    fault = Fault(args.fault, args.fault_rank, args.fault_step, args.fault_seconds)
    return fault, rest


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
    """``forward_backward`` with ``fault`` injected on its rank."""

    def __init__(self, forward_backward: ForwardBackward, fault: Fault, rank: int) -> None:
        self.forward_backward = forward_backward
        self.fault = fault if rank == fault.rank else Fault()
        self.rank = rank

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        step, f = get_ledger().step, self.fault  # the trainer sets the ledger's step
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
        return loss
