"""Every checkpoint file has a checksum, checked before it is unpickled: a flipped byte in any
file a save writes is refused naming that file, and ``--resume`` (latest) skips its checkpoint.

The files are those chapter 07 wrote in one process (its sharded checkpoints: DCP's data
files and ``.metadata``, the manifests), a consolidated file converted from its last
checkpoint, and the checksum file beside each, listed from the disk, not by hand. (Chapter
00's per-rank files: tests/test_resume.py and tests/test_bad_inputs.py.)
"""

import copy
import os
import re
import shutil
import tempfile
import unittest
from typing import List, Tuple

from scaletorch.models import build_model
from scaletorch.models.hf import export_hf_llama
from scaletorch.rules.errors import InputError
from scaletorch.rules.safe_files import CorruptFileError
from scaletorch.trainer import Trainer
from scaletorch.trainer import checkpoint as ckpt
from scaletorch.trainer import parse_args
from scaletorch.trainer.consolidated import load_consolidated
from scaletorch.trainer.dcp_checkpoint import to_consolidated
from tests.harness import NCCL_CHECKS, run_forked
from tests.test_hf import HAVE_HF, SKIP_REASON
from tests.test_run_dirs import snapshot

C07 = "examples/07_nd_parallel.py"
CONFIG = ["--config", "examples/configs/07_nd_parallel.yaml", "--logging.progress", "false"]


def run_script(script: str, *argv: str) -> Tuple[int, str, str]:
    """``python script ARGV`` from the repository root, one process of its own (no torchrun),
    as tests/test_run_dirs.py's ``run_script`` runs it, but forked from the suite's forkserver
    instead of a new Python (tests/harness.py's ``run_forked``): (exit status, stdout, stderr)."""
    env = {**os.environ, **NCCL_CHECKS}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(name, None)
    done = run_forked(script, *argv, env=env, timeout=300)
    return done.returncode, done.stdout, done.stderr


def flip_byte(path: str) -> None:
    """Invert the bits of the byte in the middle of ``path`` (calling it again restores it)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def kind(path: str) -> str:
    """The kind of a checkpoint file: its name without the rank (rank_.pt, manifest.json...)."""
    return re.sub(r"_\d+", "_", os.path.basename(path))


class AFlippedByteInEveryCheckpointFileIsRefusedNamingIt(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.run_dir = os.path.join(cls.tmp.name, "runs")
        code, out, err = run_script(C07, *CONFIG[2:], "--steps", "4", "--checkpoint.every", "2",
                                    "--logging.run_dir", cls.run_dir)
        assert code == 0, out + err
        cls.run_path = os.path.join(cls.run_dir, "07_nd_parallel")
        cls.checkpoints = os.path.join(cls.run_path, "checkpoints")
        # the last checkpoint as one consolidated file, as scripts/convert_dcp.py writes it
        to_consolidated(ckpt.step_dir(cls.checkpoints, 4),
                        os.path.join(cls.run_path, "consolidated.pt"))
        # what the saves wrote: everything under checkpoints/, and the consolidated file
        cls.files: List[str] = sorted(
            os.path.join(cls.run_path, name) for name in snapshot(cls.run_path)
            if name.startswith("checkpoints") or name.startswith("consolidated.pt"))

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def config(self, *args: str):
        return parse_args([*CONFIG, "--logging.run_dir", self.run_dir, *args])

    def test_the_list_holds_every_kind_a_save_writes(self):
        self.assertEqual(
            {kind(f)
             for f in self.files},
            {
                "___.distcp", "___.distcp.sha256", ".metadata", ".metadata.sha256", "manifest.json",
                "manifest.json.sha256", "consolidated.pt", "consolidated.pt.sha256"
            })
        self.assertEqual(len(self.files), 2 * 6 + 2)  # steps 2 and 4, and the converted file

    def test_every_file_flipped_is_refused_naming_it_and_latest_falls_back(self):
        latest = ckpt.step_dir(self.checkpoints, 4)
        for path in self.files:
            with self.subTest(file=os.path.relpath(path, self.run_path)):
                name = os.path.basename(path)
                consolidated = name.startswith("consolidated.pt")
                # --resume of what the file belongs to: the consolidated file, or the checkpoint
                target = path[:-len(".sha256")] if name.endswith(".sha256") else path
                target = target if consolidated else os.path.dirname(path)
                flip_byte(path)
                try:
                    with self.assertRaises(InputError) as refused:
                        ckpt.check_resume(self.config("--resume", target), 1, files=True)
                    self.assertIn(name, str(refused.exception))
                    if consolidated:  # the loader verifies before it unpickles
                        with self.assertRaisesRegex(CorruptFileError, re.escape(name)):
                            load_consolidated(target)
                    elif os.path.dirname(path) == latest:
                        found, skipped = ckpt.latest_valid_checkpoint(self.checkpoints)
                        self.assertEqual(found, ckpt.step_dir(self.checkpoints, 2))
                        self.assertEqual(len(skipped), 1)
                        self.assertIn(name, skipped[0])
                        ckpt.check_resume(self.config("--resume"), 1)  # latest: step 2 passes
                finally:
                    flip_byte(path)
        ckpt.verify_checkpoint(latest)  # every file restored

    def test_a_damaged_checkpoint_resumed_by_path_is_one_line_exit_2_nothing_written(self):
        copy = os.path.join(self.tmp.name, "copy")
        shutil.copytree(self.run_dir, copy)
        manifest = os.path.join(copy, "07_nd_parallel", "checkpoints", "step_0000004",
                                ckpt.MANIFEST)
        flip_byte(manifest)
        before = snapshot(copy)
        code, out, err = run_script(C07, *CONFIG[2:], "--steps", "6", "--logging.run_dir", copy,
                                    "--resume", os.path.dirname(manifest))
        self.assertEqual(code, 2, out + err)
        self.assertEqual(out, "")
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertIn(f"error: '{manifest}' does not match its checksum in manifest.json.sha256",
                      err)
        self.assertEqual(snapshot(copy), before)

    def test_the_pre_flight_compares_keys_both_ways_and_shapes(self):
        final = os.path.join(self.run_path, "consolidated.pt")
        layers = self.config().model.num_layers
        # a block holds 9 tensors: 2 norms, q k v o, gate up down
        fewer = (["--model.num_layers", str(layers - 1)], "holds another model: 9 tensor\\(s\\) "
                 f"that this config's model.\\* does not have, e.g. layers.{layers - 1}.")
        more = (["--model.num_layers",
                 str(layers + 1)], f"holds another model: layers.{layers}.\\S+ is missing there")
        wider = (["--model.intermediate_size", "96"], "is shape \\(\\d+, \\d+\\) there, shape")
        for args, message in (fewer, more, wider):
            with self.subTest(args=args):
                with self.assertRaisesRegex(InputError, message):
                    ckpt.check_resume(self.config(*args, "--resume", final), 1, files=True)
        ckpt.check_resume(self.config("--resume", final), 1, files=True)  # its own model passes


class APerRankFileOfAnotherModelIsRefusedBeforeItLoads(unittest.TestCase):

    def test_missing_unexpected_and_reshaped_keys_name_the_file(self):
        cfg = parse_args(["--config", "examples/configs/00_single_device.yaml"])
        state = Trainer(cfg, build_model(cfg.model, 42), verbose=False).state_dict()
        deeper = copy.deepcopy(cfg)
        deeper.model.num_layers += 1
        wider = copy.deepcopy(cfg)
        wider.model.intermediate_size += 32
        for other, message in ((deeper, "layers.2.\\S+ is missing there"),
                               (wider, "\\S+ is shape \\(\\d+, \\d+\\) there")):
            with self.subTest(model=other.model):
                trainer = Trainer(other, build_model(other.model, 42), verbose=False)
                with self.assertRaisesRegex(InputError, f"'rank_00000.pt' holds another model: "
                                            f"{message}"):
                    trainer.load_state_dict(state, "'rank_00000.pt'")
        fewer = copy.deepcopy(cfg)
        fewer.model.num_layers -= 1
        trainer = Trainer(fewer, build_model(fewer.model, 42), verbose=False)
        with self.assertRaisesRegex(
                InputError, "9 tensor\\(s\\) that this rank's model does "
                "not have, e.g. layers.1."):
            trainer.load_state_dict(state, "'rank_00000.pt'")


@unittest.skipUnless(HAVE_HF, SKIP_REASON)
class ADamagedHuggingFaceExportIsRefusedBeforeAnyPieceIsRead(unittest.TestCase):

    def test_init_from_it_is_one_line_naming_the_file_exit_2(self):
        cfg = parse_args(["--config", "examples/configs/10_real_model.yaml"])
        with tempfile.TemporaryDirectory() as tmp:
            hf_dir = os.path.join(tmp, "hf")
            export_hf_llama(build_model(cfg.model, 42), hf_dir)  # with a .sha256 beside each
            weights = os.path.join(hf_dir, "model.safetensors")
            flip_byte(weights)  # in the tensors' bytes: the headers (the pre-flight) still read
            code, out, err = run_script("examples/10_real_model.py", "--init-from", hf_dir,
                                        "--steps", "1", "--logging.run_dir", tmp,
                                        "--logging.progress", "false")
            size = os.path.getsize(weights)
        self.assertEqual(code, 2, out + err)
        self.assertEqual(
            err.strip(), f"error: '{weights}' does not match its checksum in "
            f"model.safetensors.sha256 ({size} bytes; truncated or damaged)")


if __name__ == "__main__":
    unittest.main()
