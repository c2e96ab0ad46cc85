"""Chapter 05 rows: ring attention variants against each other, and K/V bytes vs the formula.

There is no native context parallel on CPU (torch's ring attention has no CPU sharding rule,
see doc/cpu_and_gloo.md), so the rows compare our variants, measured alternately in one world
of ``args.world_size`` ranks (cp = world size) on a long sequence where attention dominates:

- zigzag / contiguous: the same ring, with balanced vs unbalanced causal work (slowest rank);
- ring / Ulysses: point-to-point K/V rotation vs all-to-all of heads;
- fused / math: the CPU flash kernel vs the readable matmul + logsumexp tiles.

Each step is forward + backward of the model on this rank's tokens; a step's time is the
slowest rank's; a row reports the median over rounds of the ratio. zigzag / contiguous only
shows the balance when every rank has a core to itself: on an oversubscribed CPU the wall time
follows the total work, which both layouts share equally.

    python scripts/benchmark.py --only context_parallel --steps 5 --repeats 2
"""

from typing import Dict, List

import torch

from scaletorch.dist import destroy_pg_manager, get_ledger, init_pg_manager
from scaletorch.models import LlamaConfig, build_model
from scaletorch.parallel.context_parallel import apply_context_parallel, zigzag_positions
from scaletorch.parallel.step import forward_backward
from scripts.benchmarks import timing

MODEL = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                    num_attention_heads=8, num_key_value_heads=4, max_seq_len=1024)
BATCH, SEQ_LEN, WARMUP = 2, 1024, 1
# name: (variant, sequence order, tile kernel)
VARIANTS = {
    "zigzag": ("ring", "zigzag", "math"),
    "contiguous": ("ring", "contiguous", "math"),
    "fused": ("ring", "zigzag", "fused"),
    "ulysses": ("ulysses", "zigzag", "math"),
}


def _measure(rank: int, world: int, samples: int) -> Dict[str, object]:
    pgm = init_pg_manager(context_parallel_size=world)
    cp, cp_rank = pgm.context_parallel_world_size, pgm.context_parallel_rank
    names = list(VARIANTS)
    models = {
        name: apply_context_parallel(build_model(MODEL, seed=0), pgm, variant, order, kernel)
        for name, (variant, order, kernel) in VARIANTS.items()
    }
    gen = torch.Generator().manual_seed(0)  # the same sequences on every rank
    x = torch.randint(0, MODEL.vocab_size, (BATCH, SEQ_LEN), generator=gen)
    y = torch.randint(0, MODEL.vocab_size, (BATCH, SEQ_LEN), generator=gen)
    positions = {name: zigzag_positions(SEQ_LEN, cp, cp_rank, VARIANTS[name][1]) for name in names}

    def step(name: str) -> None:
        pos = positions[name]
        models[name].zero_grad(set_to_none=True)
        forward_backward(models[name], x[:, pos], y[:, pos], 1, position_ids=pos)

    def read(name: str) -> float:
        op = "all_to_all" if VARIANTS[name][0] == "ulysses" else "send"
        return get_ledger().total(op=op, group="cp") / MODEL.num_layers

    times, sent = timing.alternate(names, samples, WARMUP, step, read)
    times = timing.max_over_ranks(times)
    destroy_pg_manager()
    return {"times": times, "sent": sent}


def run(args) -> List[dict]:
    """Rows: zigzag/contiguous, ring/Ulysses, fused/math step-time ratios; elements vs formula."""
    from scaletorch.dist.spawn import run_distributed

    cp = getattr(args, "world_size", 2)
    samples = timing.samples(args)
    result = run_distributed(_measure, cp, samples, timeout=1800)[0]
    times, sent = result["times"], result["sent"]
    s, d = SEQ_LEN // cp, MODEL.head_dim
    hq, hkv = MODEL.num_attention_heads, MODEL.num_key_value_heads
    ring_formula = (3 * cp - 2) * 2 * BATCH * s * hkv * d
    ulysses_formula = 2 * (cp - 1) * BATCH * s * (2 * hq + 2 * hkv) * d // cp
    common = {"ranks": cp, "seq": SEQ_LEN, "steps": samples}
    rows = []
    for name, a, b, target in (("cp zigzag / contiguous (slowest rank)", "zigzag", "contiguous",
                                "< 1"), ("cp ring / ulysses", "zigzag", "ulysses", "~ 1"),
                               ("cp ring fused / math tiles", "fused", "zigzag", "< 1")):
        rows.append(timing.versus(name, times[a], times[b], target, **common))
    rows.append({
        "name": "cp ring K/V elements per layer / (3cp-2) 2 b s/cp hkv d",
        "ours_ms": "",
        "native_ms": "",
        "ratio": sent["zigzag"] / ring_formula,
        "target": "== 1",
        **common
    })
    rows.append({
        "name": "cp ulysses all-to-all elements per layer / formula",
        "ours_ms": "",
        "native_ms": "",
        "ratio": sent["ulysses"] / ulysses_formula,
        "target": "== 1",
        **common
    })
    return rows
