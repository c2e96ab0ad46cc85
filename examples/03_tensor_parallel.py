"""Chapter 03: tensor parallel. Every matrix of every block is split over the "tp" ranks.

    scripts/launch.sh examples/03_tensor_parallel.py --nproc-per-node 2 -- --check
    scripts/launch.sh examples/03_tensor_parallel.py --nproc-per-node 4 -- --tp 4 \
        --model.num_key_value_heads 4 --check     # tp 4 needs 4 kv heads: a different model
    scripts/launch.sh examples/03_tensor_parallel.py --nproc-per-node 4 -- --sequence-parallel
    scripts/launch.sh examples/03_tensor_parallel.py --nproc-per-node 2 -- --impl torch --check

With 4 processes and the config's tp 2, the other factor 2 is data parallel (tp 2 x dp 2).
The model is chapter 00's (4 query, 2 key/value heads): tp 2 splits both evenly; tp 4 needs
4 key/value heads, a different model (the layout check says so before anything starts).

Chapter 01's ``parallelize`` call, now with tp > 1 in the config: it converts the model
(column / row / vocab-parallel layers) and returns a step with the vocab-parallel loss and a
grad norm that counts every shard once. With dp > 1 the data-parallel wrapper of chapter 01
goes around the tensor-parallel model. ``--impl torch`` runs torch's DTensor tensor parallel
(``parallelize_module``) on the same model instead, with FSDP2's ``replicate`` over dp.
"""

import sys

from scaletorch.dist import (destroy_distributed, destroy_pg_manager, init_distributed,
                             init_pg_manager_from_config)
from scaletorch.models import build_model
from scaletorch.parallel.parallelize import parallelize
from scaletorch.parallel.tensor_parallel import tp_report
from scaletorch.trainer import Trainer, check_against_reference, load_config


def limits(cfg, world_size: int) -> None:
    """This chapter's scope (load_config checks it with the layout, before anything starts)."""
    p = cfg.parallel
    if p.pipeline_model_parallel_size > 1 or p.context_parallel_size > 1 or \
            p.expert_model_parallel_size > 1 or p.impl not in ("scaletorch", "torch"):
        raise ValueError(f"03_tensor_parallel composes tp with dp, with impl scaletorch or torch "
                         f"(got impl {p.impl!r}); pp, cp and ep have their own chapters")


def main() -> int:
    cfg = load_config("examples/configs/03_tensor_parallel.yaml",
                      "Chapter 03: tensor parallel (+ sequence parallel)", limits)
    env = init_distributed(cfg.training.timeout_seconds)
    pgm = init_pg_manager_from_config(cfg.parallel, cfg.training.timeout_seconds)
    pgm.log_topology()

    model = build_model(cfg.model, seed=cfg.training.model_seed)
    par = parallelize(model, cfg, pgm, env.device)  # tp shards every block, dp goes around
    result = Trainer.from_parallelized(cfg, par, pgm, device=env.device).train()

    # What this chapter is about: 2 + 2 collectives of b x s x h per block, nothing bigger.
    report = tp_report(cfg, pgm, step=cfg.training.steps - 1)
    if pgm.rank == 0 and report:
        print(report)

    ok = True
    if cfg.check:
        full = par.full_state_dict()  # collective: the shards gathered over tp, on rank 0
        ok = check_against_reference(cfg, result.losses, env.device, full, result.start_step)
    destroy_pg_manager()
    destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
