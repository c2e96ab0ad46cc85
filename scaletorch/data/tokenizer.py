"""Tokenizers: text <-> token ids, for preparing data and reading generated samples.

- ByteTokenizer: the UTF-8 bytes of the text, vocabulary 256, no dependency. Any text
  round-trips exactly; a model trained on it needs no tokenizer file.
- HFTokenizer: a local ``tokenizer.json`` (the file every Hugging Face model directory ships)
  through the ``tokenizers`` library (the optional ``hf`` extra). Nothing is downloaded.
"""

import os
from typing import List, Union

import numpy as np


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
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        try:
            from tokenizers import Tokenizer
        except ImportError as err:
            raise ImportError("a tokenizer.json needs the tokenizers library: pip install -e "
                              "'.[hf]' (or pip install tokenizers); 'byte' needs nothing") from err
        self.path = path
        self.tokenizer = Tokenizer.from_file(path)
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
