"""Plots: loss curves of several runs on one chart, and pipeline timelines.

    python scripts/plot.py loss runs/00_single_device/metrics.jsonl \
        runs/07_nd_parallel/metrics.jsonl
    python scripts/plot.py timeline runs/07_nd_parallel/timeline.json      # a measured step
    python scripts/plot.py timeline --simulate 1f1b --pp 4 --micro-batches 8
    python scripts/plot.py timeline --simulate interleaved --pp 4 --micro-batches 8 \\
        --virtual-stages 2

``metrics.jsonl`` is what the Trainer writes (one JSON object per step); ``timeline.json`` what
07_nd_parallel writes when it runs a pipeline. Writes a PNG (``--out``). matplotlib is
optional: without it the script says so and prints the same data as text.
"""

import argparse
import json
import os
import sys
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scaletorch.parallel import pipeline_schedules as ps  # noqa: E402

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
    timeline = ps.Timeline(data["stages"], data["micro_batches"], data["virtual_stages"])
    for rank, kind, mb, chunk, start, end in data["events"]:
        timeline.record(rank, ps.Action(kind, mb, chunk), start, end)
    return timeline


def plot_timeline(timeline: ps.Timeline, title: str, out: str, unit: str = "s") -> None:
    """One row per pipeline rank; a box per forward (light) and backward (dark) of each
    micro-batch, numbered; gaps are the bubble."""
    plt = pyplot()
    if plt is None:
        print(timeline.chart())
        print(timeline.summary())
        return
    start, end = timeline.span()
    cmap = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(timeline.ranks()) + 1.5))
    for e in timeline.events:
        color = cmap(e.action.micro_batch % 10)
        ax.barh(e.rank, e.end - e.start, left=e.start - start, color=color,
                alpha=0.45 if e.action.kind == "F" else 0.95, edgecolor="black", linewidth=0.4)
        ax.text((e.start + e.end) / 2 - start, e.rank, str(e.action), ha="center", va="center",
                fontsize=6)
    ax.set_yticks(timeline.ranks())
    ax.set_yticklabels([f"stage {r}" for r in timeline.ranks()])
    ax.invert_yaxis()
    ax.set_xlim(0, end - start)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(
        f"{title}\nbubble {timeline.bubble_fraction():.2f} (theory "
        f"{timeline.theory():.2f}); light = forward, dark = backward", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


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
    tl.add_argument("--pp", type=int, default=4)
    tl.add_argument("--micro-batches", type=int, default=8)
    tl.add_argument("--virtual-stages", type=int, default=1)
    tl.add_argument("--out", default="timeline.png")
    args = parser.parse_args(argv)
    if args.what == "loss":
        plot_losses(args.paths, args.key, args.out)
    elif args.simulate:
        timeline = ps.simulate(args.simulate, args.pp, args.micro_batches, args.virtual_stages)
        plot_timeline(
            timeline, f"{args.simulate}, p={args.pp}, m={args.micro_batches}, "
            f"v={args.virtual_stages} (simulated: F 1 slot, B 2)", args.out, "slots")
    elif args.path:
        plot_timeline(read_timeline(args.path), label_of(args.path), args.out)
    else:
        parser.error("timeline needs a timeline.json path or --simulate SCHEDULE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
