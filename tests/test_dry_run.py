"""The dry run (scaletorch/trainer/dry_run.py) equals the planner at full scale.

One rank of worlds of 1,024 to 16,384 runs the real code (parallelize, the Trainer's step, the
optimizer's, the Trainer's checkpoint save) over the fake process group with meta tensors, one
step each. Model states, ZeRO-3's gathered units, the checkpoint files' bytes and every (op,
group, phase)'s wire bytes and calls equal the planner's exactly; saved activations, one
micro-batch's and the schedule's, are within 5% (the planner's formulas leave out small
tensors: RMSNorm's and RoPE's few per token, the loss's scalars). Every pipeline stage of an
even and an uneven layer split matches, and the planner names the heaviest one.
"""

import contextlib
import io
import os
import tempfile
import unittest
import zipfile
from dataclasses import replace
from typing import Dict

import torch
import torch.distributed as dist

from scaletorch.plan.layout import PlanLayout
from scaletorch.plan.memory import activation_bytes, checkpoint_bytes, rank_memory, state_bytes
from scaletorch.plan.model import preset
from scaletorch.plan.report import most_loaded
from scaletorch.plan.search import with_split
from scaletorch.plan.traffic import collectives
from scaletorch.trainer.checkpoint import rng_state, tensor_bytes
from scaletorch.trainer.config import Config
from scaletorch.trainer.dry_run import DryRun, dry_run, dry_run_text, planned, run_config
from tests.harness import run_forked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the activations' tolerance: what the formulas leave out is under 0.1% at these sizes; 5% is
# the planner's promise for activations (doc/09)
ACTIVATIONS = 0.05

# name: (preset, layout, the pipeline ranks to run). Llama 3's sequence 8192, 16M tokens/step.
# 405B's plain 1F1B (tp 8, pp 16, dp 64) proves nothing these do not: "405b interleaved" runs
# the same model, tp, sp and selective recomputation at pp 16 (virtual stages on top), and "8b
# even" / "8b uneven" check 1F1B's p - r micro-batches in flight exactly, at every stage.
# Context parallelism at Llama 3's long-context width (cp 16, 131072 tokens, 16,384 ranks) runs
# on the 8B: the 405B's 126 layers in 1F1B ask 126 layer-forwards of 16 ring steps each of any
# rank (83 s of a core in meta kernels); the 8B's 32 run the same code at a quarter of that.
# Its stage's 8 layers run one micro-batch under AFAB (1F1B needs m >= p: 4 passes of each
# layer's 16 ring steps, the same code four times); the pipeline's micro-batches in flight are
# the "8b even" / "uneven" runs' check (the ring's calls per micro-batch, m of 2 and 4:
# tests/test_plan.py's tp2_cp2 and zbv_cp2_pp2, against the ledger). Mixtral: m = p = 4 (not
# 16) fills its 1F1B pipeline; more repeat each block's dispatch and combine, the same shapes.
LAYOUTS = {
    "405b interleaved":
    ("llama3-405b",
     PlanLayout(tp=8, pp=16, dp=64, virtual_stages=2, schedule="interleaved", num_micro_batches=16,
                micro_batch_size=2, seq_len=8192, sequence_parallel=True,
                activation_checkpointing="selective"), None),
    "8b cp16 s131072": ("llama3-8b",
                        PlanLayout(tp=8, cp=16, pp=4, dp=32, num_micro_batches=1, seq_len=131072,
                                   schedule="afab", sequence_parallel=True,
                                   activation_checkpointing="selective"), None),
    "mixtral ep8": ("mixtral-8x7b",
                    PlanLayout(tp=4, pp=4, dp=64, ep=8, num_micro_batches=4, micro_batch_size=2,
                               seq_len=4096), None),
}
for _stage in (1, 2, 3):
    LAYOUTS[f"8b zero{_stage} dp1024"] = ("llama3-8b",
                                          PlanLayout(dp=1024, zero_stage=_stage, micro_batch_size=2,
                                                     seq_len=8192), None)
# every stage: an even split (8 blocks each) and an uneven one that loads the middle
STAGES = PlanLayout(tp=8, pp=4, dp=32, num_micro_batches=4, micro_batch_size=2, seq_len=8192,
                    sequence_parallel=True)
LAYOUTS["8b even"] = ("llama3-8b", STAGES, [0, 1, 2, 3])
LAYOUTS["8b uneven"] = ("llama3-8b", replace(STAGES, layer_split=[4, 12, 10, 6]), [0, 1, 2, 3])


def config_of(name: str) -> Config:
    from scaletorch.trainer.config import parse_args

    model, layout, _ = LAYOUTS[name]
    spec = preset(model)
    return run_config(parse_args(["--config", "examples/configs/07_nd_parallel.yaml"]), spec,
                      with_split(layout, spec.num_layers))


def planned_wire(name: str, pp_rank: int) -> Dict[tuple, tuple]:
    """{(op, group, phase): (wire bytes, calls)} the planner predicts."""
    cfg = config_of(name)
    model, layout = planned(cfg, LAYOUTS[name][1].world)
    out: Dict[tuple, tuple] = {}
    for c in collectives(model, layout, pp_rank):
        wire, calls = out.get((c.op, c.group, c.phase), (0.0, 0))
        out[(c.op, c.group, c.phase)] = (wire + c.wire, calls + c.calls)
    return out


class DryRunEqualsThePlannerAtScale(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        if dist.is_initialized():  # the dry run is this process's world
            raise unittest.SkipTest("a process group exists in this process")
        cls.runs: Dict[str, Dict[int, DryRun]] = {}
        cls.checkpoints = os.path.join(tempfile.mkdtemp(), "checkpoints")  # never created
        for name, (_, layout, ranks) in LAYOUTS.items():
            cfg = config_of(name)
            cfg.checkpoint.every, cfg.checkpoint.dir = 1, cls.checkpoints  # asked to save
            model, plan = planned(cfg, layout.world)
            ranks = ranks if ranks is not None else [most_loaded(model, plan)]
            cls.runs[name] = {r: dry_run(cfg, layout.world, r, steps=1) for r in ranks}
        os.rmdir(os.path.dirname(cls.checkpoints))  # empty: nothing was written

    def test_model_states_and_zero3_gathered_units_equal_the_planners(self):
        for name, runs in self.runs.items():
            model, layout = planned(config_of(name), LAYOUTS[name][1].world)
            for r, run in runs.items():
                states = state_bytes(model, layout, r)
                for kind in ("params", "grads", "optimizer"):
                    self.assertEqual(run.total(kind), states[kind], f"{name} pp {r} {kind}")
                self.assertEqual(run.gathered, states["buffers"], f"{name} pp {r}")

    def test_wire_bytes_and_calls_of_every_op_group_and_phase_equal_the_planners(self):
        for name, runs in self.runs.items():
            for r, run in runs.items():
                predicted = planned_wire(name, r)
                measured = {k: (run.wire[k], run.calls[k]) for k in run.wire}
                self.assertEqual(measured, predicted, f"{name} pp {r}")

    def test_saved_activations_within_5_percent_of_the_planners(self):
        for name, runs in self.runs.items():
            model, layout = planned(config_of(name), LAYOUTS[name][1].world)
            for r, run in runs.items():
                saved = activation_bytes(model, layout, r)["saved"]
                self.assertAlmostEqual(saved / run.saved, 1, delta=ACTIVATIONS, msg=f"{name} {r}")

    def test_one_micro_batchs_activations_within_5_percent_and_1f1b_holds_p_minus_r_of_them(self):
        for name, runs in self.runs.items():
            model, layout = planned(config_of(name), LAYOUTS[name][1].world)
            for r, run in runs.items():
                micro = activation_bytes(model, layout, r)["micro_batch"]
                self.assertAlmostEqual(micro / run.micro_batch, 1, delta=ACTIVATIONS,
                                       msg=f"{name} {r}")
        # 1F1B keeps p - r micro-batches in flight on stage r, each as its forward left it
        # (the last stage, one: its backward follows each forward): exactly, in bytes
        for name in ("8b even", "8b uneven"):
            pp = LAYOUTS[name][1].pp
            for r, run in self.runs[name].items():
                self.assertEqual(run.saved, (pp - r) * run.micro_batch, f"{name} pp {r}")

    def test_checkpoint_files_hold_the_planners_model_state_bytes_and_nothing_is_written(self):
        for name, runs in self.runs.items():
            model, layout = planned(config_of(name), LAYOUTS[name][1].world)
            for r, run in runs.items():
                files = checkpoint_bytes(model, layout, r)
                self.assertEqual(run.checkpoint["model"], files["model"], f"{name} pp {r}")
                # AdamW's step counters are fp32 scalars, one per parameter tensor, beside m, v
                self.assertEqual(run.checkpoint["optimizer"] - run.step_counters,
                                 files["optimizer"], f"{name} pp {r}")
                self.assertEqual(run.consolidated, files["consolidated"], f"{name} pp {r}")
        # 405B: the consolidated file holds 12 bytes (weight, m, v) for each parameter, whatever
        # the layout that wrote it
        (run, ) = self.runs["405b interleaved"].values()
        self.assertEqual(run.consolidated, 12 * 405_853_388_800)
        self.assertFalse(os.path.exists(self.checkpoints))

    def test_the_planner_names_the_heaviest_stage_of_an_even_and_an_uneven_split(self):
        for name in ("8b even", "8b uneven"):
            model, layout = planned(config_of(name), STAGES.world)
            runs = self.runs[name]
            held = {
                r: sum(run.total(k) for k in ("params", "grads", "optimizer")) + run.saved
                for r, run in runs.items()
            }
            heaviest = max(held, key=held.get)
            self.assertEqual(most_loaded(model, layout), heaviest, name)
            # planned totals per stage within the activations' tolerance of the dry run's
            for r in runs:
                total = rank_memory(model, layout, r)["total"]
                self.assertAlmostEqual(total / held[r], 1, delta=ACTIVATIONS, msg=f"{name} {r}")
        # the uneven split loads a middle stage most: an estimate from the ends would miss it
        self.assertNotIn(most_loaded(*planned(config_of("8b uneven"), STAGES.world)), (0, 3))


class CountedBytesAreWhatTorchSaveWrites(unittest.TestCase):

    def test_tensor_bytes_equal_the_storages_in_a_torch_save_file(self):
        # a Trainer-like state on the CPU: weights, AdamW's state after a step, the RNG states,
        # two views of one storage (saved whole, once) and a plain int; torch.save writes each
        # storage's bytes as one archive/data/N entry, which the count must equal exactly
        layer = torch.nn.Linear(8, 6)
        optimizer = torch.optim.AdamW(layer.parameters())
        layer(torch.randn(2, 8)).sum().backward()
        optimizer.step()
        flat = torch.zeros(100)
        state = {
            "model": layer.state_dict(),
            "optimizer": optimizer.state_dict(),
            "rng": rng_state(),
            "views": [flat[:10], flat[50:]],
            "step": 3
        }
        buffer = io.BytesIO()
        torch.save(state, buffer)
        archive = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
        written = sum(i.file_size for i in archive.infolist() if "/data/" in i.filename)
        self.assertEqual(tensor_bytes(state), written)


class DryRunCommand(unittest.TestCase):

    def test_the_report_shows_each_figure_beside_the_planners_with_the_ratio(self):
        if dist.is_initialized():
            self.skipTest("a process group exists in this process")
        text = dry_run_text(config_of("8b zero3 dp1024"), 1024, "0", steps=1)
        self.assertRegex(text, r"params \(float32\) +31\.4 MB +31\.4 MB  =")
        self.assertRegex(text, r"wire dp all_gather +64\.2 GB +64\.2 GB  =  calls 68 / 68")
        self.assertIn("dry run: 1 rank(s), 1 steps each", text)

    def test_what_the_dry_run_cannot_run_is_refused_with_the_value(self):
        cfg = config_of("8b zero1 dp1024")
        cfg.training.precision = "bf16"
        with self.assertRaisesRegex(
                ValueError, r"training.precision bf16: the dry run runs fp32 "
                r"only \(autocast has no meta device\)"):
            dry_run_text(cfg, 1024)
        cfg = config_of("8b zero1 dp1024")
        cfg.parallel.impl = "torch"
        with self.assertRaisesRegex(ValueError, "parallel.impl torch: .* bypass the ledger"):
            dry_run_text(cfg, 1024)
        with self.assertRaisesRegex(ValueError, "pipeline rank 4 is not in 0..3"):
            dry_run_text(config_of("8b even"), STAGES.world, "4")

    def test_the_planners_dry_run_refuses_bf16_in_one_line_naming_why(self):
        from scripts.plan import main

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            status = main(
                ["--preset", "llama3-8b", "--gpus", "1024", "--precision", "bf16", "--dry-run"])
        self.assertEqual(status, 2)
        self.assertRegex(err.getvalue(), r"^error: --dry-run .*: fp32 \(autocast has no meta "
                         r"device\), .*\n$")

    def test_the_planners_dry_run_refuses_a_stage_outside_the_pipeline_before_the_plan(self):
        from scripts.plan import main

        for stages in ("99", "0,2", "x"):
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                status = main([
                    "--preset", "llama3-8b", "--gpus", "8", "--tp", "2", "--pp", "2", "--dry-run",
                    stages
                ])
            self.assertEqual((status, out.getvalue()), (2, ""), err.getvalue())  # no plan first
            self.assertRegex(err.getvalue(), rf"^error: --dry-run '?{stages}'?: .*\n$")

    def test_chapter_07s_dry_run_refuses_a_missing_world_in_one_line_with_status_2(self):
        # forked from the suite's forkserver (tests/harness.py): the script's own exit status
        # and stderr, without a new Python importing torch again
        run = run_forked("examples/07_nd_parallel.py", "--dry-run", cwd=ROOT)
        self.assertEqual(run.returncode, 2, run.stderr)
        self.assertEqual(run.stderr.strip().splitlines(),
                         ["error: --dry-run needs --world-size N: the world whose rank runs here"])


if __name__ == "__main__":
    unittest.main()
