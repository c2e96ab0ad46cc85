"""Chapter 06: expert parallel. Every block's MLP is a mixture of experts, split over "ep".

    scripts/launch.sh examples/06_expert_parallel.py --nproc-per-node 2 -- --check
    scripts/launch.sh examples/06_expert_parallel.py --nproc-per-node 4 -- --check
    scripts/launch.sh examples/06_expert_parallel.py --nproc-per-node 4 -- --ep 4 --check
    scripts/launch.sh examples/06_expert_parallel.py --nproc-per-node 4 -- --tp 2 --check

The experts are carved out of the data-parallel ranks: with 4 processes and the config's ep 2,
dp 4 = ep 2 x edp 2 (two ranks hold each half of the experts, each sees its own tokens).

Chapter 01's ``parallelize`` call, now with ``num_experts`` > 0 in the config's model
(chapter 00 builds the same MoE model, the reference of ``--check``): ``apply_expert_parallel``
runs first and its wrapper takes the place of the data-parallel one: it keeps this rank's
experts, routes tokens through two all-to-alls per layer, and reduces expert gradients over
"edp", dense ones over "dp_cp". With ``--tp`` the attention is tensor parallel (chapter 03) and
the MoE runs whole on every tp rank.
"""

import sys

from scaletorch.dist import (destroy_distributed, destroy_pg_manager, init_distributed,
                             init_pg_manager_from_config)
from scaletorch.models import build_model
from scaletorch.parallel.expert_parallel import ep_report
from scaletorch.parallel.parallelize import parallelize
from scaletorch.trainer import Trainer, check_against_reference, load_config


def limits(cfg, world_size: int) -> None:
    """This chapter's scope (load_config checks it with the layout, before anything starts)."""
    p = cfg.parallel
    if p.pipeline_model_parallel_size > 1 or p.context_parallel_size > 1 or \
            p.impl != "scaletorch" or p.sequence_parallel:
        raise ValueError(f"06_expert_parallel composes ep with dp and tp (impl scaletorch, got "
                         f"{p.impl!r}); pp, cp and sequence parallel are in 07_nd_parallel")
    if cfg.model.num_experts < 1:
        raise ValueError(f"06_expert_parallel needs a mixture-of-experts model "
                         f"(model.num_experts >= 1), got {cfg.model.num_experts}")


def main() -> int:
    cfg = load_config("examples/configs/06_expert_parallel.yaml",
                      "Chapter 06: expert parallel (mixture of experts)", limits)
    env = init_distributed(cfg.training.timeout_seconds)
    pgm = init_pg_manager_from_config(cfg.parallel, cfg.training.timeout_seconds)
    pgm.log_topology()

    model = build_model(cfg.model, seed=cfg.training.model_seed)
    par = parallelize(model, cfg, pgm, env.device)  # expert, then tensor parallel
    model = par.model
    result = Trainer.from_parallelized(cfg, par, pgm, device=env.device).train()

    # What this chapter is about: where the tokens went, and what moving them cost.
    report = ep_report(model, pgm, step=cfg.training.steps - 1)
    if pgm.rank == 0:
        print(report)

    ok = True
    if cfg.check:
        full = par.full_state_dict()  # collective: experts gathered over ep, on rank 0
        ok = check_against_reference(cfg, result.losses, env.device, full, result.start_step)
    destroy_pg_manager()
    destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
