"""What scripts/plan.py and scripts/calibrate.py both need from a real run: a planned layout
as a trainer config (``run_config``), the trainer's layout check for it (``checker``), and one
rank's measurements of training it (``measure_rank``: ledger bytes and calls, memory, saved
activations, step times).
"""

import os
import sys
from typing import Dict, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scaletorch.dist import destroy_pg_manager, get_ledger, init_pg_manager  # noqa: E402
from scaletorch.dist.layout_check import validate_layout  # noqa: E402
from scaletorch.parallel.activation_checkpointing import saved_activation_bytes  # noqa: E402
from scaletorch.parallel.memory_report import measure_memory  # noqa: E402
from scaletorch.plan.layout import PlanLayout  # noqa: E402
from scaletorch.plan.model import ModelSpec  # noqa: E402
from scaletorch.trainer.config import Config  # noqa: E402
from scaletorch.trainer.dry_run import build_run, run_config  # noqa: E402, F401
from scaletorch.trainer.plan_line import plan_report  # noqa: E402


def checker(base: Config):
    """The trainer's layout check for a planned layout: None if it can run, else why not."""

    def check(model: ModelSpec, layout: PlanLayout) -> Optional[str]:
        try:
            validate_layout(run_config(base, model, layout), layout.world)
        except ValueError as err:
            return str(err)
        return None

    return check


def measure_rank(rank: int, world: int, configs: Dict[str, Config]) -> Dict[str, dict]:
    """Inside a gloo world: train each config's layout (``training.steps`` steps) and measure
    this rank: ``wire`` {(op, group, phase): wire bytes of the last step} and ``calls`` {the
    same keys: calls of the last step} from the ledger, ``memory`` (parameters, gradients,
    optimizer: the tensors held), ``saved`` (the most bytes autograd kept for backward during
    one more step, saved_tensors_hooks), ``pp_rank``, ``step_seconds`` (each step's wall
    time)."""
    out, ledger = {}, get_ledger()
    for name, cfg in configs.items():
        p = cfg.parallel
        pgm = init_pg_manager(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                              p.context_parallel_size, p.expert_model_parallel_size)
        par, trainer = build_run(cfg, pgm, torch.device("cpu"))
        ledger.clear()
        result = trainer.train()
        wire: Dict[tuple, float] = {}
        calls: Dict[tuple, int] = {}
        for r in ledger.select(step=cfg.training.steps - 1):
            key = (r.op, r.group, r.phase)
            wire[key] = wire.get(key, 0.0) + r.wire_bytes
            calls[key] = calls.get(key, 0) + 1
        memory = measure_memory(trainer.model, trainer.optimizer)
        inputs, targets = trainer.loader.get_batch(0)
        with ledger.paused():  # not the step's traffic
            saved, _ = saved_activation_bytes(par.model,
                                              lambda: par.forward_backward(inputs, targets))
        out[name] = {
            "wire":
            wire,
            "calls":
            calls,
            "memory":
            memory,
            "saved":
            saved,
            "pp_rank":
            pgm.pipeline_model_parallel_rank,
            "step_seconds":
            result.step_seconds,
            # what the trainer prints at the end of a run (rank 0's), from this rank
            "report":
            plan_report(cfg, world, pgm.pipeline_model_parallel_rank, trainer.model,
                        trainer.optimizer, cfg.training.steps - 1, []),
        }
        destroy_pg_manager()
    return out


if __name__ == "__main__":  # a module: one line saying what to run instead, exit 2
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from scripts import module_only

    module_only(__doc__, "python scripts/plan.py CONFIG.yaml --measure (or --calibrate FILE.json)")
