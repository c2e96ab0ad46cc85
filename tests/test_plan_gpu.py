"""The planner's GPU model against published runs, its rough edges, and its bad input.

Pure Python, no process group: a few seconds. The published figures are carried here with
their sources, and checked against scripts/plan_validate.py's copy of them:

- torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (Llama 3.1 on H100s capped at 500 W;
  tokens/s per GPU and peak reserved memory, GiB): 8B with FSDP on 8 GPUs, local batch 2,
  per-op selective recomputation: 5,762 / 82.4 (eager), 6,667 / 77.0 (torch.compile), 8,532 /
  76.8 (compile + float8); the same on 128 GPUs: 5,605 / 67.0, 6,514 / 62.0, 8,380 / 61.8;
  8B with FSDP + CP on 8 GPUs, compile + float8, local batch 1, full recomputation, at
  32768 / 65536 / 131072 / 262144 tokens (CP 1 / 2 / 4 / 8): 3,890 / 83.9, 2,540 / 84.2,
  1,071 / 84.0, 548 / 84.5; 70B with FSDP 32 x TP 8 on 256 GPUs, compile + float8, local batch
  16, full recomputation: 829 / 71.9 (AsyncTP: 876 / 67.6); 405B with FSDP 8 x TP 8 x PP 8
  on 512 GPUs, local batch 32, full recomputation, AsyncTP: 1F1B 100 / 82.5, interleaved
  128 / 72.7; 405B with TP 8 x PP 8 and FSDP x CP = 8 on 512 GPUs, local batch 8, full
  recomputation, AsyncTP, 1F1B, at 32768 / 65536 / 131072 / 262144 tokens (CP 1 / 2 / 4 / 8):
  76 / 75.3, 47 / 75.9, 31 / 77.1, 16 / 84.9.
- torchao, torchao/float8/README.md, Training benchmarks (torchtitan on 8 H100s, local batch
  1, sequence 8192, torch.compile, FSDP2, per-op selective recomputation; median tokens/s,
  peak GB as torchtitan logs it): bf16 6,150 / 47.65; float8 tensorwise with float8
  all-gather 7,689.5 / 47.77.
- The Llama 3 Herd of Models (2024), Table 4: 405B on H100 (700 W), 16M tokens a step, TFLOP/s
  per GPU: 8,192 GPUs TP 8 CP 1 PP 16 DP 64 at 8192 tokens 430; 16,384 GPUs DP 128 400; 16,384
  GPUs TP 8 CP 16 PP 16 DP 8 at 131072 tokens 380.
"""

import contextlib
import io
import json
import os
import tempfile
import unittest

from scaletorch.plan.cluster import load_cluster
from scaletorch.plan.kernels import gemm_efficiency
from scaletorch.plan.layout import PlanLayout
from scaletorch.plan.memory import model_state_bytes
from scaletorch.plan.model import preset
from scripts import plan, plan_validate

# name: (tokens/s per GPU or TFLOP/s per GPU, peak GiB or None): the sources above
PUBLISHED = {
    "8B FSDP 8 GPUs": (5762, 82.4),
    "8B FSDP 8 GPUs compile": (6667, 77.0),
    "8B FSDP 8 GPUs compile fp8": (8532, 76.8),
    "8B FSDP 128 GPUs": (5605, 67.0),
    "8B FSDP 128 GPUs compile": (6514, 62.0),
    "8B FSDP 128 GPUs compile fp8": (8380, 61.8),
    "8B FSDP 8 GPUs b1 compile": (6150, 47.65),
    "8B FSDP 8 GPUs b1 compile fp8+AG": (7689.5, 47.77),
    "8B FSDP8 CP1 s32k": (3890, 83.9),
    "8B FSDP4 CP2 s64k": (2540, 84.2),
    "8B FSDP2 CP4 s128k": (1071, 84.0),
    "8B FSDP1 CP8 s256k": (548, 84.5),
    "70B FSDP32 TP8": (829, 71.9),
    "70B FSDP32 TP8 AsyncTP": (876, 67.6),
    "405B FSDP8 TP8 PP8 1F1B": (100, 82.5),
    "405B FSDP8 TP8 PP8 interleaved": (128, 72.7),
    "405B FSDP8 CP1 TP8 PP8 s32k": (76, 75.3),
    "405B FSDP4 CP2 TP8 PP8 s64k": (47, 75.9),
    "405B FSDP2 CP4 TP8 PP8 s128k": (31, 77.1),
    "405B FSDP1 CP8 TP8 PP8 s256k": (16, 84.9),
    "405B 8,192 GPUs s8k": (430, None),
    "405B 16,384 GPUs s8k": (400, None),
    "405B 16,384 GPUs s128k": (380, None),
}
# the modelled rows the planner misses today (doc/09_appendix_validation.md says why): each
# must stay a miss until fixed, and then leave this set, so that the test shows the change
KNOWN_MISSES: set = set()
# rows whose run used what the planner does not model (their verdicts are not counted)
NOT_MODELLED = {
    "8B FSDP2 CP4 s128k", "8B FSDP1 CP8 s256k", "70B FSDP32 TP8 AsyncTP", "405B FSDP8 TP8 PP8 1F1B",
    "405B FSDP8 TP8 PP8 interleaved", "405B FSDP8 CP1 TP8 PP8 s32k", "405B FSDP4 CP2 TP8 PP8 s64k",
    "405B FSDP2 CP4 TP8 PP8 s128k", "405B FSDP1 CP8 TP8 PP8 s256k"
}


def run_plan(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = plan.main(list(argv))
    if status:
        raise AssertionError(f"plan.py {' '.join(argv)} exited {status}")
    return out.getvalue()


class PublishedRuns(unittest.TestCase):

    @classmethod
    def setUpClass(cls) -> None:
        cls.results = {r["name"]: r for r in map(plan_validate.predict, plan_validate.ROWS)}

    def test_the_scripts_figures_are_the_published_ones(self):
        self.assertEqual(set(self.results), set(PUBLISHED))
        for row in plan_validate.ROWS:
            speed, memory = PUBLISHED[row.name]
            self.assertEqual(row.tokens_per_s or row.tflops, speed, row.name)
            self.assertEqual(row.memory_gib or None, memory, row.name)

    def test_the_rows_not_modelled_are_the_ones_named(self):
        self.assertEqual({n for n, r in self.results.items() if r["missing"]}, NOT_MODELLED)
        # the ring rows name the measured cost the planner lacks; cp 1 and 2 stay modelled
        for name in ("8B FSDP2 CP4 s128k", "8B FSDP1 CP8 s256k"):
            self.assertIn("ring attention beyond 2 ranks", self.results[name]["missing"])

    def test_the_ring_steps_show_where_the_planner_falls_short(self):
        # 8B, 32768 local tokens a GPU: step s = 32768 / tokens per s; from cp a to b a rank runs
        # b - a more ring steps. Published: (32768/2540 - 32768/3890) / 1 = 4.48 s, then 8.85
        # and 7.30 s; the planner's ring costs the same at every cp, near the cp 1 -> 2 figure
        text = plan_validate.ring_steps(list(self.results.values()))
        lines = text.splitlines()
        row = lines.index("  8B on 8 GPUs, FSDP + CP          cp 1->2   cp 2->4   cp 4->8")
        published = [float(x) for x in lines[row + 1].split()[1:]]
        planned = [float(x) for x in lines[row + 2].split()[1:]]
        self.assertEqual(published, [4.5, 8.8, 7.3])
        self.assertTrue(all(5.0 <= p <= 6.0 for p in planned), planned)
        self.assertIn("  405B on 512 GPUs, 4-D", text)

    def test_every_modelled_row_is_within_20_percent_speed_and_15_percent_memory(self):
        for name, r in self.results.items():
            if r["missing"]:
                continue
            within = abs(r["speed_error"]) <= 0.20 and (r["memory_error"] is None
                                                        or abs(r["memory_error"]) <= 0.15)
            self.assertEqual(within, name not in KNOWN_MISSES,
                             f"{name}: speed {r['speed_error']:+.1%}, memory {r['memory_error']}")

    def test_the_issues_8b_fsdp_case(self):
        # issue 30: 5,762 tokens/s and 82.4 GiB measured (torchtitan, above); the planner said
        # 11,129 tokens/s and 143 GB before
        r = self.results["8B FSDP 8 GPUs"]
        self.assertLess(abs(r["predicted_tokens_per_s"] / 5762 - 1), 0.20)
        self.assertLess(abs(r["predicted_memory_gib"] / 82.4 - 1), 0.15)

    def test_fp8_and_compile_speed_up_as_published(self):
        # published: compile x 1.157, float8 on top x 1.280 (8 GPUs); x 1.162, x 1.286 (128)
        for gpus in ("8", "128"):
            eager, comp, fp8 = (self.results[f"8B FSDP {gpus} GPUs{s}"]["predicted_tokens_per_s"]
                                for s in ("", " compile", " compile fp8"))
            self.assertGreater(comp / eager, 1.08)
            self.assertLess(comp / eager, 1.25)
            self.assertGreater(fp8 / comp, 1.1)
            self.assertLess(fp8 / comp, 1.4)

    def test_the_table_prints_each_row_with_its_verdict(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            plan_validate.main([])
        text = out.getvalue()
        self.assertIn("8B FSDP 8 GPUs", text)
        self.assertIn(
            f"{len(PUBLISHED) - len(NOT_MODELLED) - len(KNOWN_MISSES)} of "
            f"{len(PUBLISHED) - len(NOT_MODELLED)} "
            "modelled rows within 20%", text)


class GpuModel(unittest.TestCase):

    def test_a_gemms_tiles_run_in_waves_of_the_sms(self):
        h100 = load_cluster("h100")
        full = gemm_efficiency(128 * 132, 256, 4096, h100)  # 132 tiles: one full wave
        self.assertAlmostEqual(full, 0.75 * 4096 / (4096 + 128), places=12)
        # one more row of tiles: a second wave with one SM's worth of work
        self.assertAlmostEqual(gemm_efficiency(128 * 133, 256, 4096, h100), full * 133 / 264,
                               places=12)

    def test_bad_gpu_input_names_the_numbers(self):
        with self.assertRaisesRegex(ValueError, "m 0, n 4, k 4"):
            gemm_efficiency(0, 4, 4, load_cluster("h100"))
        with self.assertRaisesRegex(ValueError, "'op'.*torchtitan"):
            PlanLayout(activation_checkpointing="op")
        with self.assertRaisesRegex(ValueError, "every-0"):
            PlanLayout(framework="torchtitan", activation_checkpointing="every-0")
        with self.assertRaisesRegex(ValueError, "compiled True"):
            PlanLayout(compiled=True)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "c.json")
            h100 = {
                k: v
                for k, v in vars(load_cluster("h100")).items() if k not in ("sources", "name")
            }
            with open(path, "w") as f:
                json.dump({**h100, "name": "x", "attention_efficiency": 1.5}, f)
            with self.assertRaisesRegex(ValueError, "attention_efficiency 1.5"):
                load_cluster(path)

    def test_recomputation_modes_order_torchtitans_activations(self):
        model = preset("llama3-8b")
        act = {}
        for mode in ("none", "every-2", "op", "full"):
            lay = PlanLayout(framework="torchtitan", precision="autocast", dp=8, zero_stage=3,
                             seq_len=8192, micro_batch_size=2, flash_attention=True,
                             activation_checkpointing=mode)
            from scaletorch.plan.memory import activation_bytes
            act[mode] = activation_bytes(model, lay)["saved"]
        self.assertGreater(act["none"], act["every-2"])
        self.assertGreater(act["every-2"], act["op"])
        self.assertGreater(act["op"], act["full"])
        # full keeps each block's bf16 input (2 h a token) and the head's ends
        ends = 16384 * (8 + 6 * 4096 + 2 * 4096 + 4 * 128256)
        self.assertEqual(act["full"], 32 * 16384 * 2 * 4096 + ends)


class FrameworkMechanisms(unittest.TestCase):
    """What doc/09_appendix_validation.md's "Against measured GPU runs" adds for torchtitan's
    runs."""

    def test_the_500w_gpus_stream_at_their_published_hbm_bandwidth(self):
        # torchtitan's benchmark file: "96GB HBM2e with 2.4 TB/sec peak memory bandwidth"
        self.assertEqual(load_cluster("h100-500w").hbm_bandwidth, 2.4e12)
        self.assertEqual(load_cluster("h100").hbm_bandwidth, 3.35e12)  # H100 SXM datasheet

    def test_loss_parallel_keeps_three_fp32_logit_tensors_in_its_backward(self):
        from scaletorch.plan.memory import titan_loss_backward_bytes
        model = preset("llama3-70b")
        lay = PlanLayout(framework="torchtitan", precision="autocast", tp=8, dp=32, zero_stage=3,
                         sequence_parallel=True, seq_len=8192, micro_batch_size=16,
                         flash_attention=True, activation_checkpointing="full")
        # 16 x 8192 tokens, 128256 / 8 columns of fp32: zeros + exp + their sum (12 bytes)
        self.assertEqual(titan_loss_backward_bytes(model, lay), 12 * 16 * 8192 * 16032)
        # without tp: aten's fused kernels, two fp32 tensors (8 bytes)
        one = PlanLayout(framework="torchtitan", precision="autocast", dp=8, zero_stage=3,
                         seq_len=8192, micro_batch_size=2, flash_attention=True)
        self.assertEqual(titan_loss_backward_bytes(preset("llama3-8b"), one), 8 * 2 * 8192 * 128256)

    def test_the_rings_bytes_grow_by_the_same_amount_each_rank(self):
        from scaletorch.plan.kernels import ring_bytes_per_element

        # cp 2, full recomputation (two forwards): (8 + 32.5 + 12) x 2 + (8 + 50.5 x 2 + 30)
        self.assertEqual(ring_bytes_per_element(2, 1.0), 244.0)
        step = ring_bytes_per_element(3, 1.0) - ring_bytes_per_element(2, 1.0)
        self.assertEqual(step, (8 + 32.5) * 2 + 8 + 50.5)
        self.assertEqual(ring_bytes_per_element(8, 1.0) - ring_bytes_per_element(4, 1.0), 4 * step)

    def test_fp8_all_gather_halves_fsdps_gathered_bytes(self):
        from scaletorch.plan.traffic import collectives
        model, wire = preset("llama3-8b"), {}
        for fp8 in ("matmul", "matmul+all-gather"):
            lay = PlanLayout(framework="torchtitan", precision="autocast", dp=8, zero_stage=3,
                             seq_len=8192, flash_attention=True, compiled=True, fp8=fp8)
            wire[fp8] = {(c.group, c.op): c.wire for c in collectives(model, lay)}
        gather = ("dp", "all_gather")
        self.assertEqual(wire["matmul+all-gather"][gather] * 2, wire["matmul"][gather])
        scatter = ("dp", "reduce_scatter")  # gradients stay fp32
        self.assertEqual(wire["matmul+all-gather"][scatter], wire["matmul"][scatter])

    def test_the_search_plans_torchtitan_with_its_sharding_and_recomputation(self):
        from scaletorch.plan.search import candidates
        base = {"framework": "torchtitan", "compiled": True, "fp8": "matmul"}
        layouts = candidates(preset("llama3-8b"), 8, load_cluster("h100-500w"), 16, 8192,
                             "autocast", True, base)
        self.assertEqual({lay.zero_stage for lay in layouts}, {3})
        self.assertEqual({lay.activation_checkpointing for lay in layouts}, {"none", "op", "full"})
        self.assertTrue(all(lay.compiled and lay.fp8 == "matmul" for lay in layouts))
        mine = candidates(preset("llama3-8b"), 8, load_cluster("h100"), 16, 8192, "bf16-fp32-grads",
                          True)
        self.assertEqual({lay.zero_stage for lay in mine}, {1, 3})
        self.assertEqual({lay.framework for lay in mine}, {"scaletorch"})
        self.assertIsNone(plan.search_progress())  # no terminal here: no progress line

    def test_a_long_search_shows_a_progress_line_on_a_terminal(self):
        from unittest import mock

        class Tty(io.StringIO):

            def isatty(self):
                return True

        clock = iter([0.0, 5.0, 10.5, 10.7, 12.0, 12.5])  # the start, then one per layout
        err = Tty()
        with mock.patch.object(plan.time, "monotonic", lambda: next(clock)), \
                contextlib.redirect_stderr(err):
            show = plan.search_progress()
            for done in range(5):
                show(done, 5)
        lines = err.getvalue().replace("\r\033[K", "\n").split("\n")
        # nothing before 10 s, then at most one line a second, ended by a newline
        self.assertEqual([x for x in lines if x],
                         ["searching: 1 of 5 layouts, 10 s", "searching: 3 of 5 layouts, 12 s"])
        self.assertTrue(err.getvalue().endswith("\n"))


class RoughEdges(unittest.TestCase):

    def test_a_pipeline_without_micro_batches_gets_the_fewest_that_fill_it(self):
        out = run_plan("--preset", "llama3-405b", "--tp", "8", "--pp", "16", "--gpus", "8192")
        self.assertIn("micro-batches: 16, the fewest that fill the 16-stage pipeline", out)
        self.assertIn("dp64 m16 b2", out)

    def test_exact_params_gives_zeros_table_1_to_the_papers_rounding(self):
        # ZeRO (Rajbhandari et al. 2020) Table 1, Psi = 7.5e9, Nd = 64: stages 1, 2, 3 at
        # 31.4, 16.6, 1.88 GB per device (K = 12, 2 + 2 bytes of parameters and gradients)
        for stage, paper in ((1, 31.4), (2, 16.6), (3, 1.88)):
            out = run_plan("--params", "7.5e9", "--exact-params", "--gpus", "64", "--dp", "64",
                           "--zero-stage", str(stage), "--precision", "bf16", "--json")
            result = json.loads(out)["layouts"][0]
            self.assertEqual(result["parameters"], 7_500_000_000)
            states = sum(result["memory_bytes"][k] for k in ("params", "grads", "optimizer"))
            self.assertAlmostEqual(states / 1e9, paper, delta=0.051 if stage < 3 else 0.0051)
            self.assertAlmostEqual(states, sum(model_state_bytes(stage, 7.5e9, 64).values()),
                                   delta=1e3)
        text = run_plan("--params", "7.5e9", "--exact-params", "--gpus", "64", "--dp", "64")
        self.assertTrue(text.startswith("model llama-7.5b (7,500,000,000 parameters)"))

    def test_exact_params_without_params_is_an_error(self):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.assertEqual(plan.main(["--exact-params", "--gpus", "8"]), 2)
        self.assertIn("--exact-params needs --params N", err.getvalue())


if __name__ == "__main__":
    unittest.main()
