"""Tokenizers: text <-> token ids, for preparing data and reading generated samples.

- ByteTokenizer: the UTF-8 bytes of the text, vocabulary 256, no dependency. Any text
  round-trips exactly; a model trained on it needs no tokenizer file.
- HFTokenizer: a local ``tokenizer.json`` (the file every Hugging Face model directory ships)
  through the ``tokenizers`` library (the optional ``hf`` extra). Nothing is downloaded.
"""

import codecs
import json
import os
from typing import Any, Dict, List, Optional, Tuple, Union

import numpy as np

from scaletorch.rules import boundary
from scaletorch.rules.errors import InputError, MissingInputError, clip
from scaletorch.rules.safe_files import WriteError, checksum_path, write_checksummed


def check_utf8(data: bytes, path: str, what: str, whole: bool = True, hint: str = "") -> None:
    """Raise InputError naming ``path`` unless ``data`` (its bytes, or its first bytes when not
    ``whole``) is UTF-8 text without NUL bytes, which no text holds and binary files do."""
    nul = data.find(b"\0")
    problem = f"holds a NUL byte at offset {nul}" if nul >= 0 else ""
    if not problem:
        try:  # incremental: a first chunk may end inside a character
            codecs.getincrementaldecoder("utf-8")().decode(data, final=whole)
        except UnicodeDecodeError as err:
            problem = f"is not UTF-8 (byte 0x{data[err.start]:02x} at offset {err.start})"
    if problem:
        raise InputError(f"{what} {clip(path)} is not text: it {problem}; "
                         f"{hint or 'convert it to UTF-8 first (e.g. iconv -t utf-8)'}")


def read_text(path: str) -> str:
    """The UTF-8 text of ``path``; InputError naming it when it is missing or not text."""
    if not os.path.exists(path):
        raise MissingInputError(f"text file {clip(path)} does not exist")
    if os.path.isdir(path):  # a FIFO or a device: named by read_bytes
        raise InputError(f"text file {clip(path)} is a directory, not a file: give the text files "
                         f"themselves")
    data = boundary.read_bytes(path, "text file", boundary.TEXT_BYTES, digest=False)
    check_utf8(data, path, "text file")
    return data.decode("utf-8")


# [core: byte-tokenizer]
class ByteTokenizer:
    """Token i is the byte value i: encode is ``text.encode("utf-8")``."""

    vocab_size = 256

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: List[int]) -> str:
        # A sampled byte sequence need not be valid UTF-8; show what cannot decode as U+FFFD.
        return bytes(ids).decode("utf-8", errors="replace")


# [end: byte-tokenizer]
class HFTokenizer:
    """A local ``tokenizer.json`` (BPE, SentencePiece-converted, ...) via ``tokenizers``."""

    def __init__(self, path: str) -> None:
        if not os.path.lexists(path):
            raise MissingInputError(
                f"tokenizer file {clip(path)} not found: give a tokenizer.json (or "
                f"the model directory that holds one), or 'byte'")
        try:
            from tokenizers import Tokenizer
        except ImportError as err:
            raise ImportError("a tokenizer.json needs the tokenizers library: pip install -e "
                              "'.[hf]' (or pip install tokenizers); 'byte' needs nothing") from err
        self.path = path
        # a user's file (a model directory's tokenizer.json, no digest), parsed as data by the
        # tokenizers library; its size is checked first
        boundary.regular_file(path, "tokenizer file", boundary.TEXT_BYTES)
        try:
            self.tokenizer = Tokenizer.from_file(path)
        except Exception as err:  # tokenizers raises a bare Exception for a file it cannot parse
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise InputError(
                f"tokenizer file {clip(path)} is not a tokenizer.json that the tokenizers "
                f"library reads ({reason}): give the tokenizer.json of a Hugging "
                f"Face model directory, or 'byte'") from None
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)

    def _failed(self, doing: str, err: Exception) -> InputError:
        """The tokenizers library raises a bare Exception for a model that cannot do its work
        (a WordLevel vocabulary without its unk token): one line naming the file."""
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        return InputError(f"tokenizer file {clip(self.path)} cannot {doing} ({clip(reason)}): "
                          f"give a tokenizer.json whose vocabulary covers the text (an unk "
                          f"token for the rest), or 'byte'")

    def encode(self, text: str) -> List[int]:
        # No special tokens: training text is one stream, documents are not wrapped in BOS/EOS.
        try:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        except Exception as err:
            raise self._failed(f"encode the text{self._where_encode_fails(text)}", err) from None

    def _where_encode_fails(self, text: str, window: int = 1 << 20) -> str:
        """Where in ``text`` encoding first fails: the shortest failing prefix of its first
        ``window`` characters, by bisection (an error path only: log2(window) encodes)."""
        low, high = 0, min(len(text), window)  # prefix text[:high] fails, text[:low] passes
        try:
            self.tokenizer.encode(text[:high], add_special_tokens=False)
            return f" ({len(text)} characters)"  # the first window encodes: no position
        except Exception:
            pass
        while high - low > 1:
            middle = (low + high) // 2
            try:
                self.tokenizer.encode(text[:middle], add_special_tokens=False)
                low = middle
            except Exception:
                high = middle
        line = text.count("\n", 0, high - 1) + 1
        return f" at character {high - 1} (line {line}: {clip(text[max(0, high - 20):high])})"

    def decode(self, ids: List[int]) -> str:
        try:
            return self.tokenizer.decode(ids)
        except Exception as err:
            raise self._failed(f"decode {len(ids)} token ids", err) from None


Tokenizer = Union[ByteTokenizer, HFTokenizer]


def load_tokenizer(spec: str) -> Tokenizer:
    """"byte" for the byte-level tokenizer, else the path of a tokenizer.json (or of the model
    directory that holds one)."""
    if spec == "byte":
        return ByteTokenizer()
    if os.path.isdir(spec):
        spec = os.path.join(spec, "tokenizer.json")
    return HFTokenizer(spec)


def bin_dtype(vocab_size: int) -> type:
    """The token dtype of a .bin file: uint16 as nanoGPT's when every id fits, else uint32."""
    return np.uint16 if vocab_size <= 2**16 else np.uint32


# What a token file means, recorded beside it by scripts/prepare_text.py (``<file>.json``,
# with its own .sha256): the width of a token, the vocabulary and the tokenizer that wrote
# it. A file without the record (nanoGPT's, or one written before it) is read at the width
# bin_dtype gives for the run's model.vocab_size.
META_SUFFIX = ".json"
META_FORMAT = "scaletorch-tokens"
TOKEN_DTYPES = ("uint16", "uint32")


def meta_path(path: str) -> str:
    return path + META_SUFFIX


RECORD_FIELDS = ("format", "dtype", "tokens", "vocab_size", "tokenizer")  # write_token_file's


def write_token_file(path: str, tokens: np.ndarray, vocab_size: int, tokenizer: str) -> None:
    """Write ``tokens`` (uint16 or uint32) to ``path`` and its record, each with a digest."""
    record = {
        "format": META_FORMAT,
        "dtype": str(tokens.dtype),
        "tokens": int(tokens.size),
        "vocab_size": int(vocab_size),
        "tokenizer": tokenizer
    }
    kept = "no token file is left there (what was written of it and its record is removed)"
    try:
        write_checksummed(path, tokens.tobytes(), kept)  # whole or absent, with its .sha256
        write_checksummed(meta_path(path), (json.dumps(record, indent=1) + "\n").encode(), kept)
    except WriteError:  # a .bin without its record would be read at a guessed width
        for written in (path, meta_path(path)):
            for name in (written, checksum_path(written)):
                if os.path.lexists(name):
                    os.remove(name)
        raise


def token_file_meta(path: str) -> Optional[Dict[str, Any]]:
    """The record of the token file ``path`` (dtype, tokens, vocab_size, tokenizer), or None
    when it has none and the user trusted the file (``--trust-unchecked``: another tool's);
    InputError naming the record when it is missing, damaged or not ours. A .bin with our
    digest was written by scripts/prepare_text.py with its record: without it, the width of
    the tokens would be guessed."""
    side = meta_path(path)
    if not os.path.lexists(side):
        if boundary.is_trusted_unchecked(path):
            return None
        raise MissingInputError(
            f"data.path {clip(path)} has no record {os.path.basename(side)} (its token dtype "
            f"and vocabulary; scripts/prepare_text.py writes it beside the .bin): write both "
            f"again with it, or add --trust-unchecked {clip(path)} for a file made elsewhere")
    what = f"the record of data.path {clip(path)}"
    record = boundary.load_json(side, what, 1 << 16)
    missing = [k for k in RECORD_FIELDS if k not in record]
    if missing:  # named: a field deleted (digest rewritten) must not switch a check off
        raise InputError(f"{what} ({clip(side)}) has no field {missing[0]!r}: write the file "
                         f"again with scripts/prepare_text.py")
    dtype, tokens, vocab = record.get("dtype"), record.get("tokens"), record.get("vocab_size")
    if (record.get("format") != META_FORMAT or dtype not in TOKEN_DTYPES or type(tokens) is not int
            or type(vocab) is not int or tokens < 0 or vocab < 1
            or not isinstance(record.get("tokenizer"), str)):
        raise InputError(f"{what} ({clip(side)}) is not a token-file record of "
                         f"scripts/prepare_text.py (format, dtype uint16|uint32, tokens, "
                         f"vocab_size, tokenizer): write the file again with it")
    return record


def token_dtype(path: str, vocab_size: int) -> Tuple[type, Optional[Dict[str, Any]]]:
    """(the dtype a run over ``vocab_size`` reads ``path`` at, its record or None): the
    recorded width; a trusted file without a record, bin_dtype(vocab_size) (nanoGPT's rule).
    InputError when the recorded vocabulary is larger than the run's."""
    record = token_file_meta(path)
    if record is None:
        return bin_dtype(vocab_size), None
    if record["vocab_size"] > vocab_size:
        raise InputError(f"data.path {clip(path)} was written by the tokenizer "
                         f"{clip(record['tokenizer'])} of vocabulary {record['vocab_size']} "
                         f"({record['dtype']} tokens), more than model.vocab_size {vocab_size}: "
                         f"train with --model.vocab_size {record['vocab_size']}")
    return getattr(np, record["dtype"]), record


def data_tokenizer(dataset: str, path: Optional[str]) -> Tuple[Optional[Tokenizer], str]:
    """(the tokenizer that made a run's data, or None; why it is None): bytes for a text, the
    one a token file's record names, none for synthetic tokens or a .bin without a record."""
    if dataset == "text":
        return ByteTokenizer(), ""
    record = token_file_meta(path) if dataset == "bin" and path else None
    if record is None:
        return None, f"data.dataset {dataset} has no tokenizer on record"
    if record["tokenizer"] == "byte":
        return ByteTokenizer(), ""
    try:
        return load_tokenizer(record["tokenizer"]), ""
    except InputError as err:
        return None, f"the tokenizer that wrote data.path cannot be read ({err})"
