"""Chapter 02 rows: step time of our ZeRO-1/2/3 vs FSDP2 ``fully_shard``, and bytes/step.

One world of ``args.world_size`` gloo ranks (2 by default) trains four copies of the same
3.7M-parameter Llama: ZeRO-1, ZeRO-2, ZeRO-3 (ours, with prefetch) and ``fully_shard`` (each
block, then the root). A step is zero_grad, forward + backward, global-norm clipping and AdamW,
as in the Trainer. Steps alternate between the four (the order rotates every step), so
background load hits all alike; a step's time is the slowest rank's, and a row reports the
median over rounds of the ratio to ``fully_shard``. Target: ZeRO-3 <= 1.2 x fully_shard.
Then the elements each stage gathers and reduce-scatters per step, and the bytes each rank
holds after a step (parameters, gradients, AdamW state; the most of any rank), next to the
formulas of zero_report.py.

    python scripts/benchmark.py --only fsdp --steps 10 --repeats 3
"""

from typing import Dict, List

import torch

from scaletorch.dist import destroy_pg_manager, get_ledger, init_pg_manager
from scaletorch.models import LlamaConfig, build_model
from scaletorch.parallel.fully_shard import apply_fully_shard
from scaletorch.parallel.grad_norm import clip_grads_, world_grad_norm
from scaletorch.parallel.memory_report import measure_memory
from scaletorch.parallel.step import forward_backward
from scaletorch.parallel.zero import ZeroAdamW, apply_zero
from scaletorch.parallel.zero_report import comm_formula, memory_formula
from scripts.benchmarks import timing

MODEL = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=768, num_layers=4,
                    num_attention_heads=8, num_key_value_heads=4, max_seq_len=64)
BATCH_PER_RANK, SEQ_LEN, WARMUP = 4, 64, 2
IMPLS = ("zero1", "zero2", "zero3", "fully_shard")


def _build(impl: str, pgm):
    """(model, optimizer, clip) for one implementation, from the same seed."""
    model = build_model(MODEL, seed=0)
    if impl == "fully_shard":
        model = apply_fully_shard(model, pgm)
        clip = lambda max_norm: torch.nn.utils.clip_grad_norm_(  # noqa: E731
            model.parameters(), max_norm)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4), clip
    model = apply_zero(model, pgm, int(impl[-1]))
    shards = list(model.parameters())  # each element on one rank: 1 copy (grad_norm.py)

    def clip_shards(max_norm: float) -> torch.Tensor:
        norm = world_grad_norm([(s, 1) for s in shards], shards[0].device)
        return clip_grads_(shards, max_norm, norm)

    return model, ZeroAdamW(model, 1e-4, (0.9, 0.95), 0.1), clip_shards


def _measure(rank: int, world: int, samples: int) -> Dict[str, object]:
    """Per implementation: ``samples`` step times (max over ranks), and our bytes per step."""
    pgm = init_pg_manager()
    runs = {impl: _build(impl, pgm) for impl in IMPLS}
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own slice of the batch
    x = torch.randint(0, MODEL.vocab_size, (BATCH_PER_RANK, SEQ_LEN), generator=gen)
    y = torch.randint(0, MODEL.vocab_size, (BATCH_PER_RANK, SEQ_LEN), generator=gen)

    def step(impl: str) -> None:
        model, optimizer, clip = runs[impl]
        optimizer.zero_grad(set_to_none=True)
        forward_backward(model, x, y, num_micro_batches=1)
        clip(1.0)
        optimizer.step()

    times, elements = timing.alternate(
        IMPLS, samples, WARMUP, step,
        lambda impl: sum(get_ledger().total(op=op) for op in ("all_gather", "reduce_scatter")))
    times = timing.max_over_ranks(times)
    memory = timing.max_over_ranks(
        {impl: [sum(measure_memory(*runs[impl][:2]).values())]
         for impl in IMPLS})
    padded = runs["zero3"][0].padded_numel
    destroy_pg_manager()
    return {"times": times, "elements": elements, "padded": padded, "memory": memory}


def run(args) -> List[dict]:
    """Rows: ZeRO-1/2/3 / fully_shard (median step-time ratios); elements/step vs formula."""
    from scaletorch.dist.spawn import run_distributed

    world = getattr(args, "world_size", 2)
    samples = timing.samples(args)
    result = run_distributed(_measure, world, samples, timeout=1800)[0]
    times, padded = result["times"], result["padded"]
    common = {"ranks": world, "params": padded, "steps": samples}
    rows = []
    for stage in (1, 2, 3):
        impl = f"zero{stage}"
        rows.append(
            timing.versus(f"ZeRO-{stage} (ours) / fully_shard step time", times[impl],
                          times["fully_shard"], "<= 1.2" if stage == 3 else "", **common))
    for stage, label in ((1, "2 Psi'"), (3, "3 Psi'")):
        formula = sum(comm_formula(stage, padded).values())
        rows.append({
            "name": f"ZeRO-{stage} gathered + reduce-scattered elements / {label}",
            "ours_ms": "",
            "native_ms": "",
            "ratio": result["elements"][f"zero{stage}"] / formula,
            "target": "== 1",
            **common
        })
    for impl, stage, label in (("zero1", 1, "(8 + 8/N) Psi'"), ("zero2", 2, "(4 + 12/N) Psi'"),
                               ("zero3", 3, "16 Psi'/N"), ("fully_shard", 3, "16 Psi'/N")):
        formula = sum(memory_formula(stage, padded, world).values())
        rows.append({
            "name": f"{impl} bytes per rank / {label}",
            "ours_ms": "",
            "native_ms": "",
            "ratio": result["memory"][impl][0] / formula,
            "target": "== 1" if impl != "fully_shard" else "~ 1 (pads per tensor)",
            **common
        })
    return rows
