"""Chapter 01 row: step time of bucketed DDP (ours) vs naive DP vs torch DDP, and bytes/step.

One world of ``args.world_size`` gloo ranks (2 by default) trains three copies of the same
3.7M-parameter Llama, one per implementation, on the same batch. Steps alternate between the
three (the order rotates every round), so background load hits all of them alike; a step's
time is the slowest rank's, and a row reports the median over rounds of the time ratio. Both
bucketed versions use 4 MB buckets (after a 1 MB first one), so the 15 MB of gradients form
several buckets whose all-reduces can overlap backward; naive has no buckets.

    python scripts/benchmark.py --only ddp --steps 10 --repeats 3
"""

from typing import Dict, List

import torch

from scaletorch.dist import destroy_pg_manager, get_ledger, init_pg_manager
from scaletorch.models import LlamaConfig, build_model
from scaletorch.parallel.data_parallel import IMPLS, apply_data_parallel
from scaletorch.parallel.step import forward_backward
from scripts.benchmarks import timing

MODEL = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=768, num_layers=4,
                    num_attention_heads=8, num_key_value_heads=4, max_seq_len=64)
BATCH_PER_RANK, SEQ_LEN, BUCKET_MB, WARMUP = 4, 64, 4.0, 2


def _measure(rank: int, world: int, samples: int) -> Dict[str, object]:
    """Per implementation: ``samples`` step times (max over ranks), and our bytes per step."""
    pgm = init_pg_manager()
    models = {
        impl: apply_data_parallel(build_model(MODEL, seed=0), pgm, impl, BUCKET_MB)
        for impl in IMPLS
    }
    optimizers = {impl: torch.optim.AdamW(m.parameters(), lr=1e-4) for impl, m in models.items()}
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own slice of the batch
    x = torch.randint(0, MODEL.vocab_size, (BATCH_PER_RANK, SEQ_LEN), generator=gen)
    y = torch.randint(0, MODEL.vocab_size, (BATCH_PER_RANK, SEQ_LEN), generator=gen)

    def step(impl: str) -> None:
        optimizers[impl].zero_grad(set_to_none=True)
        forward_backward(models[impl], x, y, num_micro_batches=1)
        optimizers[impl].step()

    times, wire = timing.alternate(
        IMPLS, samples, WARMUP, step,
        lambda impl: get_ledger().total(op="all_reduce", field="wire_bytes"))
    psi = models["ours"].num_parameters()
    times = timing.max_over_ranks(times)
    destroy_pg_manager()
    return {"times": times, "wire": wire, "psi": psi}


def run(args) -> List[dict]:
    """Rows: bucketed vs torch DDP, naive vs bucketed (median step-time ratios), bytes/step."""
    from scaletorch.dist.spawn import run_distributed  # gloo ranks, as the tests spawn them

    world = getattr(args, "world_size", 2)
    samples = timing.samples(args)
    result = run_distributed(_measure, world, samples, timeout=900)[0]
    times = result["times"]
    psi, n = result["psi"], world
    formula = 2 * (n - 1) / n * 4 * psi
    common = {"ranks": n, "params": psi, "steps": samples}
    return [
        timing.versus("ddp bucketed / torch DDP", times["ours"], times["torch"], "<= 1.05",
                      **common),
        timing.versus("ddp naive / bucketed", times["naive"], times["ours"], "> 1", **common),
        {
            "name": "ddp wire bytes/step / 2(N-1)/N x 4 Psi",
            "ours_ms": "",
            "native_ms": "",
            "ratio": result["wire"]["ours"] / formula,
            "target": "== 1 (bucketed)",
            **common
        },
    ]
