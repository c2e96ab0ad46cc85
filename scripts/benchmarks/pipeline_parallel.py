"""Chapter 04 row: step time of our 1F1B vs torch.distributed.pipelining's Schedule1F1B.

One world of ``args.world_size`` gloo ranks (2 by default) is one pipeline (pp = world size).
Two copies of the same 3.7M-parameter Llama are split into the same stages, one driven by
chapter 04's 1F1B loop (PipelineLoop), one by torch's Schedule1F1B, both with m = 8
micro-batches of the same batch.
Steps alternate between the two (the order flips every step), so background load hits both
alike; a step's time is the slowest rank's, and the row reports the median over rounds of the
ratio. Further rows: the p2p bytes of our step against the formula, and the bubble.

    python scripts/benchmark.py --only pipeline_parallel --steps 10 --repeats 3
"""

from typing import Dict, List

import torch

from scaletorch.dist import comm, destroy_pg_manager, get_ledger, init_pg_manager
from scaletorch.models import LlamaConfig, build_model
from scaletorch.parallel.pipeline_native import TorchPipelineSchedule
from scaletorch.parallel.pipeline_parallel import apply_pipeline_parallel, gather_timeline
from scaletorch.parallel.pipeline_schedules import PipelineLoop
from scripts.benchmarks import timing

MODEL = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=768, num_layers=4,
                    num_attention_heads=8, num_key_value_heads=4, max_seq_len=64)
BATCH, SEQ_LEN, MICRO_BATCHES, WARMUP = 16, 64, 8, 2
IMPLS = ("ours", "torch")


def _measure(rank: int, world: int, samples: int) -> Dict[str, object]:
    """Per implementation: ``samples`` step times (max over ranks); our p2p bytes and bubble."""
    pgm = init_pg_manager(pipeline_model_parallel_size=world)
    pipes = {impl: apply_pipeline_parallel(build_model(MODEL, seed=0), pgm) for impl in IMPLS}
    schedules = {
        "ours": PipelineLoop(pipes["ours"], pgm, "1f1b", MICRO_BATCHES),
        "torch": TorchPipelineSchedule(pipes["torch"], pgm, "1f1b", MICRO_BATCHES),
    }
    optimizers = {impl: torch.optim.AdamW(p.parameters(), lr=1e-4) for impl, p in pipes.items()}
    gen = torch.Generator().manual_seed(1000)  # the same global batch on every rank
    x = torch.randint(0, MODEL.vocab_size, (BATCH, SEQ_LEN), generator=gen)
    y = torch.randint(0, MODEL.vocab_size, (BATCH, SEQ_LEN), generator=gen)

    def step(impl: str) -> None:
        optimizers[impl].zero_grad(set_to_none=True)
        schedules[impl](x, y)
        optimizers[impl].step()

    times, sent = timing.alternate(
        IMPLS, samples, WARMUP, step,
        lambda impl: get_ledger().total(op="send", group="pp", field="bytes"))
    times = timing.max_over_ranks(times)
    with timing.untracked():
        sent_all = torch.tensor([sent["ours"]], dtype=torch.float64)
        comm.all_reduce(sent_all)
        timeline = gather_timeline(schedules["ours"].timeline, pgm)
    destroy_pg_manager()
    return {"times": times, "sent": sent_all.item(), "timeline": timeline}


def run(args) -> List[dict]:
    """Rows: ours / torch 1F1B (median paired step-time ratio), p2p bytes, bubble."""
    from scaletorch.dist.spawn import run_distributed

    world = getattr(args, "world_size", 2)
    samples = timing.samples(args)
    result = run_distributed(_measure, world, samples, timeout=900)[0]
    times = result["times"]
    # every stage boundary carries m activations forward and m gradients back, b s h fp32 each
    boundary = (world - 1) * 2 * MICRO_BATCHES * (BATCH // MICRO_BATCHES) * SEQ_LEN
    formula = boundary * MODEL.hidden_size * 4
    timeline = result["timeline"]
    common = {"ranks": world, "m": MICRO_BATCHES, "steps": samples}
    return [
        timing.versus("pp 1f1b ours / torch Schedule1F1B", times["ours"], times["torch"], "<= 1.05",
                      **common),
        {
            "name": "pp p2p bytes/step (all ranks) / 2 (p-1) m b s h x 4",
            "ours_ms": "",
            "native_ms": "",
            "ratio": result["sent"] / formula,
            "target": "== 1",
            **common
        },
        {
            "name": f"pp bubble measured {timeline.bubble_fraction():.3f} / theory "
            f"{timeline.theory():.3f}",
            "ours_ms": "",
            "native_ms": "",
            "ratio": timeline.bubble_fraction() / timeline.theory(),
            "target": "~1 (> 1: comm and noise)",
            **common
        },
    ]
