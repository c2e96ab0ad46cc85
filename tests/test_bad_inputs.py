"""Every mistake in a run's inputs is one line before anything starts (doc/bad_inputs.md).

The table: a bad file, directory or value per row, given to a chapter as a user would. Each
must print exactly one line ``error: ...`` naming the file, exit with status 2, print no
traceback and write nothing where the run would write. Most rows run the script in this
process through the path scripts/launch.sh takes first (``--validate-only``); the FRESH rows
run that command in a process of its own as the pre-flight's Python would (forked from the
suite's forkserver: the exit status is the process's, an escaping exception goes through
sys.excepthook); the LAUNCHED rows go through scripts/launch.sh itself, to show the whole
road: the pre-flight's line and status passed on, no torchrun started. The road is the same
for every row and every script (launch.sh runs ``SCRIPT --validate-only`` and passes on its
output and status), so one row takes it (a config read by chapter 00), plus the launcher's
own refusals; chapter 10's data file row is FRESH. RefusedByTheRanksThemselves runs one
on two ranks without the pre-flight.
``python -m tests.test_bad_inputs --table`` prints the doc's table.
"""

import argparse
import contextlib
import dataclasses
import glob
import hashlib
import io
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import unittest
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, NamedTuple, Optional, Tuple

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scaletorch.dist import destroy_pg_manager
from scaletorch.models import LlamaConfig, build_model
from scaletorch.models.hf import config_to_hf
from scaletorch.rules.safe_files import checksum_line, checksum_path, write_checksummed
from scaletorch.trainer import checkpoint as ckpt
from scaletorch.trainer.config import parse_args
from scaletorch.trainer.resume_check import record
from tests.harness import NCCL_CHECKS, launch_forked, run_distributed, run_forked
from tests.layouts import build, pg_manager_for
from tests.test_checksums import flip_byte
from tests.test_examples import ROOT, launch_status

C00, C07, C10 = "examples/00_single_device.py", "examples/07_nd_parallel.py", \
    "examples/10_real_model.py"
PREPARE = "scripts/prepare_text.py"
HAVE_HF = all(__import__("importlib").util.find_spec(m) for m in ("safetensors", "tokenizers"))
DOC = os.path.join(ROOT, "doc", "bad_inputs.md")


class Row(NamedTuple):
    what: str  # the mistake, as the doc's table names it
    script: str
    args: Tuple[str, ...]  # D stands for the folder of bad files
    says: str  # a fragment of the error line (with D); it names the file or value
    launched: bool = False  # through scripts/launch.sh, not in this process
    fresh: bool = False  # the pre-flight's command in a process of its own (run_forked)
    hf: bool = False  # needs the hf extra (safetensors, tokenizers)
    launcher: Tuple[str, ...] = ()  # scripts/launch.sh's own options (a launched row)


ROWS = [
    # the config file
    Row(
        "--config of a malformed YAML file", C00, ("--config", "D/malformed.yaml"),
        "config file 'D/malformed.yaml' is not valid YAML at line 2, column 1: expected ',' or ']'",
        launched=True),
    Row("--config of a file that does not exist", C00, ("--config", "D/nope.yaml"),
        "config file 'D/nope.yaml' does not exist"),
    Row("--config of a directory", C00, ("--config", "D/folder"),
        "config file 'D/folder' is a directory, not a file"),
    Row("--config of an empty file (comments only)", C00, ("--config", "D/empty.yaml"),
        "config file 'D/empty.yaml' holds no settings"),
    Row("--config of a file that is not text", C00, ("--config", "D/latin1.yaml"),
        "config file 'D/latin1.yaml' is not text (byte 0xe9"),
    Row("a key of the wrong type inside YAML", C00, ("--config", "D/wrong_type.yaml"),
        "D/wrong_type.yaml: training.steps must be int, got 'ten'"),
    Row("an unknown key inside YAML", C00, ("--config", "D/unknown_key.yaml"),
        "D/unknown_key.yaml: unknown config key 'training.stepz'"),
    Row("a YAML list where sections belong", C00, ("--config", "D/list.yaml"),
        "D/list.yaml must be a mapping of sections, got list"),
    # values, checked by one schema (scaletorch/rules/schema.py)
    Row("a value that is not finite", C00, ("--set", "training.lr=inf"),
        "training.lr must be >= 0 and finite, got inf", fresh=True),
    Row("a NaN inside YAML", C00, ("--config", "D/nan.yaml"),
        "D/nan.yaml: training.lr must be >= 0 and finite, got nan"),
    Row("a beta outside [0, 1)", C00, ("--training.beta1", "1.5"),
        "training.beta1 must be in [0, 1) and finite, got 1.5"),
    Row("--data.path given with the synthetic dataset, which ignores it", C00,
        ("--data.path", "D/long.txt"),
        "data.path 'D/long.txt' is given, but data.dataset 'synthetic' ignores it"),
    Row("a strategy option given to chapter 00, which runs none", C00, ("--zero-stage", "1"),
        "parallel.zero_stage 1 is given, but this script does not read parallel"),
    Row(
        "a pipeline schedule without a pipeline (pp 1), which ignores it", C00,
        ("--schedule", "afab"),
        "parallel.schedule 'afab' is given, but parallel.pipeline_model_parallel_size 1 "
        "ignores it"),
    Row("--init-from a config.json with a number written as a string", C10,
        ("--init-from", "D/hf_string", "--trust-unchecked", "D/hf_string"),
        "D/hf_string/config.json: max_position_embeddings must be int, got '2048'"),
    Row("--init-from a config.json with a null rms_norm_eps", C10,
        ("--init-from", "D/hf_null", "--trust-unchecked", "D/hf_null"),
        "D/hf_null/config.json: rms_norm_eps must be positive and finite, got null"),
    Row(
        "--max-new-tokens beyond the model's positions (chapter 10)", C10,
        ("--max-new-tokens", "200"), "--max-new-tokens 200: prompt (16) + max_new_tokens (200) "
        "= 216 exceeds max_seq_len (128)", fresh=True),
    # the data
    Row("--data.path of a text too short for one sequence (3 bytes, 129 needed)", C10,
        ("--data.path", "D/short.txt"),
        "data.path 'D/short.txt' has 3 bytes, fewer than the 129 one sequence needs"),
    Row("--data.path of a binary file read as text", C10, ("--data.path", "D/binary.txt"),
        "data.path 'D/binary.txt' is not text: it holds a NUL byte at offset 0", fresh=True),
    Row("--data.path of a text that is not UTF-8", C10, ("--data.path", "D/latin1.txt"),
        "data.path 'D/latin1.txt' is not text: it is not UTF-8 (byte 0xe9 at offset 3)"),
    Row("--data.path of an empty file", C10, ("--data.path", "D/empty.txt"),
        "data.path 'D/empty.txt' is empty"),
    Row("--data.path of a directory", C10, ("--data.path", "D/folder"),
        "data.path 'D/folder' is a directory, not a file"),
    Row("--data.path of a file that does not exist", C10, ("--data.path", "D/nope.txt"),
        "data.path 'D/nope.txt' does not exist"),
    Row("a .bin too short for one sequence", C10,
        ("--data.dataset", "bin", "--data.path", "D/tokens3.bin", "--trust-unchecked",
         "D/tokens3.bin"),
        "data.path 'D/tokens3.bin' has 3 tokens, fewer than the 129 one sequence needs"),
    Row("a .bin with tokens outside the vocabulary", C10,
        ("--data.dataset", "bin", "--data.path", "D/vocab300.bin", "--trust-unchecked",
         "D/vocab300.bin"),
        "data.path 'D/vocab300.bin' holds token 300 (at index 0), outside model.vocab_size 256"),
    Row("a .bin whose dtype does not fit the vocabulary (uint16 read as uint32)", C10,
        ("--data.dataset", "bin", "--data.path", "D/odd.bin", "--model.vocab_size", "100000",
         "--trust-unchecked", "D/odd.bin"),
        "data.path 'D/odd.bin' has 602 bytes, not a whole number of uint32 tokens"),
    Row("a .bin without its .sha256 (made by another tool)", C10,
        ("--data.dataset", "bin", "--data.path", "D/vocab300.bin"),
        "data.path (a token file) 'D/vocab300.bin' has no checksum file vocab300.bin.sha256"),
    # a Hugging Face directory to start from
    Row("--init-from a directory without checksums (as the Hub gives)", C10,
        ("--init-from", "D/hf_string"),
        "Hugging Face file 'D/hf_string/config.json' has no checksum file config.json.sha256"),
    Row(
        "--init-from a Hugging Face directory of another architecture (GPT2LMHeadModel)", C10,
        ("--init-from", "D/gpt2", "--trust-unchecked", "D/gpt2"),
        "D/gpt2/config.json: model_type 'gpt2' / architectures "
        "['GPT2LMHeadModel'] is not a Llama", fresh=True),
    Row("--init-from a directory that does not exist", C10, ("--init-from", "D/nope"),
        "Hugging Face directory D/nope does not exist"),
    Row("--init-from a file", C10, ("--init-from", "D/short.txt"),
        "D/short.txt is a file, not a Hugging Face model directory"),
    Row("--init-from a directory without config.json", C10, ("--init-from", "D/folder"),
        "D/folder is not a Hugging Face model directory: config.json is missing"),
    Row("--init-from a config.json that is not JSON", C10,
        ("--init-from", "D/bad_json", "--trust-unchecked", "D/bad_json"),
        "D/bad_json/config.json' is not valid JSON"),
    Row("--init-from a truncated safetensors file", C10, ("--init-from", "D/truncated"),
        "D/truncated/model.safetensors is not a readable safetensors file", hf=True),
    Row(
        "--init-from weights of another size than its config.json", C10,
        ("--init-from", "D/resized", "--trust-unchecked", "D/resized"),
        "D/resized/model.safetensors: tensor "
        "model.layers.0.mlp.down_proj.weight has shape (32, 64), but config.json implies "
        "(32, 128)", hf=True),
    Row(
        "--init-from a Llama whose vocabulary is smaller than text needs", C10,
        ("--init-from", "D/vocab128"),
        "--init-from D/vocab128 (its config.json sets model.*): the byte-level text dataset "
        "needs model.vocab_size >= 256, got 128", hf=True),
    # a checkpoint to resume
    Row("--resume of a file that is not a checkpoint", C00, ("--resume", "D/short.txt"),
        "--resume D/short.txt is a file, not a checkpoint directory", fresh=True),
    Row("--resume of a path that does not exist", C00, ("--resume", "D/nope"),
        "--resume D/nope does not exist"),
    Row("--resume of a directory that is not a checkpoint", C00, ("--resume", "D/folder"),
        "'D/folder' is not a complete checkpoint (no manifest.json)"),
    Row("--resume of the checkpoints folder instead of one checkpoint", C00,
        ("--resume", "D/ckpts"), "it holds checkpoints: resume one, e.g. --resume "
        "D/ckpts/step_0000005"),
    Row("--resume of a checkpoint of another model size", C00, ("--resume", "D/ckpts/step_0000005"),
        "--resume D/ckpts/step_0000005 was written by another run: model.hidden_size 128 -> 64"),
    Row("--resume of a checkpoint at or past --steps", C00,
        ("--resume", "D/done/step_0000005", "--steps", "3"),
        "--resume D/done/step_0000005 is at step 5, and training.steps is 3", fresh=True),
    Row("--resume of a consolidated file at --steps (chapter 07)", C07,
        ("--resume", "D/done.pt", "--steps", "4"),
        "--resume D/done.pt is at step 4, and training.steps is 4"),
    Row("--resume of a checkpoint with a damaged file", C00, ("--resume", "D/damaged/step_0000005"),
        "rank_00000.pt does not match its sha256 in the manifest"),
    Row(
        "--resume of a consolidated file of another model size", C07,
        ("--resume", "D/other_size.pt"), "--resume D/other_size.pt holds another model: "
        "embed_tokens.weight is shape (64, 128) there, shape (64, 64)"),
    # a sharded (DCP) checkpoint of chapter 07: every file checksummed in its manifest
    Row(
        "--resume of a DCP checkpoint with a flipped byte in a shard", C07,
        ("--resume", "D/dcp_flipped/step_0000002"),
        "checkpoint 'D/dcp_flipped/step_0000002': __1_0.distcp does not match its sha256 in the "
        "manifest"),
    Row("--resume of a DCP checkpoint missing a shard", C07,
        ("--resume", "D/dcp_missing/step_0000002"),
        "checkpoint 'D/dcp_missing/step_0000002' is missing __1_0.distcp"),
    Row(
        "--resume of a DCP checkpoint with a truncated .metadata", C07,
        ("--resume", "D/dcp_truncated/step_0000002"),
        "checkpoint 'D/dcp_truncated/step_0000002': .metadata does not match its sha256 in the "
        "manifest (100 bytes; truncated or damaged)"),
    Row(
        "--resume of a DCP checkpoint of another model size", C07,
        ("--resume", "D/dcp/step_0000002", "--model.intermediate_size", "96"),
        "--resume D/dcp/step_0000002 was written by another run: model.intermediate_size 128 -> "
        "96 (checkpoint -> this run)"),
    Row("--resume of a DCP save killed before its manifest", C07,
        ("--resume", "D/dcp_partial/step_0000002"),
        "'D/dcp_partial/step_0000002' is not a complete checkpoint (no manifest.json)"),
    Row("--resume of a torch file that needs more than tensors", C07, ("--resume", "D/pickle.pt"),
        "--resume D/pickle.pt needs more than tensors"),
    Row("--resume of a file that is not a torch file (chapter 07)", C07,
        ("--resume", "D/short.txt"), "--resume D/short.txt is not a consolidated checkpoint"),
    Row("--resume of a consolidated file with a damaged byte", C07, ("--resume", "D/damaged.pt"),
        "'D/damaged.pt' does not match its checksum in damaged.pt.sha256"),
    Row(
        "--resume of a consolidated file of a deeper model (one layer more)", C07,
        ("--resume", "D/deeper.pt"), "--resume D/deeper.pt holds another model: 9 tensor(s) that "
        "this config's model.* does not have, e.g. layers.4."),
    # a run directory that holds a run
    Row(
        "a run name whose directory holds a run, without --resume", C00,
        ("--logging.run_dir", "D/finished"), "logging.run_dir: 'D/finished/00_single_device' "
        "already holds a run (config.yaml, metrics.jsonl); nothing was written"),
    # where the run writes
    Row(
        "--logging.run_dir that cannot be created", C00, ("--logging.run_dir", "D/short.txt/runs"),
        "logging.run_dir: cannot create 'D/short.txt/runs/00_single_device', since "
        "'D/short.txt' is a file"),
    Row("--logging.run_dir that cannot be written (read-only)", C00,
        ("--logging.run_dir", "READONLY/runs"), "logging.run_dir: cannot write "
        "'READONLY/runs/00_single_device'"),
    Row("--checkpoint.dir that cannot be created", C00,
        ("--checkpoint.every", "5", "--checkpoint.dir", "D/short.txt/ckpts"),
        "checkpoint.dir: cannot create 'D/short.txt/ckpts'"),
    Row("--logging.plan_cluster of a file that does not exist", C00,
        ("--logging.plan_cluster", "D/nope.json"), "logging.plan_cluster 'D/nope.json' is not a "
        "file"),
    # the launcher's own options (scripts/launch.sh), refused before any Python starts
    Row("--nproc-per-node 0", C00, ("--steps", "5"), "--nproc-per-node must be at least 1, got 0",
        launched=True, launcher=("--nproc-per-node", "0")),
    Row("a launcher option without its value", C00, ("--steps", "5"), "--master-port needs a value",
        launched=True, launcher=("--master-port", )),
    Row("a master port out of range", C00, ("--steps", "5"),
        "--master-port must be in 1..65535, got 65536", launched=True,
        launcher=("--master-port", "65536")),
    # preparing a .bin (scripts/prepare_text.py)
    Row("--tokenizer of a tokenizer.json that is not one", PREPARE,
        ("D/long.txt", "--tokenizer", "D/not_tokenizer.json", "--out", "D/out/x.bin"),
        "tokenizer file 'D/not_tokenizer.json' is not a tokenizer.json", hf=True),
    Row("a text that is not UTF-8, where the tokenizer needs text", PREPARE,
        ("D/latin1.txt", "--out", "D/out/x.bin"),
        "text file 'D/latin1.txt' is not text: it is not UTF-8 (byte 0xe9 at offset 3)"),
]


def _write(path: str, data) -> None:
    with open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


def _fake_checkpoint(root: str, model_args: List[str], damaged: bool = False) -> None:
    """A complete checkpoint of chapter 00 at step 5 (its manifest as the Trainer writes it)
    for ``model_args``; its rank file is a stand-in, checked by checksum only."""
    cfg = parse_args(["--config", "examples/configs/00_single_device.yaml", *model_args])
    path = ckpt.step_dir(root, 5)
    os.makedirs(path)
    data = b"rank 0's state"
    _write(ckpt.rank_file(path, 0), data + (b"!" if damaged else b""))  # damaged after the save
    _write(checksum_path(ckpt.rank_file(path, 0)), checksum_line("rank_00000.pt", data))
    manifest = {
        "format_version": ckpt.FORMAT_VERSION,
        "step": 5,
        "world_size": 1,
        "layout": {
            **ckpt.run_layout(cfg, 1), "config": record(cfg)
        },
        "sha256": {
            "rank_00000.pt": hashlib.sha256(data).hexdigest()
        }
    }
    write_checksummed(os.path.join(path, ckpt.MANIFEST), json.dumps(manifest).encode())


def _dcp_checkpoint(rank: int, world: int, root: str) -> None:
    """Inside a world of 2: chapter 07's model at dp 2 ZeRO-1, 2 steps, then the Trainer's DCP
    save of step 2 under ``root`` (``__0_0.distcp``, ``__1_0.distcp``, ``.metadata``, manifest)."""
    cfg = parse_args(["--config", "examples/configs/07_nd_parallel.yaml", "--zero-stage", "1"])
    cfg.training.steps, cfg.logging.progress = 2, False
    cfg.checkpoint.format, cfg.checkpoint.dir = "dcp", root
    pgm = pg_manager_for(cfg)
    _, trainer = build(cfg, pgm)
    for _ in range(2):
        trainer.train_step()
    trainer.save()
    destroy_pg_manager()


def _dcp_checkpoints(d: str) -> None:
    """A DCP checkpoint of chapter 07 (D/dcp/step_0000002) and its damaged copies."""
    run_distributed(_dcp_checkpoint, 2, os.path.join(d, "dcp"), timeout=300)
    damage = {
        "dcp_flipped":
        lambda path: flip_byte(os.path.join(path, "__1_0.distcp")),
        "dcp_missing":
        lambda path: os.remove(os.path.join(path, "__1_0.distcp")),
        "dcp_truncated":
        lambda path: os.truncate(os.path.join(path, ".metadata"), 100),
        # killed before its manifest: the files a save writes first, without the manifest
        "dcp_partial":
        lambda path:
        [os.remove(os.path.join(path, ckpt.MANIFEST + end)) for end in ("", ".sha256")],
    }
    for name, change in damage.items():
        shutil.copytree(os.path.join(d, "dcp"), os.path.join(d, name))
        change(ckpt.step_dir(os.path.join(d, name), 2))


def _torch_file(path: str, state: dict) -> None:
    """``state`` saved as chapter 07 saves a consolidated file: with its checksum beside it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_checksummed(path, buffer.getvalue())


def make_bad_inputs(d: str) -> None:
    """Every bad file and folder of the table, in ``d``."""
    os.makedirs(os.path.join(d, "folder"))
    _write(os.path.join(d, "malformed.yaml"), "training: {steps: [1, 2\n")
    _write(os.path.join(d, "empty.yaml"), "# settings to come\n")
    _write(os.path.join(d, "latin1.yaml"), "logging:\n  name: caf\xe9\n".encode("latin-1"))
    _write(os.path.join(d, "wrong_type.yaml"), "training:\n  steps: ten\n")
    _write(os.path.join(d, "unknown_key.yaml"), "training:\n  stepz: 3\n")
    _write(os.path.join(d, "list.yaml"), "- training\n- data\n")
    _write(os.path.join(d, "short.txt"), "abc")
    _write(os.path.join(d, "long.txt"), "Tensor parallel splits every matrix. " * 20)
    _write(os.path.join(d, "empty.txt"), "")
    _write(os.path.join(d, "binary.txt"), bytes(range(256)) * 4)
    _write(os.path.join(d, "latin1.txt"), ("caf\xe9 au lait. " * 30).encode("latin-1"))
    np.arange(1, 4, dtype=np.uint16).tofile(os.path.join(d, "tokens3.bin"))
    np.full(200, 300, dtype=np.uint16).tofile(os.path.join(d, "vocab300.bin"))
    np.arange(301, dtype=np.uint16).tofile(os.path.join(d, "odd.bin"))  # 602 bytes
    _write(os.path.join(d, "not_tokenizer.json"), '{"version": "1.0", "model": 3}')
    os.makedirs(os.path.join(d, "gpt2"))
    _write(os.path.join(d, "gpt2", "config.json"),
           json.dumps({
               "architectures": ["GPT2LMHeadModel"],
               "model_type": "gpt2",
               "n_embd": 64
           }))
    os.makedirs(os.path.join(d, "bad_json"))
    _write(os.path.join(d, "bad_json", "config.json"), '{"model_type": "llama",')
    if HAVE_HF:
        from scaletorch.models.hf import export_hf_llama
        small = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_seq_len=128)
        for name, vocab in (("llama", 256), ("vocab128", 128)):
            export_hf_llama(build_model(LlamaConfig(vocab_size=vocab, **small), seed=0),
                            os.path.join(d, name))
        for name in ("truncated", "resized"):
            shutil.copytree(os.path.join(d, "llama"), os.path.join(d, name))
        weights = os.path.join(d, "truncated", "model.safetensors")
        os.truncate(weights, os.path.getsize(weights) // 2)
        config_file = os.path.join(d, "resized", "config.json")
        for name in glob.glob(os.path.join(d, "resized", "*.sha256")):  # a config.json edited
            os.remove(name)  # in a directory from the Hub, which has no checksums
        with open(config_file) as f:
            config = json.load(f)
        _write(config_file, json.dumps(dict(config, intermediate_size=128)))
    _write(os.path.join(d, "nan.yaml"), "training:\n  lr: .nan\n")
    for name, change in (("hf_string", {
            "max_position_embeddings": "2048"
    }), ("hf_null", {
            "rms_norm_eps": None
    })):
        os.makedirs(os.path.join(d, name))
        config = config_to_hf(LlamaConfig(vocab_size=256, max_seq_len=2048), torch.float32)
        _write(os.path.join(d, name, "config.json"), json.dumps(dict(config, **change)))
    _fake_checkpoint(os.path.join(d, "done"), [])
    _dcp_checkpoints(d)
    nd = parse_args(["--config", "examples/configs/07_nd_parallel.yaml"]).model
    _torch_file(os.path.join(d, "done.pt"), {
        "step": 4,
        "model": build_model(nd, seed=0).state_dict(),
        "optimizer": None
    })
    _fake_checkpoint(os.path.join(d, "ckpts"), ["--model.hidden_size", "128"])
    _fake_checkpoint(os.path.join(d, "damaged"), [], damaged=True)
    other = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=128, num_layers=4,
                        num_attention_heads=8, num_key_value_heads=4, max_seq_len=64)
    _torch_file(os.path.join(d, "other_size.pt"), {
        "step": 3,
        "model": build_model(other, seed=0).state_dict(),
        "optimizer": None
    })
    _torch_file(os.path.join(d, "pickle.pt"), {"step": 3, "model": argparse.Namespace(weights=1)})
    c07 = parse_args(["--config", "examples/configs/07_nd_parallel.yaml"]).model
    deeper = dataclasses.replace(c07, num_layers=c07.num_layers + 1)  # layers.4 is one too many
    _torch_file(os.path.join(d, "deeper.pt"), {
        "step": 3,
        "model": build_model(deeper, 0).state_dict()
    })
    _torch_file(os.path.join(d, "damaged.pt"), {
        "step": 3,
        "model": build_model(c07, 0).state_dict()
    })
    with open(os.path.join(d, "damaged.pt"), "r+b") as f:  # one byte damaged after the save
        f.seek(1000)
        f.write(b"\xff")
    os.makedirs(os.path.join(d, "finished", "00_single_device"))
    for name in ("config.yaml", "metrics.jsonl"):  # a run's files, as the Trainer leaves them
        _write(os.path.join(d, "finished", "00_single_device", name), "")
    _write(os.path.join(d, "finished", "00_single_device", ".scaletorch-run"), "{}")  # its marker


def tree_digest(d: str) -> Dict[str, str]:
    """{path: sha256 of its bytes} of every file under ``d`` (the read-only directory aside)."""
    out = {}
    for root, dirs, files in os.walk(d):
        dirs[:] = [x for x in dirs if x != "read_only"]
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                out[os.path.join(root, name)] = hashlib.sha256(f.read()).hexdigest()
    return out


def read_only_dir(d: str) -> str:
    """A directory this user cannot write: permission bits stop anyone but root, and root
    is stopped by a filesystem that refuses new entries (sysfs)."""
    if os.geteuid() == 0:
        return "/sys/scaletorch"
    path = os.path.join(d, "read_only")
    os.makedirs(path, exist_ok=True)
    os.chmod(path, 0o555)
    return path


def _argv(row: Row, d: str, read_only: str) -> List[str]:
    return [a.replace("D/", d + "/").replace("READONLY", read_only) for a in row.args]


def run_in_process(script: str, argv: List[str]) -> Tuple[int, str]:
    """``python script --validate-only --world-size 1 ARGV`` as scripts/launch.sh's pre-flight
    runs it, in this process: (exit status, stdout + stderr). prepare_text takes ARGV alone."""
    if script != PREPARE:
        argv = ["--validate-only", "--world-size", "1", *argv]
    out = io.StringIO()
    saved = sys.argv, sys.excepthook, os.getcwd()
    sys.argv = [script, *argv]
    os.chdir(ROOT)
    code: Optional[object] = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        code = done.code
    finally:
        sys.argv, sys.excepthook = saved[0], saved[1]
        os.chdir(saved[2])
    return int(code or 0), out.getvalue()


def run_fresh(script: str, argv: List[str]) -> Tuple[int, str]:
    """``python script --validate-only --world-size 1 ARGV`` in a process of its own, as
    scripts/launch.sh's pre-flight runs it (forked from the suite's forkserver, with the
    launcher's environment): (exit status, stdout + stderr)."""
    done = run_forked(script, "--validate-only", "--world-size", "1", *argv, env={
        **os.environ,
        **NCCL_CHECKS
    }, timeout=180)
    return done.returncode, done.stdout + done.stderr


def run_table(d: str, rows: List[Row]) -> Dict[str, Tuple[int, str, List[str]]]:
    """{row.what: (exit status, output, arguments)}, each row with a run directory of its own;
    the launched rows in two launchers at a time (the pre-flight is one Python each)."""
    read_only = read_only_dir(d)
    results: Dict[str, Tuple[int, str, List[str]]] = {}
    launched = []
    for i, row in enumerate(rows):
        argv = ["--logging.run_dir", os.path.join(d, "runs", str(i))] if row.script != PREPARE \
            else []
        argv += _argv(row, d, read_only)
        if row.launched:
            launched.append((row, argv))
        else:
            code, out = (run_fresh if row.fresh else run_in_process)(row.script, argv)
            results[row.what] = (code, out, argv)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            row.what: (pool.submit(launch_status, row.script, 1, *argv, timeout=180,
                                   launcher=row.launcher), argv)
            for row, argv in launched
        }
        for what, (future, argv) in futures.items():
            out, code, _ = future.result()
            results[what] = (code, out, argv)
    return results


class EveryBadInputIsOneLine(unittest.TestCase):
    """The table, run once for every test of the class."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.d = os.path.join(cls.tmp.name, "bad_inputs")
        os.makedirs(cls.d)
        make_bad_inputs(cls.d)
        cls.before = tree_digest(cls.d)
        cls.rows = [r for r in ROWS if HAVE_HF or not r.hf]
        cls.results = run_table(cls.d, cls.rows)

    @classmethod
    def tearDownClass(cls):
        ro = os.path.join(cls.d, "read_only")
        if os.path.isdir(ro):
            os.chmod(ro, 0o755)
        cls.tmp.cleanup()

    def test_the_table_has_every_case_of_the_issue_and_more(self):
        self.assertGreaterEqual(len(ROWS), 25)
        self.assertEqual(len({r.what for r in ROWS}), len(ROWS))
        self.assertGreaterEqual(sum(r.launched for r in ROWS), 4)
        self.assertGreaterEqual(sum(r.launched and not r.launcher for r in ROWS), 1)
        self.assertGreaterEqual(sum(r.fresh for r in ROWS), 5)
        self.assertTrue(any(r.fresh and r.script == C10 for r in ROWS))

    def test_each_bad_input_is_one_error_line_naming_it_exit_2_no_traceback(self):
        read_only = read_only_dir(self.d)
        for row in self.rows:
            with self.subTest(what=row.what):
                code, out, _ = self.results[row.what]
                says = row.says.replace("D/", self.d + "/").replace("READONLY", read_only)
                self.assertEqual(code, 2, out[-2000:])
                self.assertEqual(out.count("error: "), 1, out[-2000:])
                self.assertIn(says, out)
                self.assertNotIn("Traceback", out)
                self.assertNotIn("torchrun.py", out)  # launched: refused before any rank
                line = next(x for x in out.splitlines() if x.startswith("error: "))
                self.assertEqual(out.strip(), line)  # nothing but the line

    def test_nothing_is_written_where_the_run_would_write(self):
        self.assertFalse(os.path.exists(os.path.join(self.d, "runs")))
        self.assertEqual(tree_digest(self.d), self.before)  # no bad input was changed either
        self.assertFalse(os.path.exists(os.path.join(self.d, "out")))
        leftovers = [n for n in os.listdir(self.d) if n.startswith(".scaletorch-probe")]
        self.assertEqual(leftovers, [])

    def test_the_doc_shows_every_row(self):
        with open(DOC, encoding="utf-8") as f:
            doc = f.read()
        for row in ROWS:
            with self.subTest(what=row.what):
                self.assertIn(f"| {row.what} |", doc)
                self.assertIn(
                    row.says.replace("D/",
                                     "/tmp/bad_inputs/").replace("READONLY", "/sys/scaletorch"),
                    doc)


class RefusedByTheRanksThemselves(unittest.TestCase):
    """Without the launcher's pre-flight, every rank refuses and rank 0 says it once; an
    InputError found later ends the script the same way; a bug keeps its traceback."""

    def test_two_ranks_refuse_a_bad_file_with_one_line_and_exit_2(self):
        # the ranks forked as torchrun starts them (no pre-flight, no torchrun): each refuses
        # the file in its load_config, rank 0 with the line. torchrun's part, ending the other
        # ranks quietly on a status 2, is tests/test_layout_errors.py's launch without the
        # pre-flight (the same road for every refusal of load_config)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "short.txt")
            _write(path, "abc")
            out, code = launch_forked(C10, 2, "--logging.run_dir", tmp, "--data.path", path,
                                      "--steps", "1", timeout=180)
        self.assertEqual(code, 2, out[-2000:])
        self.assertEqual(out.count("error: data.path"), 1, out[-2000:])
        self.assertNotIn("Traceback", out)

    def _python(self, code: str) -> subprocess.CompletedProcess:
        """``python -c CODE`` after the scripts' hook is set, as a process of its own (forked
        from the suite's forkserver: the hook runs as Python's own, on an escaping exception)."""
        prelude = ("import sys; from scaletorch.trainer.config import InputError, "
                   "report_input_errors; sys.excepthook = report_input_errors; ")
        with tempfile.TemporaryDirectory() as tmp:
            script = os.path.join(tmp, "snippet.py")
            _write(script, prelude + code + "\n")
            return run_forked(script, timeout=120)

    def test_an_input_error_found_later_is_one_line_and_a_bug_keeps_its_traceback(self):
        later = self._python("print('step 1'); raise InputError('data.path x.bin holds token 9')")
        self.assertEqual((later.returncode, later.stdout, later.stderr),
                         (2, "step 1\n", "error: data.path x.bin holds token 9\n"))
        bug = self._python("raise KeyError('a bug')")
        self.assertEqual(bug.returncode, 1)
        self.assertIn("Traceback", bug.stderr)
        self.assertIn("KeyError: 'a bug'", bug.stderr)


def print_table() -> None:
    """The doc's table, from a run of every row (paths as /tmp/bad_inputs/...)."""
    with tempfile.TemporaryDirectory() as tmp:
        d = os.path.join(tmp, "bad_inputs")
        os.makedirs(d)
        make_bad_inputs(d)
        results = run_table(d, ROWS)
        print("| mistake | command | what the user sees |")
        print("| --- | --- | --- |")
        for row in ROWS:
            code, out, argv = results[row.what]
            line = out.strip().replace(d, "/tmp/bad_inputs")
            args = " ".join(row.args).replace("D/", "/tmp/bad_inputs/").replace(
                "READONLY", "/sys/scaletorch")
            command = f"{row.script} {args}"
            if row.launcher:
                command = f"scripts/launch.sh {row.script} {' '.join(row.launcher)} -- {args}"
            print(f"| {row.what} | `{command}` | `{line}` (exit {code}) |")


if __name__ == "__main__":
    if sys.argv[1:] == ["--table"]:
        print_table()
    else:
        unittest.main()


class PrepareTextNeverWritesOverAFileItDidNotMake(unittest.TestCase):
    """scripts/prepare_text.py with --out spelled as one of its inputs in any way (the same
    name, ./, a longer path through .., a symlink) or naming an existing file of the user's:
    exit 2, one ``error:`` line, every file as it was. Its own earlier output (a matching
    .sha256) may be written again. In this process; 20 examples, 200 long."""

    @settings(max_examples=200 if os.environ.get("SCALETORCH_LONG_TESTS") == "1" else 20,
              deadline=None)
    @given(
        spelling=st.sampled_from(["same", "dot", "dotdot", "absolute", "symlink", "user", "ours"]),
        which=st.integers(0, 2), text=st.text(alphabet="abc \n", min_size=1, max_size=40))
    def test_out_is_never_an_input_nor_a_users_file(self, spelling, which, text):
        with tempfile.TemporaryDirectory() as d:
            inputs = []
            for i in range(3):
                inputs.append(os.path.join(d, f"in{i}.txt"))
                with open(inputs[-1], "w") as f:
                    f.write(text + str(i))
            target = inputs[which]
            out = {
                "same": target,
                "dot": os.path.join(os.path.dirname(target), ".", os.path.basename(target)),
                "dotdot": os.path.join(d, "..", os.path.basename(d), os.path.basename(target)),
                "absolute": os.path.abspath(target),
                "symlink": os.path.join(d, "link.bin"),
                "user": os.path.join(d, "mine.bin"),
                "ours": os.path.join(d, "ours.bin"),
            }[spelling]
            if spelling == "symlink":
                os.symlink(target, out)
            if spelling == "user":
                with open(out, "w") as f:
                    f.write("my notes")
            if spelling == "ours":
                self.assertEqual(run_in_process(PREPARE, [*inputs, "--out", out])[0], 0)
            before = tree_digest(d)
            code, output = run_in_process(PREPARE, [*inputs, "--out", out])
            if spelling == "ours":
                self.assertEqual(code, 0, output)
                return
            self.assertEqual(code, 2, output)
            self.assertEqual(len(output.splitlines()), 1, output)
            self.assertTrue(output.startswith("error: --out"), output)
            self.assertEqual(tree_digest(d), before)


def _value_options() -> List[Tuple[str, str]]:
    """(script, option) of every option that takes one value: those of load_config's parsers
    (the pre-flight's, ``parse_args``'s fixed ones and its aliases) and chapter 10's own."""
    from scaletorch.trainer.config import ALIASES
    options = [(C00, flag)
               for flag in ["--config", "--set", "--trust-unchecked", "--world-size", *ALIASES]]
    return options + [
        (C10, flag) for flag in
        ["--init-from", "--prompt", "--max-new-tokens", "--temperature", "--top-k", "--top-p"]
    ]


class AnOptionWithoutItsValueIsOneLine(unittest.TestCase):
    """Generated: each option that takes a value, given none (the last word, or followed by
    ``-x``, which argparse reads as an option), is one ``error:`` line naming the option and
    exit 2, as an unknown option is; never argparse's usage (23 lines)."""

    @settings(max_examples=200 if os.environ.get("SCALETORCH_LONG_TESTS") == "1" else 20,
              deadline=None)
    @given(option=st.sampled_from(_value_options()), dash=st.booleans())
    def test_exit_2_one_line_naming_the_option(self, option, dash):
        script, flag = option
        with tempfile.TemporaryDirectory() as d:
            code, out = run_in_process(script,
                                       ["--logging.run_dir", d, flag] + (["-x"] if dash else []))
        self.assertEqual(code, 2, out)
        self.assertEqual(len(out.splitlines()), 1, out)
        self.assertTrue(out.startswith(f"error: argument {flag}"), out)
