"""A resume continues the same run: the checkpoint's config is compared with this one's.

Each checkpoint's manifest keeps the config of the run that wrote it (``record``: every field
but the SILENT ones, under ``layout["config"]``). Before anything starts, ``check_resumed``
compares it with the resumed run's by the policy each field declares beside its rule
(scaletorch/config.py, ``checked(..., resume=...)``):

    REFUSED   another run: model shapes, the data (source, seed, seq_len, global batch)
    RESHARD   the layout: refused for per-rank checkpoints, which hold one layout's shards;
              printed for dcp ones, which any layout reads
    PRINTED   allowed, and said: learning rate, steps, logging, checkpoint cadence
    SILENT    allowed without a word: paths, the resume itself

Every refused field is named in one line, with both values; the printed ones go in one line
too (``resume_notes``). A manifest without the config (deleted: every manifest of format
version 2 holds it) is refused, or, under ``--trust-unchecked``, resumed with a line saying so.

The record also keeps the sha256 of the data file's contents (``DATA_DIGEST``): the same
``data.path`` whose file was rewritten is another run's data, refused like another path. A
checkpoint written before the record kept it is not compared on it.
"""

import dataclasses
import json
from typing import Any, Dict, Iterator, List, Optional, Tuple

from scaletorch.config import Config
from scaletorch.data.datasets import data_digest
from scaletorch.rules import boundary
from scaletorch.rules.errors import InputError, clip
from scaletorch.rules.schema import (PRINTED, REFUSED, RESHARD, RESUME, SILENT, Rule, ignored_by,
                                     rules_of)

# The Trainer says these itself when it loads the optimizer's state (trainer.py
# note_changed_settings, with the schedule they lead to): not said twice.
SAID_BY_THE_TRAINER = ("training.lr", "training.beta1", "training.beta2", "training.weight_decay")

# the record's key for the sha256 of data.path's contents (no config field: the file's)
DATA_DIGEST = "data.sha256"


def fields(cfg: Config) -> Iterator[Tuple[str, Any, Optional[str], Any, Rule]]:
    """(key, value, resume policy, default, rule) of every field of ``cfg`` that has a rule,
    as "section.name" (or a top-level name)."""
    for top in dataclasses.fields(cfg):
        obj = getattr(cfg, top.name)
        section = obj if dataclasses.is_dataclass(obj) else cfg
        prefix = f"{top.name}." if section is obj else ""
        declared = {f.name: f.metadata for f in dataclasses.fields(section)}
        for name, _, rule, default in rules_of(type(section)):
            if section is cfg and name != top.name:
                continue  # a top-level field, once: at its own turn
            yield (prefix + name, getattr(section, name), declared[name].get(RESUME), default, rule)


def setting(cfg: Config, key: str) -> Any:
    """The value of ``section.name`` (or a top-level name) in ``cfg``."""
    section, _, name = key.rpartition(".")
    return getattr(getattr(cfg, section) if section else cfg, name)


def record(cfg: Config) -> Dict[str, Any]:
    """{key: value} of every field of ``cfg`` whose change a resume notices (all but the
    SILENT), as JSON holds them; a field the run ignores (its rule's ``unless``) at its
    default, so that giving it or not is the same run."""
    out = {}
    for key, value, policy, default, rule in fields(cfg):
        if policy == SILENT:
            continue
        if ignored_by(key, rule, lambda other: setting(cfg, other)):
            value = default
        out[key] = json.loads(json.dumps(value))  # a tuple as the list JSON gives back
    digest = data_digest(cfg.data.dataset, cfg.data.path)
    if digest is not None:
        out[DATA_DIGEST] = digest
    return out


def policies(cfg: Config) -> Dict[str, Optional[str]]:
    """{key: resume policy} of every field of ``cfg`` (None: none declared)."""
    return {key: policy for key, _, policy, _, _ in fields(cfg)}


def changes(saved: Dict[str, Any], cfg: Config,
            checkpoint_format: str) -> Tuple[List[str], List[str]]:
    """(refused, printed): "key old -> new" for each field of ``cfg`` whose value differs from
    ``saved`` (a checkpoint's ``record``), split by the field's policy; RESHARD is refused
    unless ``checkpoint_format`` is "dcp"."""
    now = record(cfg)
    policy = policies(cfg)
    refused, printed = [], []
    for key, value in now.items():
        if key not in saved or saved[key] == value:
            continue
        if key == DATA_DIGEST:  # another path is data.path's own change, said by it
            if saved.get("data.path") == now.get("data.path"):
                refused.append(f"the contents of data.path {clip(cfg.data.path)} (sha256 "
                               f"{str(saved[key])[:12]}... -> {value[:12]}...)")
            continue
        said = f"{key} {saved[key]!r} -> {value!r}"
        kind = policy[key]
        if kind == REFUSED or (kind == RESHARD and checkpoint_format != "dcp"):
            refused.append(said)
        elif (kind == PRINTED or kind == RESHARD) and key not in SAID_BY_THE_TRAINER:
            printed.append(said)
    return refused, printed


def check_resumed(path: str, manifest: Dict[str, Any], cfg: Config) -> Optional[str]:
    """InputError naming every refused change between checkpoint ``path`` (its ``manifest``)
    and ``cfg``, old and new; else the line of the printed ones (None when there are none)."""
    saved = (manifest.get("layout") or {}).get("config")
    if not isinstance(saved, dict):  # every manifest this format version has holds it
        if boundary.is_trusted_unchecked(path):
            return (f"resuming {path} without comparing its settings with this run's: its "
                    f"manifest has no layout.config (--trust-unchecked {path})")
        raise InputError(f"--resume {path}: its manifest has no layout.config (the settings of "
                         f"the run that wrote it; every manifest of format version 2 holds "
                         f"them), so a changed setting would go unnoticed: resume a checkpoint "
                         f"as saved, or add --trust-unchecked {path} to resume without comparing")
    fmt = manifest.get("format", "per-rank")
    refused, printed = changes(saved, cfg, fmt)
    if refused:
        why = ("a per-rank checkpoint resumes only at the layout that wrote it; " if any(
            policies(cfg).get(s.split(" ", 1)[0]) == RESHARD for s in refused) else "")
        if any(s.startswith("the contents of data.path") for s in refused):
            why += "the data file was rewritten since the checkpoint: restore it; "
        raise InputError(f"--resume {path} was written by another run: {', '.join(refused)} "
                         f"(checkpoint -> this run); {why}a resume continues the same run: give "
                         f"its values (config.yaml in its run directory), or start a new run "
                         f"with another --name")
    if printed:
        return f"resuming {path} with changed settings: {', '.join(printed)}"
    return None
