"""Chapter 04's loops with their jaxtyping shapes checked at run time (beartype, the dev extra).

``pipeline_schedules`` is imported afresh under jaxtyping's import hook, which checks every
annotated argument and return value of its functions and methods: a message (b, s, h), its
answer of the same shape, the token ids (b, s), the scalar loss. One world of 2 ranks runs AFAB
and 1F1B at pp 2 for one step each and compares the loss and every gradient with one device; an
annotation that lied would raise there. Two calls that break the annotations show the checker is
on: they raise before anything is sent.
"""

import importlib
import sys
import unittest

import torch

from scaletorch.dist import destroy_pg_manager, init_pg_manager
from scaletorch.dist.timer import Spans
from scaletorch.models import LlamaConfig, build_model, loss_fn
from scaletorch.parallel.pipeline_parallel import apply_pipeline_parallel
from tests.harness import run_distributed

MODULE = "scaletorch.parallel.pipeline_schedules"
CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_seq_len=32)
M, BATCH, SEQ = 4, 8, 16  # micro-batches, global batch, tokens


def checked_module():
    """``pipeline_schedules`` imported again with every annotation checked at each call."""
    from jaxtyping import install_import_hook
    sys.modules.pop(MODULE, None)
    with install_import_hook(MODULE, "beartype.beartype"):
        return importlib.import_module(MODULE)


def refused(fn) -> str:
    """The name of the error ``fn()`` raises and its first line, or "no error"."""
    try:
        fn()
    except TypeError as err:  # jaxtyping.TypeCheckError is a TypeError
        return f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return "no error"


def world(rank: int, world_size: int) -> dict:
    loops = checked_module()
    pgm = init_pg_manager(pipeline_model_parallel_size=2)
    batch = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ),
                          generator=torch.Generator().manual_seed(0))
    out = {"hooked": loops.PipelineLoop.__call__.__qualname__}
    for schedule in ("afab", "1f1b"):
        pipe = apply_pipeline_parallel(build_model(CONFIG, seed=0), pgm)
        loss = loops.PipelineLoop(pipe, pgm, schedule, M)(batch, batch)
        grads = {n: p.grad.clone() for n, p in pipe.chunks[0].named_parameters()}  # full names
        out[schedule] = (loss.item(), grads)
    pipe = apply_pipeline_parallel(build_model(CONFIG, seed=0), pgm)
    step = loops.PipelineLoop(pipe, pgm, "1f1b", M)
    out["float tokens"] = refused(lambda: step(batch.float(), batch))
    micro = [(batch[:2], batch[:2])] * M
    stage = loops.PipelineRank(pipe, pgm, micro, loss_fn, Spans(torch.device("cpu")))
    out["2-d message"] = refused(lambda: stage.send_forward(0, torch.zeros(2, SEQ)))
    destroy_pg_manager()
    return out


class PipelineLoopShapes(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.results = run_distributed(world, 2, timeout=120)
        model = build_model(CONFIG, seed=0)  # one device: the mean loss over the whole batch
        batch = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ),
                              generator=torch.Generator().manual_seed(0))
        cls.loss = loss_fn(model(batch), batch)
        cls.loss.backward()
        cls.grads = {n: p.grad for n, p in model.named_parameters()}

    def test_the_loops_pass_their_shape_checks_and_match_one_device(self):
        # fp32; the loss is m micro-batch means / m instead of one mean, and the gradients are
        # summed over m backwards: only the order of the additions differs, a few ulps of values
        # below 10 (fp32 ulp at 4: 4.8e-7), so 1e-6 absolute holds them
        for schedule in ("afab", "1f1b"):
            for rank, res in enumerate(self.results):
                loss, grads = res[schedule]
                with self.subTest(schedule=schedule, rank=rank):
                    self.assertAlmostEqual(loss, self.loss.item(), delta=1e-6)
                    for name, grad in grads.items():
                        torch.testing.assert_close(grad, self.grads[name], rtol=0, atol=1e-6)

    def test_the_two_stages_hold_every_parameter_once(self):
        names = [set(res["1f1b"][1]) for res in self.results]
        self.assertEqual(names[0] & names[1], set())
        self.assertEqual(names[0] | names[1], set(self.grads))
        self.assertIn("embed_tokens.weight", names[0])
        self.assertIn("lm_head.weight", names[1])

    def test_a_call_that_breaks_an_annotation_raises_before_sending(self):
        for res in self.results:
            self.assertEqual(res["hooked"], "PipelineLoop.__call__")
            self.assertTrue(res["float tokens"].startswith("TypeCheckError: "), res["float tokens"])
            self.assertTrue(res["2-d message"].startswith("TypeCheckError: "), res["2-d message"])


if __name__ == "__main__":
    unittest.main()
