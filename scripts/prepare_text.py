"""Turn text files into a nanoGPT-style token file that ``--data.dataset bin`` reads.

    python scripts/prepare_text.py doc/*.md --out runs/docs.bin                   # bytes
    python scripts/prepare_text.py my.txt --tokenizer path/to/tokenizer.json --out my.bin

The files are joined with a blank line, tokenized ("byte": UTF-8 bytes, vocabulary 256, no
dependency; or a local tokenizer.json through the ``tokenizers`` library) and written as one
flat array of token ids: uint16 when the vocabulary fits (as nanoGPT's), uint32 otherwise.
``<out>.json`` records that width, the vocabulary and the tokenizer (each file with its
.sha256); the loader reads the tokens at the recorded width. Prints the flags that train on it.
"""

import os
import sys
from typing import List

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scaletorch.data import tokenizer as tok  # noqa: E402
from scaletorch.rules.errors import InputError, OneLineParser, clip  # noqa: E402
from scaletorch.rules.safe_files import checksum_path, verify_checksum  # noqa: E402


def check_out(paths: List[str], out: str) -> None:
    """InputError unless ``out`` may be written: it is none of the input files (by real path,
    so a symlink or ``./`` is seen through), and, when it exists, it is a token file this
    script wrote (its .sha256 matches), not a file of the user's that would be lost. The same
    for the record written beside it (``<out>.json``)."""
    if not out:
        raise InputError("--out '' names no file: give the .bin file to write")
    for written in (out, tok.meta_path(out)):  # the tokens and their record
        check_written(paths, written)


def check_written(paths: List[str], out: str) -> None:
    """``check_out`` for one of the files written: the .bin, or its record."""
    for path in paths:
        if os.path.realpath(path) == os.path.realpath(out):
            raise InputError(f"--out {clip(out)} is the input file {clip(path)}: it would be "
                             f"overwritten with its tokens; give another --out")
    if not os.path.lexists(out):
        return
    if not os.path.isfile(out) or os.path.islink(out):
        raise InputError(f"--out {clip(out)} exists and is not a regular file: give the path "
                         f"of a new .bin file")
    try:
        verify_checksum(out)
    except InputError:
        raise InputError(f"--out {clip(out)} exists and is not a token file this script wrote "
                         f"(no matching {os.path.basename(checksum_path(out))}): it is not "
                         f"written over; give a new path, or move the file away") from None


def prepare(paths: List[str], tokenizer_spec: str, out: str) -> np.ndarray:
    """Tokenize the concatenated files and write them to ``out`` (``check_out`` first);
    returns the token array."""
    check_out(paths, out)
    tokenizer = tok.load_tokenizer(tokenizer_spec)
    texts = [tok.read_text(path) for path in paths]  # InputError naming a file that is not text
    ids = np.asarray(tokenizer.encode("\n\n".join(texts)), dtype=np.int64)
    if ids.size < 2:  # a run needs a sequence of 2 tokens at least (one input, one target)
        named = ", ".join(clip(path) for path in paths[:3]) + (" ..." if len(paths) > 3 else "")
        raise InputError(f"{named} hold{'s' if len(paths) == 1 else ''} {ids.size} token"
                         f"{'' if ids.size == 1 else 's'} ({sum(map(len, texts))} characters): "
                         f"nothing to train on; give a text with content")
    if ids.max() >= tokenizer.vocab_size:  # a tokenizer.json with stray ids
        raise ValueError(f"token {ids.max()} >= the tokenizer's vocabulary {tokenizer.vocab_size}")
    tokens: np.ndarray = ids.astype(tok.bin_dtype(tokenizer.vocab_size))
    # the record beside it says the width, vocabulary and tokenizer: a run reads the tokens
    # at that width and chapter 10 samples with that tokenizer
    spec = os.path.realpath(tokenizer.path) if isinstance(tokenizer, tok.HFTokenizer) else "byte"
    tok.write_token_file(out, tokens, tokenizer.vocab_size, spec)
    return tokens


def main() -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="text files (UTF-8), joined in this order")
    parser.add_argument("--tokenizer", default="byte",
                        help='"byte" (default) or a tokenizer.json / model directory holding one')
    parser.add_argument("--out", required=True, help="the .bin file to write")
    args = parser.parse_args()
    tokens: np.ndarray
    try:
        tokens = prepare(args.files, args.tokenizer, args.out)
        vocab = tok.load_tokenizer(args.tokenizer).vocab_size
    except (OSError, ValueError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{len(args.files)} files -> {tokens.size} tokens ({tokens.dtype}, vocabulary {vocab}) "
          f"in {args.out}")
    print(f"train on it with: --data.dataset bin --data.path {args.out} "
          f"--model.vocab_size {vocab}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
