"""Token sources. Each has ``vocab_size`` and ``sample(num_sequences, length, rng)``.

``sample`` draws everything from the numpy Generator it is given, so the loader can make a
batch a pure function of (seed, step): identical on every rank and after a resume.

- SyntheticMarkov: tokens from a random first-order Markov chain. Its entropy rate is known
  exactly, so a learning curve has a floor to aim for (a perfect model reaches it).
- ByteTextDataset: the bytes of a local text file, vocabulary 256.
- BinDataset: a nanoGPT-style flat file of token ids (e.g. uint16), read window by window.

``check_data_file`` checks a text or .bin file against the run before anything starts (kind,
format, length, vocabulary); a mistake is an ``InputError`` that names the file.
"""

import os
from typing import Dict, Optional, Tuple, Union

import numpy as np

from scaletorch.data.tokenizer import check_utf8, meta_path, token_dtype
from scaletorch.rules import boundary
from scaletorch.rules.errors import InputError, MissingInputError, clip
from scaletorch.rules.safe_files import checksum_path, file_sha256, read_checksum

# The chain keeps two V x V float64 matrices (transition and its cumulative sum): 256 MiB at
# 4096 tokens, but 40 GB at GPT-2's 50257. Real vocabularies train on text or .bin files.
SYNTHETIC_MAX_VOCAB = 4096


def check_synthetic_vocab(vocab_size: int) -> None:
    """Refuse a synthetic chain too large for memory, naming its size and the alternatives."""
    if vocab_size > SYNTHETIC_MAX_VOCAB:
        gib = 2 * vocab_size**2 * 8 / 2**30
        raise ValueError(f"the synthetic dataset over vocab_size {vocab_size} needs two "
                         f"{vocab_size} x {vocab_size} float64 matrices ({gib:.1f} GiB); it "
                         f"allows at most {SYNTHETIC_MAX_VOCAB} tokens. Use data.dataset bin "
                         f"(scripts/prepare_text.py) or text for a larger vocabulary")


class SyntheticMarkov:
    """A seeded random Markov chain over ``vocab_size`` tokens.

    Row i of the transition matrix is softmax(z_i / temperature) with z_i ~ N(0, I). Lower
    temperature concentrates each row on a few tokens (lower entropy, easier to learn);
    temperature 0.3 over 256 tokens gives about 2.2 nats/token against log(256) = 5.5.
    Every entry is positive, so the chain has a unique stationary distribution.
    The matrix is V x V float64, so the vocabulary is at most SYNTHETIC_MAX_VOCAB.
    """

    def __init__(self, vocab_size: int, seed: int, temperature: float = 0.3) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        check_synthetic_vocab(vocab_size)
        self.vocab_size = vocab_size
        rng = np.random.default_rng(seed)  # its own generator: the chain depends on seed only
        logits = rng.standard_normal((vocab_size, vocab_size)) / temperature
        logits -= logits.max(axis=1, keepdims=True)  # stable softmax
        probs = np.exp(logits)
        self.transition = probs / probs.sum(axis=1, keepdims=True)  # (V, V), rows sum to 1
        self._cdf = np.cumsum(self.transition, axis=1)
        self.stationary = self._stationary_distribution()

    def _stationary_distribution(self, tol: float = 1e-13, max_iters: int = 10000) -> np.ndarray:
        """pi with pi = pi P, by power iteration (converges: all entries of P are positive)."""
        pi = np.full(self.vocab_size, 1.0 / self.vocab_size)
        for _ in range(max_iters):
            new_pi = pi @ self.transition
            if np.abs(new_pi - pi).sum() < tol:
                return new_pi
            pi = new_pi
        return pi

    def entropy_rate(self) -> float:
        """Exact entropy rate in nats/token: sum_i pi_i H(P_i)."""
        row_entropy = -(self.transition * np.log(self.transition)).sum(axis=1)
        return float(self.stationary @ row_entropy)

    def sample(self, num_sequences: int, length: int, rng: np.random.Generator) -> np.ndarray:
        """(num_sequences, length) int64; the first token is drawn from the stationary dist."""
        out = np.empty((num_sequences, length), dtype=np.int64)
        if length == 0:
            return out
        out[:, 0] = rng.choice(self.vocab_size, size=num_sequences, p=self.stationary)
        for t in range(1, length):
            # Inverse-CDF sampling of every sequence's next token at once.
            u = rng.random((num_sequences, 1))
            next_tokens = (u > self._cdf[out[:, t - 1]]).sum(axis=1)
            # Rounding can leave the last cdf entry a hair below 1.
            out[:, t] = np.minimum(next_tokens, self.vocab_size - 1)
        return out


# check_data_file reads at most this many tokens of a .bin for its vocabulary check (256 MB of
# uint16: a fraction of a second); windows past them are checked when they are sampled.
SCAN_TOKENS = 1 << 27


def _too_short(path: str, have: int, length: int, unit: str = "tokens") -> InputError:
    return InputError(
        f"data.path {clip(path)} has {have} {unit}, fewer than the {length} one sequence "
        f"needs (data.seq_len {length - 1} + 1): use a longer file or lower "
        f"--data.seq_len")


def _bin_vocab_error(path: str, token: int, where: str, vocab_size: int) -> InputError:
    return InputError(f"data.path {clip(path)} holds token {token} ({where}), outside "
                      f"model.vocab_size {vocab_size}: the file was written for a larger "
                      f"vocabulary; train with the --model.vocab_size that "
                      f"scripts/prepare_text.py printed for it")


def check_data_file(dataset: str, path: Optional[str], vocab_size: int, seq_len: int) -> None:
    """Raise InputError unless ``path`` can feed ``dataset`` ("text" or "bin") sequences of
    ``seq_len`` + 1 tokens over ``vocab_size``: it exists, is a file, is UTF-8 text without NUL
    bytes (text), holds whole tokens all below ``vocab_size`` (bin), and is long enough."""
    if not path:
        raise InputError(f"data.dataset {dataset!r} needs data.path: give it a file with "
                         f"--data.path FILE")
    if not os.path.exists(path):
        raise MissingInputError(f"data.path {clip(path)} does not exist: give a text file "
                                f"(data.dataset text) or a token file from "
                                f"scripts/prepare_text.py (data.dataset bin)")
    if os.path.isdir(path):
        raise InputError(f"data.path {clip(path)} is a directory, not a file: give one file "
                         f"(scripts/prepare_text.py joins several into one .bin)")
    # through the trust boundary: a regular file (a FIFO or a device named as what it is); a
    # text is read whole into memory, so it has a size limit; a .bin is ours
    # (scripts/prepare_text.py writes its .sha256) or named with --trust-unchecked
    size = boundary.regular_file(
        path, "data.path", boundary.TEXT_BYTES if dataset == "text" else boundary.UNLIMITED,
        hint="a run reads data.path again and again, a window at any offset: save what it "
        "streams to a file and give that")
    if dataset == "bin":
        boundary.verified(path, "data.path (a token file)")
    length = seq_len + 1
    if dataset == "text":
        if size == 0:
            raise InputError(
                f"data.path {clip(path)} is empty: give a text file of at least {length} "
                f"bytes (data.seq_len {seq_len} + 1)")
        try:
            with open(path, "rb") as f:
                head = f.read(1 << 20)
        except OSError as err:  # e.g. no permission to read it
            raise InputError(f"data.path {clip(path)} cannot be read ({err.strerror}): give a file "
                             f"you can read") from None
        check_utf8(head, path, "data.path", whole=size <= len(head),
                   hint="data.dataset text reads UTF-8 text; a token file is --data.dataset bin")
        if size < length:
            raise _too_short(path, size, length, "bytes")
        return
    raw, record = token_dtype(path, vocab_size)  # the recorded width, or nanoGPT's rule
    dtype = np.dtype(raw)
    rule = (f"its record {os.path.basename(meta_path(path))} says {dtype}"
            if record else f"the dtype for model.vocab_size {vocab_size}, as it has no record")
    if size == 0:
        raise InputError(f"data.path {clip(path)} holds no tokens (0 bytes): give a token file "
                         f"of at least {length} tokens (data.seq_len {seq_len} + 1), e.g. from "
                         f"scripts/prepare_text.py")
    if size % dtype.itemsize:
        raise InputError(f"data.path {clip(path)} has {size} bytes, not a whole number of {dtype} "
                         f"tokens ({dtype.itemsize} bytes each, {rule}): it is not a token "
                         f"file written for this vocabulary (scripts/prepare_text.py writes "
                         f"one and prints the vocab_size)")
    if record is not None and record["tokens"] != size // dtype.itemsize:
        raise InputError(f"data.path {clip(path)} holds {size // dtype.itemsize} {dtype} tokens, "
                         f"its record {os.path.basename(meta_path(path))} says "
                         f"{record['tokens']}: the record belongs to another file; write both "
                         f"again with scripts/prepare_text.py")
    if size // dtype.itemsize < length:
        raise _too_short(path, size // dtype.itemsize, length)
    index, token = _scan_max(path, dtype, SCAN_TOKENS)
    if token >= vocab_size:
        raise _bin_vocab_error(path, token, f"at index {index}", vocab_size)


def _scan_max(path: str, dtype: np.dtype, count: int, chunk: int = 1 << 22) -> Tuple[int, int]:
    """(index, value) of the largest of the first ``count`` tokens of ``path``, read in chunks
    (not memory-mapped: a file cut while it is read is a short read here, not a SIGBUS)."""
    best, where, offset = -1, 0, 0
    with open(path, "rb") as f:
        while offset < count:
            block = np.frombuffer(f.read(min(chunk, count - offset) * dtype.itemsize), dtype)
            if not block.size:
                break
            at = int(block.argmax())
            if int(block[at]) > best:
                best, where = int(block[at]), offset + at
            offset += block.size
    return where, best


# (path, inode, size, mtime) -> sha256 of a data file hashed here (recorded at every checkpoint)
_DIGESTS: Dict[Tuple[str, int, int, int], str] = {}


def data_digest(dataset: str, path: Optional[str]) -> Optional[str]:
    """The sha256 of the contents of a run's data file (text or bin), or None (synthetic, or no
    such file). A .bin's is its .sha256's, which the pre-flight matched with its bytes; a text
    (or a .bin trusted without a digest) is hashed once per size and mtime. A resume compares
    it with the one its checkpoint recorded (scaletorch/trainer/resume_check.py)."""
    if dataset not in ("text", "bin") or not path or not os.path.isfile(path):
        return None
    if dataset == "bin" and os.path.isfile(checksum_path(path)):
        return read_checksum(path)
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _DIGESTS:
        _DIGESTS[key] = file_sha256(path)[0]
    return _DIGESTS[key]


def _random_windows(tokens: np.ndarray, num_sequences: int, length: int, rng: np.random.Generator,
                    source: str, unit: str = "tokens") -> np.ndarray:
    """(num_sequences, length) int64 windows starting at uniform random offsets."""
    if len(tokens) < length:
        raise _too_short(source, len(tokens), length, unit)
    starts = rng.integers(0, len(tokens) - length + 1, size=num_sequences)
    index = starts[:, None] + np.arange(length)[None, :]  # (num_sequences, length)
    return tokens[index].astype(np.int64)


def _check_exists(path: str) -> None:
    if not os.path.isfile(path):
        raise MissingInputError(f"dataset file not found: {path}")


class ByteTextDataset:
    """The bytes of a local file as tokens (vocabulary 256, no tokenizer needed)."""

    def __init__(self, path: str) -> None:
        _check_exists(path)
        self.path = path
        self.vocab_size = 256
        data = boundary.read_bytes(path, "text file", boundary.TEXT_BYTES, digest=False)
        self.tokens = np.frombuffer(data, dtype=np.uint8)

    def sample(self, num_sequences: int, length: int, rng: np.random.Generator) -> np.ndarray:
        """(num_sequences, length) int64 random windows of the file."""
        return _random_windows(self.tokens, num_sequences, length, rng, self.path, "bytes")


class DataChanged(InputError):
    """A data file that changed under a running run. The run's loop adds the step it reached
    and the checkpoint to resume from (trainer/stops.py's ``interruptible``)."""


class BinDataset:
    """A nanoGPT-style token file: a flat array of ``dtype`` token ids.

    vocab_size: the tokenizer's vocabulary (50257 for GPT-2); the default 65536 admits any
    uint16 token. Sampled windows are checked against it, so a wrong value fails loudly.
    Windows are read with ``os.pread``, not through a memory map: the file can be far larger
    than RAM, and a file cut while the run reads it is a short read, reported as DataChanged
    naming it, where a memory map would kill the process with SIGBUS.
    """

    def __init__(self, path: str, vocab_size: int = 65536, dtype: type = np.uint16) -> None:
        _check_exists(path)
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.path = path
        self.vocab_size = vocab_size
        self.dtype = np.dtype(dtype)
        self._fd = os.open(path, os.O_RDONLY)
        self.num_tokens = os.fstat(self._fd).st_size // self.dtype.itemsize

    def __len__(self) -> int:
        return self.num_tokens

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens ``start .. start + length - 1`` of the file (its dtype); DataChanged naming
        the file when they are no longer there."""
        nbytes = length * self.dtype.itemsize
        data = os.pread(self._fd, nbytes, start * self.dtype.itemsize)
        if len(data) < nbytes:
            now = os.fstat(self._fd).st_size
            raise DataChanged(f"data.path {clip(self.path)} changed while the run read it: it had "
                              f"{self.num_tokens * self.dtype.itemsize} bytes, now {now} "
                              f"(truncated or rewritten); restore the file, then resume")
        return np.frombuffer(data, dtype=self.dtype)

    def sample(self, num_sequences: int, length: int, rng: np.random.Generator) -> np.ndarray:
        """(num_sequences, length) int64 random windows of the file."""
        if self.num_tokens < length:
            raise _too_short(self.path, self.num_tokens, length)
        starts = rng.integers(0, self.num_tokens - length + 1, size=num_sequences)
        out = np.empty((num_sequences, length), dtype=np.int64)
        for row, start in enumerate(starts.tolist()):
            out[row] = self.window(start, length)
        if out.size and out.max() >= self.vocab_size:  # past check_data_file's scan
            raise _bin_vocab_error(self.path, int(out.max()), "in a sampled window",
                                   self.vocab_size)
        return out


Dataset = Union[SyntheticMarkov, ByteTextDataset, BinDataset]  # each has sample()
DATASET_NAMES = ("synthetic", "text", "bin")


def build_dataset(name: str, vocab_size: int, seed: int, path: Optional[str] = None) -> "Dataset":
    """Build a dataset by name: "synthetic", "text" or "bin".

    seed only shapes the synthetic chain; path is required for "text" and "bin". For "text"
    vocab_size must be at least 256 (one token per byte value).
    """
    if name not in DATASET_NAMES:
        raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(DATASET_NAMES)}")
    if name == "synthetic":
        return SyntheticMarkov(vocab_size, seed)
    if path is None:
        raise ValueError(f"dataset {name!r} needs a path")
    if name == "text":
        if vocab_size < 256:
            raise ValueError(f"byte-level text needs vocab_size >= 256, got {vocab_size}")
        return ByteTextDataset(path)
    # the width scripts/prepare_text.py recorded; without a record, uint16 while ids fit
    return BinDataset(path, vocab_size=vocab_size, dtype=token_dtype(path, vocab_size)[0])
