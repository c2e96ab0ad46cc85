"""Chapter 03: tensor parallel. Every matrix of every block is split over the "tp" ranks.

    scripts/launch.sh examples/03_tensor_parallel.py --nproc-per-node 2 -- --check
    scripts/launch.sh examples/03_tensor_parallel.py --nproc-per-node 4 -- --tp 4 --check
    scripts/launch.sh examples/03_tensor_parallel.py --nproc-per-node 4 -- --sequence-parallel
    scripts/launch.sh examples/03_tensor_parallel.py --nproc-per-node 2 -- --impl torch --check

With 4 processes and the config's tp 2, the other factor 2 is data parallel (tp 2 x dp 2).

Chapter 01's ``parallelize`` call, now with tp > 1 in the config: it converts the model
(column / row / vocab-parallel layers) and returns a step with the vocab-parallel loss and a
grad norm that counts every shard once. With dp > 1 the data-parallel wrapper of chapter 01
goes around the tensor-parallel model. ``--impl torch`` runs torch's DTensor tensor parallel on
the same model instead (tp = world size).
"""

import sys

from scaletorch.dist import (destroy_distributed, destroy_pg_manager, get_ledger, init_distributed,
                             init_pg_manager)
from scaletorch.models import build_model
from scaletorch.parallel import tensor_parallel as tp_lib
from scaletorch.parallel.parallelize import parallelize
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
    p = cfg.parallel
    tp, sp = p.tensor_model_parallel_size, p.sequence_parallel
    pgm = init_pg_manager(tensor_model_parallel_size=tp)
    pgm.log_topology()

    model = build_model(cfg.model, seed=cfg.training.model_seed)
    par = parallelize(model, cfg, pgm, env.device)  # tp shards every block, dp goes around
    result = Trainer.from_parallelized(cfg, par, pgm, device=env.device).train()

    # What this chapter is about: 2 + 2 collectives of b x s x h per block, nothing bigger.
    ledger, last = get_ledger(), cfg.training.steps - 1
    tokens = cfg.data.global_batch_size // pgm.data_parallel_world_size * cfg.data.seq_len
    if pgm.rank == 0 and tp > 1:
        print(tp_lib.format_block_comm(cfg.model, tokens // cfg.data.num_micro_batches, tp, sp))
        print(ledger.table(step=last))
        if p.impl == "torch":
            print("note: DTensor issues its collectives itself, out of our ledger's sight")
        else:
            # the grad norm is one all-reduce over the world (grad_norm.py), not over tp
            formula = tp_lib.comm_elements_per_step(cfg.model, tokens, sp,
                                                    cfg.data.num_micro_batches)
            for op, expected in formula.items():
                measured = ledger.total(op=op, group="tp", step=last, phase="compute")
                print(f"{op} over tp in step {last}: ledger {measured:,.0f} elements, formula "
                      f"{expected:,} ({'OK' if measured == expected else 'MISMATCH'})")

    ok = True
    if cfg.check:
        full = par.full_state_dict()  # collective: the shards gathered over tp, on rank 0
        ok = check_against_reference(cfg, result.losses, env.device, full, result.start_step)
    destroy_pg_manager()
    destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
