"""Chapter 11: when a run hangs, fails or is slow. Inject a fault, then find it.

    scripts/launch.sh examples/11_debugging.py --nproc-per-node 2 -- --fault skip
    python scripts/fr_analyze.py runs/11_debugging/flight_recorder
    TORCH_DISTRIBUTED_DEBUG=DETAIL scripts/launch.sh examples/11_debugging.py \\
        --nproc-per-node 2 -- --fault shape
    scripts/launch.sh examples/11_debugging.py --nproc-per-node 2 -- --fault straggler
    scripts/launch.sh examples/11_debugging.py --nproc-per-node 2 -- --fault raise
    scripts/launch.sh examples/11_debugging.py --nproc-per-node 2 -- --fault kill
    scripts/launch.sh examples/11_debugging.py --nproc-per-node 2 -- --profile 2

Chapter 01's data parallel run (bucketed DDP) with two additions: the flight recorder keeps
each rank's last collectives, and a rank whose collective fails or times out writes them to
``<run dir>/flight_recorder/rank_<r>`` for scripts/fr_analyze.py; ``--fault KIND --fault-rank
R --fault-step K`` breaks rank R at step K (scaletorch/trainer/faults.py). What finds the faults
is in every run: the Trainer's straggler line at each log line, and ``--profile STEPS`` (a
torch.profiler trace per rank in ``<run dir>/profile/``, collectives labelled "dp all_reduce").
"""

import os
import sys
from functools import partial
from typing import List, Optional

from scaletorch.dist import (destroy_distributed, destroy_pg_manager, flight_recorder,
                             init_distributed, init_pg_manager_from_config)
from scaletorch.models import build_model
from scaletorch.parallel.data_parallel import apply_data_parallel
from scaletorch.parallel.grad_norm import clip_replicated
from scaletorch.parallel.step import make_data_parallel_step
from scaletorch.trainer import Trainer, load_config
from scaletorch.trainer.faults import FaultyStep, parse_fault_args, steps_on_this_rank


def main(argv: Optional[List[str]] = None) -> int:
    fault, rest = parse_fault_args(sys.argv[1:] if argv is None else argv)
    cfg = load_config("examples/configs/11_debugging.yaml", "Chapter 11: debugging",
                      lambda cfg, world: fault.check(world, cfg.training.steps), argv=rest)
    flight_recorder.enable()  # before the first process group: it records from then on
    env = init_distributed(cfg.training.timeout_seconds)
    p = cfg.parallel
    pgm = init_pg_manager_from_config(p, cfg.training.timeout_seconds)
    pgm.log_topology()

    model = build_model(cfg.model, seed=cfg.training.model_seed).to(env.device)
    model = apply_data_parallel(model, pgm, p.impl, p.bucket_size_mb)
    step = FaultyStep(
        make_data_parallel_step(model, cfg.data.num_micro_batches, pgm.data_parallel_rank,
                                pgm.data_parallel_world_size, pgm.gradient_sync_group), fault,
        env.rank)
    cfg.training.steps = steps_on_this_rank(fault, env.rank, cfg.training.steps)
    trainer = Trainer(cfg, model, pgm, device=env.device, forward_backward=step,
                      clip_grad_norm=partial(clip_replicated, list(model.parameters())))
    try:
        trainer.train()
    except Exception:
        # a collective failed or timed out: this rank's last collectives, for fr_analyze.py
        path = flight_recorder.dump(os.path.join(cfg.run_path, "flight_recorder"), env.rank,
                                    pgm.group_names.items())
        # one write, newline included: both ranks print at once, and print() would write the
        # text and its newline apart, so that two ranks' lines could run together
        sys.stderr.write(f"rank {env.rank}: flight recorder written to {path} (read them all: "
                         f"python scripts/fr_analyze.py {os.path.dirname(path)})\n")
        sys.stderr.flush()
        raise
    destroy_pg_manager()
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
