"""Chapter 02: ZeRO and FSDP. Same global batch as chapter 01, but each of the N data-parallel
ranks keeps only 1/N of the optimizer state (ZeRO-1), of the gradients too (ZeRO-2), of the
parameters too (ZeRO-3 = FSDP). The run is still chapter 00's, to 1e-5.

    scripts/launch.sh examples/02_fsdp.py --nproc-per-node 2 -- --check
    scripts/launch.sh examples/02_fsdp.py --nproc-per-node 4 -- --zero-stage 1 --micro-batches 2
    scripts/launch.sh examples/02_fsdp.py --nproc-per-node 2 -- --impl torch --check   # FSDP2

Chapter 01's ``parallelize`` call does it: with zero_stage > 0 it shards the model (ours) or
hands it to FSDP2 (``--impl torch``). Prints the communication of the last step and the memory
ledger of every rank, each next to its formula, and writes runs/<name>/consolidated.pt: full
weights and full AdamW state, keyed like chapter 00's model (``build_model(cfg.model, seed)
.load_state_dict(torch.load(path)["model"])``; chapter 07 resumes it with ``--resume``).
"""

import os
import sys

from scaletorch.dist import (destroy_distributed, destroy_pg_manager, init_distributed,
                             init_pg_manager_from_config)
from scaletorch.models import build_model
from scaletorch.parallel.memory_report import zero_report
from scaletorch.parallel.parallelize import parallelize
from scaletorch.parallel.zero import check_zero_layout
from scaletorch.trainer import Trainer, check_against_reference, load_config
from scaletorch.trainer.consolidated import save_consolidated


def limits(cfg, world_size: int) -> None:
    """This chapter's scope, ZeRO over data parallel only (load_config checks it with the
    layout, before anything starts); chapter 07 combines ZeRO with the others."""
    p = cfg.parallel
    check_zero_layout(p.zero_stage, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                      p.expert_model_parallel_size)


def main() -> int:
    cfg = load_config("examples/configs/02_fsdp.yaml", "Chapter 02: ZeRO-1/2/3 and FSDP", limits)
    env = init_distributed(cfg.training.timeout_seconds)
    p = cfg.parallel
    pgm = init_pg_manager_from_config(p, cfg.training.timeout_seconds)
    pgm.log_topology()

    model = build_model(cfg.model, seed=cfg.training.model_seed)
    numel = model.num_parameters()
    # the new idea: shard, and let each rank's AdamW (ours: ZeroAdamW) update its shard only
    par = parallelize(model, cfg, pgm, env.device)
    model = par.model
    name = "FSDP2 fully_shard" if p.impl == "torch" else f"ZeRO-{p.zero_stage}"
    if env.rank == 0:
        print(f"{name}: {numel:,} parameters over {pgm.data_parallel_world_size_with_context} "
              f"data-parallel ranks")
    trainer = Trainer.from_parallelized(cfg, par, pgm, device=env.device)
    result = trainer.train()

    # What this chapter is about: 1/N of the model state per rank (stage 3: for 1.5x the traffic).
    report = zero_report(model, trainer.optimizer, cfg, pgm, numel, step=cfg.training.steps - 1)
    path = os.path.join(cfg.run_path, "consolidated.pt")
    save_consolidated(path, trainer, par)
    if env.rank == 0:
        print(report)
        print(f"consolidated checkpoint (full weights and AdamW state, chapter 00's keys): "
              f"{path}")

    ok = True
    if cfg.check:
        full = par.full_state_dict()  # collective: every rank gathers, rank 0 compares
        ok = check_against_reference(cfg, result.losses, env.device, full, result.start_step)
    destroy_pg_manager()
    destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
