"""Chapter 06: expert parallel. Every block's MLP is a mixture of experts, split over "ep".

    scripts/launch.sh examples/06_expert_parallel.py --nproc-per-node 2 -- --check
    scripts/launch.sh examples/06_expert_parallel.py --nproc-per-node 4 -- --check
    scripts/launch.sh examples/06_expert_parallel.py --nproc-per-node 4 -- --ep 4 --check
    scripts/launch.sh examples/06_expert_parallel.py --nproc-per-node 4 -- --tp 2 --check

The experts are carved out of the data-parallel ranks: with 4 processes and the config's ep 2,
dp 4 = ep 2 x edp 2 (two ranks hold each half of the experts, each sees its own tokens).

Chapter 01 plus: the config's model has ``num_experts`` > 0 (chapter 00 would build the same
MoE model, the reference of ``--check``), and ``apply_expert_parallel`` takes the place of the
data-parallel wrapper: it keeps this rank's experts, routes tokens through two all-to-alls per
layer, and reduces expert gradients over "edp", dense ones over "dp_cp". With ``--tp`` the
attention is tensor parallel (chapter 03) and the MoE runs whole on every tp rank.
"""

import sys

from scaletorch.dist import (destroy_distributed, destroy_pg_manager, get_ledger, init_distributed,
                             init_pg_manager)
from scaletorch.models import build_model, loss_fn
from scaletorch.parallel import tensor_parallel as tp_lib
from scaletorch.parallel.expert_parallel import (all_to_all_elements, apply_expert_parallel,
                                                 format_routing, validate_expert_parallel)
from scaletorch.trainer import (Trainer, check_against_reference, make_data_parallel_step,
                                parse_args, validate_layout)


def main() -> int:
    cfg = parse_args(default_config="examples/configs/06_expert_parallel.yaml",
                     description="Chapter 06: expert parallel (mixture of experts)")
    env = init_distributed(cfg.training.timeout_seconds)
    validate_layout(cfg, env.world_size)
    p = cfg.parallel
    if p.pipeline_model_parallel_size > 1 or p.context_parallel_size > 1 or \
            p.impl != "scaletorch" or p.sequence_parallel:
        raise ValueError(f"06_expert_parallel composes ep with dp and tp (impl scaletorch, got "
                         f"{p.impl!r}); pp, cp and sequence parallel are in 07_nd_parallel")
    tp, ep = p.tensor_model_parallel_size, p.expert_model_parallel_size
    validate_expert_parallel(cfg.model.num_experts, ep, env.world_size // tp)
    pgm = init_pg_manager(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    pgm.log_topology()

    model = build_model(cfg.model, seed=cfg.training.model_seed).to(env.device)
    loss = loss_fn
    if tp > 1:
        model = tp_lib.apply_tensor_parallel(model, pgm)
        loss = tp_lib.tensor_parallel_loss_fn(pgm)
    model = apply_expert_parallel(model, pgm)  # the new line
    step = make_data_parallel_step(model, cfg.data.num_micro_batches, pgm.data_parallel_rank,
                                   pgm.data_parallel_world_size,
                                   pgm.data_parallel_group_with_context, loss)
    result = Trainer(cfg, model, pgm, device=env.device, forward_backward=step,
                     clip_grad_norm=model.clip_grad_norm).train()

    # What this chapter is about: where the tokens went, and what moving them cost.
    report, ledger, last = format_routing(model, pgm), get_ledger(), cfg.training.steps - 1
    if pgm.rank == 0:
        print(report)
        print(ledger.table(step=last))
        # token rows: every all_to_all over ep but the exchange of int64 counts
        moved = sum(r.elements for r in ledger.select("all_to_all", "ep", last)
                    if r.bytes != 8 * r.elements)
        formula = all_to_all_elements(model, pgm)
        print(f"rank 0, step {last}: all-to-all token elements over ep {moved:,} = 2 directions "
              f"x h x (sent + received) summed over layers {formula:,} "
              f"({'OK' if moved == formula else 'MISMATCH'})")

    ok = True
    if cfg.check:
        full_state = model.full_state_dict()
        ok = check_against_reference(cfg, result.losses, env.device,
                                     full_state if pgm.rank == 0 else None, result.start_step)
    destroy_pg_manager()
    destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
