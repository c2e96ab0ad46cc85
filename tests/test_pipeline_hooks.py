"""What chapter 08 attaches to a pipeline schedule from outside: fp16's loss scale.

A schedule seeds each backward with the gradient of its losses: ``None`` (1) for the last
stage's loss, ones for a middle stage's own loss (MoE's auxiliary loss). Under fp16 those seeds
must be the scale; ``scale_backward`` wraps the loss functions so that they are, while the
losses the schedule reports stay unscaled. The fp16 parity runs (tests/test_mixed_precision.py,
pp 2) cover the last stage; this covers the arithmetic, the middle stage's path included.
"""

import unittest

import torch

from scaletorch.parallel.mixed_precision import DynamicLossScaler, scale_backward


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


if __name__ == "__main__":
    unittest.main()
