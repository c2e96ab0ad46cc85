"""Search: every layout of a model on N GPUs for a global batch, the ones that fit, ranked.

Enumerated: tp in the divisors of the GPUs per node (a tp group stays on NVLink), cp and pp
powers of two (pp up to the layer count; an uneven layer count gets Llama 3's split, one layer
fewer on the first and the last stage), dp what is left, ZeRO 1 or 3 (stage 0 and 2 send the
same bytes as 1 and hold more), virtual stages 1, 2, 4 under a pipeline, micro-batch 1 or 2,
recomputation none, selective or full; sequence parallel whenever tp > 1. Each is checked by
``check`` (the trainer's one layout check, from scripts/plan.py) and against the GPU's memory;
the rest are ranked by predicted tokens/s per GPU. A family (tp, cp, pp) none of whose
variants survive is reported with its reason. The pipelines are 1F1B (v = 1) and
interleaved (v > 1): the zero-bubble schedules (``NOT_SEARCHED``) are planned one at a time
(``--schedule``), since their bubble is a simulation of the schedule (pipeline.bubble), about
a second per layout at p = 64 and longer beyond, where a search tries thousands of layouts.
"""

from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Tuple

from scaletorch.plan.cluster import Cluster
from scaletorch.plan.layout import ZERO_BUBBLE, PlanLayout
from scaletorch.plan.model import ModelSpec
from scaletorch.plan.report import evaluate

Check = Callable[[ModelSpec, PlanLayout], Optional[str]]  # None: valid; else why not
NOT_SEARCHED = ZERO_BUBBLE  # what the search leaves out (the module docstring says why)


def _powers(limit: int) -> List[int]:
    out, p = [], 1
    while p <= limit:
        out.append(p)
        p *= 2
    return out


def balanced_split(layers: int, stages: int) -> Optional[List[int]]:
    """None when ``stages`` divides ``layers``; else one fewer layer on the first and the last
    stage (Llama 3's 126 layers on 16 stages: 7, 8 x 14, 7) if that balances, else the most even
    split."""
    if layers % stages == 0:
        return None
    if stages > 2 and (layers + 2) % stages == 0:
        per = (layers + 2) // stages
        return [per - 1] + [per] * (stages - 2) + [per - 1]
    base, extra = divmod(layers, stages)
    return [base + (1 if 0 < s <= extra else 0) for s in range(stages)] if base else None


def candidates(model: ModelSpec, gpus: int, cluster: Cluster, batch_sequences: int, seq_len: int,
               precision: str, flash: bool, base: Optional[Dict[str,
                                                                Any]] = None) -> List[PlanLayout]:
    """Every layout the module docstring lists; ``base``: fields every layout shares (a
    framework, compiled, fp8). torchtitan's layouts shard with FSDP2 only (ZeRO-3) and
    recompute none, per op or fully (its modes)."""
    base = dict(base or {})
    titan = base.get("framework") == "torchtitan"
    zeros = (3, ) if titan else (1, 3)
    modes = ("none", "op", "full") if titan else ("none", "selective", "full")
    out = []
    tps = [t for t in (1, 2, 4, 8) if t <= cluster.gpus_per_node]
    for tp in tps:
        for cp in _powers(min(gpus // tp, seq_len // 1024 or 1)):
            for pp in _powers(min(gpus // (tp * cp), model.num_layers)):
                if gpus % (tp * cp * pp):
                    continue
                dp = gpus // (tp * cp * pp)
                for b in (1, 2):
                    if batch_sequences % (dp * b):
                        continue
                    m = batch_sequences // (dp * b)
                    for v in ((1, 2, 4) if pp > 1 else (1, )):
                        stages = pp * v
                        if stages > model.num_layers:
                            continue
                        split = balanced_split(model.num_layers, stages)
                        if split is None and model.num_layers % stages:
                            continue
                        for zero in zeros:
                            for ac in modes:
                                out.append(
                                    PlanLayout(tp=tp, pp=pp, cp=cp, dp=dp, zero_stage=zero,
                                               virtual_stages=v,
                                               schedule="interleaved" if v > 1 else "1f1b",
                                               num_micro_batches=m, micro_batch_size=b,
                                               seq_len=seq_len, sequence_parallel=tp > 1,
                                               activation_checkpointing=ac, precision=precision,
                                               flash_attention=flash, layer_split=split, **base))
    return out


def search(
        model: ModelSpec, gpus: int, cluster: Cluster, batch_sequences: int, seq_len: int,
        precision: str, flash: bool, check: Check, top: int = 5, base: Optional[Dict[str,
                                                                                     Any]] = None,
        progress: Optional[Callable[[int, int], None]] = None) -> Tuple[List[Dict], Dict[str, str]]:
    """(the ``top`` best layouts as ``evaluate`` dicts, {family: reason} for rejected
    families); ``base`` as for ``candidates``; ``progress(done, total)`` after each layout."""
    fits: List[Dict] = []
    reasons: Dict[Tuple[int, int, int], List[str]] = {}
    layouts = candidates(model, gpus, cluster, batch_sequences, seq_len, precision, flash, base)
    for i, layout in enumerate(layouts):
        if progress:
            progress(i, len(layouts))
        family = (layout.tp, layout.cp, layout.pp)
        why = check(model, layout)
        if why is None:
            result = evaluate(model, layout, cluster)
            if result["fits"]:
                fits.append(result)
                continue
            need = result["memory_bytes"]["total"] / 1e9
            why = f"out of memory: at least {need:.0f} GB per GPU > {cluster.hbm_bytes / 1e9:.0f}"
        reasons.setdefault(family, []).append(why)
    alive = {(r["tp"], r["cp"], r["pp"]) for r in fits}
    rejected = {}
    for (tp, cp, pp), whys in sorted(reasons.items()):
        if (tp, cp, pp) in alive:
            continue
        # the least memory any variant needed, or the layout check's reason
        memory = [w for w in whys if w.startswith("out of memory")]
        others = [w for w in whys if not w.startswith("out of memory")]
        reason = min(memory, key=lambda w: float(w.split()[5])) if memory else others[0]
        rejected[f"tp{tp} cp{cp} pp{pp}"] = reason
    if not fits and not rejected:
        rejected["all"] = f"no layout of {gpus} GPUs divides the global batch of " \
            f"{batch_sequences} sequences"
    fits.sort(key=lambda r: -r["tokens_per_s_per_gpu"])
    return fits[:top], rejected


def with_split(layout: PlanLayout, layers: int) -> PlanLayout:
    """``layout`` with Llama 3's uneven split when its stages do not divide ``layers``."""
    split = balanced_split(layers, layout.pp * layout.virtual_stages)
    return replace(layout, layer_split=split) if split and layout.layer_split is None \
        else layout
