"""Sharded checkpoints with torch.distributed.checkpoint (DCP): each rank writes its pieces of
the full tensors, and a run at another layout reads just the pieces it will hold. No gather.

The pieces, DCP's planners and the metadata reader are in dcp_pieces.py; here: save (each rank
writes ``__<rank>_0.distcp``, the coordinator ``.metadata`` after them, then a checksum beside
every file), verify, load at any layout, and the converter to one consolidated file.

Keys: ``model.<name>``, ``optim.exp_avg.<name>``, ``optim.exp_avg_sq.<name>`` (rectangles),
``optim.step``, ``trainer`` (step, scheduler, loss scale) and ``rng.<rank>`` (plain values,
one writer each; read with ``load_tensors_only``, never a full unpickle; the ``.metadata``
pickle with an allow-list of DCP's own classes).
"""

import io
import os
import shutil
import warnings
from typing import TYPE_CHECKING, Any, Dict, List

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from scaletorch.dist import comm
from scaletorch.models import Llama
from scaletorch.parallel.moe_balance import bias_state, load_bias_state
from scaletorch.rules.errors import InputError, clip
from scaletorch.rules.safe_files import (CorruptFileError, read_checksummed, verify_checksum,
                                         write_checksum, write_checksummed)
from scaletorch.trainer.checkpoint import (MANIFEST, adamw_settings, check_state_keys,
                                           removed_unless_complete, rng_state, set_rng_state,
                                           step_dir, verify_checkpoint, write_manifest)
from scaletorch.trainer.dcp_pieces import (METADATA, TIED, TIED_COPY, Pieces, _LoadPlanner, _Reader,
                                           _SavePlanner, data_files, entries, local_pieces)
from scaletorch.trainer.run_dir import MARKER, is_run_dir

if TYPE_CHECKING:  # types only: the Trainer (chapter 00) must not import chapter 07's parallelize
    from scaletorch.parallel.parallelize import Parallelized

MOMENTS = ("exp_avg", "exp_avg_sq")


def _params(par: "Parallelized") -> List[torch.Tensor]:
    return [param for param, _, _ in entries(par)]


def sharded_state(trainer: Any, par: "Parallelized") -> Dict[str, Any]:
    """What ``save_sharded`` writes from this rank: its rectangles of the weights and of AdamW's
    moments (once AdamW has stepped), and the plain values (trainer state, this rank's RNG)."""
    state: Dict[str, Any] = {
        f"model.{k}": v
        for k, v in local_pieces(par, torch.Tensor.detach).items()
    }
    opt = trainer.optimizer
    params = _params(par)
    if all(p in opt.state for p in params):
        for key in MOMENTS:
            pieces = local_pieces(par, lambda p: opt.state[p][key])  # called at once: this key
            state.update({f"optim.{key}.{k}": v for k, v in pieces.items()})
        state["optim.step"] = float(opt.state[params[0]]["step"])
    extra = {
        "step": trainer.step,
        "scheduler": trainer.scheduler.state_dict(),
        "aliases": {
            TIED_COPY: TIED
        } if trainer.cfg.model.tie_word_embeddings else {},
        "adamw": adamw_settings(opt.param_groups[0]),  # a resume says which of them changed
    }
    if trainer.scaler is not None:  # fp16: the loss scale resumes where it was
        extra["scaler"] = trainer.scaler.state_dict()
    if trainer.balancer is not None:  # model.moe_bias_rate: the same (layers, E) on every rank
        extra["moe_bias"] = bias_state(trainer.balancer)
    state["trainer"] = extra
    state[f"rng.{par.layout.pgm.rank}"] = rng_state()
    return state


def save_sharded(path: str, trainer: Any, par: "Parallelized") -> Dict[str, str]:
    """Collective over the world: every rank writes its pieces to directory ``path`` (DCP's
    ``__<rank>_0.distcp`` files), the coordinator ``.metadata``; then each file gets its
    checksum beside it (the ranks share the hashing), ``.metadata.sha256`` last: a checkpoint
    without it is incomplete. Returns {file name: sha256} on global rank 0 ({} elsewhere)."""
    metadata = dcp.save(sharded_state(trainer, par), storage_writer=dcp.FileSystemWriter(path),
                        planner=_SavePlanner())
    return checksum_sharded(path, metadata)


def checksum_sharded(path: str, metadata: Metadata) -> Dict[str, str]:
    """Collective over the world, once DCP wrote ``path`` (``metadata``, what its save
    returned): each file's checksum beside it, ``.metadata.sha256`` last. Returns {file name:
    sha256} on global rank 0 ({} elsewhere)."""
    rank, world = comm.group_rank(), comm.group_size()
    mine = {
        name: write_checksum(os.path.join(path, name))
        for name in data_files(metadata)[rank::world]
    }
    # every data file has its checksum before the metadata's marks the checkpoint complete
    digests = {k: v for part in comm.gather_objects(mine) for k, v in part.items()}
    if rank == 0:
        digests[METADATA] = write_checksum(os.path.join(path, METADATA))
    comm.barrier()
    return digests


def save_sharded_checkpoint(root: str, step: int, trainer: Any, par: "Parallelized", keep_last: int,
                            layout: Dict[str, Any]) -> str:
    """Collective: ``save_sharded`` into ``step_<step>`` under ``root``, then rank 0 writes the
    manifest of checkpoint.py (format "dcp"), so the latest complete checkpoint is found,
    verified and rotated as a per-rank one is. A save that fails before the manifest (a full
    disk) leaves no partial file: each rank removes its own, as a per-rank save does. Returns
    the checkpoint directory."""
    path = step_dir(root, step)
    rank = comm.group_rank()
    clear_step_dir(path)
    with removed_unless_complete(path, _written_by(path, rank)):
        commit_sharded(root, path, step, save_sharded(path, trainer, par), keep_last, layout)
    return path


def clear_step_dir(path: str) -> None:
    """Collective over the world, before a save writes checkpoint directory ``path``: rank 0
    removes what is there, such as the files of a save killed before its manifest (an earlier
    run's, at another world size). DCP would write over them, mixing two runs' files."""
    if comm.group_rank() == 0 and os.path.isdir(path):
        shutil.rmtree(path)
    comm.barrier()  # no rank writes before it is gone


def commit_sharded(root: str, path: str, step: int, digests: Dict[str, str], keep_last: int,
                   layout: Dict[str, Any]) -> None:
    """Collective: rank 0 writes the manifest of the checksummed checkpoint ``path`` (the last
    write: from now on ``--resume latest`` finds it, and older ones rotate out)."""
    if comm.group_rank() == 0:
        write_manifest(root, path, step, comm.group_size(), layout, digests, keep_last,
                       checkpoint_format="dcp")
    comm.barrier()


def _written_by(path: str, rank: int) -> List[str]:
    """The files rank ``rank`` writes into checkpoint ``path`` (their checksums beside them):
    its DCP data file, and on rank 0 ``.metadata`` (and DCP's temporary name for it) and the
    manifest. A save that fails before the manifest removes them (``removed_unless_complete``)."""
    mine = [os.path.join(path, f"__{rank}_0.distcp")]  # one file per rank: DCP's default
    if rank == 0:
        mine += [os.path.join(path, n) for n in (METADATA, METADATA + ".tmp", MANIFEST)]
    return mine


def verify_sharded(path: str) -> Metadata:
    """Collective over the world: the checkpoint's metadata once it and every data file match
    their checksums (the ranks share the reading); else every rank raises the same
    CorruptFileError naming the first bad file, before anything is loaded."""
    meta = os.path.join(path, METADATA)
    if not os.path.isfile(meta):
        raise InputError(f"{clip(path)} is not a sharded checkpoint: it has no {METADATA} (written "
                         f"last: a save that stopped before it left an incomplete one)")
    read_checksummed(meta)  # every rank: a truncated or damaged metadata file is never unpickled
    metadata = _Reader(path).read_metadata()
    errors = []
    for name in data_files(metadata)[comm.group_rank()::comm.group_size()]:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            errors.append(f"checkpoint {clip(path)} is missing {name} (one of its shards)")
            continue
        try:
            verify_checksum(file)  # in blocks: a shard's bytes are never all in memory at once
        except CorruptFileError as err:
            errors.append(str(err))
    found = [e for errors_of_rank in comm.all_gather_objects(errors) for e in errors_of_rank]
    if found:
        raise CorruptFileError(found[0])
    return metadata


def verify_sharded_checkpoint(path: str) -> Metadata:
    """Offline, on one process: ``--resume``'s check of step directory ``path``
    (``verify_checkpoint``: complete, every file matching its manifest), then that it is
    sharded and its shards match their checksums (``verify_sharded``). InputError naming it."""
    manifest = verify_checkpoint(path)
    if manifest.get("format") != "dcp":
        raise InputError(f"checkpoint {clip(path)} is a per-rank one, not sharded (its {MANIFEST} "
                         f"has no format dcp): only --checkpoint.format dcp saves convert")
    return verify_sharded(path)


def check_output(key: str, path: str) -> None:
    """InputError when output ``path`` (option ``key``) is in a checkpoint directory (one above
    holds a manifest or DCP's .metadata) or a run's directory (one above carries the run
    marker): files there that no manifest lists would mix with the run's, and a rotation or
    ``--overwrite`` would remove them."""
    here = os.path.abspath(path)
    while True:
        if any(os.path.lexists(os.path.join(here, n)) for n in (MANIFEST, METADATA)):
            raise InputError(f"{key} {path} is inside checkpoint directory {here}: nothing was "
                             f"written; give a new or empty directory outside it")
        if is_run_dir(here):
            raise InputError(f"{key} {path} is inside the directory of run {here} (it carries "
                             f"{MARKER}): nothing was written; give a directory outside it")
        if os.path.dirname(here) == here:
            return
        here = os.path.dirname(here)


def check_model(path: str, metadata: Metadata, model: Dict[str, torch.Tensor]) -> None:
    """InputError naming ``path`` unless it holds exactly the tensors of ``model`` (chapter
    00's state dict with ``keep_vars``, on the meta device: shapes only) with their shapes. A
    tied weight (one object under two names) is saved once, under its first name. The same
    answer on every rank: no rank loads half."""
    first: Dict[int, str] = {}
    expected = {first.setdefault(id(t), k): t for k, t in model.items() if id(t) not in first}
    saved = {
        k[len("model."):]: torch.empty(md.size, device="meta")
        for k, md in metadata.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(md, TensorStorageMetadata)
    }
    check_state_keys(f"checkpoint {clip(path)}", saved, expected, "this config's model.*",
                     "resume it with the model config that wrote it")


def load_sharded(path: str, trainer: Any, par: "Parallelized") -> None:
    """Collective over the world: read this rank's pieces of the weights and AdamW state from
    the DCP checkpoint ``path`` (written at any layout), and the trainer state, once every file
    matches its checksum (``verify_sharded``) and every tensor its shape here (InputError
    naming the checkpoint). ZeRO-1/2 then all-gather the loaded shards (over dp_cp). This
    run's lr, betas and weight decay apply from here, each change said in one line (rank 0)."""
    metadata = verify_sharded(path)
    with torch.device("meta"):
        check_model(path, metadata, Llama(trainer.cfg.model).state_dict(keep_vars=True))
    opt = trainer.optimizer
    params = _params(par)
    state: Dict[str, Any] = {
        f"model.{k}": v
        for k, v in local_pieces(par, torch.Tensor.detach, load=True).items()
    }
    with_optim = "optim.step" in metadata.state_dict_metadata
    if with_optim:
        for p in params:
            opt.state[p] = {key: torch.zeros_like(p.detach()) for key in MOMENTS}
        for key in MOMENTS:
            pieces = local_pieces(par, lambda p: opt.state[p][key], load=True)
            state.update({f"optim.{key}.{k}": v for k, v in pieces.items()})
        state["optim.step"] = None
    state["trainer"] = None
    rng_key = f"rng.{par.layout.pgm.rank}"
    if rng_key in metadata.state_dict_metadata:
        state[rng_key] = None
    dcp.load(state, storage_reader=_Reader(path), planner=_LoadPlanner(f"checkpoint {clip(path)}"))
    if with_optim:
        for p in params:
            opt.state[p]["step"] = torch.tensor(state["optim.step"])
    units = {id(unit): unit for _, _, unit in entries(par) if unit is not None}
    for unit in units.values():
        if unit.zero_stage < 3:  # the full parameters are views of the flat vector: refill it
            unit.gather()
    extra = state["trainer"]
    saved_lr = trainer.load_schedule(extra["scheduler"])  # this run's lr, as a per-rank resume
    if trainer.scaler is not None and "scaler" in extra:
        trainer.scaler.load_state_dict(extra["scaler"])
    if trainer.balancer is not None and "moe_bias" in extra:  # else it starts at 0
        load_bias_state(trainer.balancer, extra["moe_bias"], f"checkpoint {clip(path)}")
    trainer.step = extra["step"]
    if state.get(rng_key) is not None:  # another world size: the ranks' generators start anew
        set_rng_state(state[rng_key])
    now = adamw_settings(opt.param_groups[0])  # the optimizer was built with this run's
    changed = {k: (v, now[k]) for k, v in extra.get("adamw", {}).items() if v != now[k]}
    trainer.note_changed_settings(saved_lr, changed)


def to_consolidated(path: str, out: str) -> Dict[str, Any]:
    """Offline, on one process: the DCP checkpoint ``path`` (verified) as one consolidated file
    ``out`` (consolidated.py's format: full reference-keyed weights and AdamW state, any layout
    resumes it), written with its checksum beside it. Holds the whole model in host memory: for
    people who want one file, not for resuming. Returns the state written."""
    metadata = verify_sharded_checkpoint(path)
    state: Dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            full = torch.empty(md.size, dtype=md.properties.dtype)
            state[key] = Pieces(md.size, [((0, ) * len(md.size), full)])
        elif not key.startswith("rng."):
            state[key] = None
    with warnings.catch_warnings():  # DCP warns that no_dist loads in one process: we ask it to
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=_Reader(path),
                 planner=_LoadPlanner(f"checkpoint {clip(path)}"), no_dist=True)

    def named(prefix: str) -> Dict[str, torch.Tensor]:
        tensors = {
            k[len(prefix):]: v.pieces[0][1]
            for k, v in state.items() if k.startswith(prefix) and isinstance(v, Pieces)
        }
        tensors.update({alias: tensors[first] for alias, first in extra["aliases"].items()})
        return tensors

    extra = state["trainer"]
    optimizer = None
    if "optim.step" in state:
        optimizer = {"step": state["optim.step"], **{k: named(f"optim.{k}.") for k in MOMENTS}}
    consolidated = {
        "step": extra["step"],
        "model": named("model."),
        "optimizer": optimizer,
        "scheduler": extra["scheduler"],
    }
    if "moe_bias" in extra:
        consolidated["moe_bias"] = extra["moe_bias"]
    buffer = io.BytesIO()
    torch.save(consolidated, buffer)
    write_checksummed(out, buffer.getvalue())
    return consolidated
