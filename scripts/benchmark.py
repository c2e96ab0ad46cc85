"""Benchmarks: our strategies against PyTorch's native ones, measured side by side.

    python scripts/benchmark.py                 # every chapter's rows
    python scripts/benchmark.py --only ddp fsdp # some of them
    python scripts/benchmark.py --scaling       # world 1, 2, 4: memory and traffic per rank
    python scripts/benchmark.py --list

Each chapter's rows live in ``scripts/benchmarks/<name>.py`` as ``run(args) -> list[dict]``,
timed with the helpers of ``scripts/benchmarks/timing.py``. Each runs at ``--world-size`` ranks,
2 unless given; a module with a ``WORLD_SIZE`` runs at that world only (zero_bubble: pp = 4),
and is skipped, with one line saying why, when another world is asked for.
A row reports ratios measured alternately in one run (ours / native step time), never a
single absolute time: on a shared CPU only ratios measured together mean something.
"""

import copy
import importlib
import os
import pkgutil
import sys
import time
from typing import Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import scripts.benchmarks as benchmarks  # noqa: E402
from scaletorch.rules.errors import OneLineParser  # noqa: E402

DEFAULT_WORLD_SIZE = 2


def available() -> list:
    """The chapters' modules: every one in scripts/benchmarks but the shared ``timing``."""
    return sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__) if m.name != "timing")


def world_for(module, asked: Optional[int]) -> Tuple[Optional[int], str]:
    """The world a benchmark module runs at (``asked``, or its own), or None and why not."""
    needs = getattr(module, "WORLD_SIZE", None)  # a family that runs at one world only
    if needs is not None and asked not in (None, needs):
        return None, f"skipped: it runs at world size {needs} only (--world-size {asked} asked)"
    return asked or needs or DEFAULT_WORLD_SIZE, ""


def print_rows(rows: list) -> None:
    if not rows:
        return
    keys = list(dict.fromkeys(k for row in rows for k in row))
    widths = {k: max(len(k), *(len(_fmt(row.get(k, ""))) for row in rows)) for k in keys}
    print("  ".join(k.ljust(widths[k]) for k in keys))
    for row in rows:
        print("  ".join(_fmt(row.get(k, "")).ljust(widths[k]) for k in keys))


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def main() -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", default=None, help="chapters to run")
    parser.add_argument("--list", action="store_true", help="list the chapters and exit")
    parser.add_argument("--scaling", action="store_true",
                        help="sweep world size 1, 2, 4 (= --only scaling)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    parser.add_argument("--repeats", type=int, default=3,
                        help="alternating repeats of each implementation")
    parser.add_argument(
        "--world-size", type=int, default=None,
        help=f"ranks per benchmark (default {DEFAULT_WORLD_SIZE}, or the one "
        f"world a benchmark needs)")
    args = parser.parse_args()
    names = available()
    if args.list:
        print("\n".join(names))
        return 0
    selected = ["scaling"] if args.scaling else (args.only or names)
    unknown = sorted(set(selected) - set(names))
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; available: {names}")
    for name in selected:
        module = importlib.import_module(f"scripts.benchmarks.{name}")
        world, why = world_for(module, args.world_size)
        if world is None:
            print(f"== {name}: {why}\n", flush=True)
            continue
        start = time.perf_counter()
        print(f"== {name}")
        module_args = copy.copy(args)
        module_args.world_size = world
        print_rows(module.run(module_args))
        print(f"({time.perf_counter() - start:.0f} s)\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
