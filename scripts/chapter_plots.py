"""The chapters' pictures, each drawn from what the chapter's own run wrote or printed.

``scripts/plot.py`` dispatches these subcommands here. A run's printed tables (the memory table,
the ledger, the overlap chart, the routing table) are read from its saved standard output, so
the picture shows exactly the numbers the page shows:

    scripts/launch.sh examples/01_ddp.py --nproc-per-node 2 -- --steps 10 --verbose > runs/01.log
    python scripts/plot.py ddp-buckets runs/01.log --out doc/img/01_buckets.png

    loss-floor RUN_DIR...      00, 10: metrics.jsonl and the floor of the run's data (config.yaml)
    ddp-buckets LOG            01: each bucket's all-reduce against backward (each rank's last step)
    zero-memory LOG...         01, 02: bytes per rank by kind, measured beside the formula
    tp-split LOG               03: column and row parallel layers and the bytes of each all-reduce
    pipeline-vs-sim RUN_DIR    04: the measured timeline.json beside the simulator's, same costs
    zigzag LOG                 05: which rank holds which slice, attention work per rank
    experts LOG                06: tokens per expert per rank, and what each rank sends
    rank-grid LOG              07: the ranks of the layout and each one's traffic per group
    dtype-bytes LOG...         08: bytes on the wire per collective, one bar per run's precision

Each prints the data it draws as a table, then writes the PNG (``--out``); without matplotlib
it prints the table only. The parsers need no matplotlib (tests/test_chapter_plots.py).
"""

import math
import os
import re
import sys
from typing import Dict, List, Tuple

from scaletorch.rules import boundary

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from scripts.plot_base import draw_timeline, label_of, pyplot  # noqa: E402  # isort: skip
from scripts.plot_base import read_metrics, read_timeline, save_figure  # noqa: E402  # isort: skip

NUMBER = r"[\d,]+(?:\.\d+)?"
RANK_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
               "tab:pink", "tab:gray")


def _num(text: str) -> float:
    return float(text.replace(",", ""))


LOG_BYTES = 64 << 20  # a chapter's saved output is kilobytes; a larger file is not one


def read_log(path: str) -> str:
    """A chapter's saved output: a regular file within LOG_BYTES (a directory, a FIFO or a
    huge file is refused unread), decoded with any stray byte replaced."""
    if not os.path.lexists(path):
        raise FileNotFoundError(f"log {path!r} does not exist (save the run's output: "
                                f"scripts/launch.sh ... > {path})")
    return boundary.read_bytes(path, "log", LOG_BYTES, digest=False).decode("utf-8", "replace")


def _need(found, what: str, path: str):
    if not found:
        raise ValueError(f"{path}: no {what} in it (is it the output of the right chapter?)")
    return found


def _save(plt, fig, out: str) -> None:
    fig.tight_layout()
    save_figure(fig, out, dpi=110)
    print(f"wrote {out}")


# --- 00, 10: the loss and its floor ------------------------------------------------------------


def read_config(run_dir: str) -> dict:
    """The resolved config the Trainer wrote beside metrics.jsonl."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist (the Trainer writes it with metrics.jsonl)")
    return boundary.load_yaml(boundary.read_text(path, "run config", boundary.CONFIG_BYTES), path)


def loss_floor(run_dir: str) -> Tuple[str, float]:
    """(what the floor is, its value in nats/token) for the run's data: the entropy rate of the
    synthetic chain, else the loss of a uniform guess over the vocabulary (log V)."""
    cfg = read_config(run_dir)
    data, vocab = cfg["data"], cfg["model"]["vocab_size"]
    if data["dataset"] == "synthetic":
        from scaletorch.data import build_dataset
        return "entropy floor", build_dataset("synthetic", vocab, data["seed"]).entropy_rate()
    return f"uniform over {vocab} tokens, log {vocab}", math.log(vocab)


def plot_loss_floor(run_dirs: List[str], out: str) -> None:
    plt = pyplot()
    fig, ax = (None, None) if plt is None else plt.subplots(figsize=(7, 3.8))
    for i, run_dir in enumerate(run_dirs):
        curve = read_metrics(os.path.join(run_dir, "metrics.jsonl"), "loss")
        what, floor = loss_floor(run_dir)
        name = label_of(os.path.join(run_dir, "metrics.jsonl"))
        steps, loss = curve["step"], curve["loss"]
        print(f"{name}: {len(steps)} steps, loss {loss[0]:.4f} -> {loss[-1]:.4f}; {what} "
              f"{floor:.4f}; last loss minus it: {loss[-1] - floor:+.4f}")
        if ax is not None:
            color = RANK_COLORS[i % len(RANK_COLORS)]
            ax.plot(steps, loss, color=color, linewidth=1.3, label=f"{name}: loss")
            ax.axhline(floor, color=color, linestyle="--", linewidth=1, label=f"{what} {floor:.3f}")
    if ax is not None:
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.set_title(
            "training loss against " +
            ("the lowest loss the data allows" if what == "entropy floor" else "a uniform guess"),
            fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        _save(plt, fig, out)


# --- 01: buckets against backward --------------------------------------------------------------

OVERLAP_ROW = re.compile(r"^(forward\+backward|bucket \d+|wait)\s+\|[^|]*\|\s*(" + NUMBER +
                         r") -\s+(" + NUMBER + r") ms(?:\s+(" + NUMBER + r") MB)?")


def parse_overlap(text: str, path: str = "log") -> Dict[int, List[dict]]:
    """The last step's overlap chart of each rank of a 01_ddp run: {rank: [{"row", "start_ms",
    "end_ms", "mb"}, ...]} (ms since that rank's step began: each rank has its own clock)."""
    heads = list(re.finditer(r"^overlap in step (\d+) \(rank (\d+)", text, re.M))
    heads = _need(heads, "per-bucket overlap chart (01_ddp.py prints it under --verbose)", path)
    last = max(int(h.group(1)) for h in heads)
    charts: Dict[int, List[dict]] = {}
    for head in heads:
        if int(head.group(1)) != last:
            continue
        rows = charts.setdefault(int(head.group(2)), [])
        for line in text[head.end():].splitlines()[1:]:
            m = OVERLAP_ROW.match(line.strip())
            if m is None:
                break
            rows.append(
                dict(row=m.group(1), start_ms=_num(m.group(2)), end_ms=_num(m.group(3)),
                     mb=_num(m.group(4)) if m.group(4) else None))
        _need(rows, f"rows under 'overlap in step {last} (rank {head.group(2)}'", path)
    return charts


def plot_ddp_buckets(path: str, out: str) -> None:
    charts = parse_overlap(read_log(path), path)
    for rank, rows in sorted(charts.items()):
        print(f"rank {rank}: {'row':<18}{'MB':>8}  from, to (ms since the rank's step began)")
        for r in rows:
            mb = "" if r["mb"] is None else f"{r['mb']:.3f}"
            print(f"rank {rank}: {r['row']:<18}{mb:>8}  {r['start_ms']:.1f} ms to "
                  f"{r['end_ms']:.1f} ms")
        buckets = [r for r in rows if r["row"].startswith("bucket")]
        print(f"rank {rank}: {len(buckets)} buckets, {sum(r['mb'] for r in buckets):.3f} MB "
              f"all-reduced, waited {rows[-1]['end_ms'] - rows[-1]['start_ms']:.1f} ms")
    plt = pyplot()
    if plt is None:
        return
    height = sum(0.3 * len(rows) + 0.6 for rows in charts.values()) + 0.8
    fig, axes = plt.subplots(len(charts), 1, figsize=(8, height), sharex=True, squeeze=False)
    for ax, (rank, rows) in zip(axes[:, 0], sorted(charts.items())):
        for y, r in enumerate(rows):
            kind = r["row"].split()[0]
            color = {"forward+backward": "tab:gray", "wait": "tab:red"}.get(kind, "tab:blue")
            width = max(r["end_ms"] - r["start_ms"], 0.05)
            ax.barh(y, width, left=r["start_ms"], color=color, alpha=0.8, edgecolor="black",
                    linewidth=0.4)
            if r["mb"] is not None:
                ax.text(r["end_ms"], y, f" {r['mb']:.3f} MB", va="center", fontsize=6)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([r["row"] for r in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_ylabel(f"rank {rank}", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("ms since the rank's step began (each rank's own clock)")
    axes[0, 0].set_title("each bucket's all-reduce, launched while backward still runs, per rank",
                         fontsize=10)
    _save(plt, fig, out)


# --- 01, 02: memory per rank -------------------------------------------------------------------

KINDS = ("params", "grads", "optimizer")


def parse_memory(text: str, path: str = "log") -> List[dict]:
    """Every memory table ("memory per rank, bytes (...)"): [{"title", "ranks": [{"params",
    "grads", "optimizer", "peak"}], "formula": {...}, "symbols": [...]}, ...]."""
    tables = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^memory per rank, bytes \((.*)\)\s*$", line.strip())
        if not m:
            continue
        table = dict(title=m.group(1).split(", Psi")[0], ranks=[], formula=None, symbols=[])
        for row in lines[i + 2:]:
            fields = row.split()
            if fields and fields[0].isdigit():
                peak = fields[5] if len(fields) > 5 else "-"
                table["ranks"].append(
                    dict(zip(KINDS, map(_num, fields[1:4])),
                         peak=None if peak == "-" else _num(peak)))
            elif fields and fields[0] == "formula":
                table["formula"] = dict(zip(KINDS, map(_num, fields[1:4])))
            elif table["formula"] is not None and fields:
                table["symbols"] = fields[:3]
                break
            else:
                break
        if table["ranks"] and table["formula"]:
            tables.append(table)
    return _need(tables, "memory table ('memory per rank, bytes')", path)


def plot_zero_memory(paths: List[str], out: str) -> None:
    tables = [t for p in paths for t in parse_memory(read_log(p), p)]
    print(f"{'run':<28}{'params':>11}{'grads':>11}{'optimizer':>11}{'total':>11}"
          f"{'formula':>11}{'peak gathered':>15}")
    for t in tables:
        r = t["ranks"][0]
        total, formula = sum(r[k] for k in KINDS), sum(t["formula"][k] for k in KINDS)
        peak = "-" if r["peak"] is None else f"{r['peak']:,.0f}"
        print(f"{t['title']:<28}" + "".join(f"{r[k]:>11,.0f}" for k in KINDS) +
              f"{total:>11,.0f}{formula:>11,.0f}{peak:>15}")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4.2))
    colors = dict(params="tab:blue", grads="tab:orange", optimizer="tab:green")
    for x, t in enumerate(tables):
        r, bottom = t["ranks"][0], 0.0
        for k in KINDS:
            ax.bar(x, r[k] / 1e3, bottom=bottom, color=colors[k], width=0.55,
                   label=k if x == 0 else None)
            bottom += r[k] / 1e3
        if r["peak"]:
            ax.bar(x, r["peak"] / 1e3, bottom=bottom, color="none", edgecolor="tab:red", hatch="//",
                   width=0.55, label="peak gathered (ZeRO-3)" if x == len(tables) - 1 else None)
        formula = sum(t["formula"][k] for k in KINDS) / 1e3
        ax.plot([x - 0.35, x + 0.35], [formula, formula], color="black", linewidth=2,
                label="formula" if x == 0 else None)
        ax.text(x, formula, " + ".join(t["symbols"]), ha="center", va="bottom", fontsize=7,
                bbox=dict(fc="white", ec="none", pad=1))
    ax.set_xticks(range(len(tables)))
    ax.set_xticklabels([t["title"].replace(", N", "\nN") for t in tables], fontsize=8)
    ax.set_ylabel("kB on rank 0 (fp32)")
    ax.set_title("model state per rank: measured (bars) and formula (line)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    _save(plt, fig, out)


# --- the ledger table, any chapter ---------------------------------------------------------------


def parse_ledger(text: str, path: str = "log") -> List[dict]:
    """The last ledger table ("communication per rank (step N)"): [{"op", "group", "n", "calls",
    "elements", "mb", "wire_mb"}, ...]."""
    tables = _need(text.split("communication per rank (step")[1:], "ledger table", path)
    rows = []
    for line in tables[-1].splitlines()[2:]:
        fields = line.split()
        if len(fields) != 7 or not fields[2].isdigit():
            break
        rows.append(
            dict(op=fields[0], group=fields[1], n=int(fields[2]), calls=int(fields[3]),
                 elements=_num(fields[4]), mb=_num(fields[5]), wire_mb=_num(fields[6])))
    return _need(rows, "rows in the ledger table", path)


# --- 03: column and row parallel ---------------------------------------------------------------


def parse_tp_sites(text: str, path: str = "log") -> dict:
    """03_tensor_parallel's block summary: elements per collective, tp, and each site's ops."""
    m = _need(
        re.search(
            r"b x s x h = (\d+) x (\d+) = (" + NUMBER + r") elements per collective, "
            r"tp (\d+)", text), "'b x s x h = ...' line", path)
    sites = re.findall(r"^(\S.*?\(([fg](?:-bar)?)\))\s+(\S+)\s+(\S+)\s*$", text, re.M)
    return dict(tokens=int(m.group(1)), hidden=int(m.group(2)), elements=int(_num(m.group(3))),
                tp=int(m.group(4)), sites=[(s[0], s[2], s[3]) for s in sites])


def plot_tp_split(path: str, out: str) -> None:
    text = read_log(path)
    info, ledger = parse_tp_sites(text, path), parse_ledger(text, path)
    tp, kb = info["tp"], info["elements"] * 4 / 1e3
    print(f"tp {tp}; one all-reduce carries b x s x h = {info['elements']:,} elements = "
          f"{kb:.1f} kB (fp32)")
    for site, fwd, bwd in info["sites"]:
        print(f"  {site:<24} forward {fwd:<11} backward {bwd}")
    for r in ledger:
        print(f"ledger: {r['op']} over {r['group']}: {r['calls']} calls, {r['elements']:,.0f} "
              f"elements, {r['wire_mb']:.3f} wire MB per step")
    plt = pyplot()
    if plt is None:
        return
    from matplotlib.patches import Rectangle
    fig, ax = plt.subplots(figsize=(9, 3.6))
    # (name, x, kind): column parallel splits the output features, row parallel the input ones
    layers = [("q, k, v", 1.0, "column"), ("o_proj", 3.2, "row"), ("gate, up", 6.4, "column"),
              ("down_proj", 8.6, "row")]
    for name, x, kind in layers:
        for r in range(tp):
            color = RANK_COLORS[r % len(RANK_COLORS)]
            if kind == "column":  # W (in, out): each rank a band of output columns
                box = Rectangle((x + r * 1.2 / tp, 0.5), 1.2 / tp, 1.6, color=color, alpha=0.6)
            else:  # each rank a band of input rows
                box = Rectangle((x, 0.5 + (tp - 1 - r) * 1.6 / tp), 1.2, 1.6 / tp, color=color,
                                alpha=0.6)
            ax.add_patch(box)
        ax.add_patch(Rectangle((x, 0.5), 1.2, 1.6, fill=False, edgecolor="black"))
        ax.text(x + 0.6, 2.25, f"{name}\n{kind} parallel", ha="center", fontsize=8)
    marks = [(0.45, "f", "backward"), (4.95, "f-bar", "forward"), (5.85, "f", "backward"),
             (10.35, "f-bar", "forward")]
    for x, op, when in marks:
        ax.annotate(f"{op}\nall-reduce\nin {when}\n{kb:.1f} kB", (x, 1.3), ha="center", va="center",
                    fontsize=7, bbox=dict(boxstyle="round", fc="lightyellow"))
    for x0, x1 in ((2.2, 3.2), (7.6, 8.6)):
        ax.annotate("", (x1, 1.3), (x0, 1.3), arrowprops=dict(arrowstyle="->"))
    ax.text(2.7, 2.95, "attention", ha="center", fontsize=9, weight="bold")
    ax.text(7.9, 2.95, "MLP", ha="center", fontsize=9, weight="bold")
    wire = sum(r["wire_mb"] for r in ledger if r["group"] == "tp")
    calls = sum(r["calls"] for r in ledger if r["group"] == "tp")
    ax.text(
        5.4, -0.05, f"each matrix drawn (in, out), colored by tp rank 0-{tp - 1}.  Ledger, one "
        f"step: {calls} all-reduces over tp, {wire:.3f} MB on the wire per rank", ha="center",
        fontsize=8)
    ax.set_xlim(0, 10.9)
    ax.set_ylim(-0.2, 3.3)
    ax.axis("off")
    ax.set_title("one block under tensor parallel: which rank holds which part of each matrix",
                 fontsize=10)
    _save(plt, fig, out)


# --- 04: measured pipeline beside the simulator -----------------------------------------------


def mean_costs(timeline) -> Dict[str, float]:
    """Mean duration of each kind of action (F, B, W) in a measured timeline."""
    sums: Dict[str, List[float]] = {}
    for e in timeline.events:
        sums.setdefault(e.action.kind, []).append(e.end - e.start)
    return {k: sum(v) / len(v) for k, v in sums.items()}


def plot_pipeline_vs_sim(run_dir: str, out: str) -> None:
    from scaletorch.schedule import analysis
    path = os.path.join(run_dir, "timeline.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist (examples/04_pipeline_parallel.py "
                                f"writes it)")
    schedule = boundary.load_json(path, "timeline", digest=False).get("schedule")  # V-shaped
    schedule = schedule or read_config(run_dir)["parallel"]["schedule"]
    measured = read_timeline(path)
    costs = mean_costs(measured)
    p, m, v = measured.pp, measured.micro_batches, measured.virtual_stages
    sim = analysis.simulate(schedule, p, m, v, costs["F"], costs["B"], costs.get("W"))
    span = max(t.span()[1] - t.span()[0] for t in (measured, sim))
    print(f"{schedule}, p = {p}, m = {m}, v = {v}; measured mean F {costs['F'] * 1e3:.2f} ms, "
          f"B {costs['B'] * 1e3:.2f} ms")
    for name, t in (("measured", measured), ("simulated", sim)):
        start, end = t.span()
        peaks = [t.peak_live(r) for r in t.ranks()]
        print(f"{name:<10} step {(end - start) * 1e3:.1f} ms, bubble {t.bubble_fraction():.0%}, "
              f"peak live per rank {peaks}")
    print(f"theory (equal stages, no messages): {measured.theory():.3f} = {measured.formula()}")
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(2, 1, figsize=(10, 0.9 * p + 2.2), sharex=True)
    for ax, (name, t) in zip(axes, (("measured (this run, rank by rank)", measured),
                                    ("simulated with the measured mean F and B", sim))):
        draw_timeline(ax, t, name, "s", span)
    fig.suptitle(
        f"{schedule}, p={p}, m={m}: light = forward, dark = backward; numbers = "
        f"micro-batch", fontsize=9)
    _save(plt, fig, out)


# --- 05: zigzag -----------------------------------------------------------------------------------


def parse_cp_tiles(text: str, path: str = "log") -> List[Tuple[int, int]]:
    """Per cp rank (full, diagonal) attention tiles per layer per forward, from 05's report."""
    line = _need(re.search(r"by cp rank \(full \+ diagonal\): (.*)$", text, re.M),
                 "'attention tiles ... by cp rank' line", path).group(1)
    return [(int(f), int(d)) for f, d in re.findall(r"rank \d+: (\d+) \+ (\d+)", line)]


def expected_tiles(cp: int, order: str) -> List[Tuple[int, int]]:
    """(full, diagonal) tiles per rank when each rank holds slice_ids(rank, cp, order)."""
    from scaletorch.parallel.ring_attention import slice_ids, tile_kind
    counts = []
    for r in range(cp):
        kinds = [tile_kind(q, k) for q in slice_ids(r, cp, order) for k in range(2 * cp)]
        counts.append((kinds.count("full"), kinds.count("diagonal")))
    return counts


def plot_zigzag(path: str, out: str) -> None:
    from scaletorch.parallel.ring_attention import slice_ids, tile_kind
    measured = parse_cp_tiles(read_log(path), path)
    cp = len(measured)
    contiguous = expected_tiles(cp, "contiguous")
    print(f"cp {cp}: the sequence in {2 * cp} slices; rank r holds slices r and {2 * cp - 1} - r "
          f"(zigzag)")
    print(f"{'rank':<6}{'slices':>10}{'measured full + diag':>22}{'work':>7}"
          f"{'contiguous slices':>19}{'its work':>9}")
    for r, (f, d) in enumerate(measured):
        cf, cd = contiguous[r]
        print(f"{r:<6}{str(slice_ids(r, cp)):>10}{f'{f} + {d}':>22}{f + d / 2:>7g}"
              f"{str(slice_ids(r, cp, 'contiguous')):>19}{cf + cd / 2:>9g}")
    print("work: full tiles + half of each diagonal tile (its causal triangle)")
    plt = pyplot()
    if plt is None:
        return
    fig, (grid, bars) = plt.subplots(1, 2, figsize=(10, 4.2),
                                     gridspec_kw={"width_ratios": [1, 1.2]})
    owner = {c: r for r in range(cp) for c in slice_ids(r, cp)}
    n = 2 * cp
    for q in range(n):
        for k in range(n):
            kind = tile_kind(q, k)
            if kind == "skipped":
                continue
            color = RANK_COLORS[owner[q] % len(RANK_COLORS)]
            grid.add_patch(
                plt.Rectangle((k, q), 1, 1, color=color, alpha=0.6 if kind == "full" else 0.3,
                              hatch="//" if kind == "diagonal" else None, ec="white"))
    grid.set_xlim(0, n)
    grid.set_ylim(n, 0)
    grid.set_xticks([i + 0.5 for i in range(n)])
    grid.set_xticklabels(range(n))
    grid.set_yticks([i + 0.5 for i in range(n)])
    grid.set_yticklabels([f"{i} (rank {owner[i]})" for i in range(n)], fontsize=8)
    grid.set_xlabel("key slice")
    grid.set_ylabel("query slice (its rank)")
    grid.set_title("causal attention by slice, zigzag (hatched: diagonal)", fontsize=9)
    x = range(cp)
    work = [f + d / 2 for f, d in measured]
    bars.bar([i - 0.2 for i in x], work, width=0.4, color=[RANK_COLORS[i] for i in x],
             label="zigzag (measured in the run)")
    bars.bar([i + 0.2 for i in x], [f + d / 2 for f, d in contiguous], width=0.4, color="none",
             edgecolor="black", hatch="..", label="contiguous slices (same rule)")
    bars.set_xticks(list(x))
    bars.set_xticklabels([f"rank {i}" for i in x])
    bars.set_ylabel("attention tiles per layer (diagonal = 1/2)")
    bars.set_title("work per cp rank", fontsize=9)
    bars.legend(fontsize=8)
    _save(plt, fig, out)


# --- 06: tokens per expert ----------------------------------------------------------------------


def parse_routing(text: str, path: str = "log") -> dict:
    """06's routing table: experts, top-k, ep, and per MoE layer each rank's tokens per local
    expert and the tokens it sends and receives."""
    head = _need(
        re.search(r"routing of the last forward: (\d+) experts, top-(\d+), over ep (\d+)", text),
        "'routing of the last forward' line", path)
    layers = []
    for block in text.split("MoE layer ")[1:]:
        ranks = []
        for line in block.splitlines()[2:]:
            m = re.match(r"^\s*(\d+)\s+(\d+)-(\d+)\s+\[([\d, ]+)\]\s+(\d+)\s+(\d+)", line)
            if m is None:
                break
            ranks.append(
                dict(rank=int(m.group(1)), first=int(m.group(2)),
                     tokens=[int(t) for t in m.group(4).split(",")], sent=int(m.group(5)),
                     recv=int(m.group(6))))
        layers.append(ranks)
    return dict(experts=int(head.group(1)), top_k=int(head.group(2)), ep=int(head.group(3)),
                layers=_need([r for r in layers if r], "'MoE layer' tables", path))


def plot_experts(path: str, out: str) -> None:
    info = parse_routing(read_log(path), path)
    e = info["experts"]
    for i, ranks in enumerate(info["layers"]):
        total = sum(sum(r["tokens"]) for r in ranks)
        print(f"MoE layer {i}: {total} token-slots over {e} experts (mean {total / e:g}); " +
              "; ".join(f"rank {r['rank']}: {r['tokens']}, sent {r['sent']}, recv {r['recv']}"
                        for r in ranks))
    plt = pyplot()
    if plt is None:
        return
    layers = info["layers"]
    fig, axes = plt.subplots(1, len(layers), figsize=(4.2 * len(layers), 4.4), squeeze=False)
    for i, (ax, ranks) in enumerate(zip(axes[0], layers)):
        for r in ranks:
            xs = [r["first"] + j for j in range(len(r["tokens"]))]
            ax.bar(xs, r["tokens"], color=RANK_COLORS[r["rank"] % len(RANK_COLORS)],
                   label=f"rank {r['rank']}: sent {r['sent']}, recv {r['recv']}")
        total = sum(sum(r["tokens"]) for r in ranks)
        ax.axhline(total / e, color="black", linestyle="--", linewidth=1, label="equal share")
        ax.set_xticks(range(e))
        ax.set_xlabel("expert")
        ax.set_ylabel("tokens routed to it")
        ax.set_title(f"MoE layer {i}", fontsize=9)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    fig.suptitle(
        f"tokens per expert, top-{info['top_k']} of {e}, experts split over ep "
        f"{info['ep']} (color = the rank that holds it)", fontsize=9)
    _save(plt, fig, out)


# --- 07: the rank grid --------------------------------------------------------------------------


def parse_rank_table(text: str, path: str = "log") -> dict:
    """07's per-rank table ("per rank, step N: coordinates | wire MB per group | memory MB"):
    {"sizes": {"world", "tp", "cp", "dp", "pp"}, "groups": [...], "ranks": [{"rank", "tp", "cp",
    "dp", "pp", "ep", "wire": {group: MB}}, ...]}."""
    m = _need(
        re.search(r"rank grid: world (\d+) = tp (\d+) x cp (\d+) x dp (\d+) x pp (\d+)", text),
        "'rank grid: world' line", path)
    sizes = dict(zip(("world", "tp", "cp", "dp", "pp"), map(int, m.groups())))
    head = _need(
        re.search(r"^per rank, step \d+: coordinates.*\n(rank .*)\n((?:\s*\d+ .*\n?)+)", text,
                  re.M), "'per rank, step N: coordinates' table", path)
    coords, groups, _ = (part.split() for part in head.group(1).split("|"))
    ranks = []
    for line in head.group(2).splitlines():
        c, w, _ = (part.split() for part in line.split("|"))
        row = dict(zip(coords, map(int, c)))
        row["wire"] = dict(zip(groups, map(float, w)))
        ranks.append(row)
    return dict(sizes=sizes, groups=groups, ranks=ranks)


def plot_rank_grid(path: str, out: str) -> None:
    info = parse_rank_table(read_log(path), path)
    sizes, ranks = info["sizes"], info["ranks"]
    used = [g for g in info["groups"] if any(r["wire"][g] > 0 for r in ranks)]
    print(f"world {sizes['world']} = tp {sizes['tp']} x cp {sizes['cp']} x dp {sizes['dp']} x "
          f"pp {sizes['pp']}; MB each rank sends per step, by group:")
    print(f"{'rank':<6}{'tp':>4}{'cp':>4}{'dp':>4}{'pp':>4} |" + "".join(f"{g:>8}" for g in used))
    for r in ranks:
        print(f"{r['rank']:<6}{r['tp']:>4}{r['cp']:>4}{r['dp']:>4}{r['pp']:>4} |" +
              "".join(f"{r['wire'][g]:>8.3f}" for g in used))
    plt = pyplot()
    if plt is None:
        return
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(10, 1.3 * sizes["pp"] + 1.8),
                                   gridspec_kw={"width_ratios": [1.3, 1]})
    per_row = sizes["tp"] * sizes["cp"] * sizes["dp"]
    for r in ranks:
        x = (r["dp"] * sizes["cp"] + r["cp"]) * sizes["tp"] + r["tp"]
        x += 0.3 * (r["dp"] * sizes["cp"] + r["cp"])  # a gap between tp groups
        ax.add_patch(
            plt.Rectangle((x, r["pp"]), 0.92, 0.85, color=RANK_COLORS[r["tp"] % 8], alpha=0.3))
        lines = [f"rank {r['rank']}", f"tp {r['tp']} cp {r['cp']} dp {r['dp']} pp {r['pp']}"]
        lines += [f"{g} {r['wire'][g]:.2f} MB" for g in used if r["wire"][g] > 0]
        ax.text(x + 0.46, r["pp"] + 0.42, "\n".join(lines), ha="center", va="center", fontsize=7)
    ax.set_xlim(-0.1, per_row + 0.3 * (per_row // sizes["tp"]))
    ax.set_ylim(sizes["pp"], -0.1)
    ax.axis("off")
    ax.set_title(
        f"world {sizes['world']} = tp {sizes['tp']} x cp {sizes['cp']} x dp "
        f"{sizes['dp']} x pp {sizes['pp']} (a row per pipeline stage)", fontsize=9)
    bottom = [0.0] * len(ranks)
    for i, g in enumerate(used):
        values = [r["wire"][g] for r in ranks]
        bars.bar([r["rank"] for r in ranks], values, bottom=bottom, label=g,
                 color=RANK_COLORS[i % 8])
        bottom = [b + v for b, v in zip(bottom, values)]
    bars.set_xticks([r["rank"] for r in ranks])
    bars.set_xlabel("rank")
    bars.set_ylabel("MB sent per step")
    bars.set_title("traffic per rank, by group (the ledger)", fontsize=9)
    bars.legend(fontsize=8)
    _save(plt, fig, out)


# --- 08: bytes by dtype --------------------------------------------------------------------------


def parse_dtype_traffic(text: str, path: str = "log") -> dict:
    """08's precision line and its "traffic in step" rows: {"label", "group", "rows": [{"op",
    "elements", "element_bytes", "bytes", "wire"}]}."""
    prec = _need(re.search(r"compute (\w+), param_dtype (\w+), reduce_dtype (\w+)", text),
                 "'compute ..., param_dtype ..., reduce_dtype ...' line", path)
    head = _need(re.search(r"traffic in step \d+ \(rank 0, over (\w+)\):\n((?:  .*\n?)+)", text),
                 "'traffic in step' table", path)
    rows = []
    for m in re.finditer(
            r"^\s+(\w+)\s+(" + NUMBER + r") elements x ([\d.]+) B =\s+(" + NUMBER +
            r") B, on the wire\s+(" + NUMBER + r") B", head.group(2), re.M):
        rows.append(
            dict(op=m.group(1), elements=_num(m.group(2)), element_bytes=_num(m.group(3)),
                 bytes=_num(m.group(4)), wire=_num(m.group(5))))
    label = (f"compute {prec.group(1)}, params {prec.group(2)}, reduce {prec.group(3)}")
    return dict(label=label, group=head.group(1), rows=rows)


def plot_dtype_bytes(paths: List[str], out: str) -> None:
    runs = [parse_dtype_traffic(read_log(p), p) for p in paths]
    ops = [r["op"] for r in runs[0]["rows"] if r["op"] != "all_reduce" or r["elements"] > 1]
    print(f"{'run':<44}" + "".join(f"{op:>16}" for op in ops) + f"{'total':>12}")
    for run in runs:
        by_op = {r["op"]: r for r in run["rows"]}
        wire = [by_op[op]["wire"] if op in by_op else 0.0 for op in ops]
        print(f"{run['label']:<44}" + "".join(f"{w:>14,.0f} B"
                                              for w in wire) + f"{sum(wire):>10,.0f} B")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        by_op = {r["op"]: r for r in run["rows"]}
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(ops))]
        ys = [by_op[op]["wire"] / 1e3 if op in by_op else 0.0 for op in ops]
        ax.bar(xs, ys, width=width, color=RANK_COLORS[i], label=run["label"])
        for x, op in zip(xs, ops):
            if op in by_op:
                ax.text(x, by_op[op]["wire"] / 1e3, f"{by_op[op]['element_bytes']:g} B/elt",
                        ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(ops)))
    ax.set_xticklabels([f"{op} ({runs[0]['group']})" for op in ops])
    ax.set_ylabel("kB on the wire per step, rank 0")
    ax.set_title("the same step's collectives, bytes per element set by the precision", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    _save(plt, fig, out)


# --- plot.py's subcommands ------------------------------------------------------------------------

COMMANDS = {
    "loss-floor": ("runs", "+", "run directories (metrics.jsonl, config.yaml)", plot_loss_floor),
    "ddp-buckets": ("path", None, "saved output of examples/01_ddp.py --verbose", plot_ddp_buckets),
    "zero-memory":
    ("paths", "+", "saved outputs of examples/01_ddp.py, 02_fsdp.py", plot_zero_memory),
    "tp-split": ("path", None, "saved output of examples/03_tensor_parallel.py", plot_tp_split),
    "pipeline-vs-sim":
    ("run", None, "run directory of 04_pipeline_parallel (timeline.json)", plot_pipeline_vs_sim),
    "zigzag": ("path", None, "saved output of examples/05_context_parallel.py", plot_zigzag),
    "experts": ("path", None, "saved output of examples/06_expert_parallel.py", plot_experts),
    "rank-grid": ("path", None, "saved output of examples/07_nd_parallel.py", plot_rank_grid),
    "dtype-bytes":
    ("paths", "+", "saved outputs of examples/08_mixed_precision.py", plot_dtype_bytes),
}


def add_parsers(sub) -> None:
    """Add the chapters' subcommands to plot.py's subparsers."""
    for name, (dest, nargs, help_, draw) in COMMANDS.items():
        p = sub.add_parser(name, help=help_)
        p.add_argument(dest, nargs=nargs, help=help_)
        p.add_argument("--out", default=f"{name}.png")
        p.set_defaults(
            chapter_plot=lambda args, dest=dest, draw=draw: draw(getattr(args, dest), args.out))


def dispatch(args) -> bool:
    """Draw the chapter picture ``args`` asks for; False if it is not one of these."""
    draw = getattr(args, "chapter_plot", None)
    if draw is None:
        return False
    draw(args)
    return True


if __name__ == "__main__":  # a module: one line saying what to run instead, exit 2
    from scripts import module_only

    module_only(__doc__,
                "python scripts/plot.py SUBCOMMAND ... (python scripts/plot.py --help lists them)")
