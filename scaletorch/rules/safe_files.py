"""How a run writes and reads the files it keeps: whole or absent, checksummed, named on failure.

    write_atomic(path, data)       temporary name, fsync, rename: old or new, never half
    write_checksummed(path, data)  the same, then ``<path>.sha256`` ("<hex>  <name>"; read
                                   also in ``sha256sum -b``'s "<hex> *<name>")
    read_checksummed(path)         the bytes, once they match ``<path>.sha256``
    verify_checksum(path)          the same check, reading the file in blocks
    write_checksum(path)           ``<path>.sha256`` of a file already written, read in blocks

A write that fails (a full disk, an I/O error, Ctrl-C) removes its temporary file and raises
``WriteError`` naming the file, so the directory holds only whole files. ``write_all`` is the
one place bytes reach a file: a test replaces it to simulate a full disk.
"""

import errno
import hashlib
import os
from typing import BinaryIO, Tuple

from scaletorch.rules.errors import InputError, clip

__all__ = [
    "CorruptFileError", "WriteError", "checksum_line", "checksum_path", "file_sha256",
    "read_checksum", "read_checksummed", "sha256", "verify_checksum", "write_all", "write_atomic",
    "write_checksum", "write_checksummed"
]

SUFFIX = ".sha256"
# What hashing a file holds at once: 256 KiB, less than one tensor of a model worth sharding,
# so checksumming a checkpoint shard adds no copy of the shard to a rank's memory
BLOCK = 1 << 18


class CorruptFileError(InputError):
    """A checkpoint file whose bytes do not match its checksum, or that cannot be read."""


class WriteError(InputError):
    """A file the run could not write (disk full, I/O error): the message names it."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def checksum_path(path: str) -> str:
    """Where the checksum of ``path`` is kept: beside it, ``<name>.sha256``."""
    return path + SUFFIX


def write_all(f: BinaryIO, data: bytes) -> None:
    """Write ``data`` to the open file ``f`` (the seam a test patches to fill the disk)."""
    f.write(data)


# what a failed write of a training run leaves: the error's last words (``write_atomic``)
RUN_KEPT = "what the run wrote before (the previous checkpoint, metrics.jsonl) is kept"


def write_atomic(path: str, data: bytes, kept: str = RUN_KEPT) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the new one, never half.

    On any failure the temporary file is removed; an OSError becomes a WriteError naming
    ``path`` (ENOSPC: "no space left on device") and ending with ``kept``, what the caller
    leaves in place (a run: its previous checkpoint; a script: its own words). The directory
    is created if it is missing: another rank whose own write failed may have removed a
    checkpoint directory it found empty, and this rank's error must be its own (the full
    disk), not a missing directory."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(tmp, "wb") as f:
            write_all(f, data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(err, OSError):
            reason = os.strerror(err.errno) if err.errno else str(err)
            hint = " (free space there)" if err.errno == errno.ENOSPC else ""
            raise WriteError(
                f"could not write {clip(path)}: {reason}{hint}; its partial files were "
                f"removed, and {kept}") from None
        raise


def checksum_line(name: str, data: bytes) -> bytes:
    """The content of a checksum file: ``<hex>  <name>\n``, which ``sha256sum -c`` reads."""
    return _digest_line(name, sha256(data))


def _digest_line(name: str, digest: str) -> bytes:
    return f"{digest}  {name}\n".encode()


def file_sha256(path: str) -> Tuple[str, int]:
    """(sha256 hex digest, size in bytes) of the file at ``path``, read BLOCK bytes at a time."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


def write_checksum(path: str) -> str:
    """Write ``<path>.sha256`` for the file ``path`` that something else wrote (DCP's storage
    layer), hashing it in blocks; returns the digest."""
    digest, _ = file_sha256(path)
    write_atomic(checksum_path(path), _digest_line(os.path.basename(path), digest))
    return digest


def write_checksummed(path: str, data: bytes, kept: str = RUN_KEPT) -> None:
    """``write_atomic`` the file, then its checksum file (a file without one is not trusted)."""
    write_atomic(path, data, kept)
    write_atomic(checksum_path(path), checksum_line(os.path.basename(path), data), kept)


def read_checksum(path: str) -> str:
    """The hex digest recorded for ``path`` in ``<path>.sha256``; CorruptFileError naming the
    file when there is none or it is damaged (every byte of it is checked, the name too)."""
    side = checksum_path(path)
    if not os.path.isfile(side):
        raise CorruptFileError(
            f"{clip(path)} has no checksum file {os.path.basename(side)}: it was "
            f"not written whole by this ScaleTorch; it is not trusted")
    with open(side, "rb") as f:
        line = f.read(4096)  # a digest line is under 4 KB; never read a huge file whole
    digest = line[:64].decode(errors="replace")
    name = os.path.basename(path).encode()
    # "<hex>  <name>" as we write it, or "<hex> *<name>" (``sha256sum -b``): both what
    # ``sha256sum -c`` reads; the newline may be missing (an editor's save)
    tails = [sep + name + end for sep in (b"  ", b" *") for end in (b"\n", b"")]
    if line[64:] not in tails or any(c not in "0123456789abcdef" for c in digest):
        raise CorruptFileError(f"{side!r} is not a sha256 line of {os.path.basename(path)} "
                               f"(64 lowercase hex digits, two spaces or ' *', the name): "
                               f"damaged, or written by another tool in another format")
    return digest


def _regular(path: str) -> None:
    """CorruptFileError unless ``path`` is a regular file (a FIFO would block the read)."""
    if not os.path.isfile(path):
        raise CorruptFileError(f"{clip(path)} is not a regular file: it cannot be the file written")


def read_checksummed(path: str) -> bytes:
    """The bytes of ``path`` once they match ``<path>.sha256``; CorruptFileError naming both."""
    expected = read_checksum(path)
    _regular(path)
    with open(path, "rb") as f:
        data = f.read()
    if sha256(data) != expected:
        raise _mismatch(path, len(data))
    return data


def verify_checksum(path: str) -> None:
    """CorruptFileError naming ``path`` unless its bytes match ``<path>.sha256``; read in
    blocks, for a file too large to hold (a Hugging Face model's weights, a checkpoint shard)."""
    expected = read_checksum(path)
    _regular(path)
    digest, size = file_sha256(path)
    if digest != expected:
        raise _mismatch(path, size)


def _mismatch(path: str, size: int) -> CorruptFileError:
    return CorruptFileError(f"{clip(path)} does not match its checksum in "
                            f"{os.path.basename(checksum_path(path))} ({size} bytes; truncated "
                            f"or damaged)")
