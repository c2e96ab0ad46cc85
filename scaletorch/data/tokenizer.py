"""Tokenizers: text <-> token ids, for preparing data and reading generated samples.

- ByteTokenizer: the UTF-8 bytes of the text, vocabulary 256, no dependency. Any text
  round-trips exactly; a model trained on it needs no tokenizer file.
- HFTokenizer: a local ``tokenizer.json`` (the file every Hugging Face model directory ships)
  through the ``tokenizers`` library (the optional ``hf`` extra). Nothing is downloaded.
"""

import codecs
import os
from typing import List, Union

import numpy as np

from scaletorch.rules import boundary
from scaletorch.rules.errors import InputError, MissingInputError


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
        raise InputError(f"{what} {path!r} is not text: it {problem}; "
                         f"{hint or 'convert it to UTF-8 first (e.g. iconv -t utf-8)'}")


def read_text(path: str) -> str:
    """The UTF-8 text of ``path``; InputError naming it when it is missing or not text."""
    if not os.path.exists(path):
        raise MissingInputError(f"text file {path!r} does not exist")
    if not os.path.isfile(path):
        raise InputError(f"text file {path!r} is not a file: give the text files themselves")
    data = boundary.read_bytes(path, "text file", boundary.TEXT_BYTES, digest=False)
    check_utf8(data, path, "text file")
    return data.decode("utf-8")


class ByteTokenizer:
    """Token i is the byte value i: encode is ``text.encode("utf-8")``."""

    vocab_size = 256

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: List[int]) -> str:
        # A sampled byte sequence need not be valid UTF-8; show what cannot decode as U+FFFD.
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local ``tokenizer.json`` (BPE, SentencePiece-converted, ...) via ``tokenizers``."""

    def __init__(self, path: str) -> None:
        if not os.path.lexists(path):
            raise MissingInputError(f"tokenizer file {path!r} not found: give a tokenizer.json (or "
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
            raise InputError(f"tokenizer file {path!r} is not a tokenizer.json that the tokenizers "
                             f"library reads ({reason}): give the tokenizer.json of a Hugging "
                             f"Face model directory, or 'byte'") from None
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> List[int]:
        # No special tokens: training text is one stream, documents are not wrapped in BOS/EOS.
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: List[int]) -> str:
        return self.tokenizer.decode(ids)


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
