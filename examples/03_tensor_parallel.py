"""Chapter 03: tensor parallel. Every matrix of every block is split over the "tp" ranks.

    scripts/launch.sh examples/03_tensor_parallel.py --nproc-per-node 2 -- --check
    scripts/launch.sh examples/03_tensor_parallel.py --nproc-per-node 4 -- --tp 4 --check
    scripts/launch.sh examples/03_tensor_parallel.py --nproc-per-node 4 -- --sequence-parallel
    scripts/launch.sh examples/03_tensor_parallel.py --nproc-per-node 2 -- --impl torch --check

With 4 processes and the config's tp 2, the other factor 2 is data parallel (tp 2 x dp 2).

Chapter 01 plus: convert the model (column / row / vocab-parallel layers), train with the
vocab-parallel loss and a grad norm that sums the shards over "tp". With dp > 1 the data-
parallel wrapper of chapter 01 goes around the tensor-parallel model. ``--impl torch`` runs
torch's DTensor tensor parallel on the same model instead (tp = world size).
"""

import sys
from contextlib import nullcontext

from torch.distributed.tensor.parallel import loss_parallel

from scaletorch.dist import (destroy_distributed, destroy_pg_manager, get_ledger, init_distributed,
                             init_pg_manager)
from scaletorch.models import build_model
from scaletorch.parallel import tensor_parallel as tp_lib
from scaletorch.parallel.data_parallel import apply_data_parallel
from scaletorch.trainer import (Trainer, check_against_reference, make_data_parallel_step,
                                parse_args, validate_layout)


def main() -> int:
    cfg = parse_args(default_config="examples/configs/03_tensor_parallel.yaml",
                     description="Chapter 03: tensor parallel (+ sequence parallel)")
    env = init_distributed(cfg.training.timeout_seconds)
    validate_layout(cfg, env.world_size)
    p = cfg.parallel
    if p.pipeline_model_parallel_size > 1 or p.context_parallel_size > 1 or \
            p.expert_model_parallel_size > 1 or p.impl not in ("scaletorch", "torch"):
        raise ValueError(f"03_tensor_parallel composes tp with dp, with impl scaletorch or torch "
                         f"(got impl {p.impl!r}); pp, cp and ep have their own chapters")
    tp, sp = p.tensor_model_parallel_size, p.sequence_parallel
    tp_lib.validate_tensor_parallel(cfg.model, tp, sp, cfg.data.seq_len)
    pgm = init_pg_manager(tensor_model_parallel_size=tp)
    pgm.log_topology()

    model = build_model(cfg.model, seed=cfg.training.model_seed).to(env.device)
    if p.impl == "torch":  # DTensor: parallelize_module + loss_parallel
        model = tp_lib.apply_dtensor_tensor_parallel(model, pgm, sp)
        loss, clip = tp_lib.dtensor_loss_fn, tp_lib.dtensor_clip_grad_norm(model, pgm)
    else:  # the new lines: shard every block, then data parallel around it
        model = tp_lib.apply_tensor_parallel(model, pgm, sp)
        loss, clip = tp_lib.tensor_parallel_loss_fn(pgm), \
            tp_lib.tensor_parallel_clip_grad_norm(model, pgm)
        if pgm.data_parallel_world_size > 1:
            model = apply_data_parallel(model, pgm, "scaletorch", p.bucket_size_mb)
    step = make_data_parallel_step(model, cfg.data.num_micro_batches, pgm.data_parallel_rank,
                                   pgm.data_parallel_world_size,
                                   pgm.data_parallel_group_with_context, loss)
    with loss_parallel() if p.impl == "torch" else nullcontext():
        result = Trainer(cfg, model, pgm, device=env.device, forward_backward=step,
                         clip_grad_norm=clip).train()

    # What this chapter is about: 2 + 2 collectives of b x s x h per block, nothing bigger.
    ledger, last = get_ledger(), cfg.training.steps - 1
    tokens = cfg.data.global_batch_size // pgm.data_parallel_world_size * cfg.data.seq_len
    if pgm.rank == 0 and tp > 1:
        print(tp_lib.format_block_comm(cfg.model, tokens // cfg.data.num_micro_batches, tp, sp))
        print(ledger.table(step=last))
        if p.impl == "torch":
            print("note: DTensor issues its collectives itself, out of our ledger's sight")
        else:
            formula = tp_lib.comm_elements_per_step(cfg.model, tokens, sp,
                                                    cfg.data.num_micro_batches)
            for op, expected in formula.items():
                measured = ledger.total(op=op, group="tp", step=last)
                print(f"{op} over tp in step {last}: ledger {measured:,.0f} elements, formula "
                      f"{expected:,} ({'OK' if measured == expected else 'MISMATCH'})")

    ok = True
    if cfg.check:
        full_state = tp_lib.gather_full_state_dict(model, pgm)
        ok = check_against_reference(cfg, result.losses, env.device,
                                     full_state if pgm.rank == 0 else None, result.start_step)
    destroy_pg_manager()
    destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
