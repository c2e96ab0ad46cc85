"""What scripts/plot.py and scripts/chapter_plots.py share: matplotlib (optional), reading a
run's metrics.jsonl and timeline.json, and drawing a pipeline timeline."""

import math
import os
import sys
from typing import Dict, List

from scaletorch.rules import boundary, safe_files
from scaletorch.rules.errors import InputError, clip

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scaletorch.schedule import orders, placement, simulate  # noqa: E402
from scaletorch.schedule import zero_bubble_orders as zb  # noqa: E402
from scaletorch.schedule.timeline import Timeline  # noqa: E402

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


def save_figure(fig, out: str, dpi: int) -> None:
    """Draw ``fig`` into ``out`` whole or not at all: the picture is rendered in memory (the
    format from the name's suffix, PNG without one), then written under a temporary name and
    renamed (safe_files.write_atomic). A full disk is one line, and no empty file is left."""
    import io

    import matplotlib.pyplot as plt

    kind = os.path.splitext(out)[1][1:].lower() or "png"
    if kind not in fig.canvas.get_supported_filetypes():
        raise InputError(f"{clip(out)}: matplotlib writes no {kind!r} files; name one of "
                         f"{', '.join(sorted(fig.canvas.get_supported_filetypes()))}")
    buffer = io.BytesIO()
    fig.savefig(buffer, format=kind, dpi=dpi)
    plt.close(fig)
    safe_files.write_atomic(out, buffer.getvalue(), kept="no picture was written")


def read_metrics(path: str, key: str) -> Dict[str, List[float]]:
    """{"step": [...], key: [...]} from a metrics.jsonl file (a restarted run appends: the
    last record of each step wins). Each record's step is a count and its value a number: a
    non-finite one or null (fp16 logs the inf gradient norm of a step it skips) is drawn as a
    gap, anything else is one line."""
    records = boundary.load_jsonl(path, "metrics file")  # a FIFO or a directory: named
    if not records:
        raise InputError(f"metrics file {clip(path)} holds no records: no step to draw")
    by_step = {}
    for n, record in enumerate(records, 1):
        at = f"metrics file {clip(path)} record {n}"
        if "step" not in record or key not in record:
            raise InputError(f"{at} has no {'step' if 'step' not in record else repr(key)}; "
                             f"keys: {clip(sorted(record), 200)}")
        value = record[key]
        if value is None or isinstance(value, float) and not math.isfinite(value):
            value = math.nan  # json writes a nan loss as NaN (and None in other writers)
        else:
            value = boundary.number(value, f"{at} {key!r}")
        by_step[boundary.number(record["step"], f"{at} 'step'", integer=True, low=0)] = value
    steps = sorted(by_step)
    return {"step": steps, key: [by_step[s] for s in steps]}


def label_of(path: str) -> str:
    """The run's name: the directory holding metrics.jsonl."""
    return os.path.basename(os.path.dirname(os.path.abspath(path))) or path


def read_timeline(path: str) -> Timeline:
    """A timeline.json: {"pp", "micro_batches", "virtual_stages", "events": [[rank, kind,
    micro_batch, chunk, start, end], ...]}."""
    data = boundary.load_json(path, "timeline", digest=False)
    where = f"timeline {clip(path)}"
    sizes = [
        boundary.number(data.get(k), f"{where} {k!r}", integer=True, low=1)
        for k in ("pp", "micro_batches", "virtual_stages")
    ]
    schedule, events = data.get("schedule", ""), data.get("events")
    if not isinstance(schedule, str):
        raise InputError(f"{where} 'schedule' is {clip(schedule, 60)}, not a "
                         f"schedule's name")
    if not isinstance(events, list):
        raise InputError(f"{where} 'events' is {clip(events, 60)}, not a list "
                         f"of [rank, kind, micro_batch, chunk, start, end]")
    zero_bubble = schedule in placement.ZERO_BUBBLE  # its theory: simulated
    kind = simulate.ZeroBubbleTimeline if zero_bubble else Timeline
    timeline = kind(*sizes, schedule=schedule)
    for i, event in enumerate(events):
        at = f"{where} event {i}"
        if not isinstance(event, list) or len(event) != 6 or event[1] not in ("F", "B", "W"):
            raise InputError(f"{at} is {clip(event, 80)}, not [rank, kind F|B|W, "
                             f"micro_batch, chunk, start, end]")
        rank, mb, chunk = (boundary.number(event[j], f"{at} {name}", integer=True, low=0)
                           for j, name in ((0, "rank"), (2, "micro_batch"), (3, "chunk")))
        start, end = (boundary.number(event[j], f"{at} {name}")
                      for j, name in ((4, "start"), (5, "end")))
        if rank >= sizes[0] or chunk >= sizes[2]:
            raise InputError(f"{at}: rank {rank} or chunk {chunk} outside pp {sizes[0]} "
                             f"x virtual_stages {sizes[2]}")
        timeline.record(rank, orders.Action(event[1], mb, chunk), start, end)
    return timeline


def draw_timeline(ax, timeline: Timeline, title: str, unit: str, span: float) -> None:
    """One row per pipeline rank; a box per forward (light), backward (dark) and weight
    gradient (hatched) of each micro-batch, numbered; gaps are the bubble. DualPipeV's
    overlapped pairs (a forward and a backward run as one bundle) are framed in red."""
    import matplotlib.pyplot as plt

    if timeline.schedule == "dualpipev":
        for rank in timeline.ranks():
            events = {str(e.action): e for e in timeline.of(rank)}
            for bundle in zb.dualpipev_bundles(timeline.pp, timeline.micro_batches, rank):
                if len(bundle) == 2:
                    first, second = events[str(bundle[0])], events[str(bundle[1])]
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


if __name__ == "__main__":  # a module: one line saying what to run instead, exit 2
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from scripts import module_only

    module_only(__doc__,
                "python scripts/plot.py SUBCOMMAND ... (python scripts/plot.py --help lists them)")
