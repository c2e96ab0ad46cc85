"""Chapter 02: ZeRO and FSDP. Same global batch as chapter 01, but each of the N data-parallel
ranks keeps only 1/N of the optimizer state (ZeRO-1), of the gradients too (ZeRO-2), of the
parameters too (ZeRO-3 = FSDP). The run is still chapter 00's, to 1e-5.

    scripts/launch.sh examples/02_fsdp.py --nproc-per-node 2 -- --check
    scripts/launch.sh examples/02_fsdp.py --nproc-per-node 4 -- --zero-stage 1 --micro-batches 2
    scripts/launch.sh examples/02_fsdp.py --nproc-per-node 2 -- --impl torch --check   # FSDP2

Prints the communication of the last step and the memory ledger of every rank, each next to
its formula, and writes runs/<name>/consolidated.pt: the full weights, loadable by chapter 00's
model (``build_model(cfg.model, seed).load_state_dict(torch.load(path))``).
"""

import os
import sys

from scaletorch.dist import (destroy_distributed, destroy_pg_manager, get_ledger, init_distributed,
                             init_pg_manager)
from scaletorch.models import build_model
from scaletorch.parallel.fsdp import (apply_fully_shard, apply_zero, full_state_dict,
                                      save_consolidated)
from scaletorch.parallel.zero import ZeroAdamW, comm_report, memory_report
from scaletorch.trainer import Trainer, check_against_reference, parse_args, validate_layout


def main() -> int:
    cfg = parse_args(default_config="examples/configs/02_fsdp.yaml",
                     description="Chapter 02: ZeRO-1/2/3 and FSDP")
    env = init_distributed(cfg.training.timeout_seconds)
    validate_layout(cfg, env.world_size)
    p = cfg.parallel
    if p.impl not in ("scaletorch", "torch"):
        raise ValueError(f"02_fsdp runs parallel.impl scaletorch or torch, got {p.impl!r}")
    if p.impl == "torch" and p.zero_stage != 3:
        raise ValueError(f"--impl torch is FSDP2 fully_shard, which is ZeRO-3; got "
                         f"--zero-stage {p.zero_stage}")
    pgm = init_pg_manager(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                          p.context_parallel_size, p.expert_model_parallel_size)
    pgm.log_topology()

    model = build_model(cfg.model, seed=cfg.training.model_seed).to(env.device)
    numel = model.num_parameters()
    if p.impl == "torch":  # the Trainer's AdamW and clip_grad_norm_ work on FSDP2's DTensors
        model, optimizer, clip = apply_fully_shard(model, pgm), None, None
    else:  # the new idea: shard, and let each rank's AdamW update its shard only
        model = apply_zero(model, pgm, p.zero_stage)
        t = cfg.training
        optimizer = ZeroAdamW(model, t.lr, (t.beta1, t.beta2), t.weight_decay)
        clip = model.clip_grad_norm_
    name = "FSDP2 fully_shard" if p.impl == "torch" else f"ZeRO-{p.zero_stage}"
    if env.rank == 0:
        print(f"{name}: {numel:,} parameters over {pgm.data_parallel_world_size_with_context} "
              f"data-parallel ranks")
    trainer = Trainer(cfg, model, pgm, device=env.device, optimizer=optimizer, clip_grad_norm=clip)
    result = trainer.train()

    last = cfg.training.steps - 1
    if env.rank == 0 and result.losses:
        print(get_ledger().table(step=last))
        if p.impl == "torch":
            print("(fully_shard calls the backend directly: its collectives are not in the "
                  "ledger, only the loss and norm all-reduces are)")
        else:
            print(
                comm_report(p.zero_stage, model.padded_numel, cfg.data.num_micro_batches,
                            pgm.data_parallel_world_size_with_context, last))
    padded = getattr(model, "padded_numel", numel)
    table = memory_report(model, trainer.optimizer, p.zero_stage, numel, padded,
                          pgm.data_parallel_group_with_context)
    path = os.path.join(cfg.run_path, "consolidated.pt")
    save_consolidated(model, path)
    if env.rank == 0:
        print(table)
        print(f"consolidated checkpoint (full weights, chapter 00's keys): {path}")

    ok = True
    if cfg.check:
        full = full_state_dict(model)  # collective: every rank gathers, rank 0 compares
        ok = check_against_reference(cfg, result.losses, env.device,
                                     full_state=full if env.rank == 0 else None,
                                     start_step=result.start_step)
    destroy_pg_manager()
    destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
