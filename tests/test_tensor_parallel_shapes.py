"""Chapter 03's core with its jaxtyping shapes checked at run time (beartype, the dev extra).

``tensor_parallel_layers`` (and ``tensor_parallel``, so that the surgery builds its checked
layers) are imported afresh under jaxtyping's import hook, which checks every annotated argument
and return value: what enters a region (b, s_sp, h) and what leaves it (b, s, h), a
column-parallel output (b, s, h_tp), the logits (b, s, v_tp), the token ids (b, s) and the scalar
loss, with the cross-entropy's autograd function on (n, v_tp). One world of 2 ranks runs one
forward and backward at tp 2, without and with sequence parallel, and compares the loss and
every gradient with one device; an annotation that lied would raise there. Calls that break the
annotations show the checker is on: they raise before anything is sent.
"""

import importlib
import sys
import unittest

import torch

from scaletorch.dist import destroy_pg_manager, init_pg_manager
from scaletorch.models import LlamaConfig, build_model, loss_fn
from tests.harness import run_distributed
from tests.test_pipeline_shapes import refused

MODULES = ["scaletorch.parallel.tensor_parallel_layers", "scaletorch.parallel.tensor_parallel"]
CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_seq_len=32)
BATCH, SEQ, TP = 4, 16, 2


def checked_modules():
    """The layers and the surgery imported again with every annotation checked at each call."""
    from jaxtyping import install_import_hook
    for name in MODULES:
        sys.modules.pop(name, None)
    with install_import_hook(MODULES, "beartype.beartype"):
        return [importlib.import_module(name) for name in MODULES]


def batch() -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ),
                         generator=torch.Generator().manual_seed(0))


def world(rank: int, world_size: int) -> dict:
    layers, surgery = checked_modules()
    pgm = init_pg_manager(tensor_model_parallel_size=TP)
    group = pgm.tensor_model_parallel_group
    ids = batch()
    out = {"hooked": layers.enter_region.__qualname__}
    for sp in (False, True):
        model = surgery.apply_tensor_parallel(build_model(CONFIG, seed=0), pgm, sp)
        loss = surgery.tensor_parallel_loss_fn(pgm)(model(ids), ids)
        loss.backward()
        grads = {
            n: (p.grad.clone(), getattr(p, "partition_dim", None))
            for n, p in model.named_parameters()
        }
        out[f"sp={sp}"] = (loss.item(), grads, type(model.embed_tokens).__module__)
    x = torch.zeros(BATCH, SEQ, CONFIG.hidden_size)
    out["2-d input"] = refused(lambda: layers.enter_region(x[0], group, False))
    out["int logits"] = refused(
        lambda: layers.vocab_parallel_cross_entropy(ids.unsqueeze(-1), ids, group))
    out["float targets"] = refused(
        lambda: layers.vocab_parallel_cross_entropy(x, ids.float(), group))
    destroy_pg_manager()
    return out


class TensorParallelShapes(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.results = run_distributed(world, TP, timeout=180)
        model = build_model(CONFIG, seed=0)
        ids = batch()
        cls.loss = loss_fn(model(ids), ids)
        cls.loss.backward()
        cls.grads = {n: p.grad for n, p in model.named_parameters()}

    def test_the_core_passes_its_shape_checks_and_matches_one_device(self):
        # fp32, one step: a shard's matmul is the reference's on a block of the matrix, the sums
        # over tp add 2 partial sums in another order; values below 10 (fp32 ulp at 8: 9.5e-7),
        # so 1e-5 holds them (the layer tests of test_tensor_parallel.py hold 1e-6 per layer)
        for rank, res in enumerate(self.results):
            for sp in (False, True):
                loss, grads, module = res[f"sp={sp}"]
                with self.subTest(rank=rank, sp=sp):
                    self.assertEqual(module, "scaletorch.parallel.tensor_parallel_layers")
                    self.assertAlmostEqual(loss, self.loss.item(), delta=1e-6)
                    self.assertEqual(set(grads), set(self.grads))
                    for name, (grad, dim) in grads.items():
                        want = self.grads[name]
                        if dim is not None:  # this rank's block of the reference's gradient
                            want = want.chunk(TP, dim=dim)[rank]
                        torch.testing.assert_close(grad, want, rtol=0, atol=1e-5, msg=name)

    def test_a_call_that_breaks_an_annotation_raises_before_sending(self):
        for res in self.results:
            self.assertEqual(res["hooked"], "enter_region")
            for call in ("2-d input", "int logits", "float targets"):
                self.assertTrue(res[call].startswith("TypeCheckError: "), f"{call}: {res[call]}")


if __name__ == "__main__":
    unittest.main()
