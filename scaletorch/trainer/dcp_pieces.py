"""What each rank holds of a sharded (DCP) checkpoint: rectangles of the full tensors, the
planners that hand them to torch.distributed.checkpoint, and the reader of its metadata.

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
(global shape and rectangles of every tensor). Loading, each rank offers the rectangles it will
hold; DCP's load planner intersects them with the saved ones and reads only those bytes,
straight into the parameters and AdamW's moments. The ``.metadata`` pickle is read with an
allow-list of DCP's own classes (``_Reader``); plain values with ``load_tensors_only``.
"""

import io
import math
import os
import pickle
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   StorageMeta, TensorProperties)
from torch.distributed.checkpoint.planner import ReadItem, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

from scaletorch.dist import ProcessGroupManager
from scaletorch.parallel.tensor_layout import plain_entries
from scaletorch.rules.errors import InputError, clip
from scaletorch.trainer.checkpoint import load_tensors_only

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


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a storage of just its own bytes, sharing them (no copy), when it is a
    contiguous CPU view into a larger storage (a ZeRO range of a flat vector). DCP's file writer
    clones such a view and keeps the clone until the rank's file closes (torch 2.13): a second
    copy of the shard. On a GPU the writer's copy to the host is compact already."""
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0 or \
            t.untyped_storage().nbytes() == t.nbytes:
        return t
    raw = t.reshape(-1).view(torch.uint8).numpy()  # the same bytes, any dtype (bf16 too)
    return torch.frombuffer(raw, dtype=t.dtype).view(t.shape)


class _SavePlanner(DefaultSavePlanner):
    """DCP's default save planner (deduplication, metadata, validation) on a flat dict whose
    values are ``Pieces`` or plain values; a piece goes to the writer as ``own_storage``."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        return own_storage(obj.__get_tensor_shard__(index)) if isinstance(obj, Pieces) else \
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


# [core: local-pieces]
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


# [end: local-pieces]
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
            raise InputError(f"{clip(self.file_name)} needs {module}.{name} to load: it is not the "
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
            raise InputError(f"{clip(file)} is not the metadata of a checkpoint")
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def data_files(metadata: Metadata) -> List[str]:
    """The data files a checkpoint's metadata points into (``__<rank>_<n>.distcp``), sorted."""
    storage = metadata.storage_data or {}
    return sorted({info.relative_path for info in storage.values()})
