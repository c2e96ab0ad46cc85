"""Host syncs per training step, counted for each chapter's strategy: every ``.item()``,
``.tolist()``, ``int()``, ``float()``, ``bool()`` and index of a tensor on the run's device (on a
GPU each one stalls the host until the stream catches up; on a CPU it costs nothing visible).

A torch function mode counts them in the second step of a 2-rank run per chapter (the first
warms up); tensors made on the host (``device_check``'s mark: AdamW's step counters, say)
are no sync. Each chapter has a budget: a new sync in the step fails here, with its line.
"""

import os
import traceback
import unittest
from collections import Counter
from typing import Any, Optional

import torch

from scaletorch.dist import destroy_pg_manager
from scaletorch.dist.device_check import HostTensorMode, made_on_host
from tests.harness import run_distributed
from tests.layouts import build, layout, make_config, pg_manager_for

SYNCS = {"item", "tolist", "__int__", "__float__", "__bool__", "__index__"}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class SyncCounter(HostTensorMode):
    """Counts host syncs by the line of scaletorch that made them."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter = Counter()
        self.counting = False

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        name = getattr(func, "__name__", "")
        if self.counting and name in SYNCS and args and isinstance(args[0], torch.Tensor) and \
                not made_on_host(args[0]):
            caller = traceback.extract_stack(limit=2)[0]  # who called .item() (or int(), ...)
            path = os.path.relpath(caller.filename, ROOT)
            if path.startswith("scaletorch"):  # ours; torch's own (AdamW's step) are torch's
                self.sites[f"{path}:{caller.lineno} {name}"] += 1
        return super().__torch_function__(func, types, args, kwargs)


# chapter: (MoE, micro-batches, parallel config, precision) at 2 ranks, each chapter's strategy
CHAPTERS = {
    "01 ddp": (False, 2, layout(), "fp32"),
    "02 zero-3": (False, 2, layout(zero_stage=3), "fp32"),
    "03 tp": (False, 2, layout(tp=2), "fp32"),
    "04 1f1b": (False, 2, layout(pp=2, schedule="1f1b"), "fp32"),
    "04b zb-h1": (False, 2, layout(pp=2, schedule="zb-h1"), "fp32"),
    "05 cp": (False, 2, layout(cp=2), "fp32"),
    "06 ep": (True, 1, layout(ep=2), "fp32"),
    "07 pp x zero-1": (False, 2, layout(pp=2, schedule="1f1b", zero_stage=1), "fp32"),
    "08 bf16 zero-3": (False, 2, layout(zero_stage=3), "bf16"),
}
# 2 layers, not make_config's 4: a sync site runs once per step, per layer or per micro-batch,
# the same for every layer; 2 still tells "per layer" from "per step" (two pipeline stages too)
LAYERS = 2
# Syncs per step (the second step, on every rank): the trainer's float(loss) and
# float(grad_norm) for its log, and expert parallel's one per MoE layer and micro-batch (the
# token counts to the host for the all-to-all's splits: LAYERS x 1 micro-batch here).
TRAINER = 2
BUDGET = {name: TRAINER for name in CHAPTERS}
BUDGET["06 ep"] = TRAINER + LAYERS


def count(name: str) -> Counter:
    moe, m, parallel, precision = CHAPTERS[name]
    cfg = make_config(moe=moe, micro_batches=m, **parallel)
    cfg.training.precision, cfg.model.num_layers = precision, LAYERS
    counter = SyncCounter()  # marking from the start: what the run makes on the host is no sync
    with counter:
        pgm = pg_manager_for(cfg)
        par, trainer = build(cfg, pgm)
        trainer.train_step()  # warm-up
        counter.counting = True
        trainer.train_step()
    destroy_pg_manager()
    return counter.sites


def world(rank: int, world_size: int) -> dict:
    return {name: count(name) for name in CHAPTERS}


class TestHostSyncs(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.results = run_distributed(world, 2, timeout=120)

    def test_each_chapter_syncs_the_host_its_budget_per_step(self):
        # exactly: one more is a new wait for the GPU; one fewer, lower the budget
        for name, budget in BUDGET.items():
            with self.subTest(chapter=name):
                for rank, res in enumerate(self.results):
                    sites = res[name]
                    self.assertEqual(sum(sites.values()), budget, f"rank {rank}: {dict(sites)}")

    def test_expert_parallel_brings_its_counts_to_the_host_once_per_layer(self):
        for res in self.results:
            ep = {site: n for site, n in res["06 ep"].items() if "expert_parallel" in site}
            self.assertEqual(list(ep.values()), [LAYERS], ep)  # one site, once per MoE layer


if __name__ == "__main__":
    unittest.main()
