"""Single-process tests of the reference Llama that every parallel strategy is compared with."""

import dataclasses
import math
import unittest

import torch
import torch.nn.functional as F

from scaletorch.models import (LlamaConfig, apply_rope, build_model, causal_attention, loss_fn,
                               rope_cos_sin)
from scaletorch.models.llama import Attention

# fp32 on CPU: identical maths in a different order (e.g. SDPA vs matmul) agree to ~1e-6.
ATOL = 1e-5


class TestLlamaConfig(unittest.TestCase):

    def test_head_dim_is_hidden_over_heads(self):
        self.assertEqual(LlamaConfig(hidden_size=64, num_attention_heads=4).head_dim, 16)

    def test_invalid_configs_raise_value_error_naming_the_numbers(self):
        cases = [
            (dict(hidden_size=60, num_attention_heads=8), ["60", "8"]),
            (dict(num_attention_heads=4, num_key_value_heads=3), ["4", "3"]),
            (dict(num_layers=0), ["num_layers", "0"]),
            (dict(vocab_size=-1), ["vocab_size", "-1"]),
            (dict(hidden_size=24, num_attention_heads=8, num_key_value_heads=8), ["3"]),
        ]
        for kwargs, numbers in cases:
            with self.subTest(kwargs=kwargs):
                with self.assertRaises(ValueError) as ctx:
                    LlamaConfig(**kwargs)
                for number in numbers:
                    self.assertIn(number, str(ctx.exception))


class TestLlamaModel(unittest.TestCase):

    def setUp(self):
        self.config = LlamaConfig()
        self.model = build_model(self.config, seed=0)
        self.input_ids = torch.randint(0, self.config.vocab_size, (2, 16),
                                       generator=torch.Generator().manual_seed(1))

    def test_forward_returns_logits_of_shape_batch_seq_vocab(self):
        logits = self.model(self.input_ids)
        self.assertEqual(logits.shape, (2, 16, self.config.vocab_size))
        self.assertEqual(logits.dtype, torch.float32)

    def test_forward_equals_embed_layers_head_pieces(self):
        # Pipeline stages run these pieces separately; they must compose to forward.
        x = self.model.embed(self.input_ids)
        cos, sin = self.model.rope(None, 16, x.device)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        # exactly: forward runs these same modules on the same shapes, in the same order
        torch.testing.assert_close(self.model.head(x), self.model(self.input_ids), rtol=0, atol=0)

    def test_same_seed_builds_identical_weights_whatever_the_global_rng_state(self):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(123)  # a different prior RNG state than in setUp
            torch.rand(7)
            other = build_model(self.config, seed=0)
        for (name, p), q in zip(self.model.named_parameters(), other.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
        different = build_model(self.config, seed=1)
        self.assertFalse(torch.equal(self.model.embed_tokens.weight, different.embed_tokens.weight))

    def test_build_model_leaves_the_global_rng_state_unchanged(self):
        state = torch.get_rng_state()
        build_model(self.config, seed=5)
        self.assertTrue(torch.equal(state, torch.get_rng_state()))

    def test_init_is_gpt2_style_with_scaled_residual_projections(self):
        config = LlamaConfig(hidden_size=128, intermediate_size=256, num_layers=4)
        model = build_model(config, seed=0)
        residual_std = config.init_std / math.sqrt(2 * config.num_layers)
        layer = model.layers[0]
        # ~16k samples per matrix: the sample std is within 3% of the true one.
        self.assertAlmostEqual(layer.self_attn.q_proj.weight.std().item(), config.init_std,
                               delta=0.03 * config.init_std)
        self.assertAlmostEqual(layer.self_attn.o_proj.weight.std().item(), residual_std,
                               delta=0.03 * residual_std)
        self.assertAlmostEqual(layer.mlp.down_proj.weight.std().item(), residual_std,
                               delta=0.03 * residual_std)
        self.assertTrue(torch.equal(model.norm.weight, torch.ones(config.hidden_size)))

    def test_tied_embeddings_share_one_weight_and_count_once(self):
        tied_config = dataclasses.replace(self.config, tie_word_embeddings=True)
        tied = build_model(tied_config, seed=0)
        self.assertIs(tied.lm_head.weight, tied.embed_tokens.weight)
        vocab_by_hidden = self.config.vocab_size * self.config.hidden_size
        self.assertEqual(self.model.num_parameters() - tied.num_parameters(), vocab_by_hidden)

    def test_num_parameters_matches_the_formula(self):
        c = self.config
        kv = c.num_key_value_heads * c.head_dim
        attn = 2 * c.hidden_size * c.hidden_size + 2 * c.hidden_size * kv
        mlp = 3 * c.hidden_size * c.intermediate_size
        block = attn + mlp + 2 * c.hidden_size
        expected = 2 * c.vocab_size * c.hidden_size + c.num_layers * block + c.hidden_size
        self.assertEqual(self.model.num_parameters(), expected)

    def test_changing_a_future_token_does_not_change_earlier_logits(self):
        changed = self.input_ids.clone()
        changed[:, 10] = (changed[:, 10] + 1) % self.config.vocab_size
        before, after = self.model(self.input_ids), self.model(changed)
        # exactly: the same kernels on the same shapes, and a masked score adds exp(-inf) = 0
        torch.testing.assert_close(before[:, :10], after[:, :10], rtol=0, atol=0)
        self.assertFalse(torch.allclose(before[:, 10:], after[:, 10:]))

    def test_explicit_arange_positions_equal_default_in_both_shapes(self):
        default = self.model(self.input_ids)
        positions = torch.arange(16)
        # exactly: the default is this arange; the tables broadcast, one rounding per element
        torch.testing.assert_close(self.model(self.input_ids, positions), default, rtol=0, atol=0)
        torch.testing.assert_close(self.model(self.input_ids, positions.expand(2, 16)), default,
                                   rtol=0, atol=0)

    def test_positions_change_the_output(self):
        shifted = self.model(self.input_ids, torch.arange(16) + 3)
        self.assertFalse(torch.allclose(shifted, self.model(self.input_ids)))

    def test_sequence_longer_than_max_seq_len_raises(self):
        too_long = torch.zeros(1, self.config.max_seq_len + 1, dtype=torch.long)
        with self.assertRaises(ValueError):
            self.model(too_long)

    def test_loss_is_mean_cross_entropy_and_near_log_vocab_at_init(self):
        logits = self.model(self.input_ids)
        targets = torch.roll(self.input_ids, -1, dims=1)
        loss = loss_fn(logits, targets)
        log_probs = logits.log_softmax(-1)
        manual = -log_probs.gather(-1, targets.unsqueeze(-1)).mean()
        torch.testing.assert_close(loss, manual, rtol=0, atol=ATOL)
        self.assertEqual(loss.dim(), 0)
        # Small init gives near-uniform predictions.
        self.assertAlmostEqual(loss.item(), math.log(self.config.vocab_size), delta=0.1)


class TestRope(unittest.TestCase):
    head_dim = 16

    def setUp(self):
        self.g = torch.Generator().manual_seed(0)

    def test_cos_sin_for_a_subset_of_positions_equal_the_slice_of_the_full_table(self):
        cos, sin = rope_cos_sin(torch.arange(32), self.head_dim)
        # Zigzag-style chunks, as context parallel would pass them.
        subset = torch.tensor([0, 1, 2, 3, 28, 29, 30, 31])
        sub_cos, sub_sin = rope_cos_sin(subset, self.head_dim)
        # cos and sin of the same angles, but of a tensor of another size: a CPU kernel may take
        # an element in its vector body or its scalar tail, which can round the last bit
        # differently (6e-8 here). A wrong position is off by 0.01 or more.
        torch.testing.assert_close(sub_cos, cos[subset], rtol=0, atol=1e-6)
        torch.testing.assert_close(sub_sin, sin[subset], rtol=0, atol=1e-6)

    def test_rope_commutes_with_permuting_tokens_and_positions_together(self):
        x = torch.randn(2, 12, 3, self.head_dim, generator=self.g)
        cos, sin = rope_cos_sin(torch.arange(12), self.head_dim)
        perm = torch.randperm(12, generator=self.g)
        p_cos, p_sin = rope_cos_sin(perm, self.head_dim)
        torch.testing.assert_close(apply_rope(x[:, perm], p_cos, p_sin),
                                   apply_rope(x, cos, sin)[:, perm], rtol=0, atol=0)

    def test_rotated_dot_products_depend_only_on_relative_position(self):
        q = torch.randn(1, 1, 1, self.head_dim, generator=self.g)
        k = torch.randn(1, 1, 1, self.head_dim, generator=self.g)

        def score(m: int, n: int) -> torch.Tensor:
            cos_m, sin_m = rope_cos_sin(torch.tensor([m]), self.head_dim)
            cos_n, sin_n = rope_cos_sin(torch.tensor([n]), self.head_dim)
            return (apply_rope(q, cos_m, sin_m) * apply_rope(k, cos_n, sin_n)).sum()

        torch.testing.assert_close(score(7, 3), score(27, 23), rtol=0, atol=ATOL)
        self.assertFalse(torch.allclose(score(7, 3), score(7, 4)))

    def test_rope_preserves_the_norm(self):
        x = torch.randn(2, 5, 4, self.head_dim, generator=self.g)
        cos, sin = rope_cos_sin(torch.arange(5), self.head_dim)
        torch.testing.assert_close(apply_rope(x, cos, sin).norm(dim=-1), x.norm(dim=-1))


class TestAttention(unittest.TestCase):

    def setUp(self):
        g = torch.Generator().manual_seed(0)
        self.q = torch.randn(2, 10, 4, 8, generator=g)
        self.k = torch.randn(2, 10, 2, 8, generator=g)
        self.v = torch.randn(2, 10, 2, 8, generator=g)

    def test_gqa_equals_mha_with_each_kv_head_repeated_for_its_query_group(self):
        gqa = causal_attention(self.q, self.k, self.v)
        k_mha = self.k.repeat_interleave(2, dim=2)
        v_mha = self.v.repeat_interleave(2, dim=2)
        # exactly: causal_attention repeats the kv heads this way itself, then runs the same ops
        torch.testing.assert_close(gqa, causal_attention(self.q, k_mha, v_mha), rtol=0, atol=0)
        self.assertEqual(gqa.shape, self.q.shape)

    def test_causal_attention_matches_torch_sdpa(self):
        out = causal_attention(self.q, self.k, self.v)
        expected = F.scaled_dot_product_attention(self.q.transpose(1, 2),
                                                  self.k.repeat_interleave(2, 2).transpose(1, 2),
                                                  self.v.repeat_interleave(2, 2).transpose(1, 2),
                                                  is_causal=True).transpose(1, 2)
        torch.testing.assert_close(out, expected, rtol=0, atol=ATOL)

    def test_indivisible_head_counts_raise(self):
        with self.assertRaises(ValueError):
            causal_attention(self.q, self.k[:, :, :1].expand(-1, -1, 3, -1), self.v)

    def test_attention_infers_head_count_from_sharded_weights(self):
        # Split heads over two "ranks" the way tensor parallel does: q/k/v by output rows,
        # o_proj by input columns. The partial outputs must sum to the full output.
        config = LlamaConfig()
        full = build_model(config, seed=0).layers[0].self_attn
        x = torch.randn(2, 6, config.hidden_size, generator=torch.Generator().manual_seed(0))
        cos, sin = rope_cos_sin(torch.arange(6), config.head_dim)
        q_rows = config.num_attention_heads * config.head_dim // 2
        kv_rows = config.num_key_value_heads * config.head_dim // 2
        total = torch.zeros(2, 6, config.hidden_size)
        for rank in range(2):
            shard = Attention(config)
            with torch.no_grad():
                for name, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
                    weight = getattr(full, name).weight[rank * rows:(rank + 1) * rows]
                    getattr(shard, name).weight = torch.nn.Parameter(weight.clone())
                o_weight = full.o_proj.weight[:, rank * q_rows:(rank + 1) * q_rows]
                shard.o_proj.weight = torch.nn.Parameter(o_weight.clone())
                total += shard(x, cos, sin)
        torch.testing.assert_close(total, full(x, cos, sin), rtol=0, atol=ATOL)


if __name__ == "__main__":
    unittest.main()
