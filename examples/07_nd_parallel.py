"""Chapter 07: N-D parallel. Every strategy at once, in one fixed order, still chapter 00's run.

    scripts/launch.sh examples/07_nd_parallel.py --nproc-per-node 8 -- --tp 2 --pp 2 --check
    scripts/launch.sh examples/07_nd_parallel.py --nproc-per-node 8 -- --tp 2 --cp 2 --check
    scripts/launch.sh examples/07_nd_parallel.py --nproc-per-node 8 -- --tp 2 --zero-stage 3 --check
    scripts/launch.sh examples/07_nd_parallel.py --nproc-per-node 8 -- --tp 2 --ep 2 \\
        --model.num_experts 4 --micro-batches 1 --check
    # PyTorch's own on one DeviceMesh: DTensor tp x FSDP2 ZeRO-3 over dp (native.py)
    scripts/launch.sh examples/07_nd_parallel.py --nproc-per-node 4 -- --impl torch --tp 2 \\
        --zero-stage 3 --check
    # save at tp 2 x pp 2 x dp 2, resume at dp 4: each rank reads its pieces of step 15 (DCP)
    scripts/launch.sh examples/07_nd_parallel.py --nproc-per-node 8 -- --tp 2 --pp 2 \\
        --checkpoint.every 15
    scripts/launch.sh examples/07_nd_parallel.py --nproc-per-node 4 -- --check \\
        --resume runs/07_nd_parallel/checkpoints/step_0000015
    # a dry run: one rank of 8,192 runs this code at 405B on a CPU, nothing computed (doc/09)
    python examples/07_nd_parallel.py --dry-run --world-size 8192 --preset llama3-405b \\
        --tp 8 --pp 16 --layer-split 8,8,8,8,8,8,8,8,8,8,8,8,8,8,7,7 --micro-batches 16 \\
        --data.seq_len 8192 --model.max_seq_len 8192 --data.global_batch_size 2048

Chapter 00 plus one call, ``parallelize``: expert -> tensor (+ sequence) -> context ->
(chapter 10's recomputation) -> pipeline -> data parallel / ZeRO. The rest of the world after
tp x pp x cp is data parallel (--dp checks it). It prints the rank grid, the communication of
the last step, every rank's coordinates, traffic per group and memory. Its checkpoints are
sharded (``checkpoint.format: dcp``): each rank writes its pieces of the full tensors, and any
other layout resumes them with --resume DIR. A consolidated file (full weights and AdamW state,
from ``scripts/convert_dcp.py`` or chapter 02) resumes with --resume FILE.
"""

import json
import os
import sys

from scaletorch.dist import (destroy_distributed, destroy_pg_manager, get_ledger, init_distributed,
                             init_pg_manager_from_config)
from scaletorch.dist.layout_check import (check_fp32_without_hooks, check_recompute_without_hook,
                                          check_tied_without_hooks)
from scaletorch.models import build_model
from scaletorch.parallel.parallelize import ORDER, parallelize, rank_report
from scaletorch.parallel.pipeline_parallel import gather_timeline
from scaletorch.trainer import Trainer, check_against_reference, load_config
from scaletorch.trainer.consolidated import load_consolidated, resume_consolidated
from scaletorch.trainer.dry_run import main as dry_run_main
from scaletorch.trainer.param_map import full_state_dict

CONFIG = "examples/configs/07_nd_parallel.yaml"
DESCRIPTION = "Chapter 07: N-D parallel (tp x pp x cp x dp, ep, ZeRO)"


def limits(cfg, world_size: int) -> None:
    """What later chapters attach to ``parallelize``, refused before anything starts: 08's
    precision hooks, 10's recomputation and tied embeddings (load_config checks it)."""
    check_fp32_without_hooks(cfg)
    check_recompute_without_hook(cfg)
    check_tied_without_hooks(cfg)
    vocab, tp = cfg.model.vocab_size, cfg.parallel.tensor_model_parallel_size
    if vocab % tp != 0:  # 07 splits the vocabulary evenly, as 03 does; 10 pads it first
        raise ValueError(f"model.vocab_size ({vocab}) is not divisible by tensor_model_parallel"
                         f"_size ({tp}): examples/10_real_model.py pads the vocabulary")


def main() -> int:
    if "--dry-run" in sys.argv:  # one rank of any world, fake collectives, meta tensors
        return dry_run_main(sys.argv[1:], CONFIG, DESCRIPTION)
    cfg = load_config(CONFIG, DESCRIPTION, limits, resume_files=True)
    env = init_distributed(cfg.training.timeout_seconds)
    p = cfg.parallel
    pgm = init_pg_manager_from_config(p, cfg.training.timeout_seconds)
    pgm.log_topology(experts=cfg.model.num_experts > 0)

    model = build_model(cfg.model, seed=cfg.training.model_seed)
    resume = cfg.checkpoint.resume
    state = None
    if resume and os.path.isfile(resume):  # a consolidated file: full tensors, any layout
        state = load_consolidated(resume)
        model.load_state_dict(state["model"])  # before parallelize: it shards these weights
        cfg.checkpoint.resume = None  # the Trainer's own resume reads per-rank checkpoints
    par = parallelize(model, cfg, pgm, env.device)  # the new idea: one call, fixed order
    if env.rank == 0:
        print("applied: " + " -> ".join(ORDER))
    trainer = Trainer.from_parallelized(cfg, par, pgm, device=env.device)
    if state is not None:
        resume_consolidated(trainer, par, state)
    result = trainer.train()

    # What this chapter is about: every group's traffic and every rank's share of the model.
    last = cfg.training.steps - 1
    report = rank_report(pgm, par.model, trainer.optimizer, last)
    timeline = getattr(par.forward_backward, "timeline", None)
    if timeline is not None:
        timeline = gather_timeline(timeline, pgm)
    if env.rank == 0:
        print(get_ledger().table(step=last))
        print(report)
        if timeline is not None:
            print(f"pipeline timeline of step {last} ({p.schedule}), rank 0's pipeline:")
            print(timeline.chart())
            print(timeline.summary())
            with open(os.path.join(cfg.run_path, "timeline.json"), "w") as f:  # scripts/plot.py
                json.dump(timeline.to_json(), f)
        if cfg.model.num_experts > 0 and cfg.data.num_micro_batches > 1:
            print("note: MoE matches the reference exactly with 1 micro-batch only (the "
                  "load-balancing statistics are per micro-batch)")

    ok = True
    if cfg.check:
        full = full_state_dict(par)  # collective; the full weights on rank 0
        ok = check_against_reference(cfg, result.losses, env.device, full, result.start_step,
                                     grad_norms=result.grad_norms)
    destroy_pg_manager()
    destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
