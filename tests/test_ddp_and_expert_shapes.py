"""Chapters 01 and 06's cores with their jaxtyping shapes checked at run time (beartype).

Each core function (gradient_sync.py's three, expert_parallel.py's dispatch and combine) is
wrapped by ``jaxtyped(typechecker=beartype)``, which checks every annotated argument and return
value at each call, and put in place of the library's where the wrappers call it. One world of
2 ranks runs the naive and the bucketed DDP (dp 2) and an MoE layer at ep 2 through them and
compares the gradients with one device: an annotation that lied would raise there. Calls that
break the annotations show the checker is on: they raise before anything is sent.
"""

import unittest
from contextlib import ExitStack
from typing import Any, Callable, Dict

import torch
from beartype import beartype
from jaxtyping import jaxtyped

from scaletorch.dist import destroy_pg_manager, init_pg_manager
from scaletorch.models import LlamaConfig, build_model, loss_fn
from scaletorch.parallel import data_parallel, expert_parallel, gradient_sync
from scaletorch.parallel.data_parallel import apply_data_parallel
from scaletorch.parallel.expert_parallel import apply_expert_parallel
from tests.harness import run_distributed
from tests.test_expert_parallel import TOKENS, E, H
from tests.test_expert_parallel import _layer as moe_layer
from tests.test_expert_parallel import _layer_data as moe_data
from tests.test_expert_parallel import _layer_loss as moe_loss
from tests.test_pipeline_shapes import refused
from tests.test_planted_bugs import patched

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_seq_len=32)
BATCH, SEQ = 8, 16  # the global batch: 4 sequences a rank
# the MoE layer: test_expert_parallel's (E = 4 experts, top-2, TOKENS = 32): at ep 2, 2 experts
# and 16 tokens a rank
SMALL_BUCKET_MB = 0.01  # ~2,600 fp32 elements a bucket: many launches in one backward


def checked(module: Any, name: str, calls: Dict[str, int]) -> Callable:
    """``module.name`` with its annotations checked at every call, counting the calls."""
    fn = jaxtyped(typechecker=beartype)(getattr(module, name))

    def counted(*args: Any) -> Any:
        calls[name] = calls.get(name, 0) + 1
        return fn(*args)

    return counted


def batch() -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ),
                         generator=torch.Generator().manual_seed(0))


def world(rank: int, world_size: int) -> dict:
    calls: Dict[str, int] = {}
    out: Dict[str, Any] = {}
    tokens, rows = batch(), slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
    core = {
        name: checked(gradient_sync, name, calls)
        for name in ("average_gradients", "launch_full_buckets", "wait_for_buckets")
    }
    pgm = init_pg_manager()
    with ExitStack() as stack:
        for name, fn in core.items():  # where data_parallel.py calls them
            stack.enter_context(patched(data_parallel, name, fn))
        for impl in ("naive", "ours"):
            model = apply_data_parallel(build_model(CONFIG, seed=0), pgm, impl, SMALL_BUCKET_MB)
            loss_fn(model(tokens[rows]), tokens[rows]).backward()
            model.finish_grad_sync()
            out[impl] = {n: p.grad.clone() for n, p in model.module.named_parameters()}
    destroy_pg_manager()

    pgm = init_pg_manager(expert_model_parallel_size=2)
    dispatch = checked(expert_parallel, "dispatch_tokens", calls)
    combine = checked(expert_parallel, "combine_tokens", calls)
    with patched(expert_parallel, "dispatch_tokens", dispatch), \
            patched(expert_parallel, "combine_tokens", combine):
        layer = moe_layer()
        model = apply_expert_parallel(layer, pgm)
        x, g = moe_data()
        mine = slice(rank * TOKENS // 2, (rank + 1) * TOKENS // 2)
        loss = moe_loss(model, x[mine], g[mine])
        loss.backward()
        model.finish_grad_sync()
    out["moe"] = {
        "loss": loss.item(),
        "router": layer.router.weight.grad.clone(),
        "experts": {
            n: getattr(layer.experts, n).grad.clone()
            for n in ("gate_proj", "up_proj", "down_proj")
        },
    }
    out["calls"] = dict(calls)  # the training's calls, before the refused ones below
    int_grad = torch.zeros(3, dtype=torch.long)
    out["int gradient"] = refused(lambda: core["average_gradients"]([int_grad], None))
    out["a tensor for a work"] = refused(lambda: core["wait_for_buckets"]([torch.zeros(1)]))
    group, table = pgm.expert_model_parallel_group, [[1, 1], [1, 1]]
    out["1-d tokens"] = refused(lambda: dispatch(torch.zeros(4), table, table, group))
    out["int rows"] = refused(
        lambda: combine(torch.zeros(4, H, dtype=torch.long), table, table, group))
    destroy_pg_manager()
    return out


class DataAndExpertParallelCoreShapes(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.results = run_distributed(world, 2, timeout=120)
        model = build_model(CONFIG, seed=0)  # one device: the mean loss over the whole batch
        loss_fn(model(batch()), batch()).backward()
        cls.grads = {n: p.grad for n, p in model.named_parameters()}
        layer = moe_layer()
        x, g = moe_data()
        loss = moe_loss(layer, x, g)
        loss.backward()
        cls.moe_loss = loss.item()
        cls.router = layer.router.weight.grad
        cls.experts = {
            n: getattr(layer.experts, n).grad
            for n in ("gate_proj", "up_proj", "down_proj")
        }

    def test_every_core_function_ran_checked(self):
        for res in self.results:
            calls = res["calls"]
            # naive: one average_gradients call; bucketed: one launch_full_buckets per gradient
            # hook and one wait; MoE: one dispatch and one combine in forward
            self.assertEqual(calls["average_gradients"], 1)
            self.assertEqual(calls["wait_for_buckets"], 1)
            self.assertEqual(calls["launch_full_buckets"], len(self.grads))
            self.assertEqual((calls["dispatch_tokens"], calls["combine_tokens"]), (1, 1))

    def test_ddp_through_the_checked_core_matches_one_device(self):
        # fp32: the mean over 8 sequences against the mean of two means over 4, summed by the
        # all-reduce: only the order of the additions differs, a few ulps of gradients below 10
        # (fp32 ulp at 4: 4.8e-7), so 1e-6 absolute holds them
        for impl in ("naive", "ours"):
            for rank, res in enumerate(self.results):
                with self.subTest(impl=impl, rank=rank):
                    self.assertEqual(set(res[impl]), set(self.grads))
                    for name, grad in res[impl].items():
                        torch.testing.assert_close(grad, self.grads[name], rtol=0, atol=1e-6,
                                                   msg=name)

    def test_expert_parallel_through_the_checked_core_matches_one_device(self):
        # fp32 sums of 32 products in another order: ~1e-8 apart, 1e-6 holds them
        for rank, res in enumerate(self.results):
            moe = res["moe"]
            experts = slice(rank * E // 2, (rank + 1) * E // 2)  # ep rank = rank here
            with self.subTest(rank=rank):
                torch.testing.assert_close(moe["router"], self.router, rtol=0, atol=1e-6)
                for name, grad in moe["experts"].items():
                    torch.testing.assert_close(grad, self.experts[name][experts], rtol=0, atol=1e-6,
                                               msg=name)
        # the mean of the ranks' losses (mean loss + aux each) is the reference's loss
        mean = sum(res["moe"]["loss"] for res in self.results) / 2
        self.assertAlmostEqual(mean, self.moe_loss, delta=1e-6)

    def test_a_call_that_breaks_an_annotation_raises_before_sending(self):
        for res in self.results:
            for call in ("int gradient", "a tensor for a work", "1-d tokens", "int rows"):
                self.assertTrue(res[call].startswith("TypeCheckError: "), (call, res[call]))


if __name__ == "__main__":
    unittest.main()
