"""The table at the end of scripts/tour.sh: one row per run, from what the run left behind.

    python scripts/tour_summary.py runs/tour_runs.tsv

The TSV (written by tour.sh) has one line per run: chapter, processes, arguments, run
directory, seconds, exit code. From the run directory it reads metrics.jsonl (the last loss,
rank 0's wire bytes per step from the ledger: what it sent, a message counted at its sender)
and tour.log (the ``--check`` verdicts: the largest loss and weight deviations from the
single-device run).
"""

import os
import re
import sys
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scaletorch.rules import boundary  # noqa: E402
from scaletorch.rules.errors import OneLineParser  # noqa: E402

CHECK = re.compile(r"parity: max \|(loss|weight) - reference\| = (\S+) ")


def read_run(run_dir: str) -> Dict[str, Optional[float]]:
    """{"loss", "wire_mb", "loss_dev", "weight_dev"} of one run (None where it left nothing)."""
    out: Dict[str, Optional[float]] = dict.fromkeys(("loss", "wire_mb", "loss_dev", "weight_dev"))
    records: List[dict] = []
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.isfile(metrics):
        records = boundary.load_jsonl(metrics, "metrics file")
    if records:
        out["loss"] = records[-1]["loss"]
        wire = [r["wire_bytes"] for r in records if "wire_bytes" in r]
        out["wire_mb"] = sum(wire) / len(wire) / 1e6 if wire else None
    log = os.path.join(run_dir, "tour.log")
    if os.path.isfile(log):
        with open(log) as f:
            for kind, value in CHECK.findall(f.read()):
                out[f"{kind}_dev"] = float(value)
    return out


def _cell(value: Optional[float], fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def main(tsv: str) -> int:
    with open(tsv) as f:
        rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    script_w = max([len("script")] + [len(r[0]) for r in rows]) + 2
    args_w = max([len("arguments")] + [len(r[2]) for r in rows]) + 2
    head = (f"{'script':<{script_w}}{'ranks':>5}  {'arguments':<{args_w}}{'final loss':>12}"
            f"{'max dloss':>11}{'max dweight':>13}{'MB/step':>9}{'seconds':>9}  result")
    lines = [head, "-" * len(head)]
    failed = 0
    for chapter, nproc, args, run_dir, seconds, code in rows:
        run = read_run(run_dir)
        ok = code == "0"
        failed += not ok
        lines.append(f"{chapter:<{script_w}}{nproc:>5}  {args or '(config)':<{args_w}}"
                     f"{_cell(run['loss'], '.4f'):>12}{_cell(run['loss_dev'], '.1e'):>11}"
                     f"{_cell(run['weight_dev'], '.1e'):>13}{_cell(run['wire_mb'], '.3f'):>9}"
                     f"{float(seconds):>9.1f}  {'ok' if ok else 'FAILED'}")
    print("\n".join(lines))
    print("max dloss / dweight: largest |difference| from the single-device run (--check, "
          "tolerance 1e-5, or 32 x the floor\nmeasured above it);\nMB/step: bytes rank 0 sent per "
          "step (a receive sends nothing), as "
          "our ledger saw them (PyTorch's own collectives bypass it)")
    return 1 if failed else 0


if __name__ == "__main__":
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", metavar="RUNS.tsv", help="written by scripts/tour.sh")
    sys.exit(main(parser.parse_args().runs))
