"""Checkpoints that survive a crash mid-write: one file per rank, a manifest written last.

Layout of one checkpoint (every strategy uses it: each rank saves what it holds, so a sharded
model is saved sharded)::

    <dir>/step_0000040/rank_00000.pt     model, optimizer, scheduler, RNG of rank 0
    <dir>/step_0000040/rank_00001.pt
    <dir>/step_0000040/manifest.json     written by rank 0 after every rank has finished

Each file is written to a temporary name, flushed to disk (fsync) and renamed, so a file
either exists whole or not at all; a checkpoint without its manifest is incomplete and is
ignored. The manifest holds a format version and the sha256 of every rank's file, so a file
truncated or damaged later is detected, and ``latest_valid_checkpoint`` falls back to the one
before. Resuming needs the same world size and model (loading at another layout is chapter
07's). With several nodes the directory must be on a filesystem that every node sees.

``check_resume`` makes every check a resume makes before any process starts, without loading
a tensor; a checkpoint that cannot resume raises an ``InputError`` naming it.
"""

import io
import json
import os
import pickle
import random
import re
import shutil
import warnings
import zipfile
from contextlib import contextmanager, suppress
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from scaletorch.config import Config
from scaletorch.dist import comm, restart_count
from scaletorch.dist.dtensor import is_dtensor
from scaletorch.models import Llama
from scaletorch.parallel.memory_report import storage_key
from scaletorch.rules import boundary
from scaletorch.rules.errors import InputError, MissingInputError, clip
from scaletorch.rules.safe_files import (CorruptFileError, checksum_line, checksum_path,
                                         read_checksum, read_checksummed, sha256, write_atomic,
                                         write_checksummed)
from scaletorch.schedule.placement import V_SHAPED
from scaletorch.trainer.resume_check import check_resumed

FORMAT_VERSION = 2  # 2: every file has its checksum beside it (<name>.sha256), the manifest too
MANIFEST = "manifest.json"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:07d}")


def rank_file(path: str, rank: int) -> str:
    return os.path.join(path, f"rank_{rank:05d}.pt")


def rng_state() -> Dict[str, Any]:
    """The Python, NumPy, torch (and CUDA) generator states, in values that
    ``torch.load(weights_only=True)`` reads: Python's is a tuple of ints; NumPy's key (an
    ndarray of 624 uint32) becomes an int64 tensor beside its plain ints and float."""
    numpy = np.random.get_state(legacy=False)  # {"bit_generator", "state", "has_gauss", "gauss"}
    numpy["state"] = {
        "key": torch.from_numpy(numpy["state"]["key"].astype(np.int64)),
        "pos": int(numpy["state"]["pos"]),
    }
    state = {
        "python": random.getstate(),
        "numpy": numpy,
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned (rebuilding NumPy's ndarray key)."""
    random.setstate(state["python"])
    numpy = dict(state["numpy"])
    numpy["state"] = {
        "key": numpy["state"]["key"].numpy().astype(np.uint32),
        "pos": numpy["state"]["pos"],
    }
    np.random.set_state(numpy)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def list_checkpoints(root: str) -> List[str]:
    """Complete checkpoints (those with a manifest) under ``root``, oldest first."""
    if not os.path.isdir(root):
        return []
    found = [
        os.path.join(root, d) for d in sorted(os.listdir(root))
        if d.startswith("step_") and os.path.isfile(os.path.join(root, d, MANIFEST))
    ]
    return found


def latest_checkpoint(root: str) -> Optional[str]:
    found = list_checkpoints(root)
    return found[-1] if found else None


class SizeCounter:
    """Where a dry run's checkpoints go instead of the disk (scaletorch/trainer/dry_run.py):
    ``files`` {path: {section: bytes}}, the bytes of the tensors each file would hold under
    each key of its state ("model", "optimizer", ...), every storage once and whole, as
    ``torch.save`` writes it. Nothing is serialized: a meta tensor has no bytes to write, and
    a 405B rank's file would be tens of GB."""

    def __init__(self) -> None:
        self.files: Dict[str, Dict[str, int]] = {}

    def add(self, path: str, state: Dict[str, Any]) -> None:
        seen: Set[int] = set()
        self.files[path] = {key: tensor_bytes(value, seen) for key, value in state.items()}


def tensor_bytes(value: Any, seen: Optional[Set[int]] = None) -> int:
    """Bytes of the storages of the tensors in ``value`` (nested dicts, lists, tuples), each
    storage once (``seen``: those already counted), whole: what ``torch.save`` writes of them."""
    seen = set() if seen is None else seen
    if torch.is_tensor(value):
        key = storage_key(value)  # the storage object's: a meta tensor's data is at 0
        if key in seen:
            return 0
        seen.add(key)
        return value.untyped_storage().nbytes()
    if isinstance(value, dict):
        return sum(tensor_bytes(v, seen) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in value)
    return 0


def adamw_settings(group: Dict[str, Any]) -> Dict[str, float]:
    """beta1, beta2 and weight_decay of an AdamW parameter group: what a resume compares with
    its own config, to say which changed."""
    return {
        "beta1": float(group["betas"][0]),
        "beta2": float(group["betas"][1]),
        "weight_decay": float(group["weight_decay"])
    }


def save_checkpoint(root: str, step: int, state: Dict[str, Any], rank: int, world_size: int,
                    keep_last: int = 2, group: Optional[dist.ProcessGroup] = None,
                    layout: Optional[Dict[str, Any]] = None,
                    counter: Optional[SizeCounter] = None) -> str:
    """Every rank writes its ``state``; rank 0 writes the manifest once all have finished.

    Collective over ``group`` (the default: every rank). ``layout`` (e.g. the parallel sizes
    and ZeRO stage) goes into the manifest: the files are shards of that layout, and
    ``load_checkpoint`` refuses another. Returns the checkpoint directory. ``counter`` (a dry
    run's): each rank's file is counted there, not written, and no directory is touched; the
    barriers run as in a real save.
    """
    path = step_dir(root, step)
    if counter is not None:
        counter.add(rank_file(path, rank), state)
        comm.barrier(group)  # the two of _save_files: every file written, then the manifest
        comm.barrier(group)
        return path
    mine = [rank_file(path, rank)] + ([os.path.join(path, MANIFEST)] if rank == 0 else [])
    with removed_unless_complete(path, mine):  # a stop even before the first file: no dir left
        os.makedirs(path, exist_ok=True)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        _save_files(root, path, step, buffer.getvalue(), rank, world_size, keep_last, group, layout)
    return path


@contextmanager
def removed_unless_complete(path: str, files: List[str]) -> Iterator[None]:
    """If the block fails (a full disk: WriteError, or Ctrl-C) before checkpoint ``path`` has
    its manifest, remove ``files`` and their checksum files, and the directory if that empties
    it (or it holds nothing yet): no partial checkpoint, no empty step directory stays. A
    checkpoint with its manifest is whole: it stays. Each rank removes its own files; the last
    to do so removes the directory (another rank's files may still be there, or be written
    after this rank looked)."""
    try:
        yield
    except BaseException:
        if not os.path.exists(os.path.join(path, MANIFEST)):
            for file in files + [checksum_path(f) for f in files]:
                if os.path.exists(file):
                    os.remove(file)
            with suppress(OSError):  # not empty: another rank's files, which it removes
                os.rmdir(path)
        raise


def _save_files(root: str, path: str, step: int, data: bytes, rank: int, world_size: int,
                keep_last: int, group: Optional[dist.ProcessGroup],
                layout: Optional[Dict[str, Any]]) -> None:
    write_checksummed(rank_file(path, rank), data)
    comm.barrier(group)  # the manifest must only exist once every rank's file does
    if rank == 0:
        files = {
            os.path.basename(rank_file(path, r)): read_checksum(rank_file(path, r))
            for r in range(world_size)
        }
        write_manifest(root, path, step, world_size, layout, files, keep_last)
    comm.barrier(group)


def write_manifest(root: str, path: str, step: int, world_size: int,
                   layout: Optional[Dict[str, Any]], files: Dict[str, str], keep_last: int,
                   checkpoint_format: Optional[str] = None) -> None:
    """Rank 0, once every file of checkpoint ``path`` is whole: the manifest (``files``: the
    sha256 of each, by name), which marks it complete; then delete all but the ``keep_last``
    newest under ``root``. ``checkpoint_format`` "dcp": a sharded checkpoint (dcp_checkpoint.py)
    that resumes at any layout."""
    manifest = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "layout": layout or {},
        "sha256": files
    }
    if checkpoint_format is not None:
        manifest["format"] = checkpoint_format
    data = json.dumps(manifest, indent=1).encode()
    # its checksum first: the manifest marks the checkpoint complete, so it comes last
    write_atomic(checksum_path(os.path.join(path, MANIFEST)), checksum_line(MANIFEST, data))
    write_atomic(os.path.join(path, MANIFEST), data)
    for old in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


# A checkpoint whose manifest is unreadable or whose files do not match their checksums.
CorruptCheckpointError = CorruptFileError


class NotACheckpointError(InputError, FileNotFoundError):
    """A path given as a checkpoint directory that holds no manifest."""


# The manifest's fields, as write_manifest writes them: {name: (type, lowest, highest)}. A
# digest that matches says the bytes are those written, not that a writer wrote sane values
MAX_STEP = 10**12
MAX_RANKS = 1 << 20
MANIFEST_FIELDS: Dict[str, Tuple[type, Optional[int], Optional[int]]] = {
    "format_version": (int, None, None),
    "step": (int, 0, MAX_STEP),
    "world_size": (int, 1, MAX_RANKS),
    "layout": (dict, None, None),
    "sha256": (dict, None, None),
}
MANIFEST_OPTIONAL = {"format": (str, None, None)}
_SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
          "expert_model_parallel_size", "data_parallel_size", "virtual_pipeline_stages")
# the sizes of run_layout; the others (names, lists, the config) are compared as they are
LAYOUT_FIELDS: Dict[str, Tuple[type, Optional[int], Optional[int]]] = {
    **{
        name: (int, 1, MAX_RANKS)
        for name in _SIZES
    },
    "zero_stage": (int, 0, 3),
    "model": (dict, None, None),
}


def _check_fields(where: str, values: Dict[str, Any], schema: Dict[str, Any],
                  required: bool) -> None:
    """InputError naming the field, its type and value unless each of ``schema`` in ``values``
    has its type (a bool is no int) and range."""
    for name, (kind, low, high) in schema.items():
        if name not in values:
            if required:
                raise CorruptCheckpointError(f"{where} has no field {name!r}: it is not a "
                                             f"ScaleTorch manifest")
            continue
        value = values[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise CorruptCheckpointError(f"{where}: {name} is {type(value).__name__} "
                                         f"{clip(value)}, not {kind.__name__}")
        if (low is not None and value < low) or (high is not None and value > high):
            raise CorruptCheckpointError(f"{where}: {name} {clip(value)} is outside "
                                         f"[{low}, {high}]")


def check_manifest(manifest: Any, where: str) -> Dict[str, Any]:
    """``manifest`` once its fields have the declared types and ranges (MANIFEST_FIELDS,
    LAYOUT_FIELDS) and its file names are plain names with sha256 digests; InputError naming
    ``where`` and the field otherwise."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("sha256"), dict):
        raise CorruptCheckpointError(f"{where} is not a ScaleTorch manifest (no sha256 of the "
                                     f"rank files)")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise InputError(f"{where} has format version {clip(manifest.get('format_version'))}, "
                         f"this code reads {FORMAT_VERSION}")
    _check_fields(where, manifest, MANIFEST_FIELDS, required=True)
    _check_fields(where, manifest, MANIFEST_OPTIONAL, required=False)
    _check_fields(f"{where} layout", manifest["layout"], LAYOUT_FIELDS, required=False)
    for name, digest in manifest["sha256"].items():
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,255}", name) or name in (".", ".."):
            raise CorruptCheckpointError(f"{where}: its sha256 names {clip(name)}, not a file "
                                         f"of its directory")
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise CorruptCheckpointError(f"{where}: the sha256 of {name} is "
                                         f"{type(digest).__name__} {clip(digest)}, not 64 hex "
                                         f"digits")
    return manifest


def _digest_is_a_file(path: str) -> None:
    """InputError naming what ``<path>.sha256`` is when it is there but no regular file (a
    directory, a FIFO): not reported as missing, and a FIFO is never opened."""
    if os.path.lexists(checksum_path(path)):
        boundary.regular_file(checksum_path(path), "checksum file", 4096)


def read_manifest(path: str) -> Dict[str, Any]:
    manifest_path = os.path.join(path, MANIFEST)
    if os.path.exists(path) and not os.path.isdir(path):  # a FIFO, a device: named as such
        raise NotACheckpointError(f"{clip(path)} is {boundary.kind_of(os.stat(path).st_mode)}, "
                                  f"not a checkpoint directory (step_NNNNNNN with a {MANIFEST})")
    if not os.path.lexists(manifest_path):
        steps = list_checkpoints(path) if os.path.isdir(path) else []
        hint = (f"it holds checkpoints: resume one, e.g. --resume {steps[-1]}" if steps else
                f"resume a step_NNNNNNN directory that holds a {MANIFEST}, or --resume alone "
                f"for the latest one in checkpoint.dir")
        raise NotACheckpointError(
            f"{clip(path)} is not a complete checkpoint (no {MANIFEST}); {hint}")
    boundary.regular_file(manifest_path, "checkpoint manifest", boundary.JSON_BYTES)
    _digest_is_a_file(manifest_path)
    try:
        text = read_checksummed(manifest_path).decode("utf-8")  # verified before it is parsed
    except (OSError, UnicodeDecodeError) as err:
        raise CorruptCheckpointError(f"{clip(manifest_path)} is unreadable: {err}") from err
    manifest = boundary.parse_json(text, f"checkpoint manifest {clip(manifest_path)}", kind=None)
    return check_manifest(manifest, f"checkpoint {clip(path)}")


def _read_verified(path: str, name: str, manifest: Dict[str, Any]) -> bytes:
    file_path = os.path.join(path, name)
    if not os.path.lexists(file_path):
        raise CorruptCheckpointError(f"checkpoint {clip(path)} is missing {name}")
    boundary.regular_file(file_path, f"checkpoint {clip(path)}: {name}", boundary.UNLIMITED)
    _digest_is_a_file(file_path)
    with open(file_path, "rb") as f:
        data = f.read()
    expected = manifest["sha256"].get(name)
    if sha256(data) != expected:
        raise CorruptCheckpointError(
            f"checkpoint {clip(path)}: {name} does not match its sha256 in the manifest "
            f"({len(data)} bytes; truncated or damaged)")
    if read_checksum(file_path) != expected:  # the file beside it, damaged after the save
        raise CorruptCheckpointError(f"checkpoint {clip(path)}: {name}.sha256 does not match the "
                                     f"manifest (damaged)")
    return data


def verify_checkpoint(path: str) -> Dict[str, Any]:
    """The manifest of step directory ``path`` once it is complete (it has one), the manifest
    matches its checksum file and every file it lists matches it and its own checksum file;
    else CorruptCheckpointError (NotACheckpointError without a manifest). ``--resume`` and
    scripts/convert_dcp.py check a directory with this one function."""
    manifest = read_manifest(path)
    for name in manifest["sha256"]:
        _read_verified(path, name, manifest)
    return manifest


def latest_valid_checkpoint(root: str) -> Tuple[Optional[str], List[str]]:
    """The newest checkpoint that verifies, and a message for each newer one skipped.

    Every rank reads every file, so all ranks reach the same answer without talking.
    """
    skipped: List[str] = []
    for path in reversed(list_checkpoints(root)):
        try:
            verify_checkpoint(path)
            return path, skipped
        except CorruptCheckpointError as err:
            skipped.append(f"skipping corrupt checkpoint: {err}")
    return None, skipped


def check_layout(path: str, manifest: Dict[str, Any], world_size: int,
                 layout: Optional[Dict[str, Any]]) -> None:
    """Raise InputError unless this run has the world size, layout and model that wrote ``path``.

    Per-rank files are shards of one layout: rank r of another layout holds other pieces, so
    loading them would fail or, worse, train on misplaced weights. The message points to the
    sharded (dcp) format and the consolidated file instead: both fit any layout of their model.
    """
    saved = dict(manifest.get("layout") or {}, world_size=manifest.get("world_size"))
    now = dict(layout or {}, world_size=world_size)
    there, here = saved.pop("model", None), now.pop("model", None)
    saved.pop("config", None)  # the whole run's config: resume_check.py compares it
    now.pop("config", None)
    differ = [k for k in saved if k in now and saved[k] != now[k]]
    if manifest.get("format") == "dcp":  # pieces of the full tensors: any layout reads them
        differ = []
    if not differ:
        if there is not None and here is not None and there != here:  # the layout first
            raise InputError(f"checkpoint {clip(path)} holds another model (" +
                             ", ".join(f"{k} {there.get(k)} there, {here[k]} here"
                                       for k in here if there.get(k) != here[k]) +
                             "): resume it with the config that wrote it (config.yaml in its "
                             "run directory), or start a new run with another --name")
        return
    raise InputError(f"checkpoint {clip(path)} holds per-rank shards of another layout (" +
                     ", ".join(f"{k} {saved[k]} there, {now[k]} here" for k in differ) +
                     "); per-rank checkpoints resume only at the layout that wrote them; to "
                     "change layouts, save with --checkpoint.format dcp (chapters 07, 08 and 10 "
                     "do), or resume a consolidated file with examples/07_nd_parallel.py")


def local_tensors(state: Any) -> Any:
    """``state`` with every DTensor (PyTorch's FSDP2 / tensor parallel) replaced by this rank's
    local piece: a per-rank file holds the rank's shards, not the device mesh they were on."""
    if is_dtensor(state):
        return state.to_local()
    if isinstance(state, dict):
        return type(state)((k, local_tensors(v)) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return type(state)(local_tensors(v) for v in state)
    return state


def as_dtensor_like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A local piece loaded from a per-rank file, placed as ``param`` is (on this run's mesh),
    when ``param`` is a DTensor; unchanged otherwise."""
    if not is_dtensor(param) or is_dtensor(local) or local.dim() == 0:
        return local
    from torch.distributed.tensor import DTensor  # imported already: param is one
    return DTensor.from_local(local.to(param.device), param.device_mesh, param.placements,
                              shape=param.shape, stride=param.stride())


def load_model_and_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer,
                             state: Dict[str, Any], name: str = "the checkpoint") -> None:
    """Load what ``local_tensors`` saved: pieces of DTensor parameters (and of their AdamW
    moments) become DTensors on the current mesh again; plain tensors load as they are.
    Keys missing or unexpected, or another shape, are an InputError naming ``name``."""
    params = model.state_dict(keep_vars=True)
    check_state_keys(name, state["model"], local_tensors(params), "this rank's model",
                     "resume it with the config that wrote it")
    model.load_state_dict({k: as_dtensor_like(v, params[k]) for k, v in state["model"].items()})
    optimizer.load_state_dict(state["optimizer"])  # casts the moments to their parameter's dtype
    for index, (param, values) in enumerate(optimizer.state.items()):
        for key, value in values.items():
            if torch.is_tensor(value):
                if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                    raise InputError(f"{name}: the optimizer's {key} of parameter {index} is "
                                     f"inf or nan at the parameter's {value.dtype}: the "
                                     f"checkpoint is damaged; resume an earlier one")
                values[key] = as_dtensor_like(value, param)


def run_layout(cfg: Config, world_size: int) -> Dict[str, Any]:
    """What decides which shard of the model and optimizer each rank holds (``cfg``: the
    scaletorch Config): a per-rank checkpoint records it and resumes only where it is the same.
    """
    p = cfg.parallel
    model_parallel = (p.tensor_model_parallel_size * p.pipeline_model_parallel_size *
                      p.context_parallel_size)
    return {
        "tensor_model_parallel_size": p.tensor_model_parallel_size,
        "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
        "context_parallel_size": p.context_parallel_size,
        "expert_model_parallel_size": p.expert_model_parallel_size,
        "data_parallel_size": world_size // model_parallel,
        "zero_stage": p.zero_stage,
        "virtual_pipeline_stages": p.virtual_pipeline_stages,
        # zbv and dualpipev hold stages r and 2p - 1 - r, the interleaved schedule r and r + p
        "pipeline_placement": "v" if p.schedule in V_SHAPED else "interleaved",
        "layer_split": list(p.layer_split or []),
        "impl": p.impl,
        # what decides every tensor's shape: a checkpoint of another model cannot load
        "model": {
            name: getattr(cfg.model, name)
            for name in MODEL_SHAPE
        },
    }


MODEL_SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
               "num_attention_heads", "num_key_value_heads", "tie_word_embeddings", "num_experts",
               "moe_layer_freq", "moe_intermediate_size")


def check_resume(cfg: Config, world_size: int, files: bool = False) -> None:
    """Before any process starts training: refuse what ``checkpoint.resume`` names unless it
    can resume this run (the checks ``load_checkpoint`` makes, and the checksums), so the
    message is printed once. InputError naming the path.

    What would be resumed: ``checkpoint.resume`` (a directory, or "latest"), or after a
    torchrun restart the latest checkpoint. A file is a consolidated checkpoint, which fits any
    layout, if the script resumes those (``files``: chapter 07); it must fit the model.
    """
    resume = cfg.checkpoint.resume or ("latest" if restart_count() > 0 else None)
    if resume is None:
        return
    if resume == "latest":
        path, skipped = latest_valid_checkpoint(cfg.checkpoint_path)  # a damaged one is skipped
        if path is None and restart_count() == 0:  # (the trainer says which, when it resumes)
            raise nothing_to_resume(cfg.checkpoint_path, skipped)
        if path is None:  # a torchrun restart before the first checkpoint: from step 0
            return
    else:
        path = resume
        if not os.path.exists(path):
            raise MissingInputError(f"--resume {path} does not exist: give a checkpoint directory "
                                    f"(step_NNNNNNN under checkpoint.dir), or --resume alone for "
                                    f"the latest in {cfg.checkpoint_path}")
        if os.path.isfile(path):
            if not files:
                raise InputError(
                    f"--resume {path} is a file, not a checkpoint directory: this "
                    f"script resumes its step_NNNNNNN directories (with a {MANIFEST}); "
                    f"a consolidated file resumes with examples/07_nd_parallel.py")
            check_consolidated(path, cfg)
            return
        try:
            verify_checkpoint(path)  # "latest" falls back past a damaged one instead
        except CorruptCheckpointError as err:
            raise CorruptCheckpointError(f"{err}: resume an earlier checkpoint, or --resume alone "
                                         f"(the latest that verifies)") from None
    manifest = read_manifest(path)
    if restart_count() == 0:  # every refused field in one line, before the model's own check
        check_resumed(path, manifest, cfg)
    check_layout(path, manifest, world_size, run_layout(cfg, world_size))


def nothing_to_resume(directory: str, skipped: List[str]) -> InputError:
    """The refusal of a ``--resume`` alone that finds no checkpoint in ``directory`` (the
    damaged ones ``skipped``): a fresh start there would be a silent new run, not a resume.
    A torchrun restart instead starts from step 0 (nothing was saved before it failed)."""
    damaged = f" ({len(skipped)} damaged: {skipped[0]})" if skipped else ""
    return MissingInputError(
        f"--resume found no checkpoint to resume in {clip(directory)}{damaged}: give the "
        f"--config and --name of the run to continue, a checkpoint directory, or start a new "
        f"run without --resume")


def check_consolidated(path: str, cfg: Config) -> None:
    """InputError unless ``path`` is a consolidated checkpoint of ``cfg.model`` (its tensors
    memory-mapped: their shapes are read, not their bytes)."""
    name = f"--resume {path}"
    if not zipfile.is_zipfile(path):
        raise InputError(f"{name} is not a consolidated checkpoint (a torch.save file): give "
                         f"a consolidated.pt written by chapter 02 or scripts/convert_dcp.py, or a "
                         f"checkpoint directory")
    boundary.verified(path, name)  # before anything is unpickled (or --trust-unchecked)
    check_consolidated_state(name, load_tensors_only(path, name, mmap=True), cfg.model,
                             "this config's model.*", "resume it with the model config that "
                             "wrote it")


def check_consolidated_state(name: str, state: Any, model_cfg: Any, what: str, todo: str) -> None:
    """InputError naming ``name`` unless ``state`` (a loaded consolidated checkpoint) holds a
    'step' and a 'model' whose names, shapes, dtypes and values fit a Llama of ``model_cfg``
    (built on the meta device: nothing is allocated); ``what`` names that model, ``todo`` says
    what to do instead. The resume pre-flight and scripts/generate.py both check with it."""
    model = state.get("model") if isinstance(state, dict) else None
    if not isinstance(model, dict) or "step" not in state:
        raise InputError(f"{name} is a torch file but not a consolidated checkpoint (no 'model' "
                         f"and 'step'): give a consolidated.pt written by chapter 02 or "
                         f"scripts/convert_dcp.py")
    with torch.device("meta"):
        expected = Llama(model_cfg).state_dict()
    check_state_keys(name, model, expected, what, todo)


def check_state_keys(name: str, saved: Dict[str, Any], expected: Dict[str, Any], what: str,
                     todo: str) -> None:
    """InputError unless ``saved`` has exactly the keys of ``expected`` (missing and
    unexpected both refused) with the same shapes; ``what`` names ``expected``, ``todo`` says
    what to do instead."""
    for key, tensor in expected.items():
        there = saved.get(key)
        shape = tuple(getattr(tensor, "shape", ()))  # () for a module's non-tensor extra state
        if there is None or tuple(getattr(there, "shape", ())) != shape:
            found = "missing" if there is None else f"shape {tuple(getattr(there, 'shape', ()))}"
            raise InputError(f"{name} holds another model: {key} is {found} there, shape "
                             f"{shape} for {what}; {todo}")
        check_tensor(name, key, there, tensor)
    unexpected = [key for key in saved if key not in expected]
    if unexpected:
        raise InputError(f"{name} holds another model: {len(unexpected)} tensor(s) that "
                         f"{what} does not have, e.g. {unexpected[0]}; {todo}")


def check_tensor(name: str, key: str, saved: Any, expected: Any) -> None:
    """InputError unless tensor ``saved`` has the dtype class of ``expected`` (floating weights
    stay floating) and holds only finite values: a weight of inf or nan trains nothing."""
    if not isinstance(expected, torch.Tensor):
        return
    if not isinstance(saved, torch.Tensor) or saved.is_floating_point() != \
            expected.is_floating_point():
        found = saved.dtype if isinstance(saved, torch.Tensor) else type(saved).__name__
        raise InputError(f"{name}: {key} is {found}, not a {expected.dtype} tensor as the model "
                         f"holds")
    # a meta tensor (a sharded load's layout, before its values are read) has no values to
    # check; the others are checked at the model's dtype, which the load casts them to
    problem = "" if saved.is_meta or not saved.is_floating_point() else \
        boundary.not_finite_as(saved, expected.dtype)
    if problem:
        raise InputError(f"{name}: {key} {problem}: the checkpoint was saved from a diverged "
                         f"run or is damaged; resume an earlier one")


def check_every_tensor(name: str, state: Any, path: str = "") -> None:
    """InputError naming ``name`` and the entry unless every tensor of ``state`` (the model,
    the optimizer's moments and step counters, the scheduler, the loss scale) has a dtype a
    checkpoint of ours holds and, when floating, only finite values; the optimizer's are
    floating. A model may hold integer tensors (a BatchNorm's num_batches_tracked): each model
    entry's dtype is compared with the model's own when it is loaded (``check_tensor``).
    Walked with a stack: a file nests a few levels, but it is read from outside."""
    stack = [(path, state)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((f"{where}.{k}" if where else str(k), v) for k, v in value.items())
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, torch.Tensor):
            if where.startswith("optimizer.") and not value.is_floating_point():
                raise InputError(f"{name}: {where} is {value.dtype}, not floating point as a "
                                 f"moment or AdamW's step counter is")
            if value.is_complex() or value.dtype not in _SAVED_DTYPES:
                raise InputError(f"{name}: {where} is {value.dtype}, a dtype no ScaleTorch "
                                 f"checkpoint holds")
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise InputError(f"{name}: {where} holds inf or nan: the checkpoint was saved "
                                 f"from a diverged run or is damaged; resume an earlier one")
        elif isinstance(value, float) and not np.isfinite(value):
            raise InputError(f"{name}: {where} is {value}: the checkpoint is damaged; resume "
                             f"an earlier one")


# weights and moments at any float dtype; step counters, RNG states and token counts as ints
_SAVED_DTYPES = {
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.uint8, torch.bool
}

# What a rank file holds at its top level, and the type of each entry: every loop's
# (RANK_STATE), and the trainer's (TRAINER_STATE: its schedule and generator states too)
RANK_STATE: Dict[str, Any] = {"step": int, "model": dict, "optimizer": dict}
TRAINER_STATE: Dict[str, Any] = {**RANK_STATE, "scheduler": dict, "rng": dict}
_OPTIONAL_STATE: Dict[str, Any] = {"scaler": dict, "scheduler": dict, "rng": dict}
_RNG_STATE: Dict[str, Any] = {"python": (tuple, list), "numpy": dict, "torch": torch.Tensor}


def check_rank_state(name: str, state: Any, required: Dict[str, Any] = RANK_STATE) -> None:
    """InputError naming ``name`` unless ``state`` has the structure of a rank file: a dict
    with each ``required`` entry of its type (a step is an int >= 0, not a bool), an optimizer
    state of "state" and "param_groups", and any optional entry of its type. Digests prove a
    file whole, not that it is a checkpoint: a ``torch.save({})`` with fresh digests is not."""
    if not isinstance(state, dict):
        raise InputError(f"{name} holds a {type(state).__name__}, not a checkpoint's dict of "
                         f"{', '.join(required)}: it is not a ScaleTorch checkpoint")
    missing = [key for key in required if key not in state]
    if missing:
        raise InputError(f"{name} has no {', '.join(repr(k) for k in missing)}: it is not a "
                         f"ScaleTorch checkpoint of this loop (it needs {', '.join(required)})")
    for key, kind in {**_OPTIONAL_STATE, **required}.items():
        if key in state and (not isinstance(state[key], kind) or isinstance(state[key], bool)):
            raise InputError(f"{name}: {key!r} is a {type(state[key]).__name__}, not a "
                             f"{kind.__name__}: the checkpoint is damaged or not ours")
    if state["step"] < 0:
        raise InputError(f"{name}: 'step' is {state['step']}: the checkpoint is damaged")
    optimizer = state["optimizer"]
    if not isinstance(optimizer.get("state"), dict) or \
            not isinstance(optimizer.get("param_groups"), list):
        raise InputError(f"{name}: 'optimizer' has no 'state' dict and 'param_groups' list: "
                         f"the checkpoint is damaged or not ours")
    for key, kinds in _RNG_STATE.items() if "rng" in state else ():
        if not isinstance(state["rng"].get(key), kinds):
            raise InputError(f"{name}: 'rng' has no {key!r} generator state of its type: the "
                             f"checkpoint is damaged or not ours")


def check_step(name: str, state: Dict[str, Any], manifest: Dict[str, Any]) -> None:
    """InputError naming ``name`` unless its ``state`` (checked by ``check_rank_state``) is at
    its manifest's step: the rank file's "step" and its scheduler's ``last_epoch`` (one per
    step taken) equal the manifest's "step". The resume reads the rank file's step and the
    weights beside it; a step that disagrees would train from the wrong place."""
    saved = {"'step'": state["step"]}
    scheduler = state.get("scheduler")
    if isinstance(scheduler, dict) and "last_epoch" in scheduler:
        saved["the scheduler's last_epoch"] = scheduler["last_epoch"]
    for what, step in saved.items():
        if step != manifest["step"]:
            raise InputError(f"{name}: {what} is {clip(step)}, but its {MANIFEST} says step "
                             f"{manifest['step']}: the checkpoint is damaged or not ours")


def check_rank_files(path: str) -> None:
    """Before any process starts: every rank file of per-rank checkpoint ``path`` verified,
    loaded (one at a time) and checked (``check_rank_state`` for the trainer's structure,
    ``check_every_tensor`` for its values): a damaged value is refused before a run directory
    exists, not after the model is built."""
    manifest = read_manifest(path)
    if manifest.get("format") == "dcp":
        return
    for file in sorted(manifest["sha256"]):
        name = f"checkpoint file {os.path.join(path, file)!r}"
        state = load_tensors_only(_read_verified(path, file, manifest), name)
        check_rank_state(name, state, TRAINER_STATE)
        check_step(name, state, manifest)
        check_every_tensor(name, state)


def load_checkpoint(path: str, rank: int, world_size: int,
                    layout: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """Read this rank's state from checkpoint directory ``path`` (checked against its manifest,
    and against this run's world size and ``layout``: see ``check_layout``), every tensor
    checked (``check_every_tensor``), its step the manifest's (``check_step``)."""
    manifest = read_manifest(path)
    check_layout(path, manifest, world_size, layout)
    data = _read_verified(path, os.path.basename(rank_file(path, rank)), manifest)
    name = f"checkpoint file {rank_file(path, rank)!r}"
    state = load_tensors_only(data, name)
    check_rank_state(name, state)
    check_step(name, state, manifest)
    check_every_tensor(name, state)
    return state


def load_tensors_only(source: Union[str, bytes], name: str, mmap: bool = False) -> Any:
    """``torch.load`` on CPU that unpickles only tensors and plain Python values (dict, list,
    tuple, str, int, float, bool, None): a checkpoint someone else wrote cannot run code when it
    is loaded. ``source`` is a path or the file's bytes; ``name`` says what it is in the error.

    Every ScaleTorch checkpoint holds only such values (``rng_state`` stores NumPy's state as
    a tensor and ints); a file that needs any other class is refused with an InputError.
    ``mmap``: map a file's tensors instead of reading them (for a look at their shapes).
    """
    file = io.BytesIO(source) if isinstance(source, bytes) else source
    try:
        with warnings.catch_warnings():  # a damaged protocol byte: torch warns, then reads on
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap or None)
    except pickle.UnpicklingError as err:
        # torch's message names the class the file asked for ("Trying to load unsupported
        # GLOBAL posix.system ...") and then suggests weights_only=False, which we do not
        needed = re.search(r"GLOBAL \S+", str(err))  # e.g. "GLOBAL posix.system"
        if needed is None:  # not a class it asked for: damaged bytes ("invalid load key")
            raise InputError(f"{name} is not a readable torch file ({clip(str(err))})") from None
        asked = f" ({needed.group()})"
        raise InputError(
            f"{name} needs more than tensors and plain Python values to load{asked}: it is not "
            f"a ScaleTorch checkpoint, or it was written by an older ScaleTorch or another "
            f"program. It was not unpickled, since that could run code; re-save it with this "
            f"version from a source you trust.") from None
    except MemoryError:
        raise
    except Exception as err:  # noqa: B902 - a damaged zip or pickle fails in any of torch's steps
        # (seen on flipped or cut bytes: RuntimeError, EOFError, IndexError, KeyError, TypeError,
        # AssertionError and more); whichever it is, the file is not one we can read
        raise InputError(f"{name} is not a readable torch file ({type(err).__name__}: "
                         f"{clip(str(err))})") from None
