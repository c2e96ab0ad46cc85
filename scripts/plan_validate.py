"""Chapter 09: the planner against published GPU runs: tokens/s per GPU and peak memory.

    python scripts/plan_validate.py            # the table, then what each ring step costs
    python scripts/plan_validate.py --json     # the same rows as JSON
    python scripts/plan_validate.py --plot doc/img/09_validation.png   # predicted vs published

Each row is a run someone measured and published, with its source: the Llama 3 paper's
Table 4 (405B on 8,192 and 16,384 H100s: TFLOP/s per GPU; no memory published) and
torchtitan's benchmark of December 2024 (benchmarks/llama3_h100_202412_torchtitan.md: Llama
3.1 8B, 70B, 405B on H100s capped at 500 W: tokens/s per GPU and peak memory, which
torchtitan logs as the caching allocator's peak reserved bytes), and torchao's float8 README
(torchtitan on 8 H100s: bf16 against float8 matmuls with float8 FSDP all-gathers). The
planner is given each
run's layout as published and predicts it; a row passes when tokens/s is within 20% and
memory within 15% (the goals of issue 30). A row whose run used something the planner does
not model says so, and its verdict is not counted.
"""

import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scaletorch.plan.cluster import load_cluster  # noqa: E402
from scaletorch.plan.layout import PlanLayout  # noqa: E402
from scaletorch.plan.model import preset  # noqa: E402
from scaletorch.plan.report import evaluate  # noqa: E402
from scaletorch.plan.search import with_split  # noqa: E402
from scaletorch.rules.errors import OneLineParser  # noqa: E402
from scripts.plot_base import save_figure  # noqa: E402

SPEED_TOLERANCE = 0.20
MEMORY_TOLERANCE = 0.15
GIB = 2**30
TITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
LLAMA3 = "The Llama 3 Herd of Models (2024), Table 4"
TORCHAO = "torchao torchao/float8/README.md, Training benchmarks (8 H100s)"

# The FSDP + CP rows of a series hold every local sequence at 32768 tokens, so each ring step
# does the same work, and a rank runs cp of them (ring_steps prints what each added step costs).
# For 8B a ring step costs 4.5 s from cp 1 to 2, then 8.8 s and 7.3 s; the planner's ring (its
# FLOPs, fp32 merges and copies, hidden traffic) costs 5.4-5.7 s at every cp. What makes torch's
# ring of December 2024 slower beyond two ranks is not in its code's FLOPs, bytes or messages
# as we read them, so the planner lacks it:
RING_BEYOND_2 = ("torch's ring attention beyond 2 ranks (Dec. 2024): its steps cost more than "
                 "planned (below)")


@dataclass
class Row:
    name: str
    source: str
    model: str
    layout: Dict[str, Any]
    cluster: str
    tokens_per_s: float = 0.0  # published tokens/s per GPU (0: published as TFLOP/s)
    tflops: float = 0.0  # published model TFLOP/s per GPU
    memory_gib: float = 0.0  # published peak memory (0: not published)
    missing: str = ""  # what the run used that the planner does not model
    notes: List[str] = field(default_factory=list)


def _titan(**kw: Any) -> Dict[str, Any]:
    """torchtitan's layout defaults: FSDP2 (ZeRO-3) with fp32 sharded states and bf16
    compute ("autocast": 4 + 4 + 8 bytes a parameter), flash attention, sequence 8192."""
    out = dict(framework="torchtitan", precision="autocast", zero_stage=3, flash_attention=True,
               seq_len=8192)
    out.update(kw)
    if out.get("tp", 1) > 1:
        out["sequence_parallel"] = True
    return out


def _llama3(**kw: Any) -> Dict[str, Any]:
    """Llama 3's pre-training (the paper, Section 3.3): bf16 with fp32 master weights and
    gradients, ZeRO-1-like sharding of the optimizer, Megatron-style fused kernels (modelled
    as compiled), interleaved 1F1B (v = 4 assumed: the paper does not give it), selective
    recomputation, the 126 layers split 7, 8 x 14, 7 (one fewer on the first and last)."""
    out = dict(framework="torchtitan", precision="bf16-fp32-grads", zero_stage=1, tp=8, pp=16,
               sequence_parallel=True, flash_attention=True, compiled=True, schedule="interleaved",
               virtual_stages=4, activation_checkpointing="selective", seq_len=8192)
    out.update(kw)
    return out


ROWS: List[Row] = [
    Row("8B FSDP 8 GPUs", TITAN + ", 8B on 8 GPUs", "llama3-8b",
        _titan(dp=8, micro_batch_size=2, activation_checkpointing="op"), "h100-500w",
        tokens_per_s=5762, memory_gib=82.4),
    Row("8B FSDP 8 GPUs compile", TITAN + ", 8B on 8 GPUs", "llama3-8b",
        _titan(dp=8, micro_batch_size=2, activation_checkpointing="op", compiled=True), "h100-500w",
        tokens_per_s=6667, memory_gib=77.0),
    Row(
        "8B FSDP 8 GPUs compile fp8", TITAN + ", 8B on 8 GPUs", "llama3-8b",
        _titan(dp=8, micro_batch_size=2, activation_checkpointing="op", compiled=True,
               fp8="matmul"), "h100-500w", tokens_per_s=8532, memory_gib=76.8),
    Row("8B FSDP 128 GPUs", TITAN + ", 8B on 128 GPUs", "llama3-8b",
        _titan(dp=128, micro_batch_size=2, activation_checkpointing="op"), "h100-500w",
        tokens_per_s=5605, memory_gib=67.0),
    Row("8B FSDP 128 GPUs compile", TITAN + ", 8B on 128 GPUs", "llama3-8b",
        _titan(dp=128, micro_batch_size=2, activation_checkpointing="op", compiled=True),
        "h100-500w", tokens_per_s=6514, memory_gib=62.0),
    Row(
        "8B FSDP 128 GPUs compile fp8", TITAN + ", 8B on 128 GPUs", "llama3-8b",
        _titan(dp=128, micro_batch_size=2, activation_checkpointing="op", compiled=True,
               fp8="matmul"), "h100-500w", tokens_per_s=8380, memory_gib=61.8),
] + [
    # torchao's float8 README (torchtitan, 8 H100s, local batch 1, compile, per-op selective
    # recomputation): bf16 against float8 matmuls with float8 FSDP all-gathers. It does not name
    # the GPUs' power cap; we assume the torchtitan team's 500 W machines of the rows above
    # (at 700 W the planner predicts 42% above its bf16 row). "GB" read as torchtitan's GiB.
    Row(f"8B FSDP 8 GPUs b1 compile{name}", TORCHAO, "llama3-8b",
        _titan(dp=8, micro_batch_size=1, activation_checkpointing="op", compiled=True, fp8=fp8),
        "h100-500w", tokens_per_s=tps, memory_gib=mem)
    for name, fp8, tps, mem in (("", "none", 6150, 47.65),
                                (" fp8+AG", "matmul+all-gather", 7689.5, 47.77))
] + [
    Row(
        f"8B FSDP{8 // cp} CP{cp} s{seq // 1024}k", TITAN + ", 8B on 8 GPUs, FSDP + CP",
        "llama3-8b",
        _titan(dp=8 // cp, cp=cp, seq_len=seq, activation_checkpointing="full", compiled=True,
               fp8="matmul"), "h100-500w", tokens_per_s=tps, memory_gib=mem,
        missing=RING_BEYOND_2 if cp > 2 else "")
    for cp, seq, tps, mem in ((1, 32768, 3890, 83.9), (2, 65536, 2540, 84.2),
                              (4, 131072, 1071, 84.0), (8, 262144, 548, 84.5))
] + [
    Row(
        "70B FSDP32 TP8", TITAN + ", 70B on 256 GPUs", "llama3-70b",
        _titan(dp=32, tp=8, micro_batch_size=16, activation_checkpointing="full", compiled=True,
               fp8="matmul"), "h100-500w", tokens_per_s=829, memory_gib=71.9),
    Row(
        "70B FSDP32 TP8 AsyncTP", TITAN + ", 70B on 256 GPUs", "llama3-70b",
        _titan(dp=32, tp=8, micro_batch_size=16, activation_checkpointing="full", compiled=True,
               fp8="matmul"), "h100-500w", tokens_per_s=876, memory_gib=67.6,
        missing="AsyncTP (tp's collectives overlapped with its matmuls)"),
    Row(
        "405B FSDP8 TP8 PP8 1F1B", TITAN + ", 405B on 512 GPUs", "llama3-405b",
        _titan(dp=8, tp=8, pp=8, num_micro_batches=8, micro_batch_size=4,
               activation_checkpointing="full", compiled=True, fp8="matmul"), "h100-500w",
        tokens_per_s=100, memory_gib=82.5, missing="AsyncTP"),
    Row(
        "405B FSDP8 TP8 PP8 interleaved", TITAN + ", 405B on 512 GPUs", "llama3-405b",
        _titan(dp=8, tp=8, pp=8, num_micro_batches=8, micro_batch_size=4, schedule="interleaved",
               virtual_stages=2, activation_checkpointing="full", compiled=True, fp8="matmul"),
        "h100-500w", tokens_per_s=128, memory_gib=72.7,
        missing="AsyncTP; the stages per rank (v = 2 assumed)"),
] + [
    Row(
        f"405B FSDP{8 // cp} CP{cp} TP8 PP8 s{seq // 1024}k", TITAN + ", 405B on 512 GPUs, 4-D",
        "llama3-405b",
        _titan(dp=8 // cp, cp=cp, tp=8, pp=8, seq_len=seq, num_micro_batches=8, micro_batch_size=1,
               activation_checkpointing="full", compiled=True,
               fp8="matmul"), "h100-500w", tokens_per_s=tps, memory_gib=mem, missing="AsyncTP" +
        ("; " + RING_BEYOND_2 if cp > 2 else ""))
    for cp, seq, tps, mem in ((1, 32768, 76, 75.3), (2, 65536, 47, 75.9), (4, 131072, 31, 77.1),
                              (8, 262144, 16, 84.9))
] + [
    Row("405B 8,192 GPUs s8k", LLAMA3, "llama3-405b", _llama3(dp=64, num_micro_batches=32), "h100",
        tflops=430),
    Row("405B 16,384 GPUs s8k", LLAMA3, "llama3-405b", _llama3(dp=128, num_micro_batches=16),
        "h100", tflops=400),
    Row("405B 16,384 GPUs s128k", LLAMA3, "llama3-405b",
        _llama3(dp=8, cp=16, seq_len=131072, num_micro_batches=16), "h100", tflops=380),
]


def predict(row: Row) -> Dict[str, Any]:
    """The planner's figures for ``row``, and how far they are from the published ones."""
    model = preset(row.model)
    layout = with_split(PlanLayout(**row.layout), model.num_layers)
    result = evaluate(model, layout, load_cluster(row.cluster))
    tflops = result["mfu"] * load_cluster(row.cluster).peak_flops / 1e12
    out: Dict[str, Any] = {
        "name": row.name,
        "source": row.source,
        "layout": layout.describe() + f" s{layout.seq_len}",
        "cluster": row.cluster,
        "missing": row.missing,
        "predicted_tokens_per_s": result["tokens_per_s_per_gpu"],
        "predicted_tflops": tflops,
        "predicted_memory_gib": result["memory_reserved_bytes"] / GIB,
        "tokens_per_gpu_step": layout.tokens_per_step / layout.world,
        "cp": layout.cp,
    }
    if row.tokens_per_s:
        out["published_speed"] = row.tokens_per_s
        out["speed_error"] = result["tokens_per_s_per_gpu"] / row.tokens_per_s - 1
    else:
        out["published_speed"] = row.tflops
        out["speed_error"] = tflops / row.tflops - 1
    out["published_memory_gib"] = row.memory_gib or None
    out["memory_error"] = (out["predicted_memory_gib"] / row.memory_gib -
                           1) if row.memory_gib else None
    ok = abs(out["speed_error"]) <= SPEED_TOLERANCE and (out["memory_error"] is None or abs(
        out["memory_error"]) <= MEMORY_TOLERANCE)
    out["verdict"] = ("ok" if ok else "FAIL") + (" (not all modelled)" if row.missing else "")
    return out


def table(results: List[Dict[str, Any]]) -> str:
    lines = [
        f"{'run':<34}{'speed':>9}{'published':>11}{'error':>8}{'GiB':>7}{'published':>11}"
        f"{'error':>8}  verdict"
    ]
    for r in results:
        unit = "TF/s" if r["source"] == LLAMA3 else "tok/s"
        speed = r["predicted_tokens_per_s"] if unit == "tok/s" else r["predicted_tflops"]
        mem = f"{r['published_memory_gib']:>11.1f}{100 * r['memory_error']:>+7.0f}%" \
            if r["published_memory_gib"] else f"{'-':>11}{'-':>8}"
        lines.append(f"{r['name']:<34}{speed:>9,.0f}{r['published_speed']:>7,.0f} {unit:<4}"
                     f"{100 * r['speed_error']:>+6.0f}%{r['predicted_memory_gib']:>7.1f}{mem}"
                     f"  {r['verdict']}")
    modelled = [r for r in results if not r["missing"]]
    passed = sum(r["verdict"] == "ok" for r in modelled)
    lines.append(f"{passed} of {len(modelled)} modelled rows within {SPEED_TOLERANCE:.0%} "
                 f"(speed) and {MEMORY_TOLERANCE:.0%} (memory); {len(results) - len(modelled)} "
                 "rows ran what the planner does not model (their verdicts are not counted):")
    for r in results:
        if r["missing"]:
            lines.append(f"  {r['name']}: {r['missing']}")
    sources = sorted({r["source"].split(",")[0] for r in results})
    lines.append("sources: " + "; ".join(sources))
    return "\n".join(lines)


def ring_steps(results: List[Dict[str, Any]]) -> str:
    """What each added ring step costs, published and planned, in each series of torchtitan's
    FSDP + CP rows. Within a series every local sequence has the same length, so a ring step
    has the same work at every cp, and a rank runs cp of them: from cp a to cp b a step gains
    (b - a) ring steps. Step seconds = a GPU's tokens per step / its tokens per second."""
    series: Dict[str, List[Dict[str, Any]]] = {}
    for r in results:
        if r["source"].endswith("FSDP + CP") or r["source"].endswith("4-D"):
            series.setdefault(r["source"].split(", ", 1)[1], []).append(r)
    lines = ["seconds an added ring step costs (every local sequence the same length):"]
    for name, rows in series.items():
        rows = sorted(rows, key=lambda r: r["cp"])
        pairs = list(zip(rows, rows[1:]))
        steps = "".join(f"{'cp %d->%d' % (a['cp'], b['cp']):>10}" for a, b in pairs)
        lines.append(f"  {name:<30}{steps}")
        for label, speed in (("published", "published_speed"), ("planned",
                                                                "predicted_tokens_per_s")):
            cost = [(b["tokens_per_gpu_step"] / b[speed] - a["tokens_per_gpu_step"] / a[speed]) /
                    (b["cp"] - a["cp"]) for a, b in pairs]
            lines.append(f"    {label:<28}" + "".join(f"{c:>10.1f}" for c in cost))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="the rows as one JSON object")
    parser.add_argument(
        "--plot", metavar="FILE.png",
        help="also draw predicted against published, one point per row (needs "
        "the optional plot extra: pip install -e .[plot])")
    args = parser.parse_args(argv)
    results = [predict(r) for r in ROWS]
    print(
        json.dumps({"rows": results}, indent=1) if args.json else table(results) + "\n" +
        ring_steps(results))
    if args.plot:
        try:
            plot(results, args.plot)
        except ImportError:
            print("error: --plot needs matplotlib (pip install -e .[plot])", file=sys.stderr)
            return 2
        except ValueError as err:  # a suffix matplotlib cannot write, a full disk: one line
            print(f"error: --plot {err}", file=sys.stderr)
            return 2
        print(f"wrote {args.plot}")
    return 0


def plot(results: List[Dict[str, Any]], path: str) -> None:
    """Two panels: speed (published over predicted, as a ratio to the published figure) and
    memory, one point per row, the tolerance band shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    panels = (("speed", "published_speed", "speed_error", SPEED_TOLERANCE,
               "tokens/s per GPU (torchtitan) or TFLOP/s per GPU (Llama 3)"),
              ("memory", "published_memory_gib", "memory_error", MEMORY_TOLERANCE,
               "peak memory, GiB (torchtitan)"))
    for ax, (title, key, error, tolerance, label) in zip(axes, panels):
        rows = [r for r in results if r[key]]
        published = [r[key] for r in rows]
        predicted = [r[key] * (1 + r[error]) for r in rows]
        low, high = min(published + predicted) / 1.5, max(published + predicted) * 1.5
        line = [low, high]
        ax.plot(line, line, color="black", linewidth=0.8)
        ax.fill_between(line, [x * (1 - tolerance) for x in line],
                        [x * (1 + tolerance) for x in line], color="tab:green", alpha=0.15,
                        label=f"within {tolerance:.0%}")
        for r, x, y in zip(rows, published, predicted):
            color = "tab:gray" if r["missing"] else (
                "tab:blue" if abs(r[error]) <= tolerance else "tab:red")
            ax.scatter([x], [y], color=color, s=18)
            ax.annotate(r["name"], (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
        if title == "speed":
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_xlim(low, high)
        ax.set_ylim(low, high)
        ax.set_xlabel(f"published {label}")
        ax.set_ylabel("planner")
        ax.set_title(f"{title}: red outside the band, gray: not all modelled")
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
