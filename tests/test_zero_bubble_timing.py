"""Zero-bubble pipeline schedules measured: one world of 4 ranks (p = 4, m = 8) runs 1F1B,
ZB-H1, ZBV and DualPipeV with injected delays (F = B = W); each one's bubble against the
simulator fed that step's own costs, ZB-H1's and ZBV's against 1F1B's, and the activations each
stage holds at its peak. Timed: run_tests.py runs this module with no other beside it (ALONE).
The schedules' parity with one device: tests/test_zero_bubble.py.
"""

import statistics
import unittest

import torch

from scaletorch.dist import destroy_pg_manager, p2p_order
from scaletorch.parallel.activation_meter import ActivationMeter
from scaletorch.parallel.pipeline_parallel import gather_timeline
from scaletorch.schedule.placement import V_SHAPED, rank_of_stage
from scaletorch.schedule.simulate import simulate_async
from scripts.benchmarks.timing import Delayed
from tests.harness import run_distributed
from tests.test_pipeline_parallel import build_pipeline
from tests.test_pipeline_parallel import make_config as pipeline_config

# Shorter sleeps do not pay: the compute, the messages and a loaded host's wake-ups stay, so the
# V schedules' small bubbles leave the bounds and more steps run. Measured at load average 15
# to 22 (best step's measured / predicted; ZBV / 1F1B): 0.12 s passes (ZBV 1.106, DualPipeV
# 1.062; 0.264) in 62 s; 0.09 s fails (DualPipeV 1.172 after 6 steps) in 78 s; 0.06 s fails
# (ZBV 1.258 after 6 steps; 0.658) in 93 s.
DELAY = 0.12  # seconds per F, B and W of a stage: ~30x the compute and messages of an action
# schedule: chunks per rank
BUBBLE_RUNS = {"1f1b": 1, "zb-h1": 1, "zbv": 2, "dualpipev": 2}
# measured bubble / the simulator's prediction from the step's own costs, of the best step
BUBBLE_RATIO = (0.85, 1.15)
# A step that another process disturbed has a larger bubble than the schedule's: a rank kept off
# the cores while its message arrives (1.26x its own costs' prediction once, at load average
# ~8), or actions stretched unevenly (the bubble follows, so the ratio holds, but the bubble
# compared across schedules is not the schedule's). Timed steps run until one is undisturbed:
# within BUBBLE_RATIO, and its bubble at most UNDISTURBED x the simulator's at F = B = W (idle:
# ZBV 0.062-0.067 of 0.059 for the compute and messages on top of the sleeps), up to
# BUBBLE_MAX_STEPS. On an idle machine the first step is. A runtime that waits where the
# schedule does not (a blocking send) adds its idle time to every step: none is within, and the
# test fails.
UNDISTURBED = 1.25
BUBBLE_MAX_STEPS = 6
# What the bubble test proves of ZBV: its bubble is about a quarter of 1F1B's, the measured
# ratio within ZBV_QUARTER (see the test for the measured range)
ZBV_QUARTER = (0.15, 0.32)


def bubble_run(schedule: str, v: int) -> dict:
    """p = 4, m = 8, 8 layers: every stage's F, B and W sleep DELAY in all (each layer of a
    chunk its share). One step without delays (warm-up), then timed steps until one is
    undisturbed (at most BUBBLE_MAX_STEPS)."""
    cfg = pipeline_config(8, 8, 16)
    pgm, pipe, step = build_pipeline(cfg, 4, 1, schedule, v, "ours", delay=(0.0, 0.0))
    # attached from outside (chapter 09's meter); its hooks hide saved tensors from outer ones
    meter = ActivationMeter(list(pipe.parameters()), enabled=True)
    step.hooks.append(meter)
    inputs = torch.randint(0, cfg.model.vocab_size, (cfg.data.global_batch_size, 16))
    step(inputs, inputs)
    share = DELAY / 2  # 2 layers per stage (v = 1), or 1 per chunk of half a stage (v = 2)
    for module in pipe.modules():
        if isinstance(module, Delayed):
            module.forward_s = module.backward_s = module.weight_s = share
    timelines: list = []
    while len(timelines) < BUBBLE_MAX_STEPS:
        step(inputs, inputs)
        timelines.append(gather_timeline(step.timeline, pgm))  # rank 0's; None elsewhere
        # rank 0 decides for all: was this step undisturbed?
        found = torch.tensor(
            [int(torch.distributed.get_rank() == 0 and undisturbed(timelines[-1]))])
        torch.distributed.broadcast(found, 0)
        if found.item():
            break
    out = {
        "timelines": timelines,
        "peak_count": meter.peak_count,
        "peak_bytes": meter.peak_bytes,
        "rank": pgm.pipeline_model_parallel_rank,
    }
    destroy_pg_manager()
    return out


def message_cost(timeline) -> float:
    """The median time from the end of an action on one rank to the start of the action on
    another rank that waited for its output (the message, and the receiver waking up)."""
    p, v = timeline.pp, timeline.virtual_stages
    last, v_shape = p * v - 1, timeline.schedule in V_SHAPED
    ended = {(e.action.kind, e.action.micro_batch, e.stage): e.end for e in timeline.events}
    waits = []
    for rank in range(p):
        events = timeline.of(rank)
        for i, e in enumerate(events):
            kind, source = ("F", e.stage - 1) if e.action.kind == "F" else \
                ("B", e.stage + 1) if e.stage < last else ("F", e.stage)
            if e.action.kind == "W" or not 0 <= source <= last or \
                    rank_of_stage(source, p, v_shape) == rank:
                continue
            sent = ended[(kind, e.action.micro_batch, source)]
            if i == 0 or sent > events[i - 1].end:  # the rank was idle, waiting for it
                waits.append(e.start - sent)
    return statistics.median(waits)


def predicted(timeline) -> float:
    """The simulator's bubble from this step's per-action costs: each action's measured time
    (the sleep plus its compute, and whatever another process stole from it) and the measured
    message cost. Idle time beyond it would be the runtime's own waiting (a blocking send,
    say), not the schedule's."""
    durations = {(e.rank, str(e.action)): e.end - e.start for e in timeline.events}
    schedule = timeline.schedule or "1f1b"
    return simulate_async(schedule, timeline.pp, timeline.micro_batches, timeline.virtual_stages,
                          comm=message_cost(timeline), durations=durations).bubble_fraction()


def bubble_ratio(timeline) -> float:
    """The measured bubble over the simulator's prediction from the step's own costs."""
    return timeline.bubble_fraction() / predicted(timeline)


def undisturbed(timeline) -> bool:
    """Is the step within BUBBLE_RATIO of its own costs' prediction, and its bubble at most
    UNDISTURBED x the simulator's at F = B = W?"""
    low, high = BUBBLE_RATIO
    nominal = simulate_async(timeline.schedule or "1f1b", timeline.pp, timeline.micro_batches,
                             timeline.virtual_stages).bubble_fraction()
    return low <= bubble_ratio(timeline) <= high and \
        timeline.bubble_fraction() <= UNDISTURBED * nominal


def world(rank: int, world_size: int) -> dict:
    p2p_order.set_in_order(False)  # the bubble as gloo runs it, whatever the environment says
    return {"bubble": {s: bubble_run(s, v) for s, v in BUBBLE_RUNS.items()}}


class ZeroBubbleMeasured(unittest.TestCase):
    """The four schedules' bubbles and peak activations, measured at p = 4, m = 8."""

    @classmethod
    def setUpClass(cls):
        cls.results = run_distributed(world, 4, timeout=240)

    def timelines(self, schedule: str) -> list:
        return self.results[0]["bubble"][schedule]["timelines"]

    def test_measured_bubble_at_p4_m8_within_15_percent_of_the_simulator(self):
        # Each step's measured idle share against the simulator fed that step's per-action costs
        # and message cost: the runtime should wait only where the schedule's dependencies make
        # it wait. A process that other processes keep off the cores while a message arrives
        # adds idle time no cost shows, so the best of the timed steps (one on an idle machine,
        # up to BUBBLE_MAX_STEPS while none is undisturbed) must be within 15%.
        # Measured / predicted of the best step, 6 runs at load average 4 to 90: 1F1B
        # 1.006-1.147, ZB-H1 0.995-1.025, ZBV 1.007-1.046, DualPipeV 1.016-1.024 (single
        # steps up to 1.2-1.6 under load); messages 0.3-1.6 ms.
        for schedule, v in BUBBLE_RUNS.items():
            nominal = simulate_async(schedule, 4, 8, v).bubble_fraction()
            ratio, best = min(((bubble_ratio(t), t) for t in self.timelines(schedule)),
                              key=lambda x: x[0])
            msg = (f"{schedule}: measured {best.bubble_fraction():.4f} = {ratio:.3f} x predicted "
                   f"(F = B = W: {nominal:.4f}), message {message_cost(best) * 1e3:.1f} ms\n"
                   f"{best.chart(width=90)}")
            self.assertGreaterEqual(ratio, BUBBLE_RATIO[0], msg)
            self.assertLessEqual(ratio, BUBBLE_RATIO[1], msg)

    def test_measured_bubble_at_p4_m8_zb_h1_at_most_half_and_zbv_about_a_quarter_of_1f1b(self):
        # F = B = W = 120 ms per stage, simulated: 9/33 = 0.273 (1F1B), 3/27 = 0.111 (ZB-H1),
        # 1.5/25.5 = 0.059 (ZBV, 0.22 of 1F1B's). Each schedule's least disturbed step (the
        # smallest bubble: other processes only add idle time). ZB-H1's is at most half of
        # 1F1B's (measured ZB-H1 minus half of 1F1B -0.042 to -0.004, 6 runs at load average 4
        # to 90). ZBV's is not reliably below a quarter: the compute and messages on top of the
        # sleeps (a few ms an action, more on ZBV's rank 0, which holds the embedding and the
        # head) raise it to 0.062-0.067 in the simulator fed the measured costs, 1F1B's quarter
        # only to 0.069; measured ZBV minus a quarter of 1F1B was -0.016 to +0.003 in 6 runs
        # (ZBV / 1F1B about 0.19 to 0.26), +0.0009 at load average 12 (0.075 / 0.278 = 0.271).
        # The claim proved is "about a quarter": the ratio within ZBV_QUARTER, and ZBV's bubble
        # below ZB-H1's.
        measured = {s: min(t.bubble_fraction() for t in self.timelines(s)) for s in BUBBLE_RUNS}
        self.assertLessEqual(measured["zb-h1"], measured["1f1b"] / 2, measured)
        low, high = ZBV_QUARTER
        ratio = measured["zbv"] / measured["1f1b"]
        self.assertGreaterEqual(ratio, low, measured)
        self.assertLessEqual(ratio, high, measured)
        self.assertLess(measured["zbv"], measured["zb-h1"], measured)

    def test_measured_peak_activations_as_simulated_zb_h1_as_1f1b(self):
        # ActivationMeter: bytes autograd saved, alive from F to the last backward (W or B)
        runs = {
            s: sorted((r["bubble"][s] for r in self.results), key=lambda x: x["rank"])
            for s in BUBBLE_RUNS
        }
        count = {s: [x["peak_count"] for x in runs[s]] for s in runs}
        self.assertEqual(count["1f1b"], [4, 3, 2, 1])
        self.assertEqual(count["zb-h1"], [4, 4, 4, 4])  # 1F1B's peak, now on every stage
        self.assertEqual(count["dualpipev"], [9, 9, 9, 9])  # ZBV's 8 half-stage chunks + 1
        for schedule, v in BUBBLE_RUNS.items():
            simulated = simulate_async(schedule, 4, 8, v)
            self.assertEqual(count[schedule], [simulated.peak_live(r) for r in range(4)])
        # bytes: ZB-H1's stage 0 holds exactly 1F1B's stage 0; a middle stage p micro-batches
        # (1F1B's rank 1 holds 3); ZBV's 8 half-stage chunks about as much (within 1%: each
        # chunk also keeps its own input); DualPipeV's 9 on ranks 1-3 (equal chunks: no
        # embedding, no head) exactly 9/8 of ZBV's, on rank 0 within 1% of that
        peak = {s: [x["peak_bytes"] for x in runs[s]] for s in runs}
        self.assertEqual(peak["zb-h1"][0], peak["1f1b"][0])
        self.assertEqual(peak["zb-h1"][1:3], [peak["1f1b"][1] // 3 * 4] * 2)
        for rank in (1, 2):
            self.assertAlmostEqual(peak["zbv"][rank], peak["zb-h1"][rank],
                                   delta=0.01 * peak["zb-h1"][rank])
        self.assertEqual(peak["dualpipev"][1:], [peak["zbv"][r] // 8 * 9 for r in (1, 2, 3)])
        self.assertAlmostEqual(peak["dualpipev"][0], peak["zbv"][0] * 9 / 8,
                               delta=0.01 * peak["zbv"][0])


if __name__ == "__main__":
    unittest.main()
