"""Sharded checkpoints with torch.distributed.checkpoint (DCP): each rank writes its pieces of
the full tensors, and a run at another layout reads just the pieces it will hold. No gather.

Every rank describes what it holds as rectangles of chapter 00's full tensors, under their
reference names (``Pieces``): a tp split is one rectangle at ``tp_rank x its size``, less the
padding rows of a padded vocabulary; an expert shard one at ``ep_rank x its size``; a pipeline
stage offers whole tensors of its layers; a ZeRO flat shard covers a range of each tensor
flattened, which ``flat_range_boxes`` cuts into a few rectangles (a partial first row, whole
rows, a partial last row)::

    tensor (4, 6) flattened, shard range [9, 21)     rows 1..3 of the tensor:
        row 1: . . . # # #     -> box (1, 3) size (1, 3)
        row 2: # # # # # #     -> box (2, 0) size (1, 6)
        row 3: # # # . . .     -> box (3, 0) size (1, 3)

DCP's save planner gathers every rank's list of pieces on the coordinator, drops replicas (a
dp or tp replica offers the same rectangle: one rank writes it), and writes ``.metadata``
(global shape and rectangles of every tensor) after each rank wrote its ``__<rank>_0.distcp``.
Loading, each rank offers the rectangles it will hold; DCP's load planner intersects them with
the saved ones and reads only those bytes, straight into the parameters and AdamW's moments.

Keys: ``model.<name>``, ``optim.exp_avg.<name>``, ``optim.exp_avg_sq.<name>`` (rectangles),
``optim.step``, ``trainer`` (step, scheduler, loss scale) and ``rng.<rank>`` (plain values,
one writer each; read with ``load_tensors_only``, never a full unpickle; the ``.metadata``
pickle with an allow-list of DCP's own classes).
"""

import io
import math
import os
import pickle
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import ReadItem, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from scaletorch.dist import ProcessGroupManager, comm
from scaletorch.models import Llama
from scaletorch.parallel.tensor_layout import plain_entries
from scaletorch.rules.errors import InputError
from scaletorch.rules.safe_files import (CorruptFileError, checksum_line, checksum_path,
                                         read_checksummed, sha256, write_atomic, write_checksummed)
from scaletorch.trainer.checkpoint import (check_state_keys, load_tensors_only, rng_state,
                                           set_rng_state, step_dir, write_manifest)

if TYPE_CHECKING:  # types only: the Trainer (chapter 00) must not import chapter 07's parallelize
    from scaletorch.parallel.parallelize import Parallelized
    from scaletorch.parallel.tensor_layout import Split

Box = Tuple[Tuple[int, ...], Tuple[int, ...]]  # (offsets, sizes) of a rectangle of a tensor


def flat_range_boxes(shape: Sequence[int], start: int, stop: int) -> List[Box]:
    """The rectangles that elements [start, stop) of a row-major tensor of ``shape`` make, in
    order; each is contiguous in the flattened tensor. At most 2 x ndim - 1 of them."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start, ), (stop - start, ))]
    row = math.prod(shape[1:])
    first, last = start // row, stop // row

    def within(i: int, a: int, b: int) -> List[Box]:  # part of row i: recurse one dim down
        return [((i, ) + o, (1, ) + s) for o, s in flat_range_boxes(shape[1:], a, b)]

    if first == last:
        return within(first, start - first * row, stop - first * row)
    boxes: List[Box] = []
    if start % row:
        boxes += within(first, start % row, row)
        first += 1
    if last > first:
        boxes.append(((first, ) + (0, ) * (len(shape) - 1), (last - first, ) + tuple(shape[1:])))
    if stop % row:
        boxes += within(last, 0, stop % row)
    return boxes


def flat_start(shape: Sequence[int], offsets: Sequence[int]) -> int:
    """Index in the flattened row-major tensor of the element at ``offsets``."""
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    return sum(o * s for o, s in zip(offsets, strides))


class Pieces:
    """Rectangles of one full tensor of shape ``size`` that this rank holds: (global offsets,
    local tensor) each. DCP reads its protocol (``__create_write_items__``, the chunk list, the
    shard of an offset), as it reads a DTensor's; a load copies into the local tensors in place."""

    def __init__(self, size: Sequence[int], pieces: List[Tuple[Tuple[int, ...],
                                                               torch.Tensor]]) -> None:
        self._size, self.pieces = torch.Size(size), pieces

    def size(self) -> torch.Size:
        return self._size

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(o), t.size()) for o, t in self.pieces]

    def __create_write_items__(self, fqn: str, obj: Any) -> List[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets), type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk,
                                            properties=TensorProperties.create_from_tensor(t),
                                            size=self._size))
            for chunk, (_, t) in zip(self.__create_chunk_list__(), self.pieces)
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        i = index.index  # a load's: the position in __create_chunk_list__ (two equal copies)
        if i is not None and i < len(self.pieces) and torch.Size(self.pieces[i][0]) == index.offset:
            return self.pieces[i][1]
        for offsets, t in self.pieces:
            if torch.Size(offsets) == index.offset:
                return t
        raise ValueError(f"{index.fqn}: this rank holds no piece at {tuple(index.offset or ())}")


class _SavePlanner(DefaultSavePlanner):
    """DCP's default save planner (deduplication, metadata, validation) on a flat dict whose
    values are ``Pieces`` or plain values."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Pieces) else \
            super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner (intersect the wanted rectangles with the saved ones) on
    ``Pieces``; plain values are unpickled with ``load_tensors_only`` (tensors and plain Python
    values only, as every ScaleTorch checkpoint)."""

    def __init__(self, name: str) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.name = name

    def set_up_planner(self, state_dict: Dict[str, Any], metadata: Optional[Metadata] = None,
                       is_coordinator: bool = False) -> None:
        # not the default's: it would replace every value it does not know (Pieces) by None
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        self.state_dict[fqn] = load_tensors_only(value.getvalue(), f"{self.name} ({fqn})")

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn].__get_tensor_shard__(index)


def global_shape(local: Sequence[int], split: "Split",
                 pgm: ProcessGroupManager) -> Tuple[List[int], List[int]]:
    """(full shape, this rank's offset) of a tensor whose local piece has shape ``local``:
    experts concatenated over "ep" on dim 0, then the tp split over "tp" on its dim (the order
    ``ParamMap`` gathers in), then a padded vocabulary cut to its real rows."""
    tp_dim, expert = split[0], split[1]
    padding = split[2] if len(split) > 2 else None
    shape, shift = list(local), [0] * len(local)
    if expert:
        shift[0] += pgm.expert_model_parallel_rank * shape[0]
        shape[0] *= pgm.expert_model_parallel_world_size
    if tp_dim is not None:
        shift[tp_dim] += pgm.tensor_model_parallel_rank * shape[tp_dim]
        shape[tp_dim] *= pgm.tensor_model_parallel_world_size
    if padding is not None:
        shape[0] = padding[0]  # the reference's vocabulary: padding rows are not saved
    return shape, shift


def _placed(boxes: List[Tuple[Box, torch.Tensor]], shape: List[int],
            shift: List[int]) -> List[Tuple[Tuple[int, ...], torch.Tensor]]:
    """Local rectangles moved to their global offsets, cut at the full tensor's rows (a padded
    vocabulary's extra rows drop out)."""
    out = []
    for (offsets, sizes), t in boxes:
        at = tuple(o + s for o, s in zip(offsets, shift))
        if at and sizes:
            rows = min(sizes[0], shape[0] - at[0])
            if rows <= 0:
                continue
            t = t.narrow(0, 0, rows)
        out.append((at, t))
    return out


def entries(par: "Parallelized") -> List[Any]:
    """(optimizer parameter, [(names, shape, offset)], ZeRO unit or None) of every tensor this
    rank holds: the layout's, or under impl torch its DTensor modules' (as DTensorParamMap)."""
    layout = par.layout
    if layout.dtensor_model is None:
        return layout.entries
    modules = [layout.dtensor_model] if layout.pipe is None else list(layout.pipe.chunks)
    return plain_entries(modules)


# A tied embedding under a pipeline: the last stage's copy of it (tied_embeddings.py), equal to
# the first stage's after every step. Saved once (the first stage's); a load fills both.
TIED_COPY, TIED = "lm_head.weight", "embed_tokens.weight"


def local_pieces(par: "Parallelized", value_of: Callable[[torch.Tensor], torch.Tensor],
                 load: bool = False) -> Dict[str, Any]:
    """{reference name: this rank's rectangles of it}, of the parameters (``value_of = detach``)
    or of an AdamW state shaped like them: ``Pieces``, or a DTensor as it is (impl torch). The
    tensors are views: a load writes through them. A tied embedding's pipeline copy is left
    out, or with ``load`` asks for the embedding's pieces."""
    layout = par.layout
    out: Dict[str, Any] = {}
    for param, entry_pieces, unit in entries(par):
        value = value_of(param)
        if isinstance(value, DTensor):  # PyTorch's own (impl torch): DCP reads its placements
            out[entry_pieces[0][0][0]] = value
            continue
        for names, shape, offset in entry_pieces:
            name = names[0]  # a tied weight of one parameter: under its first name
            if name == TIED_COPY and getattr(param, "shared_embedding", False):
                if not load:
                    continue
                name = TIED
            split = layout.splits.get(names[0], (None, False, None))  # impl torch: replicated
            full, shift = global_shape(shape, split, layout.pgm)
            if unit is None:
                boxes = [((0, ) * len(shape), tuple(shape))]
                data = [value]
            else:  # this rank's range of the unit's flat vector, within this tensor
                begin = unit.rank * unit.shard_numel
                a = max(offset, begin)
                b = min(offset + shape.numel(), begin + unit.shard_numel)
                boxes = flat_range_boxes(shape, a - offset, b - offset)
                data = [
                    value[offset + flat_start(shape, o) - begin:][:math.prod(s)].view(s)
                    for o, s in boxes
                ]
            placed = _placed(list(zip(boxes, data)), full, shift)
            if placed and name in out:  # both copies on this rank: each reads its pieces
                out[name].pieces += placed
            elif placed:
                out[name] = Pieces(full, placed)
    return out


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
    }
    if trainer.scaler is not None:  # fp16: the loss scale resumes where it was
        extra["scaler"] = trainer.scaler.state_dict()
    state["trainer"] = extra
    state[f"rng.{par.layout.pgm.rank}"] = rng_state()
    return state


METADATA = ".metadata"  # DCP's: global shapes, every rank's rectangles, where their bytes are
# What DCP's metadata pickle may name (torch 2.13): its dataclasses, torch.Size, dtypes, a
# layout by name, the checkpoint's path. Nothing else is unpickled: a shared checkpoint whose
# checksums match may still have been written to run code.
METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "TensorStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
                 "ChunkStorageMetadata", "BytesStorageMetadata", "MetadataIndex", "StorageMeta")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` with only METADATA_CLASSES and torch dtypes."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) not in METADATA_CLASSES and not dtype:
            raise InputError(f"{self.file_name!r} needs {module}.{name} to load: it is not the "
                             f"metadata of a checkpoint, and was not unpickled, since that could "
                             f"run code")
        return super().find_class(module, name)

    def __init__(self, data: bytes, file_name: str) -> None:
        super().__init__(io.BytesIO(data))
        self.file_name = file_name


class _Reader(dcp.FileSystemReader):
    """DCP's file reader, whose metadata is read by ``_MetadataUnpickler`` (DCP's own calls
    ``pickle.load``, which runs whatever the file names)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        file = os.path.join(str(self.path), METADATA)
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f.read(), file).load()
        if not isinstance(metadata, Metadata):
            raise InputError(f"{file!r} is not the metadata of a checkpoint")
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def data_files(metadata: Metadata) -> List[str]:
    """The data files a checkpoint's metadata points into (``__<rank>_<n>.distcp``), sorted."""
    storage = metadata.storage_data or {}
    return sorted({info.relative_path for info in storage.values()})


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
        name: _write_checksum(os.path.join(path, name))
        for name in data_files(metadata)[rank::world]
    }
    # every data file has its checksum before the metadata's marks the checkpoint complete
    digests = {k: v for part in comm.gather_objects(mine) for k, v in part.items()}
    if rank == 0:
        digests[METADATA] = _write_checksum(os.path.join(path, METADATA))
    comm.barrier()
    return digests


def save_sharded_checkpoint(root: str, step: int, trainer: Any, par: "Parallelized", keep_last: int,
                            layout: Dict[str, Any]) -> str:
    """Collective: ``save_sharded`` into ``step_<step>`` under ``root``, then rank 0 writes the
    manifest of checkpoint.py (format "dcp"), so the latest complete checkpoint is found,
    verified and rotated as a per-rank one is. Returns the checkpoint directory."""
    path = step_dir(root, step)
    commit_sharded(root, path, step, save_sharded(path, trainer, par), keep_last, layout)
    return path


def commit_sharded(root: str, path: str, step: int, digests: Dict[str, str], keep_last: int,
                   layout: Dict[str, Any]) -> None:
    """Collective: rank 0 writes the manifest of the checksummed checkpoint ``path`` (the last
    write: from now on ``--resume latest`` finds it, and older ones rotate out)."""
    if comm.group_rank() == 0:
        write_manifest(root, path, step, comm.group_size(), layout, digests, keep_last,
                       checkpoint_format="dcp")
    comm.barrier()


def _write_checksum(file: str) -> str:
    """Write ``<file>.sha256`` beside ``file``; returns the digest."""
    with open(file, "rb") as f:
        data = f.read()
    write_atomic(checksum_path(file), checksum_line(os.path.basename(file), data))
    return sha256(data)


def verify_sharded(path: str) -> Metadata:
    """Collective over the world: the checkpoint's metadata once it and every data file match
    their checksums (the ranks share the reading); else every rank raises the same
    CorruptFileError naming the first bad file, before anything is loaded."""
    meta = os.path.join(path, METADATA)
    if not os.path.isfile(meta):
        raise InputError(f"{path!r} is not a sharded checkpoint: it has no {METADATA} (written "
                         f"last: a save that stopped before it left an incomplete one)")
    read_checksummed(meta)  # every rank: a truncated or damaged metadata file is never unpickled
    metadata = _Reader(path).read_metadata()
    errors = []
    for name in data_files(metadata)[comm.group_rank()::comm.group_size()]:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            errors.append(f"checkpoint {path!r} is missing {name} (one of its shards)")
            continue
        try:
            read_checksummed(file)
        except CorruptFileError as err:
            errors.append(str(err))
    found = [e for errors_of_rank in comm.all_gather_objects(errors) for e in errors_of_rank]
    if found:
        raise CorruptFileError(found[0])
    return metadata


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
    check_state_keys(f"checkpoint {path!r}", saved, expected, "this config's model.*",
                     "resume it with the model config that wrote it")


def load_sharded(path: str, trainer: Any, par: "Parallelized") -> None:
    """Collective over the world: read this rank's pieces of the weights and AdamW state from
    the DCP checkpoint ``path`` (written at any layout), and the trainer state, once every file
    matches its checksum (``verify_sharded``) and every tensor its shape here (InputError
    naming the checkpoint). ZeRO-1/2 then all-gather the loaded shards (over dp_cp)."""
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
    dcp.load(state, storage_reader=_Reader(path), planner=_LoadPlanner(f"checkpoint {path!r}"))
    if with_optim:
        for p in params:
            opt.state[p]["step"] = torch.tensor(state["optim.step"])
    units = {id(unit): unit for _, _, unit in entries(par) if unit is not None}
    for unit in units.values():
        if unit.zero_stage < 3:  # the full parameters are views of the flat vector: refill it
            unit.gather()
    extra = state["trainer"]
    trainer.scheduler.load_state_dict(extra["scheduler"])
    for group, lr in zip(opt.param_groups, trainer.scheduler.get_last_lr()):
        group["lr"] = lr
    if trainer.scaler is not None and "scaler" in extra:
        trainer.scaler.load_state_dict(extra["scaler"])
    trainer.step = extra["step"]
    if state.get(rng_key) is not None:  # another world size: the ranks' generators start anew
        set_rng_state(state[rng_key])


def to_consolidated(path: str, out: str) -> Dict[str, Any]:
    """Offline, on one process: the DCP checkpoint ``path`` (verified) as one consolidated file
    ``out`` (consolidated.py's format: full reference-keyed weights and AdamW state, any layout
    resumes it), written with its checksum beside it. Holds the whole model in host memory: for
    people who want one file, not for resuming. Returns the state written."""
    metadata = verify_sharded(path)
    state: Dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            full = torch.empty(md.size, dtype=md.properties.dtype)
            state[key] = Pieces(md.size, [((0, ) * len(md.size), full)])
        elif not key.startswith("rng."):
            state[key] = None
    with warnings.catch_warnings():  # DCP warns that no_dist loads in one process: we ask it to
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=_Reader(path), planner=_LoadPlanner(f"checkpoint {path!r}"),
                 no_dist=True)

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
    buffer = io.BytesIO()
    torch.save(consolidated, buffer)
    write_checksummed(out, buffer.getvalue())
    return consolidated
