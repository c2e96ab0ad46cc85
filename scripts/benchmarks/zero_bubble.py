"""Chapter 04's zero-bubble rows: 1F1B, interleaved, ZB-H1 and ZBV with injected delays, ours
against torch.distributed.pipelining's schedules, in one world of 4 ranks (pp = 4, m = 8).

Every stage's forward, input-gradient and weight-gradient sleep ``DELAY`` each (``Delayed``;
a full backward sleeps both), so the bubble, not gloo's speed or the CPU's load, sets the
step time. The steps of the eight (schedule, implementation) pairs alternate (the order
rotates every round); a step's time is the slowest rank's. Rows: ours / torch per schedule;
each schedule's step over 1F1B's (ours), beside the simulator's; our measured bubble beside
the simulator's (F = B = W). One row per schedule, no spaces in a cell.

    python scripts/benchmark.py --only zero_bubble --world-size 4 --steps 1 --repeats 3
"""

from typing import Dict, List

import torch

from scaletorch.dist import destroy_pg_manager, init_pg_manager
from scaletorch.models import LlamaConfig, build_model
from scaletorch.parallel.pipeline_native import TorchPipelineSchedule
from scaletorch.parallel.pipeline_parallel import apply_pipeline_parallel, gather_timeline
from scaletorch.parallel.pipeline_runtime import PipelineSchedule
from scaletorch.schedule.placement import V_SHAPED
from scaletorch.schedule.simulate import simulate_async
from scripts.benchmarks import timing
from scripts.benchmarks.timing import Delayed

MODEL = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=8,
                    num_attention_heads=4, num_key_value_heads=2, max_seq_len=32)
BATCH, SEQ_LEN, MICRO_BATCHES, STAGES, DELAY = 16, 32, 8, 4, 0.05
SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2))
IMPLS = ("ours", "torch")
WORLD_SIZE = STAGES  # scripts/benchmark.py runs this family at pp = 4 ranks only


def _pipeline(pgm, schedule: str, v: int, impl: str):
    """8 delayed layers over 4 x v stages (a layer sleeps DELAY / 2: a stage of 2 layers DELAY,
    a chunk of 1 layer half of it)."""
    model = build_model(MODEL, seed=0)
    share = DELAY / 2
    for i, layer in enumerate(model.layers):
        model.layers[i] = Delayed(layer, share, share, share)
    pipe = apply_pipeline_parallel(model, pgm, v, v_shape=schedule in V_SHAPED)
    cls = TorchPipelineSchedule if impl == "torch" else PipelineSchedule
    return pipe, cls(pipe, pgm, schedule, MICRO_BATCHES)


def _measure(rank: int, world: int, rounds: int) -> Dict[str, object]:
    pgm = init_pg_manager(pipeline_model_parallel_size=world)
    runs = {(s, impl): _pipeline(pgm, s, v, impl) for s, v in SCHEDULES for impl in IMPLS}
    optimizers = {
        key: torch.optim.AdamW(pipe.parameters(), lr=1e-4)
        for key, (pipe, _) in runs.items()
    }
    names = {f"{s} {impl}": (s, impl) for s, impl in runs}
    gen = torch.Generator().manual_seed(1000)  # the same global batch on every rank
    x = torch.randint(0, MODEL.vocab_size, (BATCH, SEQ_LEN), generator=gen)
    y = torch.randint(0, MODEL.vocab_size, (BATCH, SEQ_LEN), generator=gen)

    def step(name: str) -> None:
        optimizers[names[name]].zero_grad(set_to_none=True)
        runs[names[name]][1](x, y)
        optimizers[names[name]].step()

    times, _ = timing.alternate(list(names), rounds, 1, step, lambda name: None)
    times = timing.max_over_ranks(times)
    with timing.untracked():
        timelines = {s: gather_timeline(runs[(s, "ours")][1].timeline, pgm) for s, _ in SCHEDULES}
    destroy_pg_manager()
    return {"times": times, "timelines": timelines}


def run(args) -> List[dict]:
    """One row per schedule: ours and torch's step, their ratio, the step over 1F1B's and the
    simulator's, our measured bubble and the simulator's."""
    from scaletorch.dist.spawn import run_distributed

    world = getattr(args, "world_size", STAGES)
    if world != STAGES:
        raise ValueError(f"the zero-bubble rows run pp = {STAGES}: --world-size {STAGES} "
                         f"(got {world})")
    rounds = min(timing.samples(args), 3)  # a step sleeps about a second
    result = run_distributed(_measure, world, rounds, timeout=1800)[0]
    times, timelines = result["times"], result["timelines"]
    common = {"ranks": world, "m": MICRO_BATCHES, "steps": rounds}
    simulated = {  # a chunk of v costs 1/v of a stage
        s: simulate_async(s, STAGES, MICRO_BATCHES, v, 1 / v, 1 / v, 1 / v)
        for s, v in SCHEDULES
    }
    span = {s: t.span()[1] - t.span()[0] for s, t in simulated.items()}
    rows = []
    for s, _ in SCHEDULES:
        ours, torch_ = times[f"{s} ours"], times[f"{s} torch"]
        rows.append({
            "schedule": s,
            "ours_ms": timing.median_ms(ours),
            "torch_ms": timing.median_ms(torch_),
            "ours/torch": timing.paired_ratio(ours, torch_),
            "step/1f1b": timing.paired_ratio(ours, times["1f1b ours"]),
            "simulated": span[s] / span["1f1b"],
            "bubble": timelines[s].bubble_fraction(),
            "simulated_bubble": simulated[s].bubble_fraction(),
            **common
        })
    return rows
