"""Pipeline parallel: schedules as data and chapter 04's loops traced (no ranks), then one
world of 4 ranks for the rest.

The world rebuilds the pg_manager for pp 4, pp 2 x dp 2 and pp 2 x tp 2, runs every schedule
(chapter 04's loops, 04b's runtime and torch.distributed.pipelining) for 2 steps against the
single-device reference, runs each schedule once more for p in {2, 4} and m in {p, 2p + 1}
under a timeout, and times the schedules with an artificial, equal delay per layer to measure
the bubble. Chapter 04's loops and 04b's runtime give bit-identical runs on the same layout.
"""

import re
import time
import unittest
from typing import Optional

import torch

from scaletorch.dist import destroy_pg_manager, get_ledger, init_pg_manager, p2p_order
from scaletorch.models import LlamaConfig, build_model
from scaletorch.parallel.data_parallel import apply_data_parallel
from scaletorch.parallel.pipeline_native import TorchPipelineSchedule
from scaletorch.parallel.pipeline_parallel import apply_pipeline_parallel, gather_timeline
from scaletorch.parallel.pipeline_runtime import PipelineSchedule
from scaletorch.parallel.pipeline_schedules import SCHEDULES, PipelineLoop, ScheduleTrace
from scaletorch.parallel.tied_embeddings import (attach_tied_embedding_sync, check_v_shape_wrappers,
                                                 tied_embedding_params, untie_across_stages)
from scaletorch.schedule.analysis import comm_plan, simulate, simulate_plans
from scaletorch.schedule.catalog import schedule_actions, validate_schedule
from scaletorch.schedule.orders import afab_actions, one_f_one_b_actions, peak_live_activations
from scaletorch.schedule.placement import V_SHAPED, split_layers, theoretical_bubble
from scaletorch.schedule.simulate import PipelineDeadlock
from scaletorch.trainer import Config, Trainer
from scripts.benchmarks.timing import Delayed
from tests.harness import bit_exact, run_distributed, stderr_warnings, value_error
from tests.layouts import assert_run_matches, clip_fn, full_state, reference

CLASSIC = ("afab", "1f1b", "interleaved")  # the zero-bubble ones: tests/test_zero_bubble.py


def order(schedule, p, m, rank, v=1):
    return " ".join(str(a) for a in schedule_actions(schedule, p, m, rank, v))


class TestScheduleDefinitions(unittest.TestCase):
    """The schedule generators and their simulation; pure Python, no ranks."""

    def test_afab_runs_all_forwards_then_all_backwards(self):
        for rank in range(3):
            self.assertEqual(order("afab", 3, 3, rank), "F0 F1 F2 B0 B1 B2")

    def test_1f1b_warms_up_p_minus_rank_minus_1_forwards_then_alternates(self):
        expected = [
            "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5",
            "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 B4 B5",
            "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5",
            "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5",
        ]
        for rank in range(4):
            self.assertEqual(order("1f1b", 4, 6, rank), expected[rank])

    def test_interleaved_visits_chunks_in_groups_of_p_micro_batches(self):
        # Megatron: warm-up 2 (p - r - 1) + (v - 1) p forwards; ".1" is the rank's chunk 1.
        expected = [
            "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3",
            "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3",
        ]
        for rank in range(2):
            self.assertEqual(order("interleaved", 2, 4, rank, 2), expected[rank])

    def test_1f1b_holds_at_most_p_minus_rank_activations_and_afab_holds_m(self):
        for p in (2, 3, 4, 8):
            for m in (p, p + 1, 2 * p + 1, 16):
                for rank in range(p):
                    one_f_one_b = schedule_actions("1f1b", p, m, rank)
                    self.assertEqual(peak_live_activations(one_f_one_b), min(p - rank, m))
                    self.assertEqual(peak_live_activations(schedule_actions("afab", p, m, rank)), m)

    def test_simulated_bubble_equals_theory_with_equal_cost_stages(self):
        # Slots, not seconds: exact. F = B and B = 2F both give (p-1)/(v m + p - 1).
        for schedule, v in (("afab", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3)):
            for p in (2, 4):
                for m in (p, 2 * p, 4 * p):
                    for backward_cost in (1.0, 2.0):
                        timeline = simulate(schedule, p, m, v, 1.0, backward_cost)
                        self.assertAlmostEqual(timeline.bubble_fraction(),
                                               theoretical_bubble(p, m, v), places=12,
                                               msg=f"{schedule} p={p} m={m} v={v}")

    def test_every_plan_pairs_its_messages_and_never_deadlocks(self):
        # simulate() uses rendezvous sends (a send waits for the matching recv, as on NCCL)
        simulated = refused = 0
        for schedule in CLASSIC:
            for v in ((1, ) if schedule != "interleaved" else (1, 2, 3)):
                for p in (1, 2, 3, 4, 5, 8):
                    for m in range(1, 2 * p + 2):
                        try:
                            validate_schedule(schedule, p, m, v)
                        except ValueError:
                            refused += 1  # 1F1B m < p; interleaved m not a multiple of p
                            continue
                        timeline = simulate(schedule, p, m, v)
                        self.assertEqual(len(timeline.events), 2 * p * m * v)
                        simulated += 1
        # 52 (p, m) pairs per (schedule, v): sum of 2p + 1 over p. afab runs all 52; 1f1b the
        # m >= p, p + 2 per p: 35; interleaved the m divisible by p: v = 1, 3 at p = 1 and 2
        # (m = p, 2p) at each other p: 13; v = 2, 3 the same but none at p = 1: 10 each.
        self.assertEqual((simulated, refused), (52 + 35 + 13 + 10 + 10, 5 * 52 - 120))

    def test_chapter_04_loops_call_the_schedule_definitions_order(self):
        # afab and one_f_one_b run on a trace: their F and B order is the data's, every rank
        definitions = {"afab": afab_actions, "1f1b": one_f_one_b_actions}
        checked = 0
        for name, loop in SCHEDULES.items():
            for p in (1, 2, 3, 4, 8):
                for m in range(p, 2 * p + 2):
                    for rank in range(p):
                        trace = ScheduleTrace(p, rank)
                        loop(trace, m)
                        actions = [line.split(": ")[1].split(" ")[0] for line in trace.lines]
                        actions = [a for a in actions if a[0] in "FB"]
                        expected = [str(a) for a in definitions[name](p, m, rank)]
                        self.assertEqual(actions, expected, f"{name} p={p} m={m} rank={rank}")
                        checked += 1
        self.assertEqual(checked, 2 * sum(p * (p + 2) for p in (1, 2, 3, 4, 8)))

    def test_chapter_04_loops_pair_every_send_with_one_receive(self):
        # every message a rank's loop sends, its peer's loop receives, once
        for name, loop in SCHEDULES.items():
            for p, m in ((2, 2), (3, 5), (4, 4), (4, 9)):
                sent, received = [], []
                for rank in range(p):
                    trace = ScheduleTrace(p, rank)
                    loop(trace, m)
                    text = " ".join(trace.lines)
                    for mb, to in re.findall(r"mb (\d+) -> rank (\d+)", text):
                        sent.append((rank, int(to), int(mb)))
                    for mb, frm in re.findall(r"mb (\d+) <- rank (\d+)", text):
                        received.append((int(frm), rank, int(mb)))
                self.assertEqual(sorted(sent), sorted(received), f"{name} p={p} m={m}")
                self.assertEqual(len(sent), 2 * m * (p - 1), f"{name} p={p} m={m}")

    def test_interleaved_without_paired_steady_state_deadlocks(self):
        # Posting one action's p2p at a time deadlocks the interleaved ring (all ranks wait
        # for their predecessor): why comm_plan pairs each steady-state F with its B.
        p, m, v = 4, 8, 2
        plans = [
            comm_plan([[a] for a in schedule_actions("interleaved", p, m, r, v)], r, p, v)
            for r in range(p)
        ]
        with self.assertRaises(PipelineDeadlock):
            simulate_plans(plans, m, v)

    def test_invalid_configs_raise_value_errors(self):
        cases = [
            (lambda: validate_schedule("1f1b", 4, 3), "1F1B needs num_micro_batches"),
            (lambda: validate_schedule("interleaved", 4, 6, 2), "divisible by"),
            (lambda: validate_schedule("1f1b", 1, 4, 2), "needs a pipeline"),
            (lambda: validate_schedule("afab", 2, 4, 2), "needs the interleaved"),
            (lambda: validate_schedule("zigzag", 2, 4), "must be one of"),
            (lambda: split_layers(6, 4), "not divisible"),
            (lambda: split_layers(6, 2, [1, 4]), "summing to"),
        ]
        for fn, message in cases:
            with self.assertRaisesRegex(ValueError, message):
                fn()
        self.assertEqual(split_layers(4, 2, [1, 3]), [[0], [1, 2, 3]])

    def test_apply_rejects_virtual_stages_without_pipeline_and_moe(self):
        pgm = init_pg_manager()  # one process, no process group: pipeline size 1
        try:
            cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4)
            with self.assertRaisesRegex(ValueError, "needs a pipeline"):
                apply_pipeline_parallel(build_model(cfg, seed=0), pgm, virtual_stages=2)
            moe = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                              num_experts=4)
            # ours runs MoE stages (chapter 07); torch's pipelining would drop the aux losses
            pipe = apply_pipeline_parallel(build_model(moe, seed=0), pgm)
            with self.assertRaisesRegex(ValueError, "MoE"):
                TorchPipelineSchedule(pipe, pgm, "afab", 1)
        finally:
            destroy_pg_manager()


# ---- one world of 4 ranks ------------------------------------------------------------------


def make_config(layers: int, micro_batches: int, global_batch: int, steps: int = 5,
                tied: bool = False, warmup: int = 2) -> Config:
    cfg = Config()
    cfg.model = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=layers,
                            num_attention_heads=4, num_key_value_heads=2, max_seq_len=32,
                            tie_word_embeddings=tied)
    cfg.data.seq_len, cfg.data.global_batch_size = 16, global_batch
    cfg.data.num_micro_batches = micro_batches
    cfg.training.steps, cfg.training.warmup_steps, cfg.training.lr = steps, warmup, 1e-2
    cfg.training.grad_clip = 0.05  # small: clipping is active, so the pp grad norm matters
    cfg.logging.progress = False
    return cfg


# The parity runs' steps: one warm-up step, then one past it on the AdamW state the first left,
# with clipping active. In fp32 a schedule's difference from the single device is the order of
# its sums; a micro-batch missed, sent to the wrong stage or reduced twice shows from step 0 on,
# so more steps add nothing (3 steps with 2 warm-up ones cost each of the 17 runs a third more).
PARITY_STEPS = 2
PARITY_WARMUP = 1
# name: (pp, tp, schedule, v, m, global batch, impl, extra); impl "loop": chapter 04's loops
PARITY_RUNS = {
    "loop_pp4_afab": (4, 1, "afab", 1, 9, 18, "loop", {}),
    "loop_pp4_1f1b": (4, 1, "1f1b", 1, 4, 16, "loop", {}),
    "loop_pp2_dp2_afab_uneven": (2, 1, "afab", 1, 2, 16, "loop", {
        "layer_split": [1, 3]
    }),
    "loop_pp2_dp2_1f1b": (2, 1, "1f1b", 1, 5, 20, "loop", {}),
    "pp4_afab": (4, 1, "afab", 1, 9, 18, "ours", {}),
    "pp4_1f1b": (4, 1, "1f1b", 1, 4, 16, "ours", {}),
    "pp4_interleaved": (4, 1, "interleaved", 2, 8, 16, "ours", {}),
    "pp2_dp2_afab_uneven": (2, 1, "afab", 1, 2, 16, "ours", {
        "layer_split": [1, 3]
    }),
    "pp2_dp2_1f1b": (2, 1, "1f1b", 1, 5, 20, "ours", {}),
    "pp2_dp2_interleaved": (2, 1, "interleaved", 2, 4, 16, "ours", {}),
    "pp2_tp2_1f1b": (2, 2, "1f1b", 1, 4, 16, "ours", {}),
    "pp2_tp2_sp_interleaved": (2, 2, "interleaved", 2, 2, 16, "ours", {
        "sequence_parallel": True
    }),
    # tied embeddings: a copy on the first and on the last stage, summed over the embedding group
    # by a hook of the step that runs after any schedule's last backward (afab at pp 2 x dp 2
    # is the same runtime and hook in another order: pp2_dp2_afab_uneven steps its order)
    "tied_pp2_dp2_1f1b": (2, 1, "1f1b", 1, 2, 8, "ours", {
        "tied": True
    }),
    "tied_pp4_interleaved": (4, 1, "interleaved", 2, 4, 8, "ours", {
        "tied": True
    }),
    "torch_pp4_afab": (4, 1, "afab", 1, 4, 16, "torch", {}),
    "torch_pp2_dp2_1f1b": (2, 1, "1f1b", 1, 4, 16, "torch", {}),
    "torch_pp4_interleaved": (4, 1, "interleaved", 2, 4, 16, "torch", {}),
}


def build_pipeline(cfg: Config, pp: int, tp: int, schedule: str, v: int, impl: str,
                   layer_split=None, sequence_parallel: bool = False, delay=None):
    """Model -> [tensor parallel] -> pipeline stages -> [data parallel]; returns the lot."""
    pgm = init_pg_manager(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model = build_model(cfg.model, seed=cfg.training.model_seed)
    if delay is not None:
        for i, layer in enumerate(model.layers):
            model.layers[i] = Delayed(layer, *delay)
    kwargs = {}
    if tp > 1:
        from scaletorch.parallel.tensor_parallel import (apply_tensor_parallel,
                                                         tensor_parallel_loss_fn)
        apply_tensor_parallel(model, pgm, sequence_parallel)
        if cfg.model.tie_word_embeddings:  # as parallelize does: one vocabulary shard
            model.lm_head.weight = model.embed_tokens.weight
        kwargs["loss_fn"] = tensor_parallel_loss_fn(pgm)
    v_shape = schedule in V_SHAPED  # zbv, dualpipev: stages r and 2p - 1 - r
    if cfg.model.tie_word_embeddings and not v_shape:
        untie_across_stages(model)  # a copy on the last stage (tied_embeddings.py)
    pipe = apply_pipeline_parallel(model, pgm, v, layer_split, sequence_parallel, v_shape)
    if pgm.data_parallel_world_size > 1:  # chapter 01's wrapper around each chunk
        wrapper = "ours" if impl == "loop" else impl
        pipe.chunks = torch.nn.ModuleList(apply_data_parallel(c, pgm, wrapper) for c in pipe.chunks)
    cls = TorchPipelineSchedule if impl == "torch" else PipelineLoop if impl == "loop" else \
        PipelineSchedule
    step = cls(pipe, pgm, schedule, cfg.data.num_micro_batches, **kwargs)
    if cfg.model.tie_word_embeddings and impl != "torch":
        attach_tied_embedding_sync(step, pgm)
    return pgm, pipe, step


def tied_copies_spread(pipe, pgm) -> float:
    """max - min over the embedding group of the tied embedding's copies (0: equal), on the
    ranks that hold one; 0.0 elsewhere."""
    copies = tied_embedding_params(pipe)
    if not copies:
        return 0.0
    high, low = copies[0].detach().clone(), copies[0].detach().clone()
    torch.distributed.all_reduce(high, torch.distributed.ReduceOp.MAX, pgm.embedding_group)
    torch.distributed.all_reduce(low, torch.distributed.ReduceOp.MIN, pgm.embedding_group)
    return (high - low).abs().max().item()


def parity_run(name: str) -> dict:
    pp, tp, schedule, v, m, batch, impl, extra = PARITY_RUNS[name]
    extra = dict(extra)
    cfg = make_config(4 * v, m, batch, PARITY_STEPS, extra.pop("tied", False), PARITY_WARMUP)
    pgm, pipe, step = build_pipeline(cfg, pp, tp, schedule, v, impl, **extra)
    get_ledger().clear()
    result = Trainer(cfg, pipe, pgm, forward_backward=step, clip_grad_norm=clip_fn(pipe, pgm),
                     verbose=False).train()
    out = {
        "losses": result.losses,
        "grad_norms": result.grad_norms,
        "full": full_state(pipe, pgm),  # on rank 0
        "slowest_step": max(result.step_seconds),  # a deadlock run's figure (DEADLOCK_GRID)
    }
    if cfg.model.tie_word_embeddings:
        out["tied_spread"] = tied_copies_spread(pipe, pgm)
        out["embd_calls"] = len(get_ledger().select(op="all_reduce", group="embd",
                                                    step=cfg.training.steps - 1))
    if impl != "torch":
        out["order"] = step.timeline.order(pgm.pipeline_model_parallel_rank)
        out["pp_rank"] = pgm.pipeline_model_parallel_rank
        last = cfg.training.steps - 1
        out["sent"] = get_ledger().total(op="send", group="pp", step=last)
        out["send_calls"] = len(get_ledger().select(op="send", group="pp", step=last))
        out["dp_calls"] = len(get_ledger().select(op="all_reduce", group="dp", step=last))
        out["timeline"] = gather_timeline(step.timeline, pgm)
    destroy_pg_manager()
    return out


# Every classic schedule at p in {2, 4}, m in {p, 2p + 1} (interleaved: {p, 2p}, it needs m
# divisible by p), ours and chapter 04's loops: (pp, schedule, m, impl) on the 4 ranks, tp 1.
DEADLOCK_GRID = [(pp, schedule, m, impl) for pp in (2, 4) for schedule in CLASSIC
                 for m in ((pp, 2 * pp) if schedule == "interleaved" else (pp, 2 * pp + 1))
                 for impl in (("ours", "loop") if schedule in SCHEDULES else ("ours", ))]


def parity_run_of(key: tuple) -> Optional[str]:
    """The parity run that already steps ``key`` = (pp, schedule, m, impl) at tp 1 (a tied
    one adds the embedding group's all-reduce, not a message of the schedule), or None: a
    deadlock run is made only for the keys no parity run covers."""
    pp, schedule, m, impl = key
    return next((name for name, (p, tp, s, _v, mb, _b, i, _e) in PARITY_RUNS.items()
                 if (p, tp, s, mb, i) == (pp, 1, schedule, m, impl)), None)


def deadlock_run(pp: int, schedule: str, m: int, impl: str = "ours") -> float:
    """One step of ``schedule``; returns its wall time (a deadlock would hit the timeout)."""
    v = 2 if schedule == "interleaved" else 1
    cfg = make_config(4 * v, m, 2 * m * (4 // pp))
    pgm, pipe, step = build_pipeline(cfg, pp, 1, schedule, v, impl)
    inputs = torch.randint(0, cfg.model.vocab_size, (cfg.data.global_batch_size, 16))
    start = time.perf_counter()
    step(inputs, inputs)
    elapsed = time.perf_counter() - start
    destroy_pg_manager()
    return elapsed


def bubble_run(schedule: str, v: int, m: int, delay=(0.08, 0.16)):
    """pp 4 with one delayed layer per chunk: a warm-up step without the delays, then one
    timed step; returns its timeline."""
    cfg = make_config(4 * v, m, 2 * m)
    pgm, pipe, step = build_pipeline(cfg, 4, 1, schedule, v, "ours", delay=(0.0, 0.0))
    inputs = torch.randint(0, cfg.model.vocab_size, (cfg.data.global_batch_size, 16))
    step(inputs, inputs)
    for module in pipe.modules():
        if isinstance(module, Delayed):
            module.forward_s, module.backward_s = delay
    step(inputs, inputs)
    timeline = gather_timeline(step.timeline, pgm)
    destroy_pg_manager()
    return timeline


def tied_embeddings_errors(cfg: Config) -> list:
    """What a tied model cannot run under pp 2 x dp 2: a V-shaped schedule's chunks wrapped for
    data parallel one by one (they share the tied weight), torch.distributed.pipelining (its
    stages share no parameter across ranks)."""
    pgm = init_pg_manager(pipeline_model_parallel_size=2)
    cfg.model.tie_word_embeddings = True

    def untied(model):
        untie_across_stages(model)
        return model

    errors = [
        value_error(lambda: check_v_shape_wrappers(
            apply_pipeline_parallel(build_model(cfg.model, 0), pgm, 2, v_shape=True), pgm)),
        value_error(lambda: TorchPipelineSchedule(
            apply_pipeline_parallel(untied(build_model(cfg.model, 0)), pgm), pgm, "1f1b", 2)),
    ]
    destroy_pg_manager()
    return errors


def reference_key(name: str) -> tuple:
    """(layers, micro-batches, global batch, steps, tied, warm-up): what the single-device
    reference depends on (``make_config``'s arguments)."""
    pp, tp, schedule, v, m, batch, impl, extra = PARITY_RUNS[name]
    return (4 * v, m, batch, PARITY_STEPS, extra.get("tied", False), PARITY_WARMUP)


def world(rank: int, world_size: int) -> dict:
    out = {"parity": {}, "deadlock": {}, "bubble": {}}
    p2p_order.set_in_order(True)  # parity and deadlock runs in NCCL's order (test_nccl_order)
    with stderr_warnings() as warnings:  # torch DDP around chunks: no find_unused_parameters
        for name in PARITY_RUNS:
            out["parity"][name] = parity_run(name)
    out["warnings"] = warnings
    for key in DEADLOCK_GRID:
        if parity_run_of(key) is None:
            out["deadlock"][key] = deadlock_run(*key)
    p2p_order.set_in_order(False)  # the bubble as gloo runs it
    for schedule, v in (("afab", 1), ("1f1b", 1), ("interleaved", 2)):
        out["bubble"][schedule] = bubble_run(schedule, v, 4)
    out["tied"] = tied_embeddings_errors(make_config(4, 2, 8))
    return out


class TestPipelineParallelRanks(unittest.TestCase):
    """pp 4, pp 2 x dp 2, pp 2 x tp 2 and torch.distributed.pipelining in one world of 4."""

    @classmethod
    def setUpClass(cls):
        cls.results = run_distributed(world, 4, timeout=300)
        # the plain loop's losses, grad norms and weights, in this process (tests/layouts.py)
        keys = sorted({reference_key(name) for name in PARITY_RUNS})
        cls.references = {key: reference(make_config(*key)) for key in keys}

    def check_parity(self, names):
        for name in names:
            with self.subTest(run=name):
                assert_run_matches(self, self.results, name, self.references[reference_key(name)],
                                   weights="full")

    def test_chapter_04_loops_match_single_device_at_pp_4_and_pp_2_x_dp_2(self):
        self.check_parity(
            ["loop_pp4_afab", "loop_pp4_1f1b", "loop_pp2_dp2_afab_uneven", "loop_pp2_dp2_1f1b"])

    @bit_exact
    def test_chapter_04_loops_and_the_04b_runtime_are_bit_identical_on_the_same_layout(self):
        # same layout, same micro-batches, same order of forwards and backwards: the same
        # floating-point operations, so no tolerance at all (losses, grad norms, weights)
        pairs = [("loop_pp4_afab", "pp4_afab"), ("loop_pp4_1f1b", "pp4_1f1b"),
                 ("loop_pp2_dp2_afab_uneven", "pp2_dp2_afab_uneven"),
                 ("loop_pp2_dp2_1f1b", "pp2_dp2_1f1b")]
        for loop, runtime in pairs:
            self.assertEqual(PARITY_RUNS[loop][:6] + PARITY_RUNS[loop][7:],
                             PARITY_RUNS[runtime][:6] + PARITY_RUNS[runtime][7:])
            for rank, res in enumerate(self.results):
                a, b = res["parity"][loop], res["parity"][runtime]
                with self.subTest(run=loop, rank=rank):
                    self.assertEqual(a["losses"], b["losses"])
                    self.assertEqual(a["grad_norms"], b["grad_norms"])
                    self.assertEqual(a["sent"], b["sent"])
                    if rank == 0:
                        self.assertEqual(sorted(a["full"]), sorted(b["full"]))
                        for key, value in a["full"].items():
                            self.assertTrue(torch.equal(value, b["full"][key]), key)
                    else:
                        self.assertIsNone(a["full"])

    def test_pipeline_4_matches_single_device_for_each_schedule(self):
        self.check_parity(["pp4_afab", "pp4_1f1b", "pp4_interleaved"])

    def test_pipeline_2_x_data_2_matches_single_device_for_each_schedule(self):
        # afab also uses an uneven split: 1 layer on stage 0, 3 on stage 1
        self.check_parity(["pp2_dp2_afab_uneven", "pp2_dp2_1f1b", "pp2_dp2_interleaved"])

    def test_pipeline_2_x_tensor_2_matches_single_device(self):
        self.check_parity(["pp2_tp2_1f1b", "pp2_tp2_sp_interleaved"])

    def test_torch_pipelining_matches_single_device(self):
        self.check_parity(["torch_pp4_afab", "torch_pp2_dp2_1f1b", "torch_pp4_interleaved"])

    def test_the_parity_runs_print_no_warning_on_any_rank(self):
        # torch DDP around each chunk (torch_pp2_dp2_1f1b) once warned on every rank that
        # find_unused_parameters=True found no unused parameter; every parameter of a chunk
        # is used, so the flag is off (data_parallel.apply_data_parallel)
        self.assertIn("torch_pp2_dp2_1f1b", PARITY_RUNS)
        for rank, res in enumerate(self.results):
            self.assertEqual(res["warnings"], [], f"rank {rank}")

    def test_recorded_order_per_stage_equals_the_schedule_definition(self):
        checked = []
        for name, (pp, tp, schedule, v, m, _batch, impl, _extra) in PARITY_RUNS.items():
            if impl == "torch":  # torch.distributed.pipelining keeps no timeline of ours
                continue
            for res in self.results:
                run = res["parity"][name]
                expected = [str(a) for a in schedule_actions(schedule, pp, m, run["pp_rank"], v)]
                self.assertEqual(run["order"], expected, name)
            checked.append(name)
        self.assertEqual(len(checked), len(PARITY_RUNS) - 3)  # all but the 3 torch runs
        self.assertIn("loop_pp4_1f1b", checked)

    def test_1f1b_holds_at_most_p_minus_rank_activations_and_afab_holds_m(self):
        for prefix in ("", "loop_"):  # 04b's runtime, 04's loops
            one_f_one_b = self.results[0]["parity"][prefix + "pp4_1f1b"]["timeline"]
            self.assertEqual([one_f_one_b.peak_live(r) for r in range(4)], [4, 3, 2, 1])
            afab = self.results[0]["parity"][prefix + "pp4_afab"]["timeline"]
            self.assertEqual([afab.peak_live(r) for r in range(4)], [9] * 4)

    def test_ledger_counts_one_activation_and_one_gradient_per_micro_batch_and_stage(self):
        # pp 4, 1F1B, m = 4, micro-batch (4, 16) x hidden 32 per message
        for res in self.results:
            run = res["parity"]["loop_pp4_1f1b"]
            r = run["pp_rank"]
            calls = 4 * ((r < 3) + (r > 0))  # activations forward, gradients backward
            self.assertEqual(run["send_calls"], calls)
            self.assertEqual(run["sent"], calls * 4 * 16 * 32)

    def test_data_parallel_syncs_each_chunk_once_per_step_not_per_micro_batch(self):
        # one gradient bucket per chunk (25 MB buckets) + the reported loss; syncing every
        # micro-batch would be m v + 1 all-reduces
        for name, v in (("loop_pp2_dp2_1f1b", 1), ("pp2_dp2_1f1b", 1), ("pp2_dp2_interleaved", 2)):
            for res in self.results:
                self.assertEqual(res["parity"][name]["dp_calls"], v + 1, name)

    def test_every_schedule_finishes_under_a_timeout(self):
        # DEADLOCK_GRID: p in {2, 4}; m in {p, 2p + 1} (interleaved: {p, 2p}). A key a parity
        # run steps is timed there (its slowest step, on every rank), the others by a deadlock
        # run of one step (rank 0). A deadlock would also fail the world after its 300 s timeout.
        self.assertEqual(len(DEADLOCK_GRID), 12 + 8)  # + chapter 04's loops
        deadlock = self.results[0]["deadlock"]
        for key in DEADLOCK_GRID:
            name = parity_run_of(key)
            if name is None:
                self.assertLess(deadlock[key], 30.0, key)
            else:
                for res in self.results:
                    self.assertLess(res["parity"][name]["slowest_step"], 30.0, (key, name))
        self.assertEqual(len(deadlock), 8)  # 12 of the 20 are parity runs' layouts

    def test_measured_bubble_with_equal_delays_is_near_theory(self):
        # Each layer sleeps 80 ms forward, 160 ms backward; compute, messages and Python add a
        # few ms per action (more on a loaded CPU), which only adds idle time: the measured
        # bubble is within [-0.02, +0.06] of (p-1)/(v m + p - 1). Measured idle on 2 cores:
        # +0.003 to +0.015; with 40/80 ms the interleaved schedule's 16 actions per rank made
        # that +0.02 to +0.08, once past the bound in CI.
        for schedule, timeline in self.results[0]["bubble"].items():
            with self.subTest(schedule=schedule):
                measured, theory = timeline.bubble_fraction(), timeline.theory()
                self.assertGreater(measured, theory - 0.02, timeline.chart(width=80))
                self.assertLess(measured, theory + 0.06, timeline.chart(width=80))

    def test_tied_embeddings_match_single_device_with_synced_copies_on_first_and_last_stage(self):
        names = ["tied_pp2_dp2_1f1b", "tied_pp4_interleaved"]
        self.check_parity(names)
        for name in names:
            for res in self.results:
                run = res["parity"][name]
                # bit for bit the same copy: both stages apply the same AdamW update to the same
                # all-reduced gradient
                self.assertEqual(run["tied_spread"], 0.0, name)
                # one all-reduce of the gradient per step, on the first and the last stage only
                ends = run["pp_rank"] in (0, PARITY_RUNS[name][0] - 1)
                self.assertEqual(run["embd_calls"], 1 if ends else 0, name)

    def test_tied_embeddings_with_a_data_parallel_v_shape_or_torch_pipelining_raise(self):
        v_shape, torch_pipelining = self.results[0]["tied"]
        self.assertIn(
            "tie_word_embeddings with a V-shaped schedule (zbv, dualpipev) and data "
            "parallel over dp (2)", v_shape)
        self.assertIn("stages do not share parameters across ranks", torch_pipelining)
        self.assertIn("use impl ours", torch_pipelining)


if __name__ == "__main__":
    unittest.main()
