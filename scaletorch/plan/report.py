"""One layout's prediction as a dict (``evaluate``, what ``scripts/plan.py --json`` prints) and
as a few lines of text (``format_breakdown``)."""

from typing import Any, Dict, Optional

from scaletorch.plan.cluster import Cluster
from scaletorch.plan.layout import PlanLayout
from scaletorch.plan.memory import activation_bytes, rank_memory
from scaletorch.plan.model import ModelSpec
from scaletorch.plan.time import step_time
from scaletorch.plan.traffic import wire_bytes_per_group

KINDS = ("params", "grads", "optimizer", "buffers", "activations", "total")


def evaluate(model: ModelSpec, layout: PlanLayout,
             cluster: Optional[Cluster] = None) -> Dict[str, Any]:
    """The layout's fields; ``memory_bytes`` and ``wire_bytes_per_step`` of the most-loaded
    pipeline rank (``most_loaded``); the time figures if a cluster is given."""
    worst = most_loaded(model, layout)
    memory = {worst: rank_memory(model, layout, worst)}
    out: Dict[str, Any] = dict(layout.as_dict())
    out.update({
        "model": model.name,
        "parameters": model.num_parameters(),
        "world": layout.world,
        "most_loaded_pp_rank": worst,
        "memory_bytes": {
            k: memory[worst][k]
            for k in KINDS
        },
        # what the caching allocator reserves at that peak (memory.ALLOCATOR_SLACK)
        "memory_reserved_bytes": memory[worst]["reserved"],
        "in_flight_micro_batches": activation_bytes(model, layout, worst)["in_flight"],
        "wire_bytes_per_step": wire_bytes_per_group(model, layout, worst),
    })
    if cluster is not None:
        t = step_time(model, layout, cluster)
        out.update({k: t[k] for k in ("bubble", "step_time_s", "tokens_per_s_per_gpu", "mfu")})
        out["exposed_comm_s"] = t["exposed_s"]
        out["compute_s"] = t["compute_s"]
        out["imbalance_s"] = t["imbalance_s"]
        out["fits"] = memory[worst]["total"] <= cluster.hbm_bytes
    return out


def most_loaded(model: ModelSpec, layout: PlanLayout) -> int:
    """The pipeline rank that holds the most bytes. Every stage is compared, not the ends
    alone: an uneven ``layer_split`` can load a middle stage most (and an average of the
    stages hides it)."""
    return max(range(layout.pp), key=lambda r: rank_memory(model, layout, r)["total"])


def human(x: float) -> str:
    """Bytes with a decimal unit: 1.23 GB, 45.6 MB, 789 B."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= size:
            return f"{x / size:.3g} {unit}"
    return f"{x:.0f} B"


def format_breakdown(result: Dict[str, Any]) -> str:
    """A few lines: memory by kind, wire bytes by group, time, bubble, MFU."""
    mem = result["memory_bytes"]
    lines = [
        f"model {result['model']} ({result['parameters']:,} parameters), world "
        f"{result['world']}: " + layout_line(result),
        f"memory per GPU (pp rank {result['most_loaded_pp_rank']}): " +
        ", ".join(f"{k} {human(mem[k])}" for k in KINDS),
        "wire bytes per step per GPU: " +
        (", ".join(f"{g} {human(v)}"
                   for g, v in sorted(result["wire_bytes_per_step"].items())) or "none"),
    ]
    if "step_time_s" in result:
        exposed = ", ".join(f"{g} {v:.3g}" for g, v in sorted(result["exposed_comm_s"].items()))
        lines.append(f"step {result['step_time_s']:.3g} s (compute {result['compute_s']:.3g} s, "
                     f"exposed comm s: {exposed or 'none'}, bubble {result['bubble']:.3f}); "
                     f"{result['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, MFU "
                     f"{100 * result['mfu']:.1f}%")
        if result.get("moe_imbalance", 1.0) != 1.0:
            hot = result["imbalance_s"]
            lines.append(f"MoE imbalance {result['moe_imbalance']:g} (max/mean rows per ep rank): "
                         f"the hot rank adds {hot['compute']:.3g} s of expert compute and "
                         f"{hot['ep']:.3g} s of all-to-all bytes; every rank waits for it")
    return "\n".join(lines)


def layout_line(r: Dict[str, Any]) -> str:
    layout = PlanLayout(**{k: r[k] for k in PlanLayout().as_dict()})
    return layout.describe() + f" s{layout.seq_len}"
