"""Chapter 00 learns, the Trainer equals a plain PyTorch loop (the independent reference), and a
resumed run is the uninterrupted run, bit for bit."""

import contextlib
import io
import json
import os
import tempfile
import unittest

import torch

from scaletorch.data import build_dataset
from scaletorch.models import build_model
from scaletorch.trainer import Trainer
from scaletorch.trainer import checkpoint as ckpt
from scaletorch.trainer import parse_args
from scaletorch.trainer.plain_loop import plain_lr, plain_training
from scaletorch.trainer.trainer import lr_at
from tests.harness import bit_exact
from tests.layouts import make_config


def _config(tmp: str, *overrides: str):
    return parse_args([
        "--config", "examples/configs/00_single_device.yaml", "--logging.run_dir", tmp,
        "--logging.progress", "false", *overrides
    ])


def _train(cfg):
    model = build_model(cfg.model, seed=cfg.training.model_seed)
    result = Trainer(cfg, model, pgm=None, verbose=False).train()
    return result, model


class SingleDeviceTrains(unittest.TestCase):

    def test_loss_falls_toward_the_entropy_floor(self):
        with tempfile.TemporaryDirectory() as tmp:
            result, _ = _train(_config(tmp, "--steps", "60"))
        floor = build_dataset("synthetic", 64, 1234).entropy_rate()
        first, last = result.losses[0], sum(result.losses[-5:]) / 5
        # Untrained, the loss is about log(64) = 4.16; the chain's floor is about 1.57.
        # 60 steps must close at least 85% of that gap (measured: 93%).
        self.assertGreater(first, 4.0)
        self.assertLess(last - floor, 0.15 * (first - floor), (first, last, floor))

    def test_verbose_run_writes_config_and_metrics(self):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = _config(tmp, "--steps", "3", "--logging.name", "unit")
            model = build_model(cfg.model, seed=cfg.training.model_seed)
            Trainer(cfg, model, pgm=None, verbose=True).train()
            with open(os.path.join(tmp, "unit", "metrics.jsonl")) as f:
                lines = f.read().splitlines()
            self.assertEqual(len(lines), 3)
            record = json.loads(lines[-1])
            self.assertEqual(record["step"], 3)
            self.assertEqual(record["wire_bytes"], 0)  # one device: nothing on the wire
            self.assertTrue(os.path.isfile(os.path.join(tmp, "unit", "config.yaml")))

    def test_lr_warms_up_then_decays_to_min_lr(self):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = _config(tmp, "--steps", "100")
        t = cfg.training
        self.assertAlmostEqual(lr_at(cfg, 0), t.lr / t.warmup_steps)
        self.assertAlmostEqual(lr_at(cfg, t.warmup_steps - 1), t.lr)
        self.assertAlmostEqual(lr_at(cfg, t.steps), t.min_lr)


# Trainer vs plain_loop.py, two code paths: each composes the loss, the MoE losses and the
# micro-batch sums in its own order, so their floats agree only up to rounding. Measured
# (tests/layouts.make_config, 5 steps, clipping active): losses 1 float32 ulp apart at most
# (4.398983478 vs 4.398983002, 1.1e-7 relative, MoE with 2 micro-batches on an AMD EPYC; bit for
# bit on another CPU); grad norms within 1.2e-7 relative (torch's clip_grad_norm_ takes
# per-tensor norms, the Trainer one sum of squares); weights within 1.2e-7. The bounds: 1e-6,
# about 8x the largest. A loss off by 1e-5 (2.3e-6 relative at 4.4) fails them
# (assert_a_loss_off_by_1e_5_fails, below).
LOSS_RTOL = 1e-6
NORM_RTOL = 1e-6
WEIGHT_TOL = 1e-6


def trainer_and_plain_loop(cfg) -> dict:
    """{"trainer": (losses, norms, state), "plain": (...)} of ``cfg`` trained both ways."""
    model = build_model(cfg.model, seed=cfg.training.model_seed)
    result = Trainer(cfg, model, pgm=None, verbose=False).train()
    losses, norms, plain = plain_training(cfg)
    return {
        "trainer": (result.losses, result.grad_norms, model.state_dict()),
        "plain": (losses, norms, plain.state_dict())
    }


def assert_trainer_equals_plain_loop(test: unittest.TestCase, runs: dict, name: str) -> None:
    (losses, norms, state), (ref_losses, ref_norms, ref_state) = runs["trainer"], runs["plain"]
    test.assertEqual(len(losses), len(ref_losses), name)
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        test.assertLessEqual(abs(a - b), LOSS_RTOL * b, f"{name} step {step}: loss {a} vs {b}")
    for a, b in zip(norms, ref_norms):
        test.assertLessEqual(abs(a - b), NORM_RTOL * b, f"{name}: grad norm {a} vs {b}")
    for key, value in state.items():
        diff = (value - ref_state[key]).abs().max().item()
        test.assertLessEqual(diff, WEIGHT_TOL, f"{name}: {key}")


class TrainerEqualsPlainLoop(unittest.TestCase):
    """The reference every parity test trusts (the Trainer on one device) against a loop written
    from torch's own pieces (scaletorch/trainer/plain_loop.py): a bug in the Trainer's step,
    micro-batch slicing, clipping, schedule or MoE loss would cancel in a Trainer-vs-Trainer
    parity test and shows here."""

    def test_trainer_equals_plain_loop_dense_and_moe_with_1_and_2_micro_batches(self):
        checked = 0
        for moe in (False, True):
            for m in (1, 2):
                name = f"{'moe' if moe else 'dense'} m={m}"
                runs = trainer_and_plain_loop(make_config(moe, m))
                assert_trainer_equals_plain_loop(self, runs, name)
                # the run clips (grad_clip 0.5 < every norm): a wrong norm would not cancel
                self.assertGreater(min(runs["plain"][1]), 0.5, name)
                checked += 1
                if moe and m == 2:
                    self.assert_a_loss_off_by_1e_5_fails(runs, name)
        self.assertEqual(checked, 4)

    def assert_a_loss_off_by_1e_5_fails(self, runs: dict, name: str) -> None:
        # A Trainer whose loss is 1e-5 off at one step (a planted bug) must fail the comparison.
        losses, norms, state = runs["trainer"]
        planted = {**runs, "trainer": ([losses[0] + 1e-5, *losses[1:]], norms, state)}
        with self.assertRaises(AssertionError, msg=f"{name}: a loss 1e-5 off passed"):
            assert_trainer_equals_plain_loop(self, planted, name)

    def test_plain_schedule_by_hand(self):
        # lr 3e-3, min_lr 3e-4, warmup 2, 5 steps: 1.5e-3, 3e-3, then the cosine over 3 steps
        # at fractions 0, 1/3, 2/3: 3e-3, 3e-4 + 2.7e-3 * 0.75, 3e-4 + 2.7e-3 * 0.25
        expected = [1.5e-3, 3e-3, 3e-3, 2.325e-3, 9.75e-4]
        got = [plain_lr(step, 3e-3, 3e-4, 2, 5) for step in range(5)]
        for a, b in zip(got, expected):
            self.assertAlmostEqual(a, b, delta=1e-12)
        cfg = make_config()  # the same numbers: lr_at is the Trainer's own
        for step, b in enumerate(expected):
            self.assertAlmostEqual(lr_at(cfg, step), b, delta=1e-12)


class ResumeIsExact(unittest.TestCase):

    @bit_exact  # the same code runs the same steps: a resume that changes a bit is a bug
    def test_k_steps_plus_resume_plus_k_equals_2k_steps(self):
        k = 4
        with tempfile.TemporaryDirectory() as tmp:
            # The uninterrupted run saves at step k (and 2k) on its way.
            cfg = _config(tmp, "--steps", str(2 * k), "--checkpoint.every", str(k))
            straight, straight_model = _train(cfg)
            # A new process would start from a freshly built model and resume at step k.
            resume_cfg = _config(tmp, "--steps", str(2 * k), "--checkpoint.every", "0",
                                 "--checkpoint.resume", ckpt.step_dir(cfg.checkpoint_path, k))
            resumed, resumed_model = _train(resume_cfg)
        self.assertEqual(resumed.start_step, k)
        self.assertEqual(resumed.losses, straight.losses[k:])  # exactly, not approximately
        for (name, a), b in zip(straight_model.state_dict().items(),
                                resumed_model.state_dict().values()):
            self.assertTrue(torch.equal(a, b), name)

    def test_a_resume_with_another_lr_or_adamw_setting_trains_at_it_and_says_so_once(self):
        # The bug: LambdaLR's state holds the base lr, so the checkpoint's lr came back
        with tempfile.TemporaryDirectory() as tmp:
            cfg = _config(tmp, "--steps", "4", "--checkpoint.every", "2")
            _train(cfg)
            old = cfg.training.lr
            lines, metrics = {}, {}
            for lr in (old, old / 4):  # the same lr: no line; a quarter of it: one
                new = _config(tmp, "--steps", "4", "--checkpoint.every", "0", "--training.lr",
                              repr(lr), "--checkpoint.resume",
                              ckpt.step_dir(cfg.checkpoint_path, 2))
                out = io.StringIO()
                with contextlib.redirect_stdout(out):
                    trainer = Trainer(new, build_model(new.model, seed=new.training.model_seed))
                    trainer.train()
                lines[lr] = [line for line in out.getvalue().splitlines() if "training.lr" in line]
                with open(os.path.join(new.run_path, "metrics.jsonl")) as f:
                    metrics[lr] = [json.loads(line) for line in f][-2:]  # this run's steps 3, 4
                # each step at the new lr's schedule, computed as a fresh run's LambdaLR does
                # (lr x lr_at / lr: the same float operations, so exactly equal)
                self.assertEqual([m["lr"] for m in metrics[lr]],
                                 [lr * (lr_at(new, s) / lr) for s in (2, 3)])
                self.assertEqual(trainer.optimizer.param_groups[0]["lr"], lr * (lr_at(new, 4) / lr))
            self.assertEqual(lines[old], [])
            self.assertEqual(lines[old / 4], [
                f"training.lr changed from {old:g} to {old / 4:g} at resume: from step 2 the "
                f"learning rate follows {old / 4:g}'s schedule"
            ])
            # AdamW's other settings came back from the optimizer's state the same way
            new = _config(tmp, "--steps", "3", "--checkpoint.every", "0", "--training.beta2",
                          "0.99", "--training.weight_decay", "0.05", "--checkpoint.resume",
                          ckpt.step_dir(cfg.checkpoint_path, 2))
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                trainer = Trainer(new, build_model(new.model, seed=new.training.model_seed))
                trainer.train()
            group = trainer.optimizer.param_groups[0]
            self.assertEqual((group["betas"], group["weight_decay"]), ((0.9, 0.99), 0.05))
            self.assertEqual([line for line in out.getvalue().splitlines() if "changed" in line], [
                f"training.beta2 changed from {cfg.training.beta2:g} to 0.99 at resume",
                f"training.weight_decay changed from {cfg.training.weight_decay:g} to 0.05 at "
                f"resume"
            ])

    def test_checkpoint_layout_manifest_and_retention(self):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = _config(tmp, "--steps", "6", "--checkpoint.every", "2", "--checkpoint.keep_last",
                          "2")
            _train(cfg)
            found = ckpt.list_checkpoints(cfg.checkpoint_path)
            self.assertEqual([os.path.basename(p) for p in found], ["step_0000004", "step_0000006"])
            # A checkpoint whose manifest never got written (a crash mid-save) is ignored.
            os.makedirs(ckpt.step_dir(cfg.checkpoint_path, 8))
            torch.save({}, ckpt.rank_file(ckpt.step_dir(cfg.checkpoint_path, 8), 0))
            self.assertTrue(ckpt.latest_checkpoint(cfg.checkpoint_path).endswith("step_0000006"))
            with self.assertRaisesRegex(ValueError, "world_size 1 there, 2 here.*consolidated"):
                ckpt.load_checkpoint(found[-1], rank=0, world_size=2)
            with self.assertRaisesRegex(FileNotFoundError, "not a complete checkpoint"):
                ckpt.load_checkpoint(ckpt.step_dir(cfg.checkpoint_path, 8), 0, 1)


if __name__ == "__main__":
    unittest.main()
