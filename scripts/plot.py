"""Plots: loss curves of several runs on one chart, pipeline timelines, the planner's memory.

    python scripts/plot.py loss runs/00_single_device/metrics.jsonl \\
        runs/07_nd_parallel/metrics.jsonl
    python scripts/plot.py timeline runs/07_nd_parallel/timeline.json      # a measured step
    python scripts/plot.py timeline --simulate 1f1b --pp 4 --micro-batches 8
    python scripts/plot.py timeline --simulate interleaved --pp 4 --micro-batches 8 \\
        --virtual-stages 2
    python scripts/plot.py schedules --pp 4 --micro-batches 8 --costs 1 1 1  # every schedule
    python scripts/plan.py --preset llama3-70b --gpus 512 --search --json > plans.json
    python scripts/plot.py plan-memory plans.json --cluster h100      # memory stack per layout
    python scripts/plot.py plan-memory --plan "--preset llama3-70b --gpus 64 --search --top 3" \\
        --plan "--preset llama3-70b --gpus 64 --tp 8 --pp 8 --sequence-parallel \\
                --micro-batches 2048"
    python scripts/plot.py plan-vs-measured runs/plan_vs_tour.json    # predicted vs measured
    python scripts/plot.py profile runs/01_ddp/profile   # one step of ranks 0, 1 (--profile)

``metrics.jsonl`` is what the Trainer writes (one JSON object per step); ``timeline.json`` what
07_nd_parallel writes when it runs a pipeline. ``schedules`` simulates every pipeline schedule
with the per-action costs F, B (input gradient), W (weight gradient) and a message latency,
prints their bubble and peak activations, and draws their timelines one above the other.
``plan-memory`` stacks the planner's memory per GPU (most-loaded pipeline rank) of each layout,
from files of ``scripts/plan.py --json`` output ("-": standard input) or from plan.py's own
arguments (``--plan "ARGS"``, run here), against the cluster's HBM. ``plan-vs-measured`` draws
the planner's step time against the measured one, log-log, from a JSON list of runs
``[{"script", "ranks", "arguments", "measured_s", "predicted_s"}, ...]`` (other keys ignored).
``profile`` draws one step of two ranks as it ran from the traces of ``--profile STEPS``
(scripts/plot_profile.py).
The chapters' pictures (``loss-floor``, ``ddp-buckets``, ``zero-memory``, ``tp-split``, ...) are
``scripts/chapter_plots.py``'s. Each prints its data as a table, then writes a PNG (``--out``).
matplotlib is optional: without it the script says so and prints the same data as text. Bad
input: one "error:" line, exit 2.
"""

import argparse
import json
import os
import sys
from typing import List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scaletorch.rules import boundary  # noqa: E402
from scaletorch.rules.errors import OneLineParser, clip  # noqa: E402
from scaletorch.schedule import analysis, placement, simulate  # noqa: E402
from scaletorch.schedule.timeline import Timeline  # noqa: E402
from scripts import plot_profile  # noqa: E402

from scripts.plot_base import draw_timeline, label_of, pyplot  # noqa: E402  # isort: skip
from scripts.plot_base import read_metrics, read_timeline, save_figure  # noqa: E402  # isort: skip


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
    save_figure(fig, out, dpi=120)
    print(f"wrote {out}")


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
    save_figure(fig, out, dpi=120)
    print(f"wrote {out}")


def plot_timeline(timeline: Timeline, title: str, out: str, unit: str = "s") -> None:
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
        timeline = simulate.simulate_async(schedule, p, m, v, f / v, b / v, w / v, comm)
        theory = {
            "afab": placement.theoretical_bubble(p, m),
            "1f1b": placement.theoretical_bubble(p, m),
            "interleaved": placement.theoretical_bubble(p, m, v),
            "zb-h1": analysis.zero_bubble_theory("zb-h1", p, m, f, b, w),
        }.get(schedule)
        peaks = [timeline.peak_live(r) for r in range(p)]
        start, end = timeline.span()
        print(f"{schedule:<12} {v:>2} {end - start:>7.2f} {timeline.bubble_fraction():>7.3f} "
              f"{'-' if theory is None else f'{theory:.3f}':>7}   {str(peaks):<27}  "
              f"{max(peaks) / v:g}")
        timelines.append((f"{schedule} (v={v})", timeline))
    plot_timelines(timelines, out, "F+B+W of one stage" if (f, b, w) == (1, 1, 1) else "cost",
                   note=f"; p={p}, m={m}, F={f:g}, B={b:g}, W={w:g}")


def read_plans(paths: List[str]) -> List[dict]:
    """The layouts of each file of ``scripts/plan.py --json`` output ("-": standard input); a
    file may hold several JSON objects one after the other (several plan.py runs)."""
    layouts = []
    for path in paths:
        if path == "-":
            layouts += plan_layouts(sys.stdin.read(boundary.JSON_BYTES + 1), "standard input")
            continue
        if not os.path.isfile(path):
            raise FileNotFoundError(f"plan file {path!r} does not exist")
        layouts += plan_layouts(boundary.read_text(path, "plan file", boundary.JSON_BYTES), path)
    return layouts


def plan_layouts(text: str, source: str) -> List[dict]:
    """The ``layouts`` of the JSON object(s) in ``text``, each checked for ``memory_bytes``
    (bytes: numbers of at least 0), its model's name and the rank it describes."""
    from scaletorch.plan.report import KINDS

    if len(text) > boundary.JSON_BYTES:
        raise ValueError(f"{source}: more than {boundary.JSON_BYTES} characters: not plan.py "
                         f"--json output")
    decoder, layouts, text, at = json.JSONDecoder(), [], text.strip(), 0
    while at < len(text):
        try:
            data, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError) as err:
            raise ValueError(f"{source}: not plan.py --json output ({clip(str(err))})") from None
        at = len(text) - len(text[at:].lstrip())
        if not isinstance(data, dict) or not isinstance(data.get("layouts"), list):
            raise ValueError(f"{source}: not plan.py --json output (no list 'layouts')")
        layouts += data["layouts"]
    if not layouts:
        raise ValueError(f"{source}: no layouts (plan.py --search found none that fits?)")
    for i, r in enumerate(layouts):
        memory = r.get("memory_bytes") if isinstance(r, dict) else None
        missing = [k for k in KINDS if not isinstance(memory, dict) or k not in memory]
        if missing:
            raise ValueError(f"{source}: layout {i} has no memory_bytes {', '.join(missing)}")
        for kind in KINDS:
            boundary.number(memory[kind], f"{source} layout {i} memory_bytes {kind!r}", low=0)
        boundary.number(r.get("most_loaded_pp_rank"), f"{source} layout {i} "
                        f"'most_loaded_pp_rank'", integer=True, low=0)
        if not isinstance(r.get("model"), str):
            raise ValueError(f"{source}: layout {i}'s 'model' is {clip(r.get('model'), 60)}, "
                             f"not a model's name")
    return layouts


def run_plans(arguments: List[str]) -> List[dict]:
    """The layouts ``scripts/plan.py ARGS --json`` prints for each string of arguments, run in
    this process; plan.py's error line names the arguments that caused it."""
    import io
    import shlex
    from contextlib import redirect_stderr, redirect_stdout

    from scripts import plan

    layouts = []
    for args in arguments:
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            status = plan.main(shlex.split(args) + ["--json"])
        if status != 0:
            why = err.getvalue().strip().splitlines()
            raise ValueError(f"--plan {args!r}: " +
                             (why[-1].removeprefix("error: ") if why else f"exit {status}"))
        layouts += plan_layouts(out.getvalue(), f"--plan {args!r}")
    return layouts


def layout_name(result: dict, with_run: bool) -> str:
    """A planned layout as plan.py prints it, after the model and sequence length if asked."""
    from scaletorch.plan.layout import PlanLayout

    # a field an older plan.py did not write (bucket_size_mb) takes its default
    layout = PlanLayout(**{k: result[k] for k in PlanLayout().as_dict() if k in result})
    return (f"{result['model']} s{layout.seq_len} " if with_run else "") + layout.describe()


# the same colour for a kind in every picture, whichever kinds it shows
COLORS = {
    "params": "tab:blue",
    "grads": "tab:orange",
    "optimizer": "tab:green",
    "buffers": "tab:purple",
    "activations": "tab:red"
}


def plot_plan_memory(layouts: List[dict], cluster: str, out: str) -> None:
    """One stacked bar per layout: params, grads, optimizer, buffers (if any), activations of
    the most-loaded pipeline rank, GB, with the cluster's HBM as a line."""
    import textwrap

    from scaletorch.plan.cluster import load_cluster
    from scaletorch.plan.report import KINDS

    hbm = load_cluster(cluster).hbm_bytes
    kinds = [k for k in KINDS[:-1] if k != "buffers" or any(r["memory_bytes"][k] for r in layouts)]
    runs = {f"{r['model']} s{r['seq_len']}" for r in layouts}  # the title if only one
    names = [layout_name(r, len(runs) > 1) for r in layouts]
    title = "memory per GPU, most-loaded pipeline rank" + (f": {min(runs)}"
                                                           if len(runs) == 1 else "")
    print(f"{title}, GB ({cluster}: {hbm / 1e9:g} GB of HBM)")
    print(f"{'layout':<56}{'rank':>5}" + "".join(f"{k:>12}" for k in kinds) + f"{'total':>8}  fits")
    for name, r in zip(names, layouts):
        gb = [r["memory_bytes"][k] / 1e9 for k in kinds + ["total"]]
        print(f"{name:<56}{r['most_loaded_pp_rank']:>5}" + "".join(f"{v:>12.1f}" for v in gb[:-1]) +
              f"{gb[-1]:>8.1f}  {'yes' if gb[-1] <= hbm / 1e9 else 'no'}")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(1.6 * len(layouts) + 2.5, 5))
    x = list(range(len(layouts)))
    bottom = [0.0] * len(layouts)
    for kind in kinds:
        values = [r["memory_bytes"][kind] / 1e9 for r in layouts]
        ax.bar(x, values, bottom=bottom, width=0.6, label=kind, color=COLORS[kind])
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, r in enumerate(layouts):
        ax.text(i, bottom[i], f"{r['memory_bytes']['total'] / 1e9:.1f}", ha="center", va="bottom",
                fontsize=8)
    ax.axhline(hbm / 1e9, color="black", linestyle="--", linewidth=1,
               label=f"HBM {hbm / 1e9:g} GB ({cluster})")
    labels = [
        textwrap.fill(name, 18) + f"\npp rank {r['most_loaded_pp_rank']}"
        for name, r in zip(names, layouts)
    ]
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylim(0, 1.12 * max(max(bottom), hbm / 1e9))
    ax.set_ylabel("GB per GPU")
    ax.set_title("planned " + title, fontsize=10)
    handles, names = ax.get_legend_handles_labels()  # the stack's order, top first
    ax.legend(handles[::-1], names[::-1], fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    save_figure(fig, out, dpi=100)
    print(f"wrote {out}")


RUN_KEYS = {
    "script": str,
    "ranks": int,
    "arguments": str,
    "measured_s": float,
    "predicted_s": float
}


def read_runs(path: str) -> List[dict]:
    """A JSON list of runs, each {"script", "ranks", "arguments", "measured_s", "predicted_s"}
    (seconds per step; other keys are ignored), as scripts/plan_vs_tour.py writes it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"runs file {path!r} does not exist")
    runs = boundary.load_json(path, "runs file", digest=False, kind=None)
    want = f"a JSON list of {{{', '.join(json.dumps(k) for k in RUN_KEYS)}}}"
    if not isinstance(runs, list) or not runs:
        raise ValueError(f"{path}: no runs (want {want})")
    for i, run in enumerate(runs):
        run = run if isinstance(run, dict) else {}
        bad = [k for k, kind in RUN_KEYS.items() if kind is str and not isinstance(run.get(k), str)]
        if bad:
            keys = ", ".join(map(repr, bad))
            raise ValueError(f"runs file {clip(path)}: run {i} has no valid {keys} (script and "
                             f"arguments are strings): {clip(runs[i])}")
        for k, kind in RUN_KEYS.items():  # finite and positive: a ratio divides by them
            if kind is not str:
                boundary.number(run.get(k), f"runs file {clip(path)} run {i} {k!r}", integer=kind
                                is int, positive=True)
    return runs


def plot_plan_vs_measured(runs: List[dict], tolerance: float, out: str) -> None:
    """Predicted against measured step time, log-log, one point per run (colour: ranks), with
    y = x and the band in which predicted / measured is within [1 / (1 + tol), 1 + tol]."""
    import textwrap

    within = [
        1 / (1 + tolerance) <= r["predicted_s"] / r["measured_s"] <= 1 + tolerance for r in runs
    ]
    print(f"{'script':<22}{'ranks':>5}  {'arguments':<62}{'measured':>9}{'predicted':>10}"
          f"{'ratio':>7}")
    for r in runs:
        print(f"{r['script']:<22}{r['ranks']:>5}  {r['arguments'] or '(config)':<62}"
              f"{1e3 * r['measured_s']:>9.1f}{1e3 * r['predicted_s']:>10.1f}"
              f"{r['predicted_s'] / r['measured_s']:>7.2f}")
    print(f"ms per step; ratio = predicted / measured; within {tolerance:.0%}: "
          f"{sum(within)} of {len(runs)}")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.5, 6))
    ms = [1e3 * v for r in runs for v in (r["measured_s"], r["predicted_s"])]
    lo, hi = min(ms) / 1.6, max(ms) * 1.6
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=1, label="predicted = measured")
    ax.fill_between([lo, hi], [lo / (1 + tolerance), hi / (1 + tolerance)],
                    [lo * (1 + tolerance), hi * (1 + tolerance)], color="green", alpha=0.12,
                    label=f"within {tolerance:.0%}")
    cmap = plt.get_cmap("tab10")
    for i, ranks in enumerate(sorted({r["ranks"] for r in runs})):
        group = [r for r in runs if r["ranks"] == ranks]
        ax.scatter([1e3 * r["measured_s"] for r in group], [1e3 * r["predicted_s"] for r in group],
                   color=cmap(i), s=25, zorder=3, label=f"{ranks} rank{'s' if ranks > 1 else ''}")
    middle = (lo * hi)**0.5
    for r in runs:  # "07 --tp 2 --pp 2", leftwards on the right half, not counted in the layout
        x, y = 1e3 * r["measured_s"], 1e3 * r["predicted_s"]
        left = x > middle
        note = ax.annotate(
            textwrap.fill(f"{r['script'].split('_')[0]} {r['arguments']}", 32,
                          break_on_hyphens=False), (x, y), fontsize=6,
            xytext=(-5 if left else 5, -2), textcoords="offset points",
            ha="right" if left else "left", va="top")
        note.set_in_layout(False)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_aspect("equal")
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title(f"planner vs measurement: {sum(within)} of {len(runs)} within {tolerance:.0%}",
                 fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    save_figure(fig, out, dpi=100)
    print(f"wrote {out}")


def main(argv=None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    loss = sub.add_parser("loss", help="overlay loss curves from metrics.jsonl files")
    loss.add_argument("paths", nargs="+")
    loss.add_argument("--key", default="loss", help="metric to plot (loss, grad_norm, lr, ...)")
    loss.add_argument("--out", default="loss.png")
    tl = sub.add_parser("timeline", help="draw a pipeline timeline")
    tl.add_argument("path", nargs="?", help="timeline.json written by 07_nd_parallel")
    tl.add_argument("--simulate", choices=placement.SCHEDULES,
                    help="draw a schedule instead (slots)")
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
    pm = sub.add_parser("plan-memory", help="the planner's memory stack per layout")
    pm.add_argument("paths", nargs="*", help="files of scripts/plan.py --json output (-: stdin)")
    pm.add_argument("--plan", action="append", default=[], metavar="ARGS",
                    help="scripts/plan.py's arguments, quoted (run here with --json); repeatable")
    pm.add_argument("--cluster", default="h100", help="whose HBM to draw: h100 | a100 | b200 | "
                    "FILE.yaml | FILE.json")
    pm.add_argument("--out", default="plan_memory.png")
    pv = sub.add_parser("plan-vs-measured", help="predicted vs measured step time, log-log")
    pv.add_argument(
        "path", help='JSON list of {"script", "ranks", "arguments", "measured_s", '
        '"predicted_s"}')
    pv.add_argument("--tolerance", type=float, default=0.3, help="the band: 0.3 is +-30%%")
    pv.add_argument("--out", default="plan_vs_measured.png")
    from scripts import chapter_plots  # the chapters' pictures, drawn with this module's helpers
    chapter_plots.add_parsers(sub)
    plot_profile.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        chapter_plots.dispatch(args) or dispatch(parser, args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.what == "loss":
        plot_losses(args.paths, args.key, args.out)
    elif args.what == "profile":
        plot_profile.run(args, pyplot)
    elif args.what == "plan-memory":
        if not args.paths and not args.plan:
            raise ValueError("plan-memory needs plan.py --json files or --plan 'ARGS'")
        plot_plan_memory(read_plans(args.paths) + run_plans(args.plan), args.cluster, args.out)
    elif args.what == "plan-vs-measured":
        if args.tolerance <= 0:
            raise ValueError(f"--tolerance must be positive, got {args.tolerance}")
        plot_plan_vs_measured(read_runs(args.path), args.tolerance, args.out)
    elif args.what == "schedules":
        compare_schedules(args.pp, args.micro_batches, args.costs, args.comm, args.out)
    elif args.simulate:
        f, b, w = args.costs or (1.0, 2.0, None)
        timeline = analysis.simulate(args.simulate, args.pp, args.micro_batches,
                                     args.virtual_stages, f, b, w)
        costs = f"F {f:g}, B {b:g}" + ("" if w is None else f", W {w:g}")
        plot_timeline(
            timeline, f"{args.simulate}, p={args.pp}, m={args.micro_batches}, "
            f"v={args.virtual_stages} (simulated: {costs})", args.out, "slots")
    elif args.path:
        plot_timeline(read_timeline(args.path), label_of(args.path), args.out)
    else:
        parser.error("timeline needs a timeline.json path or --simulate SCHEDULE")


if __name__ == "__main__":
    sys.exit(main())
