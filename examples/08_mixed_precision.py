"""Chapter 08: mixed precision. Chapter 01 / 02's run with bf16 compute and bf16 on the wire.

    scripts/launch.sh examples/08_mixed_precision.py --nproc-per-node 2 -- --check
    scripts/launch.sh examples/08_mixed_precision.py --nproc-per-node 2 -- --zero-stage 0 --check
    scripts/launch.sh examples/08_mixed_precision.py --nproc-per-node 2 -- \
        --training.precision fp32 --parallel.param_dtype fp32 --parallel.reduce_dtype fp32

The ``parallelize`` call of chapter 07 with this chapter's hooks attached from outside
(``precision_hooks``): the config's precision policy (``training.precision``,
``parallel.param_dtype``, ``parallel.reduce_dtype``, one home:
scaletorch/parallel/mixed_precision.py) decides what the strategy gathers and reduces in.
fp32 master weights, gradients and AdamW state stay on every rank. Prints the policy, the bytes
each collective moved per element in the last step (2 where bf16 crossed the wire), the memory
ledger next to its formula, and what one bf16 all-reduce of N ranks' gradients loses.
"""

import sys

import torch

from scaletorch.config import resolve_precision
from scaletorch.dist import (comm, destroy_distributed, destroy_pg_manager, get_ledger,
                             init_distributed, init_pg_manager_from_config)
from scaletorch.models import build_model
from scaletorch.parallel.mixed_precision import precision_hooks
from scaletorch.parallel.parallelize import parallelize
from scaletorch.parallel.zero_report import memory_report
from scaletorch.rules.group_names import gradient_group_name
from scaletorch.trainer import Trainer, check_against_reference, load_config
from scaletorch.trainer.param_map import full_state_dict


def limits(cfg, world_size: int) -> None:
    """This chapter's scope: data parallel and ZeRO (the strategies that honour the policy)."""
    p = cfg.parallel
    if max(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size,
           p.expert_model_parallel_size) > 1 or p.impl == "torch":
        raise ValueError(f"08_mixed_precision runs our data parallel and ZeRO (--impl ours or "
                         f"naive, tp = pp = cp = ep = 1; got --impl {p.impl}): those reduce in "
                         f"parallel.reduce_dtype")


def bf16_sum_error(group, device: torch.device, numel: int = 1 << 16) -> str:
    """Collective over ``group``: all-reduce the same random gradients in fp32 and in bf16
    (cast, sum, cast back) and compare: the precision a bf16 reduce-scatter loses. The
    gradients are drawn on the CPU (the same numbers on any device), then moved to ``device``:
    an NCCL group takes the run's device's tensors only."""
    n, rank = comm.group_size(group), comm.group_rank(group)
    g = (torch.randn(numel, generator=torch.Generator().manual_seed(rank)) * 1e-3).to(device)
    exact, low = g.clone(), g.to(torch.bfloat16)
    with get_ledger().paused():  # a measurement, not the strategy's traffic
        comm.all_reduce(exact, group)
        comm.all_reduce(low, group)

    def rel(x: torch.Tensor) -> float:  # normwise relative error against the fp32 sum
        return float((x.float() - exact).norm() / exact.norm())

    return (f"bf16 sum over {n} ranks vs fp32, {numel:,} gradients: relative error "
            f"{rel(low):.1e}; rounding the exact sum to bf16 alone: "
            f"{rel(exact.to(torch.bfloat16)):.1e} (bf16 unit roundoff 2^-8 = 3.9e-03)")


def main() -> int:
    cfg = load_config("examples/configs/08_mixed_precision.yaml", "Chapter 08: mixed precision",
                      limits)
    env = init_distributed(cfg.training.timeout_seconds)
    p = cfg.parallel
    pgm = init_pg_manager_from_config(p, cfg.training.timeout_seconds)
    pgm.log_topology()
    model = build_model(cfg.model, seed=cfg.training.model_seed)
    numel = model.num_parameters()
    precision = precision_hooks(cfg, env.device.type)  # the new idea: dtypes and fp16's scaler
    par = parallelize(model, cfg, pgm, env.device, precision)
    if env.rank == 0:
        print(f"{numel:,} parameters, ZeRO stage {p.zero_stage}, compute "
              f"{resolve_precision(cfg, env.device.type)}, {precision.policy}; "
              f"master weights, gradients and AdamW state fp32")
    trainer = Trainer.from_parallelized(cfg, par, pgm, device=env.device, scaler=precision.scaler)
    result = trainer.train()

    # What this chapter is about: the bytes per element that crossed the wire, by collective.
    step, ledger, group = cfg.training.steps - 1, get_ledger(), pgm.gradient_sync_group
    name = gradient_group_name(p.context_parallel_size)  # the ledger's: "dp" at cp 1
    lines = [f"traffic in step {step} (rank 0, over {name}):"]
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        elements = ledger.total(op=op, group=name, step=step)
        if elements:
            nbytes = ledger.total(op=op, group=name, step=step, field="bytes")
            wire = ledger.total(op=op, group=name, step=step, field="wire_bytes")
            lines.append(f"  {op:<15}{int(elements):>10,} elements x {nbytes / elements:.2f} "
                         f"B = {int(nbytes):>9,} B, on the wire {int(wire):>9,} B")
    padded = sum(u.padded_numel for u in getattr(par.model, "units", [])) or numel
    memory = memory_report(par.model, trainer.optimizer, p.zero_stage, numel, padded, group)
    error = bf16_sum_error(group, env.device)
    if env.rank == 0:
        print("\n".join(lines + [memory, error]))

    ok = True
    if cfg.check:
        ok = check_against_reference(cfg, result.losses, env.device, full_state_dict(par),
                                     result.start_step, grad_norms=result.grad_norms)
    destroy_pg_manager()
    destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
