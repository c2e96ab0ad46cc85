"""``--profile STEPS``: a torch.profiler trace of a run's steps, one file per rank.

The Trainer records ``STEPS`` steps after one of warm-up and writes
``<run_path>/profile/rank_<r>.json`` (open it in Perfetto or chrome://tracing;
``scripts/plot.py profile`` draws one step of two ranks). Every collective that
``scaletorch.dist.comm`` issues carries its ledger name there ("dp all_reduce", "pp
send/recv"), and so does each wait on one ("dp all_reduce wait").
"""

import os
from typing import Optional

import torch


def profiler(run_path: str, rank: int, steps: int) -> Optional[torch.profiler.profile]:
    """A torch.profiler that records ``steps`` steps after one of warm-up and writes
    ``<run_path>/profile/rank_<r>.json``; None if steps is 0. Call ``step()`` after each step."""
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
