"""Chapter 06 rows: expert parallel vs torch DDP with replicated experts, and bytes vs formula.

torch has no native expert parallel, so the native baseline is what one does without it:
``torch.nn.parallel.DistributedDataParallel`` around the same MoE model, every rank holding
all E experts and computing its own tokens. Ours (ep = world size) holds E/P experts per rank
and moves tokens with two all-to-alls per layer. One world of ``args.world_size`` ranks trains
both on the same per-rank batch, alternating (the order rotates every round); a step's time
is the slowest rank's and a row reports the median of the per-round ratios.

    python scripts/benchmark.py --only expert_parallel --steps 10 --repeats 3
"""

from typing import Dict, List

import torch
from torch.nn.parallel import DistributedDataParallel

from scaletorch.dist import (ProcessGroupManager, RankGrid, destroy_pg_manager, get_ledger,
                             init_pg_manager)
from scaletorch.models import LlamaConfig, build_model
from scaletorch.parallel.expert_parallel import all_to_all_elements, apply_expert_parallel
from scaletorch.parallel.step import forward_backward
from scripts.benchmarks import timing

MODEL = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                    num_attention_heads=8, num_key_value_heads=4, max_seq_len=128, num_experts=8,
                    moe_top_k=2, moe_intermediate_size=256)
BATCH_PER_RANK, SEQ_LEN, WARMUP = 4, 128, 2
IMPLS = ("ep", "ddp")


def _measure(rank: int, world: int, samples: int) -> Dict[str, object]:
    pgm = init_pg_manager()  # ep 1: the DDP baseline's data-parallel group
    ep_pgm = ProcessGroupManager(RankGrid(world, expert_model_parallel_size=world))
    ddp_group = pgm.gradient_sync_group
    models = {
        "ep": apply_expert_parallel(build_model(MODEL, seed=0), ep_pgm),
        "ddp": DistributedDataParallel(build_model(MODEL, seed=0), process_group=ddp_group),
    }
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own tokens
    x = torch.randint(0, MODEL.vocab_size, (BATCH_PER_RANK, SEQ_LEN), generator=gen)
    y = torch.randint(0, MODEL.vocab_size, (BATCH_PER_RANK, SEQ_LEN), generator=gen)

    def step(impl: str) -> None:
        models[impl].zero_grad(set_to_none=True)
        forward_backward(models[impl], x, y, num_micro_batches=1)

    def read(impl: str) -> int:
        return sum(r.elements for r in get_ledger().select("all_to_all", "ep")
                   if r.bytes != 8 * r.elements)  # token rows, not the int64 counts

    times, moved = timing.alternate(IMPLS, samples, WARMUP, step, read)
    times = timing.max_over_ranks(times)
    formula = all_to_all_elements(models["ep"], ep_pgm)  # of the last ep step's routing
    experts = {
        impl: sum(p.numel() for n, p in m.named_parameters() if ".experts." in n)
        for impl, m in models.items()
    }
    ep_pgm.destroy()
    destroy_pg_manager()
    return {"times": times, "moved": moved["ep"], "formula": formula, "experts": experts}


def run(args) -> List[dict]:
    """Rows: ep / DDP step time, all-to-all elements / formula, expert params per rank."""
    from scaletorch.dist.spawn import run_distributed

    world = getattr(args, "world_size", 2)
    samples = timing.samples(args)
    results = run_distributed(_measure, world, samples, timeout=1800)
    times = results[0]["times"]
    common = {"ranks": world, "experts": MODEL.num_experts, "steps": samples}
    moved = sum(r["moved"] for r in results)
    formula = sum(r["formula"] for r in results)
    experts = results[0]["experts"]
    return [
        timing.versus(f"ep{world} (experts sharded, all-to-all) / torch DDP (experts replicated)",
                      times["ep"], times["ddp"],
                      "~ 1 (fewer grads to all-reduce vs token all-to-alls)", **common),
        {
            "name": "ep all-to-all token elements / 2 h (sent + received) per layer",
            "ours_ms": "",
            "native_ms": "",
            "ratio": moved / formula if formula else float("nan"),
            "target": "== 1",
            **common
        },
        {
            "name": "expert parameters per rank: ep / replicated",
            "ours_ms": "",
            "native_ms": "",
            "ratio": experts["ep"] / experts["ddp"],
            "target": f"== 1/{world}",
            **common
        },
    ]
