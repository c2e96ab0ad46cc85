"""The tour's measured step times beside the planner's prediction on a calibrated host.

    scripts/tour.sh                                    # runs/tour_runs.tsv + runs/tour_*/
    python scripts/plan.py examples/configs/07_nd_parallel.yaml --calibrate runs/host.json
    python scripts/plan_vs_tour.py runs/tour_runs.tsv --cluster runs/host.json \
        --json runs/plan_vs_tour.json   # for: python scripts/plot.py plan-vs-measured FILE

For each run of the tour: its config (the run directory's config.yaml, flags applied) and world
size give the planner's model and layout; the measured step time is the 10th percentile of the
run's steps after the first (metrics.jsonl: tokens per step / tokens_per_s; --calibrate reads
its runs the same way, scaletorch/plan/time.measured_step says why); the predicted one is
scaletorch/plan/time.py's on the cluster file. Exit status 1 if a ratio is outside
[1 / (1 + tolerance), 1 + tolerance].
"""

import json
import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scaletorch.plan.cluster import load_cluster  # noqa: E402
from scaletorch.plan.layout import from_config as layout_of  # noqa: E402
from scaletorch.plan.model import from_config as model_of  # noqa: E402
from scaletorch.plan.time import measured_step, step_time  # noqa: E402
from scaletorch.rules import boundary  # noqa: E402
from scaletorch.rules.errors import OneLineParser  # noqa: E402
from scaletorch.trainer.config import parse_args  # noqa: E402


def measured_step_seconds(run_dir: str) -> float:
    """The 10th percentile of the steps after the first (warm-up), seconds, from the run's
    metrics.jsonl (scaletorch/plan/time.measured_step)."""
    cfg = parse_args(["--config", os.path.join(run_dir, "config.yaml")])
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    records = boundary.load_jsonl(os.path.join(run_dir, "metrics.jsonl"), "metrics file")
    if len(records) < 2:
        raise ValueError(f"{run_dir}: fewer than 2 steps in metrics.jsonl")
    return measured_step([tokens / r["tokens_per_s"] for r in records])


def main(argv: Optional[List[str]] = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("tsv", help="runs/tour_runs.tsv (written by scripts/tour.sh)")
    parser.add_argument("--cluster", required=True, help="a calibrated cluster file")
    parser.add_argument("--tolerance", type=float, default=0.3)
    parser.add_argument(
        "--json", metavar="FILE", help="also write the rows as a JSON list "
        "(script, ranks, arguments, measured_s, predicted_s)")
    args = parser.parse_args(argv)
    try:
        cluster = load_cluster(args.cluster)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    with open(args.tsv) as f:
        rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    print(f"{'script':<22}{'ranks':>5}  {'arguments':<62}{'measured':>9}{'predicted':>10}"
          f"{'ratio':>7}  {'largest':<12}verdict")
    outside, points = [], []
    for chapter, nproc, run_args, run_dir, _, code in rows:
        if code != "0":
            continue
        cfg = parse_args(["--config", os.path.join(run_dir, "config.yaml")])
        model, layout = model_of(cfg.model), layout_of(cfg, int(nproc))
        measured = measured_step_seconds(run_dir)
        t = step_time(model, layout, cluster)
        ratio = t["step_time_s"] / measured
        terms = {"compute": t["compute_s"] * cluster.time_slicing(layout.world)}
        terms.update({f"comm:{g}": v for g, v in t["exposed_s"].items()})
        ok = 1 / (1 + args.tolerance) <= ratio <= 1 + args.tolerance
        points.append({
            "script": chapter,
            "ranks": int(nproc),
            "arguments": run_args,
            "measured_s": measured,
            "predicted_s": t["step_time_s"]
        })
        if not ok:
            outside.append(f"{chapter} {run_args}".strip())
        print(f"{chapter:<22}{nproc:>5}  {run_args or '(config)':<62}{1e3 * measured:>9.1f}"
              f"{1e3 * t['step_time_s']:>10.1f}{ratio:>7.2f}  "
              f"{max(terms, key=lambda k: terms[k]):<12}{'ok' if ok else 'OUTSIDE'}")
    print(
        "measured (10th percentile of the steps after the first), predicted: ms per step; ratio = "
        "predicted / measured;\nlargest: the prediction's biggest term (compute incl. "
        "time-slicing, or a group's calls)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(points, f, indent=1)
    print(f"within {args.tolerance:.0%}: "
          f"{'all' if not outside else 'not ' + '; '.join(outside)}")
    return 1 if outside else 0


if __name__ == "__main__":
    sys.exit(main())
