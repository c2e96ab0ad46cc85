"""Chapter 08 rows: ZeRO-3 gathering bf16 vs fp32 parameters, ours and FSDP2's, in one run.

One world of ``args.world_size`` gloo ranks (2 by default) trains four copies of chapter 02's
3.7M-parameter Llama under bf16 autocast: our ZeRO-3 with ``param_dtype`` and ``reduce_dtype``
bf16, the same with both fp32, and ``fully_shard`` with the same two policies (FSDP2's
``MixedPrecisionPolicy``). Steps alternate between the four (the order rotates every step);
a row reports the median over rounds of a paired ratio. The headline is bytes: our ledger's
all-gather and reduce-scatter bytes per step, bf16 over fp32 (target 1/2; FSDP2 calls the
backend directly, out of the ledger). Times are measured and reported as they are: CPU bf16
matmuls are slow, and on one machine the wire is memory, so halving the bytes saves little.

    python scripts/benchmark.py --only mixed_precision --steps 5 --repeats 2
"""

from typing import Dict, List

import torch

from scaletorch.dist import destroy_pg_manager, get_ledger, init_pg_manager
from scaletorch.models import build_model
from scaletorch.parallel.fully_shard import apply_fully_shard
from scaletorch.parallel.mixed_precision import (MixedPrecisionPolicy,
                                                 disable_autocast_cache_per_unit, fsdp_mp_policy)
from scaletorch.parallel.step import forward_backward
from scaletorch.parallel.zero import ShardedDataParallel, ZeroAdamW, llama_units
from scaletorch.parallel.zero_mixed_precision import zero_in_dtypes
from scripts.benchmarks import timing
from scripts.benchmarks.fsdp import BATCH_PER_RANK, MODEL, SEQ_LEN, WARMUP

POLICIES = {
    "bf16": MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16),
    "fp32": MixedPrecisionPolicy(),
}
IMPLS = ("zero3_bf16", "zero3_fp32", "fully_shard_bf16", "fully_shard_fp32")


def _build(impl: str, pgm) -> tuple:
    """(model, optimizer) of one implementation, from the same seed."""
    model = build_model(MODEL, seed=0)
    policy = POLICIES[impl.rsplit("_", 1)[1]]
    if impl.startswith("fully_shard"):
        model = apply_fully_shard(model, pgm, fsdp_mp_policy(policy))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    wrapper = zero_in_dtypes(ShardedDataParallel, policy.param_dtype, policy.reduce_dtype)
    model = wrapper(model, llama_units(model), pgm.gradient_sync_group, 3)
    disable_autocast_cache_per_unit(model)  # as parallelize does
    return model, ZeroAdamW(model, 1e-4, (0.9, 0.95), 0.1)


def _measure(rank: int, world: int, samples: int) -> Dict[str, object]:
    """Per implementation: ``samples`` step times (max over ranks), and our bytes per step."""
    pgm = init_pg_manager()
    runs = {impl: _build(impl, pgm) for impl in IMPLS}
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own slice of the batch
    x = torch.randint(0, MODEL.vocab_size, (BATCH_PER_RANK, SEQ_LEN), generator=gen)
    y = torch.randint(0, MODEL.vocab_size, (BATCH_PER_RANK, SEQ_LEN), generator=gen)

    def step(impl: str) -> None:
        model, optimizer = runs[impl]
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            forward_backward(model, x, y, num_micro_batches=1)
        optimizer.step()

    def wire_bytes(impl: str) -> float:
        return sum(get_ledger().total(op=op, field="bytes")
                   for op in ("all_gather", "reduce_scatter"))

    times, nbytes = timing.alternate(IMPLS, samples, WARMUP, step, wire_bytes)
    times = timing.max_over_ranks(times)
    destroy_pg_manager()
    return {"times": times, "bytes": nbytes}


def run(args) -> List[dict]:
    """Rows: bf16 / fp32 gather bytes and step time (ours, FSDP2's); ours / fully_shard."""
    from scaletorch.dist.spawn import run_distributed

    world = getattr(args, "world_size", 2)
    samples = timing.samples(args)
    result = run_distributed(_measure, world, samples, timeout=1800)[0]
    times, nbytes = result["times"], result["bytes"]
    common = {"ranks": world, "steps": samples}
    return [
        {
            "name": "ZeRO-3 (ours) all-gather + reduce-scatter bytes, bf16 / fp32",
            "ours_ms": "",
            "native_ms": "",
            "ratio": nbytes["zero3_bf16"] / nbytes["zero3_fp32"],
            "target": "== 0.5",
            **common
        },
        timing.versus("ZeRO-3 (ours) step time, bf16 / fp32 gather", times["zero3_bf16"],
                      times["zero3_fp32"], "measured", **common),
        timing.versus("fully_shard step time, bf16 / fp32 mp_policy", times["fully_shard_bf16"],
                      times["fully_shard_fp32"], "measured", **common),
        timing.versus("ZeRO-3 (ours) / fully_shard step time, bf16 policy", times["zero3_bf16"],
                      times["fully_shard_bf16"], "<= 1.2", **common),
    ]
