"""The single-device mixture of experts: routing, experts, aux loss, capacity, and the
trainer adding the aux loss to the training loss (so the parity reference trains with it)."""

import copy
import math
import unittest

import torch
import torch.nn.functional as F

from scaletorch.models import LlamaConfig, MoE, build_model, loss_fn, moe_aux_loss
from scaletorch.models.llama import MLP
from scaletorch.parallel.step import forward_backward
from scaletorch.trainer import Config, run_reference

H, FFN, E, K = 32, 64, 4, 2
ATOL = 1e-5  # fp32 outputs of size ~1: the same maths in another order (batched vs per token)


def _layer(**kwargs) -> MoE:
    torch.manual_seed(0)
    layer = MoE(H, FFN, E, **{"top_k": K, "aux_loss_coeff": 0.1, **kwargs})
    layer.experts.init_weights(0.2, 0.2)  # large weights: outputs far from zero
    layer.router.weight.data.normal_(0, 0.5)
    return layer


def _tokens(t: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randn(2, t // 2, H, generator=torch.Generator().manual_seed(seed))


def _expert(layer: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    ex = layer.experts
    return F.linear(
        F.silu(F.linear(x, ex.gate_proj[e])) * F.linear(x, ex.up_proj[e]), ex.down_proj[e])


def _tiny_config(**moe) -> Config:
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.hidden_size, m.intermediate_size, m.num_layers = 64, H, FFN, 2
    m.num_attention_heads, m.num_key_value_heads, m.max_seq_len = 4, 2, 32
    m.num_experts, m.moe_top_k, m.moe_aux_loss_coeff = E, K, 0.1
    for key, value in moe.items():
        setattr(m, key, value)
    cfg.data.seq_len, cfg.data.global_batch_size = 16, 8
    cfg.training.steps, cfg.training.warmup_steps = 2, 1
    cfg.logging.progress = False
    return cfg


class TestMoEConfig(unittest.TestCase):

    def test_top_k_larger_than_num_experts_raises_value_error_naming_both(self):
        for make in (lambda: LlamaConfig(num_experts=2, moe_top_k=3),
                     lambda: MoE(H, FFN, num_experts=2, top_k=3)):
            with self.assertRaises(ValueError) as ctx:
                make()
            self.assertIn("3", str(ctx.exception))
            self.assertIn("2", str(ctx.exception))

    def test_invalid_moe_fields_raise_value_error(self):
        for kwargs in (dict(num_experts=-1), dict(num_experts=4,
                                                  moe_top_k=0), dict(moe_layer_freq=0),
                       dict(moe_capacity_factor=-0.5), dict(moe_aux_loss_coeff=-1.0),
                       dict(moe_intermediate_size=-8)):
            with self.subTest(kwargs=kwargs), self.assertRaises(ValueError):
                LlamaConfig(**kwargs)

    def test_dense_by_default_and_top_k_unchecked_without_experts(self):
        model = build_model(LlamaConfig(moe_top_k=9), seed=0)
        self.assertTrue(all(isinstance(block.mlp, MLP) for block in model.layers))

    def test_moe_layer_freq_picks_the_blocks_that_get_experts(self):
        config = LlamaConfig(num_layers=4, num_experts=4, moe_layer_freq=2,
                             moe_intermediate_size=48)
        model = build_model(config, seed=0)
        kinds = [type(block.mlp) for block in model.layers]
        self.assertEqual(kinds, [MoE, MLP, MoE, MLP])
        self.assertEqual(tuple(model.layers[0].mlp.experts.gate_proj.shape),
                         (4, 48, config.hidden_size))

    def test_experts_get_the_dense_init_with_scaled_down_projection(self):
        config = LlamaConfig(hidden_size=128, intermediate_size=256, num_layers=4, num_experts=4)
        experts = build_model(config, seed=0).layers[0].mlp.experts
        residual = config.init_std / math.sqrt(2 * config.num_layers)
        self.assertAlmostEqual(experts.gate_proj.std().item(), config.init_std,
                               delta=0.03 * config.init_std)
        self.assertAlmostEqual(experts.down_proj.std().item(), residual, delta=0.03 * residual)


class TestMoELayer(unittest.TestCase):

    def test_output_is_the_router_weighted_sum_of_each_tokens_top_k_experts(self):
        layer, x = _layer(), _tokens()
        y = layer(x).reshape(-1, H)
        tokens = x.reshape(-1, H)
        probs = layer.router(tokens).softmax(-1)
        for t in range(tokens.size(0)):
            weights, chosen = probs[t].topk(K)
            expected = sum(w * _expert(layer, int(e), tokens[t]) for w, e in zip(weights, chosen))
            torch.testing.assert_close(y[t], expected, rtol=0, atol=ATOL)

    def test_aux_loss_is_the_switch_formula_and_tokens_per_expert_counts_every_choice(self):
        layer, x = _layer(), _tokens()
        layer(x)
        tokens = x.reshape(-1, H)
        probs = layer.router(tokens).softmax(-1)
        counts = torch.bincount(probs.topk(K).indices.flatten(), minlength=E).float()
        expected = 0.1 * E * (counts / (tokens.size(0) * K) * probs.mean(0)).sum()
        torch.testing.assert_close(layer.aux_loss, expected, rtol=0, atol=ATOL)
        torch.testing.assert_close(layer.tokens_per_expert, counts, rtol=0, atol=0)
        self.assertEqual(layer.tokens_per_expert.sum().item(), tokens.size(0) * K)

    def test_aux_loss_equals_the_coefficient_when_router_probabilities_are_uniform(self):
        layer = _layer()
        layer.router.weight.data.zero_()  # p_te = 1/E: sum_e f_e / E * E = 1
        layer(_tokens())
        self.assertAlmostEqual(layer.aux_loss.item(), 0.1, places=6)

    def test_no_capacity_factor_drops_nothing(self):
        layer = _layer(capacity_factor=0.0)
        layer(_tokens())
        self.assertEqual(layer.dropped, 0)

    def test_capacity_drops_assignments_beyond_it_first_choices_served_first(self):
        layer = _layer(capacity_factor=0.5)  # C = ceil(0.5 * 24 tokens * 2 / 4) = 6 per expert
        x = _tokens()
        x[..., 0] = 5.0
        with torch.no_grad():
            layer.router.weight[0, 0] = 10.0  # logit ~50: expert 0 is every token's 1st choice
        y = layer(x).reshape(-1, H)
        tokens = x.reshape(-1, H)
        weights, chosen = layer.router(tokens).softmax(-1).topk(K)
        self.assertTrue(bool((chosen[:, 0] == 0).all()))
        capacity, served, dropped = 6, [0] * E, 0
        expected = torch.zeros_like(tokens)
        for j in range(K):  # every token's first choice, then every second choice
            for t in range(tokens.size(0)):
                e = int(chosen[t, j])
                if served[e] < capacity:
                    served[e] += 1
                    expected[t] += weights[t, j] * _expert(layer, e, tokens[t])
                else:
                    dropped += 1
        self.assertGreaterEqual(dropped, 24 - capacity)  # expert 0 alone drops 18
        self.assertEqual(layer.dropped, dropped)
        torch.testing.assert_close(y, expected, rtol=0, atol=ATOL)
        # The aux loss still sees every choice (before dropping): expert 0 got all 24.
        self.assertEqual(layer.tokens_per_expert[0].item(), 24)

    def test_gradients_reach_the_router_and_every_expert_with_tokens(self):
        layer, x = _layer(), _tokens()
        loss = layer(x).pow(2).mean() + moe_aux_loss(layer)
        loss.backward()
        self.assertGreater(layer.router.weight.grad.abs().sum().item(), 0)
        for e in range(E):
            if layer.tokens_per_expert[e] > 0:
                for name in ("gate_proj", "up_proj", "down_proj"):
                    grad = getattr(layer.experts, name).grad[e]
                    self.assertGreater(grad.abs().sum().item(), 0, msg=f"{name}[{e}]")

    def test_router_gets_gradient_from_the_aux_loss_alone(self):
        layer = _layer()
        layer(_tokens())
        moe_aux_loss(layer).backward()
        self.assertGreater(layer.router.weight.grad.abs().sum().item(), 0)
        self.assertIsNone(layer.experts.gate_proj.grad)


class TestAuxLossReachesTheTrainingLoss(unittest.TestCase):

    def test_moe_aux_loss_sums_the_layers_once_and_is_zero_for_a_dense_model(self):
        model = build_model(_tiny_config().model, seed=0)
        model(torch.zeros(1, 8, dtype=torch.long))
        expected = sum(block.mlp.aux_loss for block in model.layers)
        torch.testing.assert_close(moe_aux_loss(model), expected)
        self.assertEqual(moe_aux_loss(model), 0.0)  # handed out already
        self.assertEqual(moe_aux_loss(build_model(LlamaConfig(), seed=0)), 0.0)

    def test_trainer_step_loss_is_cross_entropy_plus_aux_loss(self):
        cfg = _tiny_config()
        model = build_model(cfg.model, seed=0)
        twin = copy.deepcopy(model)
        x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
        y = torch.roll(x, -1, dims=1)
        loss = forward_backward(model, x, y, num_micro_batches=1)
        logits = twin(x)
        aux = moe_aux_loss(twin)
        self.assertGreater(aux.item(), 0.05)  # coeff 0.1 x (about 1): a visible share
        torch.testing.assert_close(loss, (loss_fn(logits, y) + aux).detach(), rtol=0, atol=1e-6)

    def test_reference_run_trains_the_moe_model_with_the_aux_loss(self):
        with_aux, _, _ = run_reference(_tiny_config())
        without, _, _ = run_reference(_tiny_config(moe_aux_loss_coeff=0.0))
        # Step 0 (same weights) differs by the aux loss: at init the router is near uniform,
        # so each of the 2 MoE layers adds about coeff (0.1).
        self.assertAlmostEqual(with_aux[0] - without[0], 0.2, delta=0.01)
        self.assertNotAlmostEqual(with_aux[1], without[1], delta=0.05)  # and training differs


if __name__ == "__main__":
    unittest.main()
