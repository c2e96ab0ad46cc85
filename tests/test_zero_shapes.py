"""Chapter 02's collectives with their jaxtyping shapes checked at run time (beartype, dev extra).

``flat_unit`` is imported afresh under jaxtyping's import hook, which checks every annotated
argument and return value of its functions and methods: a unit's flat vector (P',), a shard (S,).
ZeRO's wrapper builds its units from that module (a subclass's ``new_unit``), so every gather,
release and reduce-scatter of training is checked. One world of 2 ranks trains stages 1 and 3
for 2 steps with 2 micro-batches, checked and unchecked: an annotation that lied would raise,
and the checks change no number (bit for bit). Two calls that break the annotations show the
checker is on: they raise before anything is sent.
"""

import importlib
import sys
import unittest

import torch

from scaletorch.dist import destroy_pg_manager, init_pg_manager
from scaletorch.models import LlamaConfig, build_model, loss_fn
from scaletorch.parallel.flat_unit import FlatUnit
from scaletorch.parallel.zero import ShardedDataParallel, ZeroAdamW, llama_units
from tests.harness import bit_exact, run_distributed
from tests.test_pipeline_shapes import refused  # the name of the error a call raises

MODULE = "scaletorch.parallel.flat_unit"
# hidden 30: units of 1,920 + 2 x 7,950 + 1,950 elements, even, so no padding over 2 ranks
CONFIG = LlamaConfig(vocab_size=64, hidden_size=30, intermediate_size=61, num_layers=2,
                     num_attention_heads=3, num_key_value_heads=1, max_seq_len=16)
STEPS, MICRO, BATCH, SEQ = 2, 2, 4, 16  # per rank: 2 micro-batches of 2 sequences


def checked_module():
    """``flat_unit`` imported again with every annotation checked at each call."""
    from jaxtyping import install_import_hook
    saved = sys.modules.pop(MODULE)
    try:
        with install_import_hook(MODULE, "beartype.beartype"):
            return importlib.import_module(MODULE)
    finally:
        sys.modules[MODULE] = saved  # the rest of the library keeps the module it imported


def train(stage: int, new_unit, group, rank: int) -> dict:
    """STEPS steps of ZeRO ``stage`` with units built by ``new_unit``: losses, full weights."""
    model = build_model(CONFIG, seed=0)
    wrapper = type("ZeroWith", (ShardedDataParallel, ), {"new_unit": new_unit})
    zero = wrapper(model, llama_units(model), group, stage)
    optimizer = ZeroAdamW(zero, 1e-2, (0.9, 0.95), 0.1)
    tokens = torch.randint(0, CONFIG.vocab_size, (STEPS, MICRO, BATCH // MICRO, SEQ),
                           generator=torch.Generator().manual_seed(rank))
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        for mb in range(MICRO):
            with zero.no_sync() if mb < MICRO - 1 else torch.enable_grad():
                loss = loss_fn(zero(tokens[step, mb]), tokens[step, mb]) / MICRO
                loss.backward()
            losses.append(loss.item())
        optimizer.step()
    return {"losses": losses, "weights": zero.full_state_dict()}


def world(rank: int, world_size: int) -> dict:
    checked = checked_module()
    pgm = init_pg_manager()
    group = pgm.gradient_sync_group
    out = {"hooked": checked.gather_unit.__qualname__, "checked": checked.FlatUnit is not FlatUnit}
    for stage in (1, 3):
        out[f"checked {stage}"] = train(stage, checked.FlatUnit, group, rank)
        out[f"plain {stage}"] = train(stage, FlatUnit, group, rank)
    flat, shard = torch.zeros(8), torch.zeros(4)
    out["2-d flat"] = refused(lambda: checked.gather_unit(flat.view(2, 4), shard, group))
    out["int gradients"] = refused(lambda: checked.reduce_scatter_mean(flat.long(), shard, group))
    destroy_pg_manager()
    return out


class ZeroCollectiveShapes(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.results = run_distributed(world, 2, timeout=180)

    @bit_exact
    def test_checked_collectives_train_stages_1_and_3_bit_for_bit_as_unchecked(self):
        for rank, res in enumerate(self.results):
            self.assertTrue(res["checked"])  # the units came from the re-imported module
            for stage in (1, 3):
                checked, plain = res[f"checked {stage}"], res[f"plain {stage}"]
                with self.subTest(rank=rank, stage=stage):
                    self.assertEqual(len(checked["losses"]), STEPS * MICRO)
                    self.assertEqual(checked["losses"], plain["losses"])
                    self.assertEqual(checked["weights"].keys(), plain["weights"].keys())
                    for name, weight in checked["weights"].items():
                        self.assertTrue(torch.equal(weight, plain["weights"][name]), name)

    def test_a_call_that_breaks_an_annotation_raises_before_sending(self):
        for res in self.results:
            self.assertEqual(res["hooked"], "gather_unit")
            self.assertTrue(res["2-d flat"].startswith("TypeCheckError: "), res["2-d flat"])
            self.assertTrue(res["int gradients"].startswith("TypeCheckError: "),
                            res["int gradients"])


if __name__ == "__main__":
    unittest.main()
