"""The planner's prediction (scaletorch/plan, chapter 09) beside what a run measured.

The Trainer prints it at the end of a run, for rank 0: its model-state bytes and its wire bytes
per group in the last step (the ledger) against ``scaletorch.plan``'s formulas, and, given a
calibrated cluster file (``logging.plan_cluster``, written by ``scripts/plan.py --calibrate``),
the predicted step time against the fastest measured step after the first. Nothing is
communicated: rank 0 compares its own figures, so the lines cost no time.
"""

from typing import TYPE_CHECKING, Dict, Sequence

from torch import nn
from torch.optim import Optimizer

from scaletorch.dist import get_ledger
from scaletorch.plan.cluster import load_cluster
from scaletorch.plan.layout import from_config as layout_of
from scaletorch.plan.memory import state_bytes
from scaletorch.plan.model import from_config as model_of
from scaletorch.plan.report import human
from scaletorch.plan.time import measured_step, step_time
from scaletorch.plan.traffic import wire_bytes_per_group

if TYPE_CHECKING:
    from scaletorch.config import Config


def _pair(predicted: float, measured: float) -> str:
    """'157 kB =' when the prediction equals the measurement, else both and the difference."""
    if predicted == measured:
        return f"{human(predicted)} ="
    if measured == 0:  # nothing measured (e.g. no gradient held at the end): no ratio
        return f"{human(predicted)} vs 0 B"
    return f"{human(predicted)} vs {human(measured)} ({100 * (predicted / measured - 1):+.1f}%)"


def plan_report(cfg: "Config", world: int, pp_rank: int, model: nn.Module, optimizer: Optimizer,
                step: int, step_seconds: Sequence[float]) -> str:
    """'plan' lines for this rank: predicted = measured. Empty when the planner does not model
    the run: impl torch (PyTorch's own collectives bypass the ledger), a precision other than
    fp32."""
    from scaletorch.parallel.memory_report import measure_memory

    if cfg.parallel.impl != "ours" or cfg.training.precision not in ("auto", "fp32"):
        return ""
    try:
        plan_model, layout = model_of(cfg.model), layout_of(cfg, world)
    except ValueError:
        return ""
    states = state_bytes(plan_model, layout, pp_rank)
    memory = measure_memory(model, optimizer)
    ledger = get_ledger()
    predicted = wire_bytes_per_group(plan_model, layout, pp_rank)
    measured: Dict[str, float] = {g: 0.0 for g in predicted}
    for r in ledger.select(step=step):
        measured[r.group] = measured.get(r.group, 0.0) + r.wire_bytes
    lines = [
        "plan (scaletorch/plan, doc/09) = measured, rank 0: " +
        ", ".join(f"{k} {_pair(states[k], memory[k])}" for k in ("params", "grads", "optimizer")) +
        "; wire per step " + (", ".join(f"{g} {_pair(predicted.get(g, 0.0), v)}"
                                        for g, v in sorted(measured.items())) or "none")
    ]
    if cfg.logging.plan_cluster and len(step_seconds) > 1:
        cluster = load_cluster(cfg.logging.plan_cluster)
        seconds = step_time(plan_model, layout, cluster)["step_time_s"]
        step_s = measured_step(step_seconds)
        lines.append(f"plan step time {1e3 * seconds:.1f} ms vs measured {1e3 * step_s:.1f} ms "
                     f"(10th percentile of the steps after the first; "
                     f"{cfg.logging.plan_cluster})")
    return "\n".join(lines)
