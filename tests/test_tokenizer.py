"""Tokenizers and scripts/prepare_text.py: text -> the .bin file the loader reads, and back."""

import importlib.util
import os
import sys
import tempfile
import unittest

import numpy as np

from scaletorch.data import ByteTokenizer, bin_dtype, build_dataset, load_tokenizer
from scaletorch.rules import boundary
from scripts.prepare_text import prepare

HAVE_TOKENIZERS = importlib.util.find_spec("tokenizers") is not None
SKIP_REASON = 'needs the hf extra: pip install -e ".[hf]" (tokenizers)'
if not HAVE_TOKENIZERS:
    print(f"tests/test_tokenizer.py: tokenizer.json tests skipped, {SKIP_REASON}", file=sys.stderr)

TEXT = "Tensor parallel splits heads; ZeRO shards state. Ünïcödé → bytes ✓\n" * 20


class TestTokenizers(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.text_file = os.path.join(self.tmp.name, "a.txt")
        with open(self.text_file, "w", encoding="utf-8") as f:
            f.write(TEXT)

    def test_byte_tokenizer_round_trips_any_text_in_256_ids(self):
        tok = load_tokenizer("byte")
        ids = tok.encode(TEXT)
        self.assertEqual(tok.vocab_size, 256)
        self.assertEqual(len(ids), len(TEXT.encode("utf-8")))
        self.assertLess(max(ids), 256)
        self.assertEqual(tok.decode(ids), TEXT)
        # a cut through a multi-byte character decodes with a replacement, not an error
        self.assertTrue(ByteTokenizer().decode(ids[:-3]).endswith("\ufffd"))

    def test_prepared_byte_file_is_what_the_bin_loader_reads(self):
        out = os.path.join(self.tmp.name, "sub", "a.bin")
        tokens = prepare([self.text_file, self.text_file], "byte", out)
        self.assertEqual(tokens.dtype, np.uint16)
        data = build_dataset("bin", 256, seed=0, path=out)
        expected = np.frombuffer((TEXT + "\n\n" + TEXT).encode("utf-8"), dtype=np.uint8)
        np.testing.assert_array_equal(data.window(0, len(data)), expected)
        window = data.sample(2, 16, np.random.default_rng(0))
        self.assertEqual(window.shape, (2, 16))

    def test_vocabularies_beyond_uint16_are_stored_and_read_as_uint32(self):
        self.assertIs(bin_dtype(50257), np.uint16)
        self.assertIs(bin_dtype(128256), np.uint32)
        path = os.path.join(self.tmp.name, "big.bin")
        np.arange(100_000, 100_040, dtype=np.uint32).tofile(path)
        with boundary.trusting([path]):  # no record of prepare_text.py: another tool's file
            data = build_dataset("bin", 128256, seed=0, path=path)
        self.assertEqual(int(data.sample(1, 40, np.random.default_rng(0)).min()), 100_000)

    @unittest.skipUnless(HAVE_TOKENIZERS, SKIP_REASON)
    def test_local_tokenizer_json_prepares_a_file_that_decodes_back(self):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.train_from_iterator([TEXT],
                                      trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"]))
        path = os.path.join(self.tmp.name, "tokenizer.json")
        tokenizer.save(path)
        tok = load_tokenizer(self.tmp.name)  # the directory that holds tokenizer.json
        out = os.path.join(self.tmp.name, "a.bin")
        tokens = prepare([self.text_file], path, out)
        self.assertLess(tokens.size, len(TEXT.encode("utf-8")))  # BPE merged something
        data = build_dataset("bin", tok.vocab_size, seed=0, path=out)
        self.assertEqual(tok.decode(data.window(0, len(data)).tolist()), TEXT)
