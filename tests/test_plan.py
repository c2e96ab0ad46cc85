"""The planner (scaletorch/plan) predicts what this repository measures, and what the papers print.

- Against the literature, in pure Python: ZeRO's Table 1 (model states of 7.5B parameters over
  1..1024 data-parallel ranks, all stages), Korthikanti et al.'s activation memory per GPU
  (22B, 175B; 530B and 1T against 80 GB), 18 bytes per parameter, the model-FLOPs formula
  72 B L s h^2 (1 + s/6h + V/12hL) and its 6 N D limit.
- Against this repository, in one world of 4 ranks: for each layout of chapter 07's parity
  matrix (tests/layouts.py, scaled to 4 ranks) the planner's bytes per group per step equal
  the ledger's exactly, every rank (expert parallel's all-to-all: within 10%, the routing is
  data-dependent); parameter, gradient and optimizer bytes equal the tensors each rank holds;
  activation bytes (no recomputation, selective, full; with and without sequence parallel)
  are within 5% of what autograd keeps (``torch.autograd.graph.saved_tensors_hooks``).
- Bad input: one ValueError naming the values.
"""

import io
import json
import os
import tempfile
import unittest
from collections import defaultdict
from contextlib import redirect_stderr, redirect_stdout

from scaletorch.plan.cluster import load_cluster
from scaletorch.plan.comm import collectives
from scaletorch.plan.flops import gpt_model_flops, model_flops, six_nd
from scaletorch.plan.layout import PlanLayout
from scaletorch.plan.layout import from_config as layout_of
from scaletorch.plan.memory import activation_bytes, model_state_bytes, state_bytes
from scaletorch.plan.model import from_config as model_of
from scaletorch.plan.model import from_params, preset
from scripts.plan import main, measure_rank
from tests.harness import run_distributed
from tests.layouts import layout, make_config

GiB = 2**30


class PlannerMatchesThePapers(unittest.TestCase):

    def test_zero_table_1_model_states_of_7_5b_parameters_to_the_papers_rounding(self):
        # Rajbhandari et al. 2020, ZeRO, Table 1: GB (1e9 bytes) per device, Psi = 7.5e9,
        # 2 + 2 bytes (fp16 parameters, gradients) + K = 12 (Adam's fp32 states) per parameter
        table = {
            1: (120, 120, 120, 120),
            4: (120, 52.5, 41.3, 30),
            16: (120, 35.6, 21.6, 7.5),
            64: (120, 31.4, 16.6, 1.88),
            256: (120, 30.4, 15.4, 0.47),
            1024: (120, 30.1, 15.1, 0.12),
        }
        for nd, row in table.items():
            for stage, paper in enumerate(row):
                ours = sum(model_state_bytes(stage, 7.5e9, nd, "bf16").values()) / 1e9
                decimals = len(str(paper).split(".")[1]) if "." in str(paper) else 0
                # the paper prints at most 3 significant figures: equal at its rounding
                self.assertAlmostEqual(ours, paper, delta=0.5 * 10**-decimals + 1e-9,
                                       msg=f"Nd {nd} stage {stage}")

    def _korthikanti(self, name: str, t: int, p: int, v: int, b: int, sp_selective: bool):
        layout_ = PlanLayout(tp=t, pp=p, micro_batch_size=b, seq_len=2048, num_micro_batches=64,
                             schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v,
                             sequence_parallel=sp_selective, precision="bf16-fp32-grads",
                             activation_checkpointing="selective" if sp_selective else "none")
        return activation_bytes(preset(name), layout_, 0)

    def test_korthikanti_activation_memory_of_22b_and_175b_first_stage(self):
        # Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
        # Models": GiB per GPU, first pipeline stage, tensor parallel only / TP + SP + selective
        # (175B: 1F1B interleaved, v = 3: 1 + (p-1)/(p v) times L layers' worth)
        published = {
            "gpt-22b": ((8, 1, 1, 4), 59.25, 9.5625),
            "gpt-175b": ((8, 8, 3, 1), 66.84, 12.35),
        }
        for name, ((t, p, v, b), tp_only, selective) in published.items():
            ours = self._korthikanti(name, t, p, v, b, False)
            self.assertAlmostEqual(ours["saved"] / GiB, tp_only, places=2, msg=name)
            ours = self._korthikanti(name, t, p, v, b, True)
            self.assertAlmostEqual(ours["saved"] / GiB, selective, places=2, msg=name)

    def test_korthikanti_model_states_are_18_bytes_per_parameter_12_l_h2_over_tp(self):
        # the same paper: fp16 parameters 2 + fp32 gradients 4 + master, momentum, variance 12;
        # parameters per GPU 12 L h^2 / (t p): 45.56 GiB for both 22B (t 8) and 175B (t 8, p 8)
        for name, tp_pp in (("gpt-22b", 8), ("gpt-175b", 64)):
            model = preset(name)
            numel = 12 * model.num_layers * model.hidden_size**2 / tp_pp
            states = model_state_bytes(0, numel, 1, "bf16-fp32-grads")
            self.assertEqual(sum(states.values()) / numel, 18)
            self.assertAlmostEqual(sum(states.values()) / GiB, 45.56, places=2, msg=name)
            # our GPT counts biases and norms too: 12 h^2 + 13 h per block, within 0.1%
            blocks = sum(sum(model.layer_params(i)) for i in range(model.num_layers))
            self.assertAlmostEqual(blocks / (numel * tp_pp), 1, delta=1e-3)

    def test_530b_and_1t_fit_in_80_gb_only_with_sequence_parallel_and_selective_recompute(self):
        # the paper's point for its two largest models (t 8; 530B p 35 v 3, 1T p 64 v 1, b 1):
        # tensor parallel alone does not fit an 80 GB GPU, SP + selective recomputation does
        for name, p, v in (("gpt-530b", 35, 3), ("gpt-1t", 64, 1)):
            model = preset(name)
            states = 18 * 12 * model.num_layers * model.hidden_size**2 / (8 * p)
            for sp_selective, fits in ((False, False), (True, True)):
                ours = self._korthikanti(name, 8, p, v, 1, sp_selective)
                total = states + ours["saved"]
                self.assertEqual(total < 80e9, fits, f"{name} {total / GiB:.1f} GiB")

    def test_model_flops_are_72_b_l_s_h2_with_attention_and_vocabulary_and_6nd_in_the_limit(self):
        # Korthikanti et al. 2022 (and Narayanan et al. 2021): model FLOPs per iteration
        for name in ("gpt-22b", "gpt-175b", "gpt-530b", "gpt-1t"):
            m = preset(name)
            for batch, s in ((1, 2048), (512, 2048), (8, 8192)):
                paper = gpt_model_flops(batch, m.num_layers, s, m.hidden_size, m.vocab_size)
                self.assertAlmostEqual(model_flops(m, batch, s) / paper, 1, delta=1e-12)
                # 6 N D with N = 12 L h^2 is the leading term: the rest is s/6h + V/12hL
                leading = six_nd(12 * m.num_layers * m.hidden_size**2, batch * s)
                rest = s / (6 * m.hidden_size) + m.vocab_size / (12 * m.hidden_size * m.num_layers)
                self.assertAlmostEqual(paper / leading, 1 + rest, delta=1e-12)

    def test_presets_and_parameter_counts(self):
        # Llama 3's published sizes: 8B, 70B, 405B (8.03e9, 70.6e9, 405.9e9 with the head)
        for name, billions in (("llama3-8b", 8.03), ("llama3-70b", 70.55), ("llama3-405b", 405.85)):
            self.assertAlmostEqual(preset(name).num_parameters() / 1e9, billions, places=2)
        for n in (1e9, 8e9, 70e9):
            self.assertAlmostEqual(from_params(n).num_parameters() / n, 1, delta=0.05)


class PlannerRefusesBadInput(unittest.TestCase):

    def test_unknown_preset_bad_sizes_and_cluster_files_name_the_values(self):
        with self.assertRaisesRegex(ValueError, "unknown model preset 'llama9'"):
            preset("llama9")
        with self.assertRaisesRegex(ValueError, "tp 0, dp -1"):
            PlanLayout(tp=0, dp=-1)
        with self.assertRaisesRegex(ValueError, "activation_checkpointing must be one of"):
            PlanLayout(activation_checkpointing="some")
        with self.assertRaisesRegex(ValueError, "--params must be positive, got 0"):
            from_params(0)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "c.yaml")
            with open(path, "w") as f:
                f.write("name: x\ngpus_per_node: 8\npeak_flops: 1e15\n")
            with self.assertRaisesRegex(ValueError, "missing keys hbm_bytes, intra_node_band"):
                load_cluster(path)
        with self.assertRaisesRegex(ValueError, "unknown cluster 'h200'"):
            load_cluster("h200")


def _script(*argv: str):
    """scripts/plan.py in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        status = main(list(argv))
    return status, out.getvalue(), err.getvalue()


class PlanScript(unittest.TestCase):

    def test_json_has_the_fields_and_predicts_the_chapter_07_run(self):
        status, out, _ = _script("examples/configs/07_nd_parallel.yaml", "--tp", "2", "--pp", "2",
                                 "--gpus", "8", "--json")
        self.assertEqual(status, 0)
        result = json.loads(out)["layouts"][0]
        self.assertEqual((result["tp"], result["pp"], result["dp"]), (2, 2, 2))
        for key in ("memory_bytes", "wire_bytes_per_step", "bubble", "step_time_s",
                    "tokens_per_s_per_gpu", "mfu"):
            self.assertIn(key, result)
        self.assertEqual(set(result["memory_bytes"]),
                         {"params", "grads", "optimizer", "buffers", "activations", "total"})
        self.assertEqual(set(result["wire_bytes_per_step"]), {"dp_cp", "tp", "pp", "world"})

    def test_search_ranks_layouts_that_fit_and_says_why_families_were_rejected(self):
        status, out, _ = _script("--preset", "llama3-70b", "--gpus", "32", "--search", "--top", "3",
                                 "--json")
        self.assertEqual(status, 0)
        found = json.loads(out)
        self.assertEqual(len(found["layouts"]), 3)
        speeds = [r["tokens_per_s_per_gpu"] for r in found["layouts"]]
        self.assertEqual(speeds, sorted(speeds, reverse=True))
        self.assertTrue(all(r["memory_bytes"]["total"] <= 80e9 for r in found["layouts"]))
        # on 8 GPUs nothing fits: 18 bytes x 70.6e9 parameters / 8 = 159 GB of model states
        status, out, _ = _script("--preset", "llama3-70b", "--gpus", "8", "--search", "--json")
        found = json.loads(out)
        self.assertEqual(found["layouts"], [])
        self.assertEqual(found["rejected"]["tp8 cp1 pp1"],
                         "out of memory: at least 162 GB per GPU > 80")

    def test_bad_input_is_one_error_line_and_exit_status_2(self):
        for argv, message in ((("--preset", "llama9"), "unknown model preset 'llama9'"),
                              (("--preset", "llama3-8b", "--gpus", "6", "--tp", "4"),
                               "world size 6 is not divisible"),
                              (("--preset", "llama3-8b", "--gpus", "0"), "--gpus must be positive"),
                              (("--preset", "llama3-8b", "--cluster", "x.yaml"), "cluster file")):
            status, out, err = _script(*argv)
            self.assertEqual(status, 2, argv)
            self.assertEqual(len(err.splitlines()), 1, err)
            self.assertIn(message, err)


# chapter 07's parity matrix (tests/layouts.py ND_LAYOUTS) on 4 ranks: each 8-rank layout
# with one of its factors of 2 taken out, and plain DDP / ZeRO-1 over 4
WORLD = 4
LAYOUTS = {
    "ddp_dp4": (False, 2, layout()),
    "zero1_dp4": (False, 2, layout(zero_stage=1)),
    "tp2_pp2": (False, 2, layout(tp=2, pp=2)),
    "tp2_cp2": (False, 2, layout(tp=2, cp=2)),
    "zero3_dp2_tp2": (False, 2, layout(tp=2, zero_stage=3)),
    "zero3_pp2_interleaved_dp2":
    (False, 2, layout(pp=2, zero_stage=3, schedule="interleaved", virtual_pipeline_stages=2)),
    "moe_ep2_dp2_tp2": (True, 1, layout(tp=2, ep=2)),
    "moe_pp2_dp2_ep2": (True, 1, layout(pp=2, ep=2, schedule="afab")),
    "ckpt_tp2_sp_pp2":
    (False, 2, layout(tp=2, pp=2, sequence_parallel=True, activation_checkpointing=True)),
    "ckpt_zero2_cp2_dp2": (False, 2, layout(cp=2, zero_stage=2, activation_checkpointing=True)),
    "selective_tp2_cp2": (False, 2, layout(tp=2, cp=2, activation_checkpointing="selective")),
}
# activations: tp 2 x dp 2, one micro-batch of 2 sequences per rank
ACTIVATIONS = {
    f"{mode}{'_sp' if sp else ''}": layout(tp=2, sequence_parallel=sp,
                                           activation_checkpointing=mode)
    for mode in ("none", "selective", "full")
    for sp in (False, True)
}


def _config(name: str):
    if name in ACTIVATIONS:
        cfg = make_config(False, 1, **ACTIVATIONS[name])
    else:
        moe, m, parallel = LAYOUTS[name]
        cfg = make_config(moe, m, **parallel)
    cfg.training.steps = 1
    return cfg


class PlannerMatchesTheLedgers(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        configs = {name: _config(name) for name in list(LAYOUTS) + list(ACTIVATIONS)}
        cls.results = run_distributed(measure_rank, WORLD, configs, timeout=300)

    def test_wire_bytes_per_group_per_step_equal_the_ledger_for_the_parity_matrix(self):
        for name in LAYOUTS:
            cfg = _config(name)
            model, plan = model_of(cfg.model), layout_of(cfg, WORLD)
            for rank, res in enumerate(self.results):
                predicted = defaultdict(float)
                for c in collectives(model, plan, res[name]["pp_rank"]):
                    predicted[(c.op, c.group, c.phase)] += c.wire
                measured = res[name]["wire"]
                self.assertEqual(set(predicted), set(measured), f"{name} rank {rank}")
                for key, wire in measured.items():
                    if key[1] == "ep":  # tokens per expert follow the router: balanced +- 10%
                        self.assertAlmostEqual(predicted[key] / wire, 1, delta=0.1, msg=name)
                    else:  # sums of exact binary fractions
                        self.assertEqual(predicted[key], wire, f"{name} rank {rank} {key}")

    def test_parameter_gradient_and_optimizer_bytes_equal_the_tensors_each_rank_holds(self):
        for name in LAYOUTS:
            cfg = _config(name)
            model, plan = model_of(cfg.model), layout_of(cfg, WORLD)
            for rank, res in enumerate(self.results):
                predicted = state_bytes(model, plan, res[name]["pp_rank"])
                predicted.pop("buffers")
                self.assertEqual(predicted, res[name]["memory"], f"{name} rank {rank}")

    def test_activation_bytes_within_5_percent_of_what_autograd_keeps(self):
        for name in ACTIVATIONS:
            cfg = _config(name)
            model, plan = model_of(cfg.model), layout_of(cfg, WORLD)
            predicted = activation_bytes(model, plan)["saved"]  # the block rebuilt: unseen
            for res in self.results:
                self.assertAlmostEqual(predicted / res[name]["saved"], 1, delta=0.05, msg=name)


if __name__ == "__main__":
    unittest.main()
