"""Offline, on one process: a sharded (DCP) checkpoint as a Hugging Face Llama directory.

DCP's metadata lists every tensor's global shape; one process asks for each whole tensor and
DCP's load planner reads every rank's rectangles of it from their ``__<rank>_0.distcp`` files.
Only the weights are read (``model.*``, 4 bytes a parameter in fp32), not AdamW's moments:
a quarter of what ``dcp_checkpoint.to_consolidated`` holds. The directory is written by the
chapter 10 export (``export_hf_llama``), with a ``.sha256`` beside each of its files.
"""

import warnings
from typing import Dict, List, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from scaletorch.models import Llama, LlamaConfig
from scaletorch.models.hf import export_hf_llama
from scaletorch.rules.errors import clip
from scaletorch.rules.safe_files import write_checksum
from scaletorch.trainer.dcp_checkpoint import check_model, verify_sharded_checkpoint
from scaletorch.trainer.dcp_pieces import Pieces, _LoadPlanner, _Reader

MODEL = "model."


def read_weights(path: str, config: LlamaConfig) -> Dict[str, torch.Tensor]:
    """The full weights of DCP checkpoint ``path`` under chapter 00's names, tied ones under
    each name: (shape of the reference parameter) each, its saved dtype. First the directory
    is checked as --resume checks it (``verify_sharded_checkpoint``: its manifest, every file's
    checksum) and the tensors against ``config``'s model (InputError naming the checkpoint)."""
    metadata = verify_sharded_checkpoint(path)
    with torch.device("meta"):
        check_model(path, metadata, Llama(config).state_dict(keep_vars=True))
    state: Dict[str, object] = {"trainer": None}  # its aliases: the tied weights' other names
    for key, md in metadata.state_dict_metadata.items():
        if key.startswith(MODEL) and isinstance(md, TensorStorageMetadata):
            full = torch.empty(md.size, dtype=md.properties.dtype)
            state[key] = Pieces(md.size, [((0, ) * len(md.size), full)])
    with warnings.catch_warnings():  # DCP warns that no_dist loads in one process: we ask it to
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, storage_reader=_Reader(path),
                 planner=_LoadPlanner(f"checkpoint {clip(path)}"), no_dist=True)
    weights = {k[len(MODEL):]: v.pieces[0][1] for k, v in state.items() if isinstance(v, Pieces)}
    aliases = state["trainer"]["aliases"]  # type: ignore[index]
    weights.update({alias: weights[first] for alias, first in aliases.items()})
    return weights


def to_hf(path: str, out: str, config: LlamaConfig,
          dtype: Optional[torch.dtype] = None) -> List[str]:
    """Write DCP checkpoint ``path`` (a Llama of ``config``) as Hugging Face directory ``out``
    (config.json + safetensors, stored at ``dtype``, default the saved one), a ``.sha256``
    beside each file. Returns the files written (checksums not listed)."""
    weights = read_weights(path, config)
    with torch.device("meta"):
        model = Llama(config)
    model.to_empty(device="cpu")
    if config.tie_word_embeddings:  # to_empty keeps the tie; re-point it to be sure
        model.lm_head.weight = model.embed_tokens.weight
    model.load_state_dict(weights)
    files = export_hf_llama(model, out, dtype)
    for file in files:
        write_checksum(file)
    return files
