"""A run directory belongs to one run: it is never written over, and never by two runs at once.

Before anything is written (``load_config``), ``check_run_dir`` refuses ``logging.run_dir /
logging.name`` when it already holds files, and ``checkpoint.dir`` when it holds checkpoints,
unless the run continues them (``--resume``, or a torchrun restart). The line says the three
ways on: ``--resume``, a new ``--name``, or ``--overwrite``, which ``move_aside`` carries out
by renaming the old directory to ``<path>.old-<time>``; nothing is ever deleted.

Ownership. A run marks each directory it writes with a MARKER file and holds an exclusive
``fcntl.flock`` on it for its whole life (``take_ownership``): global rank 0, and the first
rank of every other node, on a marker of its own (``MARKER.node<k>``), since its ranks write
their checkpoint files there too. The kernel drops the lock when the process ends, however it
ends, so a lock is never stale. A second run of the same directory finds the lock held and is
refused with one line naming the holder's pid, host and start time (``check_not_held``);
the check is made again once the lock is held, so two runs started at the same moment cannot
both pass it. ``--overwrite`` moves aside only a directory that carries the marker: one that
a run made, not any directory a path happens to name; and a checkpoint.dir only when its marker
names this run (``run``), never another run's directory given as checkpoint.dir.

Identity. A directory a run writes is the path the user gave, never a symlink to another place
(``check_not_a_symlink``), and never inside another run's directory, finished or not
(``check_not_inside_a_run``). A live lock is checked first, also on the run directory above a
checkpoint.dir inside one, so the line says "in use" rather than offering ways on.
"""

import atexit
import contextlib
import fcntl
import json
import os
import socket
import stat
import time
from typing import Dict, List, Optional, Tuple

from scaletorch.config import Config
from scaletorch.dist import restart_count
from scaletorch.rules import boundary
from scaletorch.rules.errors import InputError, clip
from scaletorch.rules.safe_files import write_atomic
from scaletorch.rules.schema import NAME_BYTES

PROBE = ".scaletorch-probe-"  # check_writable's empty directory, made and removed at once
MARKER = ".scaletorch-run"  # a run made this directory; its lock; who holds it (JSON)
MARKER_BYTES = 16384  # a marker's JSON: pid, host, start time, the run's path (at most PATH_MAX)
_held: Dict[str, int] = {}  # this process's locks: directory (real path) -> open descriptor
_made: List[str] = []  # the directories ``hold`` created (they did not exist before this run)


def _entries(path: str) -> List[str]:
    """What ``path`` holds, less the probe and the markers (a directory a run has only
    claimed is empty)."""
    if not os.path.isdir(path):
        return []
    return sorted(e for e in os.listdir(path) if not e.startswith((PROBE, MARKER)))


def _marker() -> str:
    """This process's marker: MARKER for global rank 0 (and one process); MARKER.node<k> for
    the first rank of node k > 0 under torchrun; "" for any other rank (its node's first rank
    holds the lock for it)."""
    if int(os.environ.get("RANK", "0")) == 0:
        return MARKER
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        return f"{MARKER}.node{os.environ.get('GROUP_RANK', '0')}"
    return ""


def _open_marker(marker: str, flags: int) -> int:
    """A descriptor of ``marker`` once it is a regular file: opened without following a
    symlink and without blocking (a FIFO would block a plain open for ever), then checked.
    FileNotFoundError when there is none; InputError naming it when it is anything else."""
    try:
        fd = os.open(marker, flags | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except FileNotFoundError:
        raise
    except OSError as err:  # a directory opened to write, a symlink (ELOOP), no permission
        kind = _kind(os.lstat(marker).st_mode) if os.path.lexists(marker) else None
        raise _not_a_marker(marker, kind or err.strerror or str(err)) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_a_marker(marker, _kind(mode) or "not a file")
    return fd


def _kind(mode: int) -> Optional[str]:
    """What a file that is not a regular one is, in words (None: a regular file)."""
    return None if stat.S_ISREG(mode) else boundary.kind_of(mode)


def _not_a_marker(marker: str, found: str) -> InputError:
    return InputError(f"{clip(marker)} is not a regular file ({found}): it is where a run keeps "
                      f"its marker and lock; nothing was written: remove or rename it")


def holder(path: str, name: str = MARKER) -> Optional[str]:
    """"pid P on host H, started T" of the live run that holds marker ``name`` of directory
    ``path``, or None when none does (a marker whose lock is free is a finished run's).
    InputError when the marker is not a regular file (``_open_marker``)."""
    marker = os.path.join(path, name)
    if not os.path.isdir(path):  # not made yet, or a path through a file (check_writable's)
        return None
    try:
        fd = _open_marker(marker, os.O_RDONLY)
    except FileNotFoundError:  # no marker: no run made it
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)  # free: no run holds it
        return None
    except BlockingIOError:
        return _who(marker)
    finally:
        os.close(fd)


def _who(marker: str) -> str:
    try:
        with open(marker) as f:  # parse_json: JSON within its limits, else an InputError
            info = boundary.parse_json(f.read(MARKER_BYTES), "run marker")
        return f"pid {info['pid']} on host {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not yet said who it is"


def check_not_held(key: str, path: str) -> None:
    """InputError when a live run holds the lock on directory ``path`` (the option ``key``)
    that this process would take, or on the run directory that holds ``path``. Not for a
    process that takes none (its node's first rank checks), nor for a lock this process holds
    already."""
    name = _marker()
    if not name or os.path.realpath(path) in _held:
        return
    who = holder(path, name)
    above = _run_above(path)  # a checkpoint.dir inside a run's directory: that run's lock
    if who is None and above is not None and os.path.realpath(above) not in _held:
        who = holder(above)
    if who is not None:
        raise InputError(f"{key}: {clip(path)} is in use by another run ({who}); nothing was "
                         f"written: wait for it to end, or give another {other_option(key)}")


def other_option(key: str) -> str:
    """The option that names another directory for ``key``: a run directory is
    logging.run_dir/<--name>; checkpoint.dir is given whole."""
    if key == "logging.run_dir":
        return "--name"
    return key if key.startswith("--") else f"--{key}"  # chapter 12 names its own flags


def is_run_dir(path: str) -> bool:
    """Whether a run made directory ``path``: it carries the MARKER (a regular file)."""
    marker = os.path.join(path, MARKER)
    return os.path.lexists(marker) and stat.S_ISREG(os.lstat(marker).st_mode)


def _run_above(path: str) -> Optional[str]:
    """The nearest directory above ``path`` that a run made (it carries the MARKER), or None."""
    path = os.path.abspath(path)
    while os.path.dirname(path) != path:
        path = os.path.dirname(path)
        if is_run_dir(path):
            return path
    return None


def _missing(path: str) -> List[str]:
    """The directories ``os.makedirs(path)`` would create, outermost first (``runs`` too when
    the first run of a checkout makes ``runs/NAME``)."""
    missing: List[str] = []
    while path and not os.path.lexists(path):
        missing.insert(0, path)
        parent = os.path.dirname(path)
        path = "" if parent == path else parent
    return missing


def hold(key: str, path: str, run: Optional[str] = None) -> bool:
    """Create directory ``path`` if need be and take this process's lock on it for the rest
    of its life, recording who holds it and the run directory ``run`` it writes for (``path``
    itself by default); InputError naming the holder when another run does. Returns False for
    a rank that takes no lock (``_marker``)."""
    name = _marker()
    if not name:
        return False
    if os.path.realpath(path) in _held:  # taken already (load_config twice in one process)
        return True
    missing, marker = _missing(path), os.path.join(path, name)
    _made.extend(missing)  # what this run creates, to remove if it writes nothing
    created = not os.path.lexists(marker)
    try:  # a name the schema let through may still fail here (a full disk, a path too long)
        os.makedirs(path, exist_ok=True)
        fd = _open_marker(marker, os.O_RDWR | os.O_CREAT)
    except OSError as err:
        raise InputError(f"{key}: cannot create {clip(path)} ({err.strerror}); nothing was "
                         f"written: give a shorter --name or a directory you can write") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        check_not_held(key, path)  # names the holder
        raise InputError(f"{key}: {clip(path)} is in use by another run") from None
    info = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "run": os.path.realpath(run or path)
    }
    data, old, done = json.dumps(info).encode(), os.pread(fd, MARKER_BYTES, 0), 0
    try:  # over the old marker, then cut: a full disk refuses only the bytes past its blocks
        while done < len(data):
            done += os.pwrite(fd, data[done:], done)
        os.ftruncate(fd, len(data))
    except OSError as err:  # a full disk, a quota: the old marker back, or none of this run's
        with contextlib.suppress(OSError):
            os.pwrite(fd, old, 0)
            os.ftruncate(fd, len(old))
        os.close(fd)
        with contextlib.suppress(OSError):
            if created:
                os.remove(marker)
        for made in reversed(missing):
            with contextlib.suppress(OSError):
                os.rmdir(made)
        raise InputError(f"{key}: cannot write the run marker {clip(marker)} ({err.strerror}); "
                         f"nothing was written: free space there, or give a directory on "
                         f"another disk") from None
    _held[os.path.realpath(path)] = fd
    return True


def release() -> None:
    """Drop every lock this process holds (the process's end drops them too; tests call it
    between runs made in one process)."""
    while _held:
        os.close(_held.popitem()[1])


def remove_unused() -> None:
    """Remove each directory this process created (``hold``) that still holds nothing but its
    markers, and drop the locks: an input refused after the lock was taken (a checkpoint whose
    shapes fit no model of this layout) leaves nothing behind. A directory with any file stays."""
    name = _marker()
    for path in reversed(_made):
        if _entries(path):
            continue
        fd = _held.pop(os.path.realpath(path), None)
        if fd is not None:
            os.close(fd)
        with contextlib.suppress(OSError):  # another node's marker: that node removes it
            os.remove(os.path.join(path, name))
        with contextlib.suppress(OSError):  # a parent this run made holds no marker
            os.rmdir(path)
    _made.clear()


def owned_dirs(cfg: Config) -> List[Tuple[str, str]]:
    """(config key, directory) of each directory this run writes: the run directory, and
    checkpoint.dir when checkpoints are saved outside it."""
    dirs = [("logging.run_dir", cfg.run_path)]
    if cfg.checkpoint.every > 0 and not _inside(cfg):
        dirs.append(("checkpoint.dir", cfg.checkpoint_path))
    return dirs


def _inside(cfg: Config) -> bool:
    return os.path.abspath(cfg.checkpoint_path).startswith(os.path.abspath(cfg.run_path) + os.sep)


def take_ownership(cfg: Config) -> None:
    """Lock every directory this run writes (``hold``), then check again, under the lock,
    that none holds another run (``check_run_dir``): a run that finished between the first
    check and the lock is refused too. Call once per process, after ``move_aside``."""
    if not _marker():
        return
    # a script that ends before it writes (--show-schedule, a refusal a test catches) leaves
    # no directory holding only the marker: the name stays free for the next run
    atexit.unregister(remove_unused)  # once, however many runs this process starts
    atexit.register(remove_unused)
    for key, path in owned_dirs(cfg):
        hold(key, path, cfg.run_path)
    check_run_dir(cfg)


def occupied(cfg: Config) -> List[Tuple[str, str, List[str]]]:
    """(config key, directory, its entries) of each directory this run writes that already
    holds something: the run directory, and checkpoint.dir when it lies outside it."""
    return [(key, path, _entries(path)) for key, path in owned_dirs(cfg) if _entries(path)]


def continues(cfg: Config) -> bool:
    """Whether this run continues the one in its directories (``--resume``, torchrun restart)."""
    return bool(cfg.checkpoint.resume) or restart_count() > 0


def check_run_dir(cfg: Config) -> None:
    """InputError unless this run may write its directories (see the module docstring): no
    live run holds them, and they hold no other run, unless this one continues it or moves a
    run's directory aside (``--overwrite``)."""
    if cfg.logging.overwrite and cfg.checkpoint.resume:
        raise InputError(f"--overwrite moves the run in {clip(cfg.run_path)} aside and --resume "
                         f"{cfg.checkpoint.resume} continues it: give one of the two")
    written = [("logging.run_dir", cfg.run_path)]
    if cfg.checkpoint.every > 0:
        written.append(("checkpoint.dir", cfg.checkpoint_path))
    for key, path in written:
        check_not_a_symlink(key, path)
    for key, path in owned_dirs(cfg):
        check_not_held(key, path)
    for key, path in written:
        check_not_inside_a_run(key, path, cfg.run_path)
    check_run_files(cfg.run_path)
    if continues(cfg):
        return
    for key, path, entries in occupied(cfg):
        if key == "checkpoint.dir" and is_run_dir(path):
            check_this_runs(cfg.run_path, path)
    if cfg.logging.overwrite:
        for key, path, entries in occupied(cfg):
            check_made_by_a_run(key, path)
        return
    for key, path, entries in occupied(cfg)[:1]:
        raise held(key, path, entries)


def check_not_a_symlink(key: str, path: str) -> None:
    """InputError when directory ``path`` (the option ``key``) is a symlink: its files would
    land where it points, a directory this run does not own (a parent may be a link)."""
    if os.path.islink(path):
        raise InputError(f"{key}: {clip(path)} is a symlink (to {clip(os.readlink(path))}): a "
                         f"run writes only in a directory of its own; nothing was written: give "
                         f"the real directory, or another {other_option(key)}")


def check_not_inside_a_run(key: str, path: str, run_path: str) -> None:
    """InputError when directory ``path`` (the option ``key``) lies inside the directory of
    another run, live or finished (a directory above it carries the MARKER and is not
    ``run_path``): its files would mix with that run's, and an ``--overwrite`` of that run
    would carry them away."""
    above = _run_above(path)
    if above is not None and os.path.realpath(above) != os.path.realpath(run_path):
        raise InputError(f"{key}: {clip(path)} is inside the directory of another run "
                         f"({clip(above)}, which carries {MARKER}); nothing was written: give "
                         f"a directory outside it")


def _marked_run(path: str) -> Optional[str]:
    """The run directory that marker MARKER of ``path`` records (``hold``'s "run"), or None
    when it records none (a marker of an older ScaleTorch, or an unreadable one)."""
    try:
        fd = _open_marker(os.path.join(path, MARKER), os.O_RDONLY)
    except (FileNotFoundError, InputError):
        return None
    try:
        info = boundary.parse_json(
            os.pread(fd, MARKER_BYTES, 0).decode("utf-8", "replace"), "run marker")
        return info["run"] if isinstance(info.get("run"), str) else None
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def check_this_runs(run_path: str, path: str) -> None:
    """InputError unless checkpoint.dir ``path``, a directory a run made, was made for this
    run (its marker records ``run_path``): another run's directory is neither continued nor
    moved aside (``--overwrite``) by a run that only names it as its checkpoint.dir."""
    owner = _marked_run(path)
    if owner != os.path.realpath(run_path):
        whose = f"the run in {clip(owner)}" if owner else "another run"
        raise InputError(f"checkpoint.dir: {clip(path)} belongs to {whose}, not to this run "
                         f"({clip(run_path)}); nothing was written or moved: give another "
                         f"--checkpoint.dir")


APPENDED = ("metrics.jsonl", "log.txt", "config.yaml")  # files a run opens in its directory


def check_run_files(run_path: str) -> None:
    """InputError unless each file a run opens in its directory (APPENDED, the marker) is a
    regular file or absent: a directory, FIFO or symlink there would fail or block the run
    after it has written its first lines, or send them elsewhere. Nothing is opened."""
    for name in (*APPENDED, MARKER):
        file = os.path.join(run_path, name)
        kind = _kind(os.lstat(file).st_mode) if os.path.lexists(file) else None
        if kind is not None:
            raise InputError(f"{clip(file)} is {kind}, not a regular file: the run writes its "
                             f"{name} there; nothing was written: remove or rename it")


def check_made_by_a_run(key: str, path: str) -> None:
    """InputError unless ``path`` carries a run's MARKER: --overwrite moves only those."""
    if not is_run_dir(path):
        raise InputError(f"{key}: {clip(path)} was not made by a run (it has no {MARKER}): "
                         f"--overwrite moves aside only a run's directory; give another "
                         f"{other_option(key)}, or move it yourself")


def check_free(key: str, path: str, resume: bool, overwrite: bool) -> None:
    """InputError unless directory ``path`` (the option ``key``) may be written: it holds
    nothing, or this run continues it (``resume``, a torchrun restart), or ``overwrite`` moves
    it aside. Chapter 12, whose options are its own, calls it for runs/<name>."""
    if overwrite and resume:
        raise InputError(f"--overwrite moves the run in {clip(path)} aside and --resume continues "
                         f"it: give one of the two")
    check_not_a_symlink(key, path)
    check_not_held(key, path)
    if resume or restart_count() > 0 or not _entries(path):
        return
    if overwrite:
        return check_made_by_a_run(key, path)
    raise held(key, path, _entries(path))


def held(key: str, path: str, entries: List[str]) -> InputError:
    """The one line for a directory that already holds files, with the ways on that are true
    of it: a run's (the MARKER) may be continued or moved aside; any other is not a run's."""
    shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
    above = _run_above(path)
    if not is_run_dir(path) and above is not None:  # a run's checkpoints/, in its directory
        return InputError(
            f"{key}: {clip(path)} already holds a run's files ({shown}), of the run "
            f"in {clip(above)}; nothing was written: give another {other_option(key)}")
    if not is_run_dir(path):
        return InputError(
            f"{key}: {clip(path)} already holds files ({shown}) that no run made (it "
            f"has no {MARKER}); nothing was written: give another {other_option(key)}, "
            f"or move it yourself")
    return InputError(f"{key}: {clip(path)} already holds a run ({shown}); nothing was written: "
                      f"continue it with --resume, give a new {other_option(key)}, or "
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
    """Rename directory ``path`` to ``<path>.old-<YYYYmmdd-HHMMSS>`` (-2, -3... if taken), its
    name cut (whole characters) so that the new one fits NAME_BYTES: a run name may use all of
    them. InputError naming both when the OS still refuses (a path over PATH_MAX)."""
    parent, name = os.path.split(os.path.normpath(path))
    stamp, n, target = time.strftime("%Y%m%d-%H%M%S"), 1, ""
    while not target or os.path.lexists(target):
        suffix = f".old-{stamp}" + (f"-{n}" if n > 1 else "")
        cut = name  # each character's bytes as the OS gets them (a surrogate escape: one)
        while len(os.fsencode(cut + suffix)) > NAME_BYTES:
            cut = cut[:-1]
        target, n = os.path.join(parent, cut + suffix), n + 1
    try:
        os.rename(path, target)
    except OSError as err:
        raise InputError(f"--overwrite: cannot move {clip(path)} aside to {clip(target)} "
                         f"({err.strerror}); nothing was moved: move it yourself") from None
    return target


METRICS = "metrics.jsonl"


def keep_metrics_to(run_path: str, step: int) -> Optional[str]:
    """On a resume at ``step``: ``metrics.jsonl`` keeps the lines of steps up to ``step``, and
    the later ones (steps the resumed run trains again, or half a line a kill left) move to
    ``metrics.after-step-<step>.jsonl`` (-2, -3... if taken), so every step appears once. The
    side file is written before the log is replaced (atomically): no line is ever lost. Returns
    the line that says so, or None when nothing moved. Rank 0 calls it, before the first step."""
    path = os.path.join(run_path, METRICS)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    kept: List[bytes] = []
    later: List[bytes] = []
    for line in lines:  # kept: a whole line whose step is an int (no bool, 2.9, 1e400) <= step
        try:
            record = boundary.parse_json(line.decode("utf-8"), "a metrics line")
            kept_step = record["step"]
            whole = (line.endswith(b"\n") and type(kept_step) is int and 0 <= kept_step <= step)
        except (ValueError, KeyError, TypeError):
            whole = False
        (kept if whole else later).append(line)
    if not later:
        return None
    side, n = os.path.join(run_path, f"metrics.after-step-{step}.jsonl"), 1
    while os.path.exists(side):
        n += 1
        side = os.path.join(run_path, f"metrics.after-step-{step}-{n}.jsonl")
    write_atomic(side, b"".join(later))
    write_atomic(path, b"".join(kept))
    return (f"resumed at step {step}: {len(later)} line(s) of {METRICS} after it moved to "
            f"{side}")
