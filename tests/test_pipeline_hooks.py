"""What chapters 06 and 08 attach to a pipeline schedule from outside: MoE's loss, fp16's scale.

A schedule seeds each backward with the gradient of its losses: ``None`` (1) for the last
stage's loss, ones for a middle stage's own loss (MoE's auxiliary loss). Under fp16 those seeds
must be the scale; ``scale_backward`` wraps the loss functions so that they are, while the
losses the schedule reports stay unscaled. The fp16 parity runs (tests/test_mixed_precision.py,
pp 2) cover the last stage; this covers the arithmetic, the middle stage's path included.
MoE's loss rides on a chunk's output (``MoELossInPipeline``): one backward from the output
gives what the runtime's two seeds gave, bit for bit.
"""

import unittest

import torch

from scaletorch.parallel.mixed_precision import DynamicLossScaler, scale_backward
from scaletorch.parallel.moe_pipeline import MoELossInPipeline


class ScaleBackward(unittest.TestCase):

    def setUp(self):
        self.scaler = DynamicLossScaler()
        self.scaler.scale = 2.0**12
        torch.manual_seed(0)
        self.w = torch.randn(5, requires_grad=True)

    def grad(self, loss_fn, seed=None) -> torch.Tensor:
        self.w.grad = None
        loss = loss_fn(self.w)
        torch.autograd.backward([loss], [seed])
        return self.w.grad.clone()

    def test_the_value_is_the_loss_and_the_gradient_is_scale_times_its_gradient(self):
        loss_fn = lambda w: (w**3).sum() / 4  # noqa: E731
        scaled = scale_backward(loss_fn, self.scaler)
        torch.testing.assert_close(scaled(self.w), loss_fn(self.w), rtol=0, atol=0)
        plain = self.grad(loss_fn)
        # exact: the scale is a power of two, and multiplying by one rounds nothing
        self.assertTrue(torch.equal(self.grad(scaled), plain * self.scaler.scale))

    def test_a_middle_stage_seed_of_ones_gives_what_a_seed_of_scale_gave(self):
        # the schedule before: backward([out, aux], [dout, full(scale)]); now [dout, ones]
        aux_fn = lambda w: (w.sin() * w).mean()  # noqa: E731
        before = self.grad(aux_fn, torch.full((), self.scaler.scale))
        after = self.grad(scale_backward(aux_fn, self.scaler), torch.ones(()))
        self.assertTrue(torch.equal(before, after))  # a power-of-two scale, moved: exact

    def test_the_scale_is_the_one_at_forward_time_and_non_tensors_pass_through(self):
        scaled = scale_backward(lambda w: w.sum(), self.scaler)
        loss = scaled(self.w)
        self.scaler.scale = 1.0  # the step's update comes after its backward, never between
        self.w.grad = None
        loss.backward()
        self.assertTrue(torch.equal(self.w.grad, torch.full((5, ), 2.0**12)))
        self.assertEqual(scale_backward(lambda chunk: 0.0, self.scaler)(None), 0.0)  # dense
        self.assertIsNone(scale_backward(None, self.scaler))


class MoELossCarriedByTheOutput(unittest.TestCase):
    """A middle stage: out = tanh(x w) goes on, its own loss (w^2).sum() / 10 stays; m = 4."""

    def setUp(self):
        torch.manual_seed(0)
        self.w = torch.randn(5, requires_grad=True)
        self.x, self.dout = torch.randn(3, 5), torch.randn(3, 5)
        self.own = lambda chunk: (self.w**2).sum() / 10  # noqa: E731

    def two_seeds(self, seed: float) -> torch.Tensor:
        """The runtime before: backward([out, own / m], [dout, seed])."""
        self.w.grad = None
        out = torch.tanh(self.x * self.w)
        torch.autograd.backward([out, self.own(None) / 4], [self.dout, torch.full((), seed)])
        return self.w.grad.clone()

    def carried(self, hooks: MoELossInPipeline) -> tuple:
        """Now: the hook's output, one backward from it; (gradient, reported loss)."""
        self.w.grad = None
        schedule = type("Schedule", (), {"loss": torch.zeros(())})()
        out = hooks.output(schedule, torch.nn.Identity(), torch.tanh(self.x * self.w))
        out.backward(self.dout)
        return self.w.grad.clone(), schedule.loss

    def test_one_backward_from_the_output_equals_the_two_seeds_and_the_loss_is_reported(self):
        hooks = MoELossInPipeline(num_micro_batches=4)
        hooks.loss_of = self.own
        grad, loss = self.carried(hooks)
        # exact: the same two gradient terms summed, and ones seeded for the own loss
        self.assertTrue(torch.equal(grad, self.two_seeds(1.0)))
        self.assertTrue(torch.equal(loss, self.own(None).detach() / 4))

    def test_under_fp16_the_own_loss_gradient_is_scaled_as_a_seed_of_scale_was(self):
        scaler = DynamicLossScaler()
        scaler.scale = 2.0**12
        hooks = MoELossInPipeline(num_micro_batches=4)
        hooks.loss_of = scale_backward(self.own, scaler)
        grad, loss = self.carried(hooks)
        # exact: a power-of-two scale moved from the seed into the loss's backward
        self.assertTrue(torch.equal(grad, self.two_seeds(scaler.scale)))
        self.assertTrue(torch.equal(loss, self.own(None).detach() / 4))  # reported unscaled

    def test_a_dense_chunk_passes_its_output_through(self):
        out = torch.randn(2, 3)
        schedule = type("Schedule", (), {"loss": torch.zeros(())})()
        self.assertIs(MoELossInPipeline(2).output(schedule, torch.nn.Linear(3, 3), out), out)
        self.assertEqual(schedule.loss.item(), 0.0)


if __name__ == "__main__":
    unittest.main()
