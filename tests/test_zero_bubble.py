"""Zero-bubble pipeline schedules (zb-h1, zbv, dualpipev): the split backward, the schedules as
data and their simulation (no ranks), then one world of 4 ranks: parity with the single
device for ours and torch.distributed.pipelining's, alone and beside dp (DDP and ZeRO 1-3) and
tp. Their bubbles and activations measured with injected delays: tests/test_zero_bubble_timing.py
(timed, so run with no other module beside it).
"""

import unittest
from collections import Counter

import torch

from scaletorch.dist import p2p_order
from scaletorch.dist.layout_check import validate_layout
from scaletorch.models import LlamaConfig, build_model
from scaletorch.parallel.activation_meter import ActivationMeter
from scaletorch.schedule.analysis import simulate, zero_bubble_theory
from scaletorch.schedule.catalog import schedule_actions, validate_schedule
from scaletorch.schedule.orders import peak_live_activations
from scaletorch.schedule.placement import ZERO_BUBBLE
from scaletorch.schedule.simulate import simulate_async
from scaletorch.trainer import Config, max_weight_diff
from tests.harness import run_distributed
from tests.layouts import TOL, assert_run_matches, layout, make_config, reference, train


def order(schedule, p, m, rank, v=1):
    return " ".join(str(a) for a in schedule_actions(schedule, p, m, rank, v))


class TestSplitBackward(unittest.TestCase):
    """B then W (pipeline_runtime.py's calls) give a plain backward's gradients; no ranks."""

    def test_input_then_weight_gradients_equal_one_backward_and_w_frees_the_activations(self):
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_seq_len=16)
        layer = build_model(cfg, seed=0).layers[0]
        cos, sin = build_model(cfg, seed=0).rope(None, 8, torch.device("cpu"))
        x = torch.randn(2, 8, 32, requires_grad=True)
        dout = torch.randn(2, 8, 32)
        layer(x, cos, sin).backward(dout)
        full = {n: p.grad.clone() for n, p in layer.named_parameters()}
        dx_full = x.grad.clone()
        layer.zero_grad(set_to_none=True)

        meter = ActivationMeter(list(layer.parameters()), enabled=True)
        with meter.forward((0, 0)):
            out = layer(x, cos, sin)
        saved = meter.bytes()
        dx, = torch.autograd.grad([out], [x], [dout], retain_graph=True)  # B
        self.assertTrue(all(p.grad is None for p in layer.parameters()))  # B made no dW
        torch.autograd.backward([out], [dout], inputs=list(layer.parameters()))  # W
        meter.release((0, 0))
        self.assertEqual(meter.bytes(), 0)
        self.assertEqual(meter.peak_bytes, saved)
        # at least the block's input and its MLP's hidden (b s i) are saved, in fp32
        self.assertGreaterEqual(saved, 4 * 2 * 8 * (32 + 64))
        torch.testing.assert_close(dx, dx_full, rtol=0, atol=1e-6)
        for name, p in layer.named_parameters():
            torch.testing.assert_close(p.grad, full[name], rtol=0, atol=1e-6, msg=name)


class TestZeroBubbleSchedules(unittest.TestCase):
    """The schedules as data and the asynchronous simulator; no ranks."""

    def test_zb_h1_is_1f1b_with_b_split_and_rank_r_holding_back_r_weight_gradients(self):
        expected = [
            "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 B3 W3 B4 W4 B5 W5",
            "F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 B4 W3 B5 W4 W5",
            "F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 B5 W3 W4 W5",
            "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 W3 W4 W5",
        ]
        for rank in range(4):
            self.assertEqual(order("zb-h1", 4, 6, rank), expected[rank])

    def test_zbv_places_two_chunks_per_rank_in_a_v(self):
        # p = 2, m = 4: rank 0 holds stages 0 and 3 (".1"), rank 1 stages 1 and 2
        self.assertEqual(
            order("zbv", 2, 4, 0, 2), "F0 F1 F2 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 F3 B0 W0 F2.1 "
            "B2.1 W2.1 B1 W1 F3.1 B3.1 W3.1 B2 W2 B3 W3")

    def test_zbv_runs_fewer_than_2p_micro_batches_as_the_full_order_without_the_missing(self):
        # rank 0's warm-up alone is 2p - 1 forwards: below that the order is built for 2p - 1
        # micro-batches and the ones that do not exist are dropped (torch does the same)
        for p in (2, 4):
            for m in range(1, 2 * p - 1):
                validate_schedule("zbv", p, m, 2)
                for rank in range(p):
                    full = [
                        a for a in schedule_actions("zbv", p, 2 * p - 1, rank, 2)
                        if a.micro_batch < m
                    ]
                    self.assertEqual(schedule_actions("zbv", p, m, rank, 2), full)
        # the V is not full, but never holds more than 2p half-size chunks
        timeline = simulate_async("zbv", 4, 2, 2)
        self.assertAlmostEqual(timeline.bubble_fraction(), 5 / 11, places=12)
        self.assertEqual([timeline.peak_live(r) for r in range(4)], [3, 4, 4, 4])

    def test_each_action_once_and_every_valid_schedule_runs_without_deadlock(self):
        ran = Counter()
        for schedule in ZERO_BUBBLE:
            v = 1 if schedule == "zb-h1" else 2
            for p in (2, 3, 4, 8):
                for m in range(1, 4 * p + 2):
                    try:
                        validate_schedule(schedule, p, m, v)
                    except ValueError:
                        continue
                    ran[schedule] += 1
                    for rank in range(p):
                        actions = schedule_actions(schedule, p, m, rank, v)
                        counts = Counter((a.kind, a.micro_batch, a.chunk) for a in actions)
                        self.assertEqual(max(counts.values()), 1)
                        for kind in "FB":
                            self.assertEqual(sum(k == kind for k, _, _ in counts), m * v)
                    simulate_async(schedule, p, m, v)  # raises on a deadlock or a bad order
        # m in [1, 4p + 1] at p = 2, 3, 4, 8: zb-h1 takes m >= p (3p + 2 each), zbv every m
        # (4p + 1), dualpipev m >= 2p (2p + 2)
        self.assertEqual(dict(ran), {"zb-h1": 59, "zbv": 72, "dualpipev": 42})

    def test_async_simulator_reproduces_the_classic_bubbles(self):
        # the rendezvous simulator of the classic runtime and the async one agree
        for schedule, v in (("afab", 1), ("1f1b", 1), ("interleaved", 2)):
            for p, m in ((2, 4), (4, 8)):
                got = simulate_async(schedule, p, m, v, 1.0, 1.0, 1.0).bubble_fraction()
                self.assertAlmostEqual(got, simulate(schedule, p, m, v).bubble_fraction(), 12)

    def test_simulated_bubble_and_memory_at_p4_m8(self):
        # F = B = W: 1F1B 9/33; ZB-H1 (p-1)(F+B-W) / (m(F+B+W) + ...) = 3/27; ZBV near 0
        bubble = {
            s: simulate_async(s, 4, 8, v, 1.0, 1.0, 1.0)
            for s, v in (("1f1b", 1), ("zb-h1", 1), ("zbv", 2), ("dualpipev", 2))
        }
        self.assertAlmostEqual(bubble["1f1b"].bubble_fraction(), 9 / 33, places=12)
        self.assertAlmostEqual(bubble["zb-h1"].bubble_fraction(), 3 / 27, places=12)
        self.assertLessEqual(bubble["zb-h1"].bubble_fraction(),
                             bubble["1f1b"].bubble_fraction() / 2)
        self.assertLessEqual(bubble["zbv"].bubble_fraction(), bubble["1f1b"].bubble_fraction() / 4)
        # live micro-batch chunks: ZB-H1 p on every rank (1F1B's rank 0), ZBV 2p half-size
        # chunks (the same bytes), DualPipeV 2p + 1
        self.assertEqual([bubble["zb-h1"].peak_live(r) for r in range(4)], [4] * 4)
        self.assertEqual([bubble["zbv"].peak_live(r) for r in range(4)], [8] * 4)
        self.assertEqual([bubble["dualpipev"].peak_live(r) for r in range(4)], [9] * 4)

    def test_zb_h1_bubble_equals_its_formula_for_unequal_costs(self):
        for f, b, w in ((1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (1.0, 1.5, 0.5), (2.0, 1.0, 1.0)):
            for p, m in ((2, 4), (4, 8), (4, 16)):
                got = simulate_async("zb-h1", p, m, 1, f, b, w).bubble_fraction()
                self.assertAlmostEqual(got, zero_bubble_theory("zb-h1", p, m, f, b, w), 12,
                                       msg=f"p={p} m={m} F={f} B={b} W={w}")

    def test_peak_live_counts_a_split_micro_batch_until_its_w(self):
        actions = schedule_actions("zb-h1", 4, 8, 3)  # F0 B0 F1 B1 ...: W's held back 3
        self.assertEqual(peak_live_activations(actions), 4)
        self.assertEqual(peak_live_activations(schedule_actions("1f1b", 4, 8, 3)), 1)

    def test_invalid_configs_raise_value_errors_naming_the_numbers(self):
        cases = [
            (("zb-h1", 4, 3, 1), r"num_micro_batches \(3\) >= pipeline_model_parallel_size \(4\)"),
            (("zb-h1", 2, 4, 2), r"virtual_pipeline_stages must be 1, got 2"),
            (("zbv", 2, 4, 1), r"--virtual-stages 2 \(virtual_pipeline_stages is 1\)"),
            (("dualpipev", 4, 6, 2), r"num_micro_batches \(6\) >= 2 x pipeline_model_parallel"),
            (("dualpipev", 2, 3, 2), r"--micro-batches 4 or more"),
        ]
        for args, message in cases:
            with self.assertRaisesRegex(ValueError, message):
                validate_schedule(*args)
        # through the one layout check, from a config
        cfg = make_config(**layout(pp=2, schedule="dualpipev", virtual_pipeline_stages=2))
        cfg.data.num_micro_batches = 2
        with self.assertRaisesRegex(ValueError, r"dualpipev needs num_micro_batches \(2\)"):
            validate_layout(cfg, 2)
        cfg = make_config(**layout(pp=2, schedule="zb-h1", impl="torch"))
        cfg.data.num_micro_batches, cfg.data.global_batch_size = 5, 10
        with self.assertRaisesRegex(ValueError, r"ScheduleInterleavedZeroBubble"):
            validate_layout(cfg, 2)


# ---- one world of 4 ranks ------------------------------------------------------------------

# name: (layers, micro-batches, parallel config) through parallelize (tests/layouts.py)
PARITY = {
    # zb-h1 pp 2 x dp 2 (DDP) and dualpipev pp 2 x tp 2 at m 4: tests/test_nccl_order.py's world
    # of 4 trains the same layouts in the same order against the single device (TestNcclOrder-
    # FourRanks); zb-h1 beside dp is also each ZeRO run below
    "zb-h1 pp4 m4": (4, 4, layout(pp=4, schedule="zb-h1")),
    "zb-h1 pp2 tp2 m2": (4, 2, layout(pp=2, tp=2, schedule="zb-h1")),
    "zbv pp4 m8": (8, 8, layout(pp=4, schedule="zbv", virtual_pipeline_stages=2)),
    "zbv pp2 dp2 m4": (4, 4, layout(pp=2, schedule="zbv", virtual_pipeline_stages=2)),
    "dualpipev pp4 m8": (8, 8, layout(pp=4, schedule="dualpipev", virtual_pipeline_stages=2)),
    # tied embeddings in a V: rank 0's two chunks share the one parameter (dp_cp 1, see
    # layout_check.py's refusal of a V with a data-parallel wrapper)
    "tied zbv pp2 tp2 m4": (4, 4, layout(pp=2, tp=2, schedule="zbv", virtual_pipeline_stages=2)),
    "tied dualpipev pp2 tp2 m4":
    (4, 4, layout(pp=2, tp=2, schedule="dualpipev", virtual_pipeline_stages=2)),
    "torch zb-h1 pp4 m4": (4, 4, layout(pp=4, schedule="zb-h1", impl="torch")),
    # torch's V schedules at dp 1: torch DDP around a chunk cannot follow a backward split in B
    # and W (data_parallel.apply_data_parallel's; chapter 04b's script refuses it)
    "torch zbv pp4 m8": (8, 8, layout(pp=4, schedule="zbv", virtual_pipeline_stages=2,
                                      impl="torch")),
    "torch dualpipev pp4 m8":
    (8, 8, layout(pp=4, schedule="dualpipev", virtual_pipeline_stages=2, impl="torch")),
}
# ZeRO at pp 2 x dp 2: W must reach the ZeRO units' full parameters, not the wrapper's shards
# (parallelize.py sets PipelineSchedule.params), which stage 3 also gathers for W. Stage 3
# under each schedule; stages 1 and 2, whose units the schedule sees alike (full parameters,
# the same post-accumulate hooks reduce-scatter what W makes), each under one chunk per rank
# and under a V
ZERO_RUNS = ((3, "zb-h1"), (3, "zbv"), (3, "dualpipev"), (2, "zb-h1"), (2, "dualpipev"), (1, "zbv"))
PARITY.update({
    f"zero{z} {s} pp2 dp2 m4":
    (4, 4, layout(pp=2, schedule=s, zero_stage=z, virtual_pipeline_stages=1 if s == "zb-h1" else 2))
    for z, s in ZERO_RUNS
})
TORCH_VS_OURS = {
    "torch zb-h1 pp4 m4": "zb-h1 pp4 m4",
    "torch zbv pp4 m8": "zbv pp4 m8",
    "torch dualpipev pp4 m8": "dualpipev pp4 m8",
}
# The parity runs' steps: one warm-up step, then one past it (on the AdamW state the first left),
# with clipping active. Every difference a schedule could make (an action missed, a W on stale
# weights or on a ZeRO shard, a gradient not reduced) shows from step 1 on, in an fp32 run that
# is deterministic (3 steps with 2 warm-up ones cost each of the 16 runs a third more).
PARITY_STEPS = 2
PARITY_WARMUP = 1


def config(name: str):
    layers, m, parallel = PARITY[name]
    cfg = make_config(micro_batches=m, **parallel)
    cfg.model.num_layers, cfg.training.steps = layers, PARITY_STEPS
    cfg.training.warmup_steps = PARITY_WARMUP
    cfg.model.tie_word_embeddings = name.startswith("tied")
    return cfg


def reference_key(name: str) -> tuple:
    """(layers, micro-batches, tied): what the single-device reference depends on."""
    return PARITY[name][0], PARITY[name][1], name.startswith("tied")


def world(rank: int, world_size: int) -> dict:
    p2p_order.set_in_order(True)  # the parity runs in NCCL's order (tests/test_nccl_order.py)
    return {"parity": {name: train(config(name)) for name in PARITY}}


def reference_config(layers: int, m: int, tied: bool) -> Config:
    cfg = make_config(micro_batches=m)
    cfg.model.num_layers, cfg.model.tie_word_embeddings = layers, tied
    cfg.training.steps, cfg.training.warmup_steps = PARITY_STEPS, PARITY_WARMUP
    return cfg


class TestZeroBubbleRanks(unittest.TestCase):
    """pp 4, pp 2 x dp 2 (DDP and ZeRO 1-3), pp 2 x tp 2; ours and
    torch.distributed.pipelining's."""

    @classmethod
    def setUpClass(cls):
        cls.results = run_distributed(world, 4, timeout=240)
        # the plain loop's losses, grad norms and weights, in this process (tests/layouts.py)
        keys = sorted({reference_key(n) for n in PARITY})
        cls.references = {key: reference(reference_config(*key)) for key in keys}

    def check_parity(self, names):
        for name in names:
            with self.subTest(run=name):
                assert_run_matches(self, self.results, name, self.references[reference_key(name)])

    def test_zb_h1_matches_single_device_at_2_and_4_stages_with_dp_and_tp(self):
        self.check_parity([n for n in PARITY if n.startswith("zb-h1")])

    def test_zbv_and_dualpipev_match_single_device(self):
        self.check_parity([n for n in PARITY if n.startswith(("zbv", "dualpipev"))])

    def test_zb_h1_zbv_and_dualpipev_with_zero_1_2_3_match_single_device(self):
        self.check_parity([n for n in PARITY if n.startswith("zero")])

    def test_tied_zbv_and_dualpipev_share_one_weight_and_match_the_tied_single_device(self):
        # rank 0's two chunks use the one parameter: losses, the clip's grad norms (counted
        # once, not as an embedding group's two copies) and weights within TOL (1e-5)
        names = [n for n in PARITY if n.startswith("tied")]
        self.check_parity(names)
        for name in names:
            state = self.results[0]["parity"][name]["state"]
            self.assertIs(state["lm_head.weight"], state["embed_tokens.weight"], name)

    def test_torch_zero_bubble_schedules_match_single_device_and_ours(self):
        self.check_parity([n for n in PARITY if n.startswith("torch")])
        for theirs, ours in TORCH_VS_OURS.items():
            a, b = (self.results[0]["parity"][n] for n in (theirs, ours))
            self.assertLessEqual(max(abs(x - y) for x, y in zip(a["losses"], b["losses"])), TOL)
            self.assertLessEqual(max_weight_diff(a["state"], b["state"]), TOL, theirs)


if __name__ == "__main__":
    unittest.main()
