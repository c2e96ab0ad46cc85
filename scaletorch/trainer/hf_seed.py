"""Seed a sharded run from a Hugging Face directory with no gather: each rank reads only its
own rectangles of each tensor from the safetensors files, straight into its shards.

The rectangles are those a DCP checkpoint saves (``dcp_pieces.local_pieces``): a tp split
at ``tp_rank x its size`` less the vocabulary padding, an expert shard, a stage's whole
tensors, a ZeRO flat range cut into row boxes. safetensors' ``get_slice`` reads one rectangle
of a tensor from the memory-mapped file, never the whole tensor::

    model.safetensors, q_proj (32, 32)       tp rank 0 reads rows [0, 16)
        rows  0..15  ################        tp rank 1 reads rows [16, 32)
        rows 16..31  ################        (a ZeRO shard: its few row boxes of them)

So a rank reads the bytes it will hold, not the model's: at 405B and 64 ranks a rank reads
1/64 of the weights instead of all of them. The model is first built from the seed at the
HF config (chapter 00's rule), then every piece is overwritten; ZeRO-1/2 then all-gather
their flat shards (over dp_cp) to refill the full parameters, as a DCP load does. An export of
ours has a ``.sha256`` beside each file: the ranks share the hashing before any piece is read.
"""

from typing import TYPE_CHECKING, Dict, List, Tuple

import torch

from scaletorch.dist import comm
from scaletorch.models.hf import (from_hf_name, load_hf_config, require_hf, tensor_files,
                                  to_hf_name, verify_export_file)
from scaletorch.rules import boundary
from scaletorch.rules.errors import InputError
from scaletorch.rules.safe_files import CorruptFileError
from scaletorch.trainer.dcp_pieces import Pieces, local_pieces

LM_HEAD, EMBEDDING = "lm_head.weight", "embed_tokens.weight"  # one tensor when tied

if TYPE_CHECKING:  # types only: the trainer package does not import chapter 07 at load
    from scaletorch.parallel.parallelize import Parallelized


def _sources(path: str, pieces: Dict[str, Pieces],
             par: "Parallelized") -> Dict[str, List[Tuple[str, Pieces]]]:
    """{safetensors file: [(HF name, this rank's pieces of it)]}, every shape checked against
    the model's (InputError naming the file). A tied weight is read under any of its names
    the directory holds (a tied HF export has no lm_head.weight; a pipeline's last stage holds
the tied copy as lm_head.weight alone)."""
    files = tensor_files(path)
    names_of: Dict[str, List[str]] = {name: [name] for name in pieces}
    if load_hf_config(path).tie_word_embeddings and LM_HEAD in names_of:  # a last stage's copy
        names_of[LM_HEAD].append(EMBEDDING)
    out: Dict[str, List[Tuple[str, Pieces]]] = {}
    for name, piece in pieces.items():
        found = [to_hf_name(n) for n in names_of[name] if to_hf_name(n) in files]
        if not found:
            raise InputError(f"{path}: no tensor {to_hf_name(name)} in its safetensors files")
        file, shape = files[found[0]]
        if shape != tuple(piece.size()):
            raise InputError(f"{file}: tensor {found[0]} has shape {shape}, but this run's model "
                             f"holds {from_hf_name(found[0])} at {tuple(piece.size())}")
        out.setdefault(file, []).append((found[0], piece))
    return out


def verify_files(files: List[str]) -> None:
    """Collective over the world: each safetensors file of ``files`` matches the ``.sha256``
    beside it, when the directory is an export of ours (a Hub directory has none). The ranks
    share the hashing, a file each in turn; else every rank raises the same CorruptFileError
    naming the first bad file, before any weight is read."""
    errors = []
    for file in sorted(files)[comm.group_rank()::comm.group_size()]:
        try:
            verify_export_file(file)  # in blocks: a file's bytes are never all in memory
        except CorruptFileError as err:
            errors.append(str(err))
    found = [e for errors_of_rank in comm.all_gather_objects(errors) for e in errors_of_rank]
    if found:
        raise CorruptFileError(found[0])


def seed_from_hf(path: str, par: "Parallelized") -> int:
    """Collective over the world (``verify_files``), and over dp_cp when ZeRO-1/2 (the
    refill). Overwrite this rank's pieces of every weight of ``par`` with those of Hugging Face
    directory ``path`` (cast to the parameters' dtype). Returns the bytes this rank read from
    the safetensors files: its rectangles, at the files' dtype, never a whole tensor it does
    not hold."""
    require_hf("safetensors")
    from safetensors import safe_open
    pieces = local_pieces(par, torch.Tensor.detach, load=True)  # a tied copy as the embedding
    sources = _sources(path, pieces, par)
    # every file, the same list on every rank: a damaged byte is never read into a weight
    verify_files(sorted({file for file, _ in tensor_files(path).values()}))
    read = 0
    with torch.no_grad():
        for file, wanted in sources.items():
            with safe_open(file, framework="pt") as f:
                for hf_name, piece in wanted:
                    source = f.get_slice(hf_name)
                    for offsets, t in piece.pieces:
                        box = tuple(slice(o, o + n) for o, n in zip(offsets, t.shape))
                        part = source[box]  # (t.shape): only these bytes leave the file
                        read += part.numel() * part.element_size()
                        t.copy_(part)  # cast to the parameter's dtype: checked there
                        if not bool(torch.isfinite(t).all()):
                            raise InputError(f"{file}: tensor {hf_name} holds a value that is "
                                             f"inf or nan as the model's {t.dtype}: the weights "
                                             f"are damaged or not of this model")
    units = {id(unit): unit for _, _, unit in par.layout.entries if unit is not None}
    for unit in units.values():
        if unit.zero_stage < 3:  # the full parameters are views of the flat vector: refill it
            unit.gather()
    return read


def held_bytes(par: "Parallelized", dtype: torch.dtype) -> int:
    """Bytes of this rank's rectangles of every weight at ``dtype``: what ``seed_from_hf``
    must read from files stored at that dtype."""
    size = torch.empty(0, dtype=dtype).element_size()
    return sum(t.numel() * size
               for piece in local_pieces(par, torch.Tensor.detach, load=True).values()
               for _, t in piece.pieces)


def stored_bytes(path: str) -> int:
    """Bytes of every tensor of Hugging Face directory ``path`` as its safetensors files store
    them (what loading the whole model reads), from the files' headers: no weights are read."""
    total = 0
    for file in sorted({file for file, _ in tensor_files(path).values()}):
        with open(file, "rb") as f:  # safetensors: an 8-byte little-endian length, a JSON header
            size = int.from_bytes(f.read(8), "little")  # safe_open (tensor_files) checked it
            header = boundary.parse_json(
                f.read(size).decode("utf-8", "replace"), f"safetensors header of {file}")
        total += sum(entry["data_offsets"][1] - entry["data_offsets"][0]
                     for name, entry in header.items() if name != "__metadata__")
    return total
