"""Context parallel (chapter 05): ring attention equals full causal attention, and training with
the sequence split over cp ranks (alone, with data parallel, with tensor parallel) reproduces
the single-device run.

One world of 4 ranks does most of the work (the pg_manager is rebuilt for each layout), one
world of 2 covers context parallel 2 with data parallel 1.
"""

import copy
import dataclasses
import unittest

import torch

from scaletorch.dist import destroy_pg_manager, get_ledger, init_pg_manager
from scaletorch.models import LlamaConfig, build_model, causal_attention, loss_fn
from scaletorch.parallel.context_parallel import (UlyssesAttention, apply_context_parallel,
                                                  check_ulysses_heads, make_sequence_sharder,
                                                  zigzag_positions)
from scaletorch.parallel.data_parallel import apply_data_parallel
from scaletorch.parallel.ring_attention import RingAttention, attention_block_counts, block_counts
from scaletorch.parallel.step import make_data_parallel_step
from scaletorch.parallel.tensor_parallel import apply_tensor_parallel, tensor_parallel_loss_fn
from scaletorch.trainer import Config, Trainer
from tests.harness import run_distributed
from tests.layouts import assert_matches, clip_fn, full_state, reference

# fp32: ring attention sums the same terms as full attention in another order (block by
# block, merged by log-sum-exp), so outputs and gradients agree to ~1e-6, losses to ~5e-7.
ATOL = 1e-5
HEADS = ((4, 4), (4, 2), (3, 1))  # (query heads, key/value heads): MHA, GQA, odd counts
STEPS = 5


def tiny_config() -> Config:
    cfg = Config()
    cfg.model = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_seq_len=32)
    cfg.data.seq_len, cfg.data.global_batch_size = 16, 8
    cfg.training.steps, cfg.training.warmup_steps = STEPS, 2
    cfg.training.lr, cfg.training.weight_decay = 1e-2, 0.0
    cfg.training.precision = "fp32"
    cfg.logging.progress = False
    return cfg


def attention_inputs(hq: int, hkv: int, b: int = 2, s: int = 16, d: int = 8):
    """Random q, k, v (b, s, heads, d) needing grad and an upstream gradient; same on all ranks."""
    g = torch.Generator().manual_seed(100 * hq + hkv)
    q, k, v = (torch.randn(b, s, h, d, generator=g).requires_grad_() for h in (hq, hkv, hkv))
    return q, k, v, torch.randn(b, s, hq, d, generator=g)


def attention_errors(pgm, fn, hq: int, hkv: int, order: str = "zigzag") -> float:
    """Largest |local - full| over the output and dq, dk, dv of this rank's tokens."""
    q, k, v, dout = attention_inputs(hq, hkv)
    full = causal_attention(q, k, v)
    full.backward(dout)
    pos = zigzag_positions(q.size(1), pgm.context_parallel_world_size, pgm.context_parallel_rank,
                           order)
    ql, kl, vl = (t.detach()[:, pos].clone().requires_grad_() for t in (q, k, v))
    out = fn(ql, kl, vl)
    out.backward(dout[:, pos])
    pairs = [(out, full), (ql.grad, q.grad), (kl.grad, k.grad), (vl.grad, v.grad)]
    return max((a - b[:, pos]).abs().max().item() for a, b in pairs)


def train(cfg: Config, tp: int, cp: int, variant: str = "ring") -> dict:
    """Train like examples/05_context_parallel.py; losses, K/V sends and (rank 0) full weights."""
    pgm = init_pg_manager(tensor_model_parallel_size=tp, context_parallel_size=cp)
    model = build_model(cfg.model, seed=cfg.training.model_seed)
    loss, clip = loss_fn, None
    if tp > 1:
        model = apply_tensor_parallel(model, pgm)
        loss, clip = tensor_parallel_loss_fn(pgm), clip_fn(model, pgm)
    model = apply_data_parallel(apply_context_parallel(model, pgm, variant), pgm)
    step = make_data_parallel_step(model, cfg.data.num_micro_batches, pgm.data_parallel_rank,
                                   pgm.data_parallel_world_size,
                                   pgm.data_parallel_group_with_context, loss,
                                   make_sequence_sharder(pgm, cfg.data.seq_len))
    get_ledger().clear()
    result = Trainer(cfg, model, pgm, forward_backward=step, clip_grad_norm=clip,
                     verbose=False).train()
    sends = get_ledger().total(op="send", group="cp") / (STEPS * cfg.model.num_layers)
    state = full_state(model, pgm)  # collective: on rank 0
    out = {
        "losses": result.losses,
        "grad_norms": result.grad_norms,
        "sends_per_layer": sends,
        "blocks": attention_block_counts(model),
        "state": state
    }
    destroy_pg_manager()
    return out


def world_of_four(rank: int, world_size: int, cfg: Config) -> dict:
    res: dict = {"attention": {}, "blocks": {}}
    # Attention level: ring (math and fused blocks) and Ulysses vs full causal attention.
    for cp in (2, 4):
        pgm = init_pg_manager(context_parallel_size=cp)
        group = pgm.context_parallel_group
        for hq, hkv in HEADS:
            res["attention"][("ring", cp, hq,
                              hkv)] = attention_errors(pgm, RingAttention(group), hq, hkv)
            res["attention"][("fused", cp, hq,
                              hkv)] = attention_errors(pgm, RingAttention(group, impl="fused"), hq,
                                                       hkv)
            if hq % cp == 0 and hkv % cp == 0:
                res["attention"][("ulysses", cp, hq,
                                  hkv)] = attention_errors(pgm, UlyssesAttention(group), hq, hkv)
        for order in ("zigzag", "contiguous"):  # contiguous: correct, but unbalanced
            fn = RingAttention(group, order=order)
            res["attention"][(order, cp, 4, 2)] = attention_errors(pgm, fn, 4, 2, order)
            res["blocks"][(order, cp)] = dict(fn.blocks)
        destroy_pg_manager()

    # RoPE under zigzag: local logits = full logits at the local tokens' positions.
    pgm = init_pg_manager(context_parallel_size=4)
    # larger weights than training's init: logits that depend clearly on the positions
    model = build_model(dataclasses.replace(cfg.model, init_std=0.1), seed=0)
    ids = torch.randint(0, cfg.model.vocab_size, (2, 16),
                        generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids)
        apply_context_parallel(model, pgm)
        pos = zigzag_positions(16, 4, pgm.context_parallel_rank)
        res["rope_error"] = (model(ids[:, pos], position_ids=pos) - full[:, pos]).abs().max()
        res["rope_error_without_positions"] = (model(ids[:, pos]) - full[:, pos]).abs().max()
    # Ulysses needs heads divisible by cp: 2 kv heads over 4 ranks is not.
    try:
        apply_context_parallel(model, pgm, "ulysses")
        res["ulysses_error"] = None
    except ValueError as e:
        res["ulysses_error"] = str(e)
    destroy_pg_manager()

    # Model parity: cp 4 (dp 1, two micro-batches), cp 2 x dp 2, cp 2 x tp 2, Ulysses.
    cfg_m2 = copy.deepcopy(cfg)
    cfg_m2.data.num_micro_batches = 2
    res["train"] = {
        "cp4": train(cfg_m2, tp=1, cp=4),
        "cp2_dp2": train(cfg, tp=1, cp=2),
        "cp2_tp2": train(cfg, tp=2, cp=2),
        "ulysses_cp2_dp2": train(cfg, tp=1, cp=2, variant="ulysses"),
    }
    return res


def world_of_two(rank: int, world_size: int, cfg: Config) -> dict:
    return train(cfg, tp=1, cp=2)


class TestContextParallel(unittest.TestCase):
    """Everything that needs ranks, computed in one world of 4 and one of 2."""

    @classmethod
    def setUpClass(cls):
        cls.cfg = tiny_config()
        cfg_m2 = copy.deepcopy(cls.cfg)
        cfg_m2.data.num_micro_batches = 2
        # the plain loop's (losses, grad norms, weights), by micro-batches (tests/layouts.py)
        cls.references = {1: reference(cls.cfg), 2: reference(cfg_m2)}
        cls.four = run_distributed(world_of_four, 4, cls.cfg, timeout=300)
        cls.two = run_distributed(world_of_two, 2, cls.cfg, timeout=300)

    def test_ring_attention_output_and_grads_equal_full_causal_attention(self):
        for rank_result in self.four:
            for key, err in rank_result["attention"].items():
                with self.subTest(rank=self.four.index(rank_result), case=key):
                    self.assertLess(err, ATOL)
        cases = set(self.four[0]["attention"])
        for cp in (2, 4):  # every head layout and both block kernels were checked
            for hq, hkv in HEADS:
                self.assertIn(("ring", cp, hq, hkv), cases)
                self.assertIn(("fused", cp, hq, hkv), cases)
        self.assertIn(("ulysses", 4, 4, 4), cases)

    def test_zigzag_balances_attention_blocks_and_contiguous_does_not(self):
        for cp in (2, 4):
            zigzag = [r["blocks"][("zigzag", cp)] for r in self.four]
            contiguous = [r["blocks"][("contiguous", cp)] for r in self.four]
            # Every rank: 2 cp - 1 full blocks and 2 diagonal ones, per layer forward.
            self.assertEqual({(b["full"], b["diagonal"]) for b in zigzag}, {(2 * cp - 1, 2)})
            self.assertGreater(len({b["full"] for b in contiguous}), 1)
            for r in range(cp):  # the counters agree with the schedule
                self.assertEqual(block_counts(r, cp), zigzag[r])
        # In training (cp 4): per layer, per step, per micro-batch (2), the same on every rank.
        forwards = self.cfg.model.num_layers * STEPS * 2
        for r in self.four:
            blocks = r["train"]["cp4"]["blocks"]
            self.assertEqual((blocks["full"], blocks["diagonal"]), (7 * forwards, 2 * forwards))

    def test_rope_positions_under_zigzag_are_the_unsharded_positions(self):
        for r in self.four:
            self.assertLess(r["rope_error"].item(), ATOL)
            # Without the true positions the logits differ: the check above can fail.
            self.assertGreater(r["rope_error_without_positions"].item(), 1e-2)

    def test_installing_ulysses_with_heads_not_divisible_by_cp_raises(self):
        for r in self.four:  # 2 key/value heads over cp 4
            self.assertIn("key/value heads (2)", r["ulysses_error"])
            self.assertIn("context_parallel_size (4)", r["ulysses_error"])

    def _assert_parity(self, name: str, micro_batches: int = 1) -> None:
        # every rank's losses and grad norms, rank 0's weights: ATOL (tests/layouts.py)
        runs = self.two if name == "cp2" else [r["train"][name] for r in self.four]
        assert_matches(self, runs, self.references[micro_batches], name, tol=ATOL)

    def test_context_parallel_2_matches_single_device(self):
        self._assert_parity("cp2")

    def test_context_parallel_4_matches_single_device_with_accumulation(self):
        self._assert_parity("cp4", micro_batches=2)

    def test_context_2_times_data_2_matches_single_device(self):
        self._assert_parity("cp2_dp2")

    def test_context_2_times_tensor_2_matches_single_device(self):
        self._assert_parity("cp2_tp2")

    def test_ulysses_matches_single_device(self):
        self._assert_parity("ulysses_cp2_dp2")

    def test_all_ranks_report_the_same_global_loss(self):
        for name in ("cp4", "cp2_dp2", "cp2_tp2"):
            losses = {tuple(r["train"][name]["losses"]) for r in self.four}
            self.assertEqual(len(losses), 1, name)

    def test_ring_kv_traffic_per_layer_matches_formula(self):
        # Per layer and step: forward sends K/V (cp-1) times, backward K/V (cp-1) and dK/dV
        # cp times; each message is 2 x b x s/cp x hkv x d elements (hkv not expanded).
        m = self.cfg.model
        for name, r, tp, cp, dp in (("cp4", self.four[0]["train"]["cp4"], 1, 4,
                                     1), ("cp2_dp2", self.four[0]["train"]["cp2_dp2"], 1, 2, 2),
                                    ("cp2_tp2", self.four[0]["train"]["cp2_tp2"], 2, 2,
                                     1), ("cp2", self.two[0], 1, 2, 1)):
            b, s = self.cfg.data.global_batch_size // dp, self.cfg.data.seq_len // cp
            message = 2 * b * s * (m.num_key_value_heads // tp) * m.head_dim
            self.assertEqual(r["sends_per_layer"], (3 * cp - 2) * message, name)


class TestContextParallelErrors(unittest.TestCase):
    """Invalid configurations raise ValueError naming the numbers (no process group needed)."""

    def test_sequence_not_divisible_by_twice_cp_raises(self):
        with self.assertRaises(ValueError) as ctx:
            zigzag_positions(12, 4, 0)
        for number in ("12", "4", "8"):
            self.assertIn(number, str(ctx.exception))

    def test_ulysses_heads_not_divisible_by_cp_raises(self):
        with self.assertRaises(ValueError) as ctx:
            check_ulysses_heads(4, 2, 4)
        self.assertIn("(2)", str(ctx.exception))
        self.assertIn("(4)", str(ctx.exception))
        check_ulysses_heads(8, 4, 4)  # divisible: no error

    def test_unknown_variant_order_and_impl_raise(self):
        with self.assertRaises(ValueError):
            apply_context_parallel(build_model(tiny_config().model, 0), None, "striped")
        with self.assertRaises(ValueError):
            zigzag_positions(16, 2, 0, order="random")
        with self.assertRaises(ValueError):
            RingAttention(None, impl="flash")


class TestZigzagPositions(unittest.TestCase):

    def test_ranks_hold_chunks_r_and_2cp_minus_1_minus_r_covering_the_sequence(self):
        self.assertEqual(zigzag_positions(8, 2, 0).tolist(), [0, 1, 6, 7])
        self.assertEqual(zigzag_positions(8, 2, 1).tolist(), [2, 3, 4, 5])
        for cp in (1, 2, 4):
            every = torch.cat([zigzag_positions(32, cp, r) for r in range(cp)])
            self.assertEqual(sorted(every.tolist()), list(range(32)))

    def test_rope_tables_at_zigzag_positions_equal_the_unsharded_rows(self):
        model = build_model(tiny_config().model, seed=0)
        cos, sin = model.rope(None, 16, torch.device("cpu"))
        for r in range(4):
            pos = zigzag_positions(16, 4, r)
            cos_l, sin_l = model.rope(pos, 4, torch.device("cpu"))
            torch.testing.assert_close(cos_l, cos[pos], rtol=0, atol=0)
            torch.testing.assert_close(sin_l, sin[pos], rtol=0, atol=0)


if __name__ == "__main__":
    unittest.main()
