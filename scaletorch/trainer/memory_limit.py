"""A run that cannot fit is refused before anything is allocated: the planner's estimate
against what the device has.

``check_memory`` runs in ``load_config`` (and so in scripts/launch.sh's pre-flight), before a
process group or a model exists. The need is the planner's bytes for the busiest rank of this
layout (scaletorch/plan/memory.py ``rank_memory``: parameters, gradients, optimizer state and
the activation peak, in the run's precision), for every rank that shares the device: on CPU
all the ranks of this host share its RAM, so the need is the busiest rank's times
LOCAL_WORLD_SIZE, against the RAM available now (``MemAvailable``); on CUDA each rank has its
own device, so it is one rank's against that device's total memory. A layout the planner does
not model (it raises ValueError) is not checked here; the run finds its own limits.
"""

import os
from typing import Optional, Tuple

import torch

from scaletorch.config import Config, resolve_precision
from scaletorch.plan.layout import from_config as layout_of
from scaletorch.plan.memory import rank_memory
from scaletorch.plan.model import from_config as model_of
from scaletorch.plan.report import human
from scaletorch.rules.errors import InputError


def rank_need(cfg: Config, world_size: int, device_type: str) -> Optional[float]:
    """Bytes the busiest rank of ``cfg`` on ``world_size`` ranks holds at its peak (the
    planner's estimate), or None when the planner does not model this run."""
    try:
        layout = layout_of(cfg, world_size, resolve_precision(cfg, device_type))
        model = model_of(cfg.model)
        return max(rank_memory(model, layout, r)["total"] for r in range(layout.pp))
    except (ValueError, KeyError, ZeroDivisionError):
        return None


def available(device_type: str) -> Tuple[float, str]:
    """(bytes, what they are) of the memory a run's ranks on this host may use."""
    if device_type == "cuda":
        return float(torch.cuda.get_device_properties(0).total_memory), "on each GPU"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024, "of RAM available on this host"
    except OSError:
        pass
    pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return float(pages), "of RAM free on this host"


def check_memory(cfg: Config, world_size: int) -> None:
    """InputError naming both numbers when the run's estimated memory exceeds the device's
    (see the module docstring)."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    per_rank = rank_need(cfg, world_size, device_type)
    if per_rank is None:
        return
    ranks = 1 if device_type == "cuda" else int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    need = per_rank * ranks
    have, where = available(device_type)
    if need > have:
        sharing = f" x {ranks} ranks on this host" if ranks > 1 else ""
        raise InputError(f"the run needs {human(need)} of memory ({human(per_rank)} per rank"
                         f"{sharing}: the planner's estimate of parameters, gradients, optimizer "
                         f"state and activations for this layout), and there are {human(have)} "
                         f"{where}: give a smaller model, a shorter data.seq_len or batch, or "
                         f"more ranks to share it")
