"""Plots: loss curves of several runs on one chart, and pipeline timelines.

    python scripts/plot.py loss runs/00_single_device/metrics.jsonl \
        runs/07_nd_parallel/metrics.jsonl
    python scripts/plot.py timeline runs/07_nd_parallel/timeline.json      # a measured step
    python scripts/plot.py timeline --simulate 1f1b --pp 4 --micro-batches 8
    python scripts/plot.py timeline --simulate interleaved --pp 4 --micro-batches 8 \\
        --virtual-stages 2
    python scripts/plot.py schedules --pp 4 --micro-batches 8 --costs 1 1 1  # every schedule

``metrics.jsonl`` is what the Trainer writes (one JSON object per step); ``timeline.json`` what
07_nd_parallel writes when it runs a pipeline. ``schedules`` simulates every pipeline schedule
with the per-action costs F, B (input gradient), W (weight gradient) and a message latency,
prints their bubble and peak activations, and draws their timelines one above the other.
Writes a PNG (``--out``). matplotlib is optional: without it the script says so and prints
the same data as text.
"""

import argparse
import json
import os
import sys
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scaletorch.parallel import pipeline_schedules as ps  # noqa: E402
from scaletorch.parallel import zero_bubble as zb  # noqa: E402

MISSING = ("matplotlib is not installed (it is optional): pip install matplotlib. "
           "Printing the data as text instead.")


def pyplot():
    """matplotlib.pyplot with a file backend, or None (and a message) when it is missing."""
    try:
        import matplotlib
    except ImportError:
        print(MISSING, file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def read_metrics(path: str, key: str) -> Dict[str, List[float]]:
    """{"step": [...], key: [...]} from a metrics.jsonl file (a restarted run appends: the
    last record of each step wins)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"metrics file {path!r} does not exist")
    by_step = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                if key not in record:
                    raise ValueError(f"{path}: no {key!r} in a record; keys: {sorted(record)}")
                by_step[record["step"]] = record[key]
    steps = sorted(by_step)
    return {"step": steps, key: [by_step[s] for s in steps]}


def label_of(path: str) -> str:
    """The run's name: the directory holding metrics.jsonl."""
    return os.path.basename(os.path.dirname(os.path.abspath(path))) or path


def plot_losses(paths: List[str], key: str, out: str) -> None:
    curves = {label_of(p): read_metrics(p, key) for p in paths}
    plt = pyplot()
    if plt is None:
        for name, c in curves.items():
            print(f"{name}: {len(c['step'])} steps, {key} first {c[key][0]:.4f}, "
                  f"last {c[key][-1]:.4f}, min {min(c[key]):.4f}")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, c in curves.items():
        ax.plot(c["step"], c[key], label=name, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(f"{key} per step: runs that match overlap exactly")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def read_timeline(path: str) -> ps.Timeline:
    """A timeline.json: {"stages", "micro_batches", "virtual_stages", "events": [[rank, kind,
    micro_batch, chunk, start, end], ...]}."""
    with open(path) as f:
        data = json.load(f)
    timeline = ps.Timeline(data["stages"], data["micro_batches"], data["virtual_stages"],
                           schedule=data.get("schedule", ""))
    for rank, kind, mb, chunk, start, end in data["events"]:
        timeline.record(rank, ps.Action(kind, mb, chunk), start, end)
    return timeline


def draw_timeline(ax, timeline: ps.Timeline, title: str, unit: str, span: float) -> None:
    """One row per pipeline rank; a box per forward (light), backward (dark) and weight
    gradient (hatched) of each micro-batch, numbered; gaps are the bubble. DualPipeV's
    overlapped pairs (a forward and a backward run as one unit) are framed in red."""
    import matplotlib.pyplot as plt

    if timeline.schedule == "dualpipev":
        for rank in timeline.ranks():
            events = {str(e.action): e for e in timeline.of(rank)}
            for unit_ in zb.dualpipev_units(timeline.stages, timeline.micro_batches, rank):
                if len(unit_) == 2:
                    first, second = events[str(unit_[0])], events[str(unit_[1])]
                    ax.barh(rank, second.end - first.start, left=first.start - timeline.span()[0],
                            height=0.95, fill=False, edgecolor="red", linewidth=1.2)

    start, _ = timeline.span()
    cmap = plt.get_cmap("tab10")
    for e in timeline.events:
        kind = e.action.kind
        ax.barh(e.rank, e.end - e.start, left=e.start - start,
                color=cmap(e.action.micro_batch % 10), alpha={"F": 0.45}.get(kind, 0.95),
                hatch="///" if kind == "W" else None, edgecolor="black", linewidth=0.4)
        ax.text((e.start + e.end) / 2 - start, e.rank, str(e.action), ha="center", va="center",
                fontsize=5)
    ax.set_yticks(timeline.ranks())
    ax.set_yticklabels([f"rank {r}" for r in timeline.ranks()])
    ax.invert_yaxis()
    ax.set_xlim(0, span)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(f"{title}: bubble {timeline.bubble_fraction():.3f}", fontsize=9)


def plot_timelines(timelines: List[tuple], out: str, unit: str = "s", note: str = "") -> None:
    """``timelines``: (title, Timeline) pairs, drawn one above the other on one time axis."""
    plt = pyplot()
    if plt is None:
        for title, timeline in timelines:
            print(title)
            print(timeline.chart())
            print(timeline.summary())
        return
    span = max(t.span()[1] - t.span()[0] for _, t in timelines)
    rows = [0.45 * len(t.ranks()) + 0.9 for _, t in timelines]
    fig, axes = plt.subplots(len(timelines), 1, figsize=(11, sum(rows) + 0.6),
                             gridspec_kw={"height_ratios": rows}, squeeze=False)
    for ax, (title, timeline) in zip(axes[:, 0], timelines):
        draw_timeline(ax, timeline, title, unit, span)
    fig.suptitle(
        f"light = forward F, dark = backward B (input gradient, or the whole backward), "
        f"hatched = weight gradient W{note}", fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.985))
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def plot_timeline(timeline: ps.Timeline, title: str, out: str, unit: str = "s") -> None:
    plot_timelines([(f"{title} (theory {timeline.theory():.3f})", timeline)], out, unit)


# every schedule, as the chapter compares them: (name, virtual stages)
COMPARED = (("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2), ("dualpipev",
                                                                                     2))


def compare_schedules(p: int, m: int, costs: List[float], comm: float, out: str) -> None:
    """Simulate every schedule with per-stage costs F, B, W (a chunk of v costs 1/v of them)
    and message latency ``comm``; print bubble, step time and peak activations; draw them."""
    f, b, w = costs
    print(f"p = {p}, m = {m}; per stage F = {f:g}, B = {b:g}, W = {w:g} (full backward B + W), "
          f"message {comm:g}; a chunk of v per rank costs 1/v")
    print(f"{'schedule':<12} {'v':>2} {'step':>7} {'bubble':>7} {'theory':>7}   "
          f"peak live per rank (chunks)  in stages")
    timelines = []
    for schedule, v in COMPARED:
        timeline = zb.simulate_async(schedule, p, m, v, f / v, b / v, w / v, comm)
        theory = {
            "afab": ps.theoretical_bubble(p, m),
            "1f1b": ps.theoretical_bubble(p, m),
            "interleaved": ps.theoretical_bubble(p, m, v),
            "zb-h1": zb.zero_bubble_theory("zb-h1", p, m, f, b, w),
        }.get(schedule)
        peaks = [timeline.peak_live(r) for r in range(p)]
        start, end = timeline.span()
        print(f"{schedule:<12} {v:>2} {end - start:>7.2f} {timeline.bubble_fraction():>7.3f} "
              f"{'-' if theory is None else f'{theory:.3f}':>7}   {str(peaks):<27}  "
              f"{max(peaks) / v:g}")
        timelines.append((f"{schedule} (v={v})", timeline))
    plot_timelines(timelines, out, "F+B+W of one stage" if (f, b, w) == (1, 1, 1) else "cost",
                   note=f"; p={p}, m={m}, F={f:g}, B={b:g}, W={w:g}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    loss = sub.add_parser("loss", help="overlay loss curves from metrics.jsonl files")
    loss.add_argument("paths", nargs="+")
    loss.add_argument("--key", default="loss", help="metric to plot (loss, grad_norm, lr, ...)")
    loss.add_argument("--out", default="loss.png")
    tl = sub.add_parser("timeline", help="draw a pipeline timeline")
    tl.add_argument("path", nargs="?", help="timeline.json written by 07_nd_parallel")
    tl.add_argument("--simulate", choices=ps.SCHEDULES, help="draw a schedule instead (slots)")
    tl.add_argument("--costs", type=float, nargs=3, default=None, metavar=("F", "B", "W"),
                    help="per-action costs of a simulated schedule (default F 1, B 2, no W)")
    tl.add_argument("--pp", type=int, default=4)
    tl.add_argument("--micro-batches", type=int, default=8)
    tl.add_argument("--virtual-stages", type=int, default=1)
    tl.add_argument("--out", default="timeline.png")
    sc = sub.add_parser("schedules", help="simulate every schedule: bubble, memory, timelines")
    sc.add_argument("--pp", type=int, default=4)
    sc.add_argument("--micro-batches", type=int, default=8)
    sc.add_argument("--costs", type=float, nargs=3, default=[1.0, 1.0, 1.0],
                    metavar=("F", "B", "W"), help="per-stage costs (default 1 1 1)")
    sc.add_argument("--comm", type=float, default=0.0, help="latency of one message")
    sc.add_argument("--out", default="schedules.png")
    args = parser.parse_args(argv)
    if args.what == "loss":
        plot_losses(args.paths, args.key, args.out)
    elif args.what == "schedules":
        compare_schedules(args.pp, args.micro_batches, args.costs, args.comm, args.out)
    elif args.simulate:
        f, b, w = args.costs or (1.0, 2.0, None)
        timeline = ps.simulate(args.simulate, args.pp, args.micro_batches, args.virtual_stages, f,
                               b, w)
        costs = f"F {f:g}, B {b:g}" + ("" if w is None else f", W {w:g}")
        plot_timeline(
            timeline, f"{args.simulate}, p={args.pp}, m={args.micro_batches}, "
            f"v={args.virtual_stages} (simulated: {costs})", args.out, "slots")
    elif args.path:
        plot_timeline(read_timeline(args.path), label_of(args.path), args.out)
    else:
        parser.error("timeline needs a timeline.json path or --simulate SCHEDULE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
