"""Loading a checkpoint never runs code: only tensors and plain Python values are unpickled."""

import io
import json
import os
import random
import tempfile
import unittest

import numpy as np
import torch

from scaletorch.models import build_model
from scaletorch.rules.safe_files import sha256, write_checksummed
from scaletorch.trainer import Trainer
from scaletorch.trainer import checkpoint as ckpt
from scaletorch.trainer import parse_args
from scaletorch.trainer.consolidated import load_consolidated


class _RunsCode:
    """Unpickling this calls ``open(marker, "w")``: the marker file appears if code ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _malicious_bytes(marker: str) -> bytes:
    buffer = io.BytesIO()
    torch.save({"step": 3, "model": {"w": torch.zeros(2)}, "payload": _RunsCode(marker)}, buffer)
    return buffer.getvalue()


class CraftedPickleIsRefusedWithoutRunningCode(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.marker = os.path.join(self.tmp.name, "code_ran")
        self.data = _malicious_bytes(self.marker)

    def tearDown(self):
        self.tmp.cleanup()

    def test_the_crafted_file_would_run_code_if_fully_unpickled(self):
        # the test's premise: without weights_only the payload runs (here harmlessly)
        torch.load(io.BytesIO(self.data), weights_only=False)
        self.assertTrue(os.path.exists(self.marker))

    def test_consolidated_loader_refuses_it_and_the_code_does_not_run(self):
        path = os.path.join(self.tmp.name, "consolidated.pt")
        write_checksummed(path, self.data)  # its checksum passes: unpickling must refuse it
        with self.assertRaisesRegex(ValueError, "not a ScaleTorch checkpoint") as caught:
            load_consolidated(path)
        self.assertIn(path, str(caught.exception))
        self.assertIn("GLOBAL", str(caught.exception))  # names what the file asked for
        self.assertFalse(os.path.exists(self.marker))

    def test_per_rank_loader_refuses_it_after_the_checksum_passes(self):
        # a checkpoint directory whose manifest matches the crafted file: the checksum check
        # passes, so it is the unpickling that must refuse it
        path = ckpt.step_dir(self.tmp.name, 3)
        os.makedirs(path)
        name = os.path.basename(ckpt.rank_file(path, 0))
        write_checksummed(os.path.join(path, name), self.data)
        manifest = {
            "format_version": ckpt.FORMAT_VERSION,
            "step": 3,
            "world_size": 1,
            "layout": {},
            "sha256": {
                name: sha256(self.data)
            }
        }
        write_checksummed(os.path.join(path, ckpt.MANIFEST), json.dumps(manifest).encode())
        ckpt.verify_checkpoint(path)  # passes: the file is what the manifest says
        with self.assertRaisesRegex(ValueError, "not a ScaleTorch checkpoint") as caught:
            ckpt.load_checkpoint(path, 0, 1)
        self.assertIn(ckpt.rank_file(path, 0), str(caught.exception))
        self.assertFalse(os.path.exists(self.marker))


class CheckpointsHoldOnlyWhatWeightsOnlyReads(unittest.TestCase):

    def test_rng_state_round_trips_through_a_weights_only_load(self):
        random.seed(1)
        np.random.seed(2)
        np.random.standard_normal()  # a cached Gaussian: has_gauss and gauss are saved too
        torch.manual_seed(3)
        buffer = io.BytesIO()
        torch.save(ckpt.rng_state(), buffer)
        expected = (random.random(), np.random.standard_normal(), np.random.rand(),
                    torch.rand(1).item())
        ckpt.set_rng_state(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
        actual = (random.random(), np.random.standard_normal(), np.random.rand(),
                  torch.rand(1).item())
        self.assertEqual(expected, actual)  # exact: the same generator states

    def test_trainer_checkpoint_loads_with_weights_only(self):
        # model, AdamW, LambdaLR and RNG states after some steps: all plain values and tensors
        with tempfile.TemporaryDirectory() as tmp:
            cfg = parse_args([
                "--config", "examples/configs/00_single_device.yaml", "--logging.run_dir", tmp,
                "--logging.progress", "false", "--steps", "2", "--checkpoint.every", "2"
            ])
            Trainer(cfg, build_model(cfg.model, 42), verbose=False).train()
            path = ckpt.step_dir(cfg.checkpoint_path, 2)
            state = ckpt.load_checkpoint(path, 0, 1)
        self.assertEqual(state["step"], 2)
        self.assertIn("optimizer", state)


if __name__ == "__main__":
    unittest.main()
