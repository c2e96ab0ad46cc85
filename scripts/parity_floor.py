"""The noise floor of a parity check: how far two correct single-device runs drift apart.

Trains the reference twice on one device with the same seed and the same global batches, once
with ``--micro-batches A`` and once with ``B``: the same mathematics in another summation
order, which is all any data, tensor or pipeline layout changes too. Prints their largest loss
and weight difference at each requested step. A layout's ``--check`` cannot hold a tolerance
below this floor at that many steps: past it, the differences are the training's own
sensitivity to rounding (AdamW turns rounding-level gradients of rarely used elements into
updates of about lr; a high learning rate amplifies every difference), not a wrong layout.
``--check`` measures the same floor at the run's own step count when a difference exceeds 1e-5
(scaletorch/trainer/parity.py, ``measure_floor``); this script shows how it grows with steps.

    python scripts/parity_floor.py examples/configs/10_real_model.yaml --steps 10 40 200
    python scripts/parity_floor.py examples/configs/00_single_device.yaml --steps 50 -- --lr 1e-2
"""

import os
import sys
from typing import Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scaletorch.rules.errors import OneLineParser  # noqa: E402
from scaletorch.trainer import load_config  # noqa: E402
from scaletorch.trainer.parity import reference_trainer  # noqa: E402
from scaletorch.trainer.parity import TOLERANCE, max_loss_diff, max_weight_diff  # noqa: E402

State = Dict[str, torch.Tensor]


def run(config_file: str, overrides: List[str], micro_batches: int,
        checkpoints: List[int]) -> Dict[int, tuple]:
    """{step: (losses so far, weights)} of one single-device run, at each step of checkpoints."""
    argv = overrides + ["--steps", str(max(checkpoints))]
    cfg = load_config(config_file, "parity floor", argv=argv)
    cfg.logging.progress = False
    trainer = reference_trainer(cfg, micro_batches=micro_batches)  # --check's reference
    model = trainer.model
    losses, out = [], {}
    for step in range(1, max(checkpoints) + 1):
        losses.append(trainer.train_step()[0])
        if step in checkpoints:
            out[step] = (list(losses), {
                k: v.detach().clone()
                for k, v in model.state_dict().items()
            })
    return out


def main(argv: Optional[List[str]] = None) -> None:
    """The command line above (``argv``: its arguments, sys.argv's by default)."""
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a chapter's YAML config")
    parser.add_argument("--steps", type=int, nargs="+", default=[10, 40],
                        help="report the drift after each of these step counts")
    parser.add_argument("--micro-batches", type=int, nargs=2, default=[2, 4], metavar=("A", "B"),
                        help="the two splittings of every global batch to compare")
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    args.overrides = argv[split + 1:]  # config overrides after --, as the examples take them
    if min(args.steps) < 1:
        parser.error(f"--steps must be positive, got {args.steps}")
    torch.set_num_threads(1)  # the same kernels' summation order in both runs
    a, b = (run(args.config, args.overrides, m, args.steps) for m in args.micro_batches)
    print(f"single device, micro-batches {args.micro_batches[0]} vs {args.micro_batches[1]} "
          f"(fp32 parity tolerance {TOLERANCE:.0e}):")
    for step in sorted(args.steps):
        loss = max_loss_diff(a[step][0], b[step][0])
        weight = max_weight_diff(a[step][1], b[step][1])
        verdict = "below" if max(loss, weight) <= TOLERANCE else "ABOVE"
        print(f"  after {step:4d} steps: max |loss diff| {loss:.1e}, max |weight diff| "
              f"{weight:.1e} ({verdict} the tolerance)")


if __name__ == "__main__":
    main()
