"""Chapter 05's ring with its jaxtyping shapes checked at run time (beartype, the dev extra).

``ring_attention`` is imported afresh under jaxtyping's import hook, which checks every
annotated argument and return value of its functions: ``ring_forward``'s queries (b, hq, s, d),
its K/V message (2, b, hkv, s, d), its output and its log-sum-exp (b, hq, s) on each rank. One
world of 2 ranks (cp 2) runs ring attention, both tile kernels, GQA heads, and compares the
output and its gradients with full causal attention on one device; an annotation that lied
would raise there. A call that breaks the annotations shows the checker is on: it raises before
anything is sent.
"""

import importlib
import sys
import unittest

import torch

from scaletorch.dist import destroy_pg_manager, init_pg_manager
from tests.harness import run_distributed
from tests.test_context_parallel import ATOL, attention_errors

MODULE = "scaletorch.parallel.ring_attention"


def checked_module():
    """``ring_attention`` imported again with every annotation checked at each call."""
    from jaxtyping import install_import_hook
    sys.modules.pop(MODULE, None)
    with install_import_hook(MODULE, "beartype.beartype"):
        return importlib.import_module(MODULE)


def world(rank: int, world_size: int) -> dict:
    ring = checked_module()
    pgm = init_pg_manager(context_parallel_size=2)
    group = pgm.context_parallel_group
    out = {"hooked": ring.ring_forward.__qualname__}
    for kernel in ("math", "fused"):
        fn = ring.RingAttention(group, "zigzag", kernel)
        out[kernel] = attention_errors(pgm, fn, 4, 2)  # GQA: 2 query heads per kv head
    q, kv = torch.zeros(1, 4, 8, 8), torch.zeros(2, 1, 2, 6, 8)  # kv: 6 tokens, q: 8
    try:
        ring.ring_forward(q, kv, group, "zigzag", None)
        out["refused"] = "no error"
    except TypeError as err:  # jaxtyping.TypeCheckError is a TypeError
        out["refused"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    destroy_pg_manager()
    return out


class RingShapes(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.results = run_distributed(world, 2, timeout=120)

    def test_the_ring_passes_its_shape_checks_and_matches_full_attention(self):
        # ATOL (1e-5): the fp32 tolerance of the ring's own parity test, for the same sums
        # taken tile by tile and merged by log-sum-exp
        for rank, res in enumerate(self.results):
            for kernel in ("math", "fused"):
                with self.subTest(rank=rank, kernel=kernel):
                    self.assertLess(res[kernel], ATOL)

    def test_a_call_that_breaks_an_annotation_raises_before_sending(self):
        for res in self.results:
            self.assertEqual(res["hooked"], "ring_forward")
            self.assertTrue(res["refused"].startswith("TypeCheckError: "), res["refused"])


if __name__ == "__main__":
    unittest.main()
