"""A run never writes over another: a run directory that already holds a run is refused or moved.

Before anything is written (``load_config``), ``check_run_dir`` refuses ``logging.run_dir /
logging.name`` when it already holds files, and ``checkpoint.dir`` when it holds checkpoints,
unless the run continues them (``--resume``, or a torchrun restart). The line says the three
ways on: ``--resume``, a new ``--name``, or ``--overwrite``, which ``move_aside`` carries out
by renaming the old directory to ``<path>.old-<time>``; nothing is ever deleted.
"""

import os
import time
from typing import List, Tuple

from scaletorch.config import Config
from scaletorch.dist import restart_count
from scaletorch.rules.errors import InputError

PROBE = ".scaletorch-probe-"  # check_writable's empty directory, made and removed at once


def _entries(path: str) -> List[str]:
    if not os.path.isdir(path):
        return []
    return sorted(e for e in os.listdir(path) if not e.startswith(PROBE))


def occupied(cfg: Config) -> List[Tuple[str, str, List[str]]]:
    """(config key, directory, its entries) of each directory this run writes that already
    holds something: the run directory, and checkpoint.dir when it lies outside it."""
    found = []
    if _entries(cfg.run_path):
        found.append(("logging.run_dir", cfg.run_path, _entries(cfg.run_path)))
    inside = os.path.abspath(cfg.checkpoint_path).startswith(os.path.abspath(cfg.run_path) + os.sep)
    if cfg.checkpoint.every > 0 and not inside and _entries(cfg.checkpoint_path):
        found.append(("checkpoint.dir", cfg.checkpoint_path, _entries(cfg.checkpoint_path)))
    return found


def continues(cfg: Config) -> bool:
    """Whether this run continues the one in its directories (``--resume``, torchrun restart)."""
    return bool(cfg.checkpoint.resume) or restart_count() > 0


def check_run_dir(cfg: Config) -> None:
    """InputError unless this run may write its directories (see the module docstring)."""
    if cfg.logging.overwrite and cfg.checkpoint.resume:
        raise InputError(f"--overwrite moves the run in {cfg.run_path!r} aside and --resume "
                         f"{cfg.checkpoint.resume} continues it: give one of the two")
    if continues(cfg) or cfg.logging.overwrite:
        return
    for key, path, entries in occupied(cfg)[:1]:
        raise held(key, path, entries)


def check_free(key: str, path: str, resume: bool, overwrite: bool) -> None:
    """InputError unless directory ``path`` (the option ``key``) may be written: it holds
    nothing, or this run continues it (``resume``, a torchrun restart), or ``overwrite`` moves
    it aside. Chapter 12, whose options are its own, calls it for runs/<name>."""
    if overwrite and resume:
        raise InputError(f"--overwrite moves the run in {path!r} aside and --resume continues "
                         f"it: give one of the two")
    if resume or overwrite or restart_count() > 0 or not _entries(path):
        return
    raise held(key, path, _entries(path))


def held(key: str, path: str, entries: List[str]) -> InputError:
    """The one line for a directory that already holds a run: the three ways on."""
    shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
    return InputError(f"{key}: {path!r} already holds a run ({shown}); nothing was written: "
                      f"continue it with --resume, give a new --name, or "
                      f"--overwrite to move it aside to {path}.old-<time> (kept, not deleted)")


def move_aside(cfg: Config) -> List[str]:
    """With ``--overwrite`` (and not when continuing): rename each occupied directory to
    ``<path>.old-<YYYYmmdd-HHMMSS>`` (a suffix -2, -3... if taken). One process calls it (global
    rank 0), before the run writes. Returns a line per move."""
    if not cfg.logging.overwrite or continues(cfg):
        return []
    return [
        f"--overwrite: moved {key} {path} aside to {moved_aside(path)}"
        for key, path, _ in occupied(cfg)
    ]


def moved_aside(path: str) -> str:
    """Rename directory ``path`` to ``<path>.old-<YYYYmmdd-HHMMSS>`` (-2, -3... if taken)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target, n = f"{path}.old-{stamp}", 1
    while os.path.exists(target):
        n += 1
        target = f"{path}.old-{stamp}-{n}"
    os.rename(path, target)
    return target
