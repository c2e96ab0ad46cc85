"""Chapter 00 learns, and a resumed run is the uninterrupted run, bit for bit."""

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
from scaletorch.trainer.trainer import lr_at


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


class ResumeIsExact(unittest.TestCase):

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
