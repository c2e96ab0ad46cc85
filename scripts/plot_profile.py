"""One step of two ranks as it ran, from the traces ``--profile STEPS`` writes.

    python scripts/plot.py profile runs/01_ddp/profile --out profile.png
    python scripts/plot.py profile runs/04_pipeline_parallel/profile --ranks 0 1 --step 1

Reads ``rank_<r>.json`` (torch.profiler's Chrome trace) of each rank and, for one profiled step
(``ProfilerStep#N``, the first by default), finds on the rank's main thread:

- its compute: the top-level events, each the backward (autograd's ``evaluate_function`` and
  ``AccumulateGrad``), the optimizer (``Optimizer.step``) or "forward & other" (the forward, the
  loss, clipping: the rest);
- its waits: ``"<label> wait"``, the time blocked on a collective (scaletorch.dist.comm
  labels each wait, and each call, with the ledger's name: "dp all_reduce", "pp send/recv"),
  and the calls made outside any other event (a synchronous collective blocks in its call);
- its collectives: each labelled call, and on a CPU where it ran: gloo runs a collective on a
  thread of its own (``gloo:all_reduce``), in the order the calls queued them, so the n-th
  gloo run is the n-th labelled collective. Point-to-point batches run in gloo's transport,
  which the profiler does not see: they show as their call and the wait on them.

The traces of one host share one clock, so the ranks are drawn on one time axis, in ms from
the earlier rank's step start. It prints the same as a table; matplotlib (the optional ``plot``
extra) draws it. This module parses without matplotlib (tests/test_plot_profile.py).
"""

import argparse
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from scaletorch.rules import boundary
from scaletorch.rules.errors import InputError, MissingInputError, clip

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send", "recv",
       "send/recv")
LABEL = re.compile(r"^(\w+) (" + "|".join(re.escape(op) for op in OPS) + r")$")
P2P = ("send", "recv", "send/recv")
BACKWARD = ("autograd::engine::evaluate_function", "autograd::AccumulateGrad")
FORWARD = "forward & other"
COLORS = {FORWARD: "#4C72B0", "backward": "#DD8452", "optimizer": "#55A868", "wait": "#BBBBBB"}


@dataclass
class Span:
    name: str
    start: float  # ms on the traces' common clock, from the step's start (set by ``read``)
    end: float

    @property
    def ms(self) -> float:
        return self.end - self.start


@dataclass
class Collective:
    label: str  # the ledger's: "dp all_reduce"
    issued: float  # when the call started (ms)
    run: Optional[Span] = None  # when gloo ran it (None: point-to-point, or not seen)


@dataclass
class RankStep:
    rank: int
    step: int
    span: Span  # the step (ProfilerStep#N)
    compute: List[Span] = field(default_factory=list)  # FORWARD / backward / optimizer
    waits: List[Span] = field(default_factory=list)  # "<label> wait"
    collectives: List[Collective] = field(default_factory=list)

    def runs(self) -> List[Tuple[Collective, Span]]:
        """The collectives gloo was seen running, with their runs, in issue order."""
        return [(c, c.run) for c in self.collectives if c.run is not None]

    def total(self, kind: str) -> float:
        return sum(s.ms for s in self.compute if s.name == kind)

    def overlap(self, kind: str) -> float:
        """ms during which a collective ran while the main thread did ``kind``."""
        runs = merge([Span("run", r.start, r.end) for _, r in self.runs()])
        return sum(
            max(0.0,
                min(a.end, b.end) - max(a.start, b.start)) for a in runs for b in self.compute
            if b.name == kind)


def merge(spans: List[Span], gap: float = 0.0) -> List[Span]:
    """Spans of one name joined where they touch (or are at most ``gap`` ms apart)."""
    out: List[Span] = []
    for s in sorted(spans, key=lambda s: s.start):
        if out and out[-1].name == s.name and s.start - out[-1].end <= gap:
            out[-1].end = max(out[-1].end, s.end)
        else:
            out.append(Span(s.name, s.start, s.end))
    return out


def load(path: str) -> List[dict]:
    """The complete events ("X") of a Chrome trace file, each checked for what ``read`` uses:
    a string ``name``, finite ``ts`` and ``dur`` >= 0 (microseconds), an int or string ``tid``.
    InputError naming the file and the event's index otherwise; a directory is no profile."""
    try:
        boundary.regular_file(path, "profile", boundary.JSON_BYTES)
    except MissingInputError:
        raise MissingInputError(f"no profile {clip(path)} (run with --profile STEPS "
                                f"first)") from None
    trace = boundary.load_json(path, "profile", digest=False)
    events = trace.get("traceEvents", [])
    if not isinstance(events, list):
        raise InputError(f"profile {clip(path)} 'traceEvents' is {clip(events, 60)}, not a "
                         f"list of events: is it torch.profiler's trace?")
    complete = []
    for i, e in enumerate(events):
        where = f"profile {clip(path)} event {i}"
        if not isinstance(e, dict):
            raise InputError(f"{where} is {clip(e, 60)}, not an object")
        if e.get("ph") != "X" or "dur" not in e:
            continue
        if not isinstance(e.get("name"), str):
            raise InputError(f"{where} 'name' is {clip(e.get('name'), 60)}, not a string")
        boundary.number(e.get("ts"), f"{where} 'ts'")
        boundary.number(e["dur"], f"{where} 'dur'", low=0)
        if isinstance(e.get("tid"), bool) or not isinstance(e.get("tid"), (int, str)):
            raise InputError(f"{where} 'tid' is {clip(e.get('tid'), 60)}, not an int or string")
        complete.append(e)
    return complete


def kind_of(name: str) -> str:
    if name.startswith(BACKWARD):
        return "backward"
    return "optimizer" if name.startswith("Optimizer.step") else FORWARD


def read(events: List[dict], rank: int, step: Optional[int] = None) -> RankStep:
    """The step ``step`` (None: the first profiled) of one rank's trace; times in ms on the
    trace's clock (``shift`` moves them to a common origin)."""
    steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#")),
                   key=lambda e: e["ts"])
    if step is not None:
        steps = [e for e in steps if e["name"] == f"ProfilerStep#{step}"]
    if not steps:
        raise ValueError(f"rank {rank}'s trace has no ProfilerStep#{'N' if step is None else step}"
                         " (was the run profiled, --profile STEPS?)")
    top = steps[0]
    t0, t1, main = top["ts"], top["ts"] + top["dur"], top["tid"]

    def ms(t: float) -> float:
        return t / 1e3

    inside = sorted((e for e in events if t0 <= e["ts"] <= t1 and e is not top), key=lambda e:
                    (e["ts"], -e["dur"]))
    out = RankStep(rank, int(top["name"].split("#")[1]), Span("step", ms(t0), ms(t1)))
    end = t0  # the end of the main thread's current top-level event
    for e in inside:
        name, start, stop = e["name"], e["ts"], e["ts"] + e["dur"]
        if e["tid"] != main:
            continue
        if name.endswith(" wait") and LABEL.match(name[:-len(" wait")]):
            out.waits.append(Span(name[:-len(" wait")], ms(start), ms(stop)))
        elif LABEL.match(name):
            out.collectives.append(Collective(name, ms(start)))
        if start >= end:  # top level: what the main thread was doing
            end = stop
            if LABEL.match(name):  # a call of its own: a synchronous one waits in it
                out.waits.append(Span(name, ms(start), ms(stop)))
            elif not name.endswith(" wait"):
                out.compute.append(Span(kind_of(name), ms(start), ms(stop)))
    out.compute = merge(out.compute, gap=0.05)
    runs = sorted((e for e in events
                   if e["tid"] != main and e["name"].startswith("gloo:") and t0 <= e["ts"] <= t1),
                  key=lambda e: e["ts"])
    queued = [c for c in out.collectives if c.label.split(" ")[1] not in P2P]
    for c, e in zip(queued, runs):  # gloo's threads take the collectives in queue order
        c.run = Span(c.label, ms(e["ts"]), ms(e["ts"] + e["dur"]))
    return out


def read_ranks(directory: str, ranks: Sequence[int] = (0, 1),
               step: Optional[int] = None) -> List[RankStep]:
    """``read`` for each rank's ``rank_<r>.json``, times in ms from the earliest step start."""
    steps = [read(load(os.path.join(directory, f"rank_{r}.json")), r, step) for r in ranks]
    origin = min(s.span.start for s in steps)
    for s in steps:
        for span in [s.span, *s.compute, *s.waits, *(r for _, r in s.runs())]:
            span.start, span.end = span.start - origin, span.end - origin
        for c in s.collectives:
            c.issued -= origin
    return steps


def table(steps: List[RankStep]) -> List[str]:
    """What the picture shows, as text: per rank, the step, its parts and its collectives."""
    lines = []
    for s in steps:
        counts: Dict[str, int] = {}
        for c in s.collectives:
            counts[c.label] = counts.get(c.label, 0) + 1
        lines.append(f"rank {s.rank}, step {s.step}: {s.span.start:.1f} ms to {s.span.end:.1f} ms; "
                     f"{FORWARD} {s.total(FORWARD):.1f} ms, backward {s.total('backward'):.1f} "
                     f"ms, optimizer {s.total('optimizer'):.1f} ms, waiting "
                     f"{sum(w.ms for w in s.waits):.1f} ms")
        lines.append("  collectives: " + ", ".join(f"{n} x {label}" for label, n in counts.items()))
        ran = s.runs()
        if ran:
            busy = sum(m.ms for m in merge([Span("run", r.start, r.end) for _, r in ran]))
            lines.append(f"  gloo ran {len(ran)} of them, busy {busy:.1f} ms, "
                         f"{s.overlap('backward'):.1f} ms of it under the backward")
    return lines


def draw(plt: Any, steps: List[RankStep], title: str, out: str) -> None:
    """Per rank two rows: the main thread (compute and waits) and the
    collectives (gloo's runs, one lane per overlap; point-to-point calls as ticks)."""
    from matplotlib.patches import Patch

    from scripts.plot_base import save_figure  # once scripts/plot.py put the repository on sys.path
    fig, ax = plt.subplots(figsize=(11, 1.0 + 1.3 * len(steps)))
    palette = plt.get_cmap("tab10")
    labels: Dict[str, Any] = {}
    y, ticks = 0.0, []
    for s in reversed(steps):
        lanes: List[float] = []  # each lane's end
        rows: List[Tuple[int, Collective, Span]] = []
        for c, r in sorted(s.runs(), key=lambda cr: cr[1].start):
            lane = next((i for i, e in enumerate(lanes) if e <= r.start), len(lanes))
            lanes[lane:lane + 1] = [r.end]
            rows.append((lane, c, r))
        height = 0.8 / max(1, len(lanes))
        for lane, c, r in rows:
            color = labels.setdefault(c.label, palette(len(labels) % 10))
            ax.broken_barh([(r.start, r.ms)], (y + lane * height, height * 0.9), color=color,
                           alpha=0.8)
        for c in s.collectives:
            if not c.run:
                color = labels.setdefault(c.label, palette(len(labels) % 10))
                ax.plot([c.issued, c.issued], [y, y + 0.8], color=color, linewidth=1.2)
        ticks.append((y + 0.4, f"rank {s.rank} collectives"))
        y += 1.0
        for span in s.compute:
            ax.broken_barh([(span.start, span.ms)], (y, 0.8), color=COLORS[span.name])
        for w in s.waits:
            ax.broken_barh([(w.start, w.ms)], (y, 0.8), facecolor=COLORS["wait"],
                           edgecolor=labels.setdefault(w.name, palette(len(labels) % 10)),
                           hatch="///", linewidth=0.5)
        ticks.append((y + 0.4, f"rank {s.rank} main thread"))
        y += 1.4
    ax.set_yticks([t for t, _ in ticks], [n for _, n in ticks])
    ax.set_xlabel("ms from the step's start (the earlier rank's)")
    ax.set_title(title, fontsize=10)
    handles = [Patch(color=COLORS[k], label=k) for k in (FORWARD, "backward", "optimizer")]
    handles.append(Patch(facecolor=COLORS["wait"], hatch="///", label="waiting on a collective"))
    handles += [Patch(color=c, label=label) for label, c in labels.items()]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    save_figure(fig, out, dpi=100)
    print(f"wrote {out}")


def add_parser(sub: Any) -> None:
    """``scripts/plot.py profile``'s arguments."""
    p = sub.add_parser("profile", help="one step of two ranks from --profile traces")
    p.add_argument("path", help="the run's profile directory (rank_<r>.json)")
    p.add_argument("--ranks", type=int, nargs="+", default=[0, 1])
    p.add_argument("--step", type=int, default=None, help="ProfilerStep#N (default: the first)")
    p.add_argument("--out", default="profile.png")


def run(args: argparse.Namespace, pyplot: Callable[[], Any]) -> None:
    steps = read_ranks(args.path, args.ranks, args.step)
    for line in table(steps):
        print(line)
    plt = pyplot()
    if plt is not None:
        name = os.path.basename(os.path.dirname(os.path.abspath(args.path)))
        ranks = " and ".join(str(r) for r in args.ranks)
        draw(plt, steps, f"{name}: step {steps[0].step} of ranks {ranks} as it ran "
             "(torch.profiler, CPU)", args.out)


if __name__ == "__main__":  # a module: one line saying what to run instead, exit 2
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from scripts import module_only

    module_only(__doc__, "python scripts/plot.py profile RUN_DIR/profile --out FILE.png")
