"""Sharded checkpoints beyond save and resume: seeding from Hugging Face with no gather
(scaletorch/trainer/hf_seed.py), converting offline (scripts/convert_dcp.py), each rank's peak
memory (scripts/dcp_memory.py). (The data position at another data-parallel size:
tests/test_dcp.py's DataPositionResumesAtAnotherDataParallelSize, in that file's world.)

One world of 4 ranks for both classes (``seed_and_memory_world``): the memory measurement
first, in fresh ranks as scripts/dcp_memory.py runs it, then the seeds. Seed: a tiny
transformers Llama (vocabulary 97: padded at tp 2, 3 safetensors shards with an index)
seeds tp2 x dp2 ZeRO-1 and pp2 x tp2 untied, pp2 x tp2 tied, each both ways, the whole
model loaded first or each rank's rectangles sliced: weights and 2 steps' losses
bit-identical, bytes read = bytes held. The DCP checkpoints of the tp2 x dp2 and tied runs
convert to the HF directories chapter 10 exports.
Memory: every rank's DCP save adds at most about one tensor to its shard, and its save and
load stay below the full model's bytes. The seed class needs the hf extra (without it the
world measures the memory alone).
"""

import json
import os
import shutil
import tempfile
import unittest
from typing import Dict, Optional

import torch

from scaletorch.dist import destroy_pg_manager
from scaletorch.models import build_model
from scaletorch.models.hf import check_hf_llama, export_hf_llama, load_hf_llama
from scaletorch.rules import boundary
from scaletorch.rules.safe_files import read_checksummed
from scaletorch.trainer.config import save_config
from scaletorch.trainer.consolidated import consolidated_state, load_consolidated
from scaletorch.trainer.dcp_checkpoint import commit_sharded, save_sharded
from scaletorch.trainer.hf_seed import held_bytes, seed_from_hf
from scaletorch.trainer.param_map import full_state_dict
from scaletorch.trainer.run_dir import MARKER
from scripts import convert_dcp, dcp_memory
from tests.harness import bit_exact, run_distributed, run_main
from tests.layouts import build, layout, make_config, pg_manager_for
from tests.test_hf import HAVE_HF, SKIP_REASON, read_safetensors, save_transformers_llama

WORLD = dcp_memory.WORLD  # 4: the memory measurement's world, the seeds' too
STEPS = 2  # the second step's loss shows a tie the seed broke (two copies, two updates)
HF_DIRS = {"hf": False, "hf_tied": True}  # directory -> tie_word_embeddings
# seeded layout -> (the directory it starts from, its parallel config)
SEEDED = {
    "tp2_dp2_zero1": ("hf", layout(tp=2, zero_stage=1)),
    "pp2_tp2": ("hf", layout(tp=2, pp=2)),
    "tied_pp2_tp2": ("hf_tied", layout(tp=2, pp=2)),  # lm_head on the last stage, read as
}  # the embedding: a tied HF directory has no lm_head.weight
SAVED = ("tp2_dp2_zero1", "tied_pp2_tp2")  # their sliced runs save DCP after their steps
# Resident memory that is neither tensors nor file bytes: DCP's plans and metadata objects,
# the allocator's page rounding: a fixed cost, not per parameter (a tenth of a shard here).
SLACK = 1_000_000


def config(hf_dir: str, **parallel):
    """tests/layouts.py's data and training, the model of ``hf_dir``'s config.json."""
    cfg = make_config(False, 2, **parallel)
    cfg.model = check_hf_llama(hf_dir)
    cfg.training.steps = STEPS
    return cfg


def _run(cfg, hf_dir: str, sliced: bool, save_to: Optional[str] = None) -> dict:
    """Seed ``cfg``'s layout from ``hf_dir`` (sliced: hf_seed.py, as chapter 10's --init-from
    does; else the whole model loaded first, the path before it), then train; the weights
    then, losses, bytes. ``save_to``: then a DCP checkpoint there, and the final weights the
    trainer would export (consolidated, rank 0)."""
    pgm = pg_manager_for(cfg)
    if sliced:
        par, trainer = build(cfg, pgm)
        read = seed_from_hf(hf_dir, par)
    else:
        par, trainer = build(cfg, pgm, load_hf_llama(hf_dir).state_dict())
        read = None
    out = {
        "seeded": full_state_dict(par),
        "read": read,
        "held": held_bytes(par, torch.float32),
        "losses": trainer.train().losses,
    }
    if save_to is not None:
        # a complete step directory, as the Trainer's save leaves it: the converter checks
        # it as --resume does (its manifest, then every file)
        commit_sharded(os.path.dirname(save_to), save_to, trainer.step,
                       save_sharded(save_to, trainer, par), 1, trainer.layout())
        final = consolidated_state(trainer, par)  # rank 0's; None elsewhere
        out["final"] = final and final["model"]
    destroy_pg_manager()
    return out


def _world(rank: int, world: int, root: str) -> dict:
    out = {}
    # transformers wrote the directories (no .sha256): trusted by name, as --trust-unchecked does
    with boundary.trusting([os.path.join(root, d) for d in HF_DIRS]):
        for name, (directory, parallel) in SEEDED.items():
            hf_dir = os.path.join(root, directory)
            cfg = config(hf_dir, **parallel)
            save_to = os.path.join(root, name) if name in SAVED else None
            out[name] = {
                "whole": _run(cfg, hf_dir, False),
                "sliced": _run(cfg, hf_dir, True, save_to)
            }
    return out


def _seed_and_memory(rank: int, world: int, root: str) -> dict:
    """DcpSaveAndLoadPeakMemoryPerRank's measurement first (the ranks fresh, as in
    scripts/dcp_memory.py's own world: nothing else has allocated yet), then, with the hf
    extra, the seeded runs (``_world``)."""
    out = {"memory": dcp_memory.measure(rank, world, os.path.join(root, "memory"))}
    if HAVE_HF:
        out["seed"] = _world(rank, world, root)
    return out


_ROOT = tempfile.TemporaryDirectory()  # removed when the process exits
_RESULTS: list = []
# the transformers Llamas the world seeds from: directory -> its tensors' bytes
FULL_BYTES: Dict[str, int] = {}


def seed_and_memory_world() -> list:
    """The world's per-rank results (``_seed_and_memory``), run once per process; with the hf
    extra, the HF directories it seeds from are written under ``_ROOT`` first."""
    if not _RESULTS:
        if HAVE_HF:
            for directory, tied in HF_DIRS.items():
                path = os.path.join(_ROOT.name, directory)
                save_transformers_llama(path, seed=0, vocab_size=97, num_attention_heads=4,
                                        num_key_value_heads=2, tie_word_embeddings=tied,
                                        max_shard_size="20KB")
                FULL_BYTES[directory] = sum(t.numel() * t.element_size()
                                            for t in read_safetensors(path).values())
        os.makedirs(os.path.join(_ROOT.name, "memory"))  # dcp_memory.measure's files
        _RESULTS.extend(run_distributed(_seed_and_memory, WORLD, _ROOT.name, timeout=600))
    return _RESULTS


@unittest.skipUnless(HAVE_HF, SKIP_REASON)
class SeedFromHuggingFaceReadsOnlyEachRanksPieces(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.results = [res["seed"] for res in seed_and_memory_world()]
        cls.tmp, cls.full_bytes = _ROOT, FULL_BYTES
        cls.hf_dir = os.path.join(cls.tmp.name, "hf")
        cls.trust = boundary.trusting([os.path.join(cls.tmp.name, d) for d in HF_DIRS])
        cls.trust.__enter__()
        cls.addClassCleanup(cls.trust.__exit__, None, None, None)

    def test_the_directory_is_sharded_with_an_index(self):
        files = os.listdir(self.hf_dir)
        self.assertIn("model.safetensors.index.json", files)
        self.assertGreaterEqual(len([f for f in files if f.endswith(".safetensors")]), 2)

    @bit_exact  # the same values copied into the same shards; then the same steps
    def test_sliced_seed_equals_the_whole_model_seed_in_weights_and_losses(self):
        for name in SEEDED:
            whole, sliced = self.results[0][name]["whole"], self.results[0][name]["sliced"]
            self.assertEqual(sorted(sliced["seeded"]), sorted(whole["seeded"]), name)
            for key, want in whole["seeded"].items():
                self.assertTrue(torch.equal(sliced["seeded"][key], want), f"{name} {key}")
            for rank, res in enumerate(self.results):
                self.assertEqual(len(res[name]["sliced"]["losses"]), STEPS)
                self.assertEqual(res[name]["sliced"]["losses"], res[name]["whole"]["losses"],
                                 f"{name} rank {rank}")

    def test_each_rank_reads_exactly_its_rectangles_never_the_whole_model(self):
        for name, (directory, _) in SEEDED.items():
            full = self.full_bytes[directory]
            for rank, res in enumerate(self.results):
                run = res[name]["sliced"]
                # the file is fp32 like the parameters: bytes read = bytes held, exactly
                self.assertEqual(run["read"], run["held"], f"{name} rank {rank}")
                # 4 ranks, each tensor split 2 or 4 ways, norms whole: well under half
                self.assertLess(run["read"], full / 2, f"{name} rank {rank}")
            total = sum(res[name]["sliced"]["read"] for res in self.results)
            self.assertGreaterEqual(total, full, name)  # every byte read somewhere

    @bit_exact  # the same fp32 values, gathered by the converter instead of by the layout
    def test_hf_to_sharded_run_to_dcp_to_hf_equals_the_trainers_export(self):
        for name in SAVED:
            with self.subTest(name):
                self._round_trip(name)

    def _round_trip(self, name: str) -> None:
        path, out_dir = os.path.join(self.tmp.name,
                                     name), os.path.join(self.tmp.name, "out_" + name)
        cfg = config(os.path.join(self.tmp.name, SEEDED[name][0]), **SEEDED[name][1])
        run_config = os.path.join(out_dir, "config.yaml")
        save_config(cfg, run_config)
        ours, theirs = os.path.join(out_dir, "dcp_hf"), os.path.join(out_dir, "hf_10")
        single = os.path.join(out_dir, "consolidated.pt")
        status, out, err = run_main(convert_dcp.main, path, "--config", run_config, "--hf", ours,
                                    "--consolidated", single)
        self.assertEqual((status, err), (0, ""), out)
        final = self.results[0][name]["sliced"]["final"]
        trained = build_model(cfg.model, seed=0)  # chapter 10's export of the final weights
        trained.load_state_dict(final)
        export_hf_llama(trained, theirs)
        got, want = read_safetensors(ours), read_safetensors(theirs)
        self.assertEqual(sorted(got), sorted(want))
        for name, tensor in want.items():
            self.assertTrue(torch.equal(got[name], tensor), name)
        with open(os.path.join(ours, "config.json")) as a, open(os.path.join(theirs,
                                                                             "config.json")) as b:
            self.assertEqual(json.load(a), json.load(b))
        for file in os.listdir(ours):
            if not file.endswith(".sha256"):
                read_checksummed(os.path.join(ours, file))  # each file has its checksum
        reloaded = load_hf_llama(ours).state_dict()  # and loads back as a Hugging Face Llama
        for name, tensor in final.items():
            self.assertTrue(torch.equal(reloaded[name], tensor), name)
        consolidated = load_consolidated(single)
        self.assertEqual(consolidated["step"], STEPS)
        for name, tensor in final.items():
            self.assertTrue(torch.equal(consolidated["model"][name], tensor), name)

    def test_the_converter_refuses_bad_arguments_in_one_line(self):
        out = os.path.join(self.tmp.name, "never_written")
        saved, run = os.path.join(self.tmp.name, SAVED[0]), os.path.join(self.tmp.name, "a_run")
        os.makedirs(run, exist_ok=True)
        open(os.path.join(run, MARKER), "w").close()
        partial = os.path.join(self.tmp.name, "partial")  # a save killed before its manifest
        if not os.path.isdir(partial):
            shutil.copytree(saved, partial)
            for name in ("manifest.json", "manifest.json.sha256"):
                os.remove(os.path.join(partial, name))
        cases = {
            "is not a complete checkpoint (no manifest.json)": [self.hf_dir, "--consolidated", out],
            # a DCP step without its manifest: incomplete, as --resume calls it (B7)
            f"{partial!r} is not a complete checkpoint": [partial, "--consolidated", out],
            "--hf needs --config": [os.path.join(self.tmp.name, SAVED[0]), "--hf", out],
            "nothing to write": [self.hf_dir],
            # the outputs: never into a checkpoint's or a run's directory (B8)
            "is inside checkpoint directory":
            [saved, "--consolidated", os.path.join(saved, "out.pt")],
            "is inside the directory of run": [saved, "--consolidated",
                                               os.path.join(run, "x.pt")],
        }
        for message, argv in cases.items():
            status, _, err = run_main(convert_dcp.main, *argv)
            self.assertEqual(status, 2, argv)
            self.assertRegex(err, r"^error: [^\n]+\n$", argv)  # one line, no traceback
            self.assertIn(message, err)
        self.assertFalse(os.path.exists(out))


class DcpSaveAndLoadPeakMemoryPerRank(unittest.TestCase):
    """scripts/dcp_memory.py's world: a 3.2M-parameter Llama saved at tp2 x dp2 ZeRO-1 and
    loaded at dp4 ZeRO-3, DCP and consolidated, each call's peak resident memory per rank."""

    @classmethod
    def setUpClass(cls):
        cls.results = [res["memory"] for res in seed_and_memory_world()]

    def test_every_rank_stays_below_the_full_models_bytes_while_saving_and_loading_dcp(self):
        for rank, r in enumerate(self.results):
            full, largest = r["full"], r["largest"]
            # load: the moments of its shard, then one saved chunk at a time, held twice (its
            # file bytes and the tensor unpickled from them) before the copy into place
            self.assertLessEqual(r["dcp_load"], r["load_shard"] + 2 * largest + SLACK, rank)
            # save: nothing beyond the shard it holds but about one tensor. Each piece goes to
            # DCP's writer with a storage of its own bytes (dcp_pieces.own_storage: a view
            # would be cloned, and kept until the file closes), and the checksum hashes the file
            # in 256 KiB blocks; what is left is one piece's serialization and DCP's plans
            self.assertLessEqual(r["dcp_save"], largest + SLACK, rank)
            for held in (r["save_shard"] + r["dcp_save"], r["load_shard"] + r["dcp_load"]):
                self.assertLess(held, full, f"rank {rank}")

    def test_the_consolidated_path_holds_the_whole_model_on_one_rank_and_loads_it_on_all(self):
        full = self.results[0]["full"]
        self.assertGreaterEqual(self.results[0]["consolidated_save"], full)  # gathered, pickled
        for rank, r in enumerate(self.results):
            self.assertGreaterEqual(r["consolidated_load"], full, rank)  # every rank reads it all


if __name__ == "__main__":
    unittest.main()
