"""Chapter 03 rows: step time of our tensor parallel vs torch DTensor, and elements per step.

One world of ``args.world_size`` gloo ranks (2 by default; tp = world size) trains four copies
of the same 3.7M-parameter Llama: ours and DTensor ``parallelize_module``, each without and
with sequence parallel. A step is zero_grad, forward + backward with the vocab-parallel loss,
global-norm clipping and AdamW, as in the Trainer. Steps alternate between the four (the order
rotates every step), so background load hits all alike; a step's time is the slowest rank's,
and a row reports the median over rounds of the ratio ours / DTensor.

    python scripts/benchmark.py --only tensor_parallel --steps 10 --repeats 3
"""

from contextlib import nullcontext
from typing import Dict, List

import torch
from torch.distributed.tensor.parallel import loss_parallel

from scaletorch.dist import destroy_pg_manager, get_ledger, init_pg_manager, layout_check
from scaletorch.models import LlamaConfig, build_model
from scaletorch.parallel import tensor_parallel as tp_lib
from scaletorch.parallel import tensor_parallel_dtensor as native
from scaletorch.parallel.grad_norm import clip_grads_, replica_count, world_grad_norm
from scaletorch.parallel.step import forward_backward
from scripts.benchmarks import timing

MODEL = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=768, num_layers=4,
                    num_attention_heads=8, num_key_value_heads=4, max_seq_len=64)
BATCH, SEQ_LEN, WARMUP = 4, 64, 2
# name: (impl, sequence_parallel)
IMPLS = {
    "ours": ("ours", False),
    "ours_sp": ("ours", True),
    "dtensor": ("torch", False),
    "dtensor_sp": ("torch", True),
}


def _build(impl: str, sp: bool, pgm):
    """(model, optimizer, loss_fn, clip) for one implementation, from the same seed."""
    model = build_model(MODEL, seed=0)
    if impl == "torch":
        tp_mesh = native.device_mesh(pgm, next(model.parameters()).device.type)["tp"]
        model = native.apply_dtensor_tensor_parallel(model, tp_mesh, sp)
        loss = native.dtensor_loss_fn
        clip = native.native_clip_grad_norm(list(model.parameters()), pgm)
    else:
        model = tp_lib.apply_tensor_parallel(model, pgm, sp)
        loss, params = tp_lib.tensor_parallel_loss_fn(pgm), list(model.parameters())
        copies = [(p, replica_count(p, pgm)) for p in params]  # grad_norm.py's one rule

        def clip(max_norm: float) -> torch.Tensor:
            return clip_grads_(params, max_norm, world_grad_norm(copies, params[0].device))

    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), loss, clip


def _measure(rank: int, world: int, samples: int) -> Dict[str, object]:
    """Per implementation: ``samples`` step times (max over ranks), and our elements per step."""
    pgm = init_pg_manager(tensor_model_parallel_size=world)
    names = list(IMPLS)
    runs = {name: _build(*IMPLS[name], pgm) for name in names}
    gen = torch.Generator().manual_seed(0)  # tensor parallel: every rank sees the same batch
    x = torch.randint(0, MODEL.vocab_size, (BATCH, SEQ_LEN), generator=gen)
    y = torch.randint(0, MODEL.vocab_size, (BATCH, SEQ_LEN), generator=gen)

    def step(name: str) -> None:
        model, optimizer, loss, clip = runs[name]
        with loss_parallel() if IMPLS[name][0] == "torch" else nullcontext():
            optimizer.zero_grad(set_to_none=True)
            forward_backward(model, x, y, num_micro_batches=1, loss_fn=loss)
            clip(1.0)
            optimizer.step()

    def read(name: str) -> Dict[str, float]:
        return {
            op: get_ledger().total(op=op, group="tp")
            for op in ("all_reduce", "all_gather", "reduce_scatter")
        }

    times, elements = timing.alternate(names, samples, WARMUP, step, read)
    times = timing.max_over_ranks(times)
    destroy_pg_manager()
    return {"times": times, "elements": elements}


def run(args) -> List[dict]:
    """Rows: ours / DTensor (median step-time ratio) without and with sp; elements vs formula."""
    from scaletorch.dist.spawn import run_distributed

    world = getattr(args, "world_size", 2)
    layout_check.validate_tensor_parallel(MODEL, world, True, SEQ_LEN)
    samples = timing.samples(args)
    result = run_distributed(_measure, world, samples, timeout=900)[0]
    times = result["times"]
    common = {"ranks": world, "params": build_model(MODEL, 0).num_parameters(), "steps": samples}
    rows = [
        timing.versus(f"tp{' + sp' if sp else ''} ours / DTensor", times[ours], times[native],
                      "<= 1.1", **common)
        for ours, native, sp in (("ours", "dtensor", False), ("ours_sp", "dtensor_sp", True))
    ]
    for name, sp in (("ours", False), ("ours_sp", True)):
        formula = tp_lib.tp_comm_elements(MODEL, BATCH * SEQ_LEN, sp)
        measured = sum(result["elements"][name].values())
        rows.append({
            "name": f"tp{' + sp' if sp else ''} tp elements/step / formula",
            "ours_ms": "",
            "native_ms": "",
            "ratio": measured / sum(formula.values()),
            "target": "== 1",
            **common
        })
    return rows
