"""Single-process tests of the datasets and the deterministic global-batch loader."""

import os
import tempfile
import unittest

import numpy as np
import torch

from scaletorch.data import (BinDataset, ByteTextDataset, GlobalBatchLoader, SyntheticMarkov,
                             build_dataset, shard_batch, split_micro_batches)
from scaletorch.rules import boundary


class TestSyntheticMarkov(unittest.TestCase):

    def setUp(self):
        self.dataset = SyntheticMarkov(vocab_size=64, seed=0)

    def test_same_seed_builds_the_same_chain(self):
        other = SyntheticMarkov(vocab_size=64, seed=0)
        np.testing.assert_array_equal(self.dataset.transition, other.transition)
        different = SyntheticMarkov(vocab_size=64, seed=1)
        self.assertFalse(np.array_equal(self.dataset.transition, different.transition))

    def test_stationary_distribution_is_invariant_under_the_transition(self):
        pi = self.dataset.stationary
        self.assertAlmostEqual(pi.sum(), 1.0, places=12)
        np.testing.assert_allclose(pi @ self.dataset.transition, pi, rtol=0, atol=1e-12)

    def test_entropy_rate_matches_empirical_estimate_within_2_percent(self):
        tokens = self.dataset.sample(200, 1000, np.random.default_rng(1))
        log_p = np.log(self.dataset.transition[tokens[:, :-1], tokens[:, 1:]])
        empirical = -log_p.mean()
        exact = self.dataset.entropy_rate()
        # ~200k transitions: the estimate's standard error is ~0.3% of the rate, so 2% is
        # a >5 sigma margin, yet a wrong stationary weighting or sampler is caught.
        self.assertLess(abs(empirical - exact) / exact, 0.02)
        # Learnable: well below the entropy of uniform tokens.
        self.assertLess(exact, 0.75 * np.log(64))

    def test_sample_shape_dtype_and_range(self):
        tokens = self.dataset.sample(3, 17, np.random.default_rng(0))
        self.assertEqual(tokens.shape, (3, 17))
        self.assertEqual(tokens.dtype, np.int64)
        self.assertTrue(((tokens >= 0) & (tokens < 64)).all())

    def test_invalid_arguments_raise(self):
        with self.assertRaises(ValueError):
            SyntheticMarkov(vocab_size=1, seed=0)
        with self.assertRaises(ValueError):
            SyntheticMarkov(vocab_size=8, seed=0, temperature=0.0)

    def test_a_vocabulary_too_large_for_the_matrices_is_refused_with_its_size(self):
        # GPT-2's vocabulary would need 2 x 50257^2 float64 = 37.6 GiB (the run was OOM-killed)
        with self.assertRaisesRegex(ValueError, r"vocab_size 50257 .*37\.6 GiB.* at most 4096"):
            SyntheticMarkov(vocab_size=50257, seed=0)


class TestFileDatasets(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)

    def _write(self, name: str, data: bytes) -> str:
        path = os.path.join(self.tmp.name, name)
        with open(path, "wb") as f:
            f.write(data)
        return path

    def test_byte_text_samples_are_windows_of_the_file(self):
        text = b"hello scaletorch, one byte per token. " * 10
        dataset = ByteTextDataset(self._write("text.txt", text))
        self.assertEqual(dataset.vocab_size, 256)
        tokens = dataset.sample(5, 12, np.random.default_rng(0))
        self.assertEqual(tokens.shape, (5, 12))
        self.assertEqual(tokens.dtype, np.int64)
        for row in tokens:
            self.assertIn(bytes(row.astype(np.uint8)), text)

    def test_bin_samples_are_windows_of_the_token_file(self):
        ids = np.arange(1000, dtype=np.uint16) * 7  # consecutive windows step by 7
        dataset = BinDataset(self._write("tokens.bin", ids.tobytes()), vocab_size=7000)
        tokens = dataset.sample(4, 9, np.random.default_rng(0))
        self.assertEqual(tokens.shape, (4, 9))
        self.assertEqual(tokens.dtype, np.int64)
        self.assertTrue((np.diff(tokens, axis=1) == 7).all())

    def test_bin_token_outside_vocab_raises(self):
        dataset = BinDataset(self._write("big.bin",
                                         np.full(50, 300, np.uint16).tobytes()), vocab_size=256)
        with self.assertRaisesRegex(ValueError, "300"):
            dataset.sample(1, 10, np.random.default_rng(0))

    def test_missing_file_raises_file_not_found_naming_the_path(self):
        missing = os.path.join(self.tmp.name, "nope.txt")
        for make in (ByteTextDataset, BinDataset):
            with self.subTest(dataset=make.__name__):
                with self.assertRaisesRegex(FileNotFoundError, "nope.txt"):
                    make(missing)

    def test_file_shorter_than_a_sequence_raises_naming_the_lengths(self):
        dataset = ByteTextDataset(self._write("short.txt", b"abc"))
        with self.assertRaises(ValueError) as ctx:
            dataset.sample(1, 4, np.random.default_rng(0))
        self.assertIn("3", str(ctx.exception))
        self.assertIn("4", str(ctx.exception))

    def test_build_dataset_by_name(self):
        path = self._write("t.txt", b"x" * 100)
        self.assertIsInstance(build_dataset("synthetic", 32, seed=0), SyntheticMarkov)
        self.assertIsInstance(build_dataset("text", 256, seed=0, path=path), ByteTextDataset)
        with boundary.trusting([path]):  # no record of prepare_text.py: another tool's file
            self.assertIsInstance(build_dataset("bin", 256, seed=0, path=path), BinDataset)
        with self.assertRaisesRegex(ValueError, "synthetic, text, bin"):
            build_dataset("wiki", 256, seed=0)
        with self.assertRaises(ValueError):
            build_dataset("text", 256, seed=0)  # no path
        with self.assertRaises(ValueError):
            build_dataset("text", 100, seed=0, path=path)  # bytes need 256 ids


class TestGlobalBatchLoader(unittest.TestCase):

    def setUp(self):
        self.dataset = SyntheticMarkov(vocab_size=32, seed=0)

    def test_same_seed_and_step_give_the_same_batch_in_any_call_order(self):
        a = GlobalBatchLoader(self.dataset, global_batch_size=8, seq_len=16, seed=3)
        b = GlobalBatchLoader(self.dataset, global_batch_size=8, seq_len=16, seed=3)
        a_batches = [a.get_batch(step) for step in range(4)]
        # Another "rank" (or a resumed run) asks for the steps in another order.
        for step in (3, 1, 2, 0):
            for x, y in zip(a_batches[step], b.get_batch(step)):
                self.assertTrue(torch.equal(x, y))

    def test_different_steps_and_seeds_give_different_batches(self):
        loader = GlobalBatchLoader(self.dataset, global_batch_size=8, seq_len=16, seed=3)
        other_seed = GlobalBatchLoader(self.dataset, global_batch_size=8, seq_len=16, seed=4)
        x0, _ = loader.get_batch(0)
        self.assertFalse(torch.equal(x0, loader.get_batch(1)[0]))
        self.assertFalse(torch.equal(x0, other_seed.get_batch(0)[0]))

    def test_targets_are_inputs_shifted_by_one(self):
        loader = GlobalBatchLoader(self.dataset, global_batch_size=4, seq_len=10, seed=0)
        x, y = loader.get_batch(5)
        self.assertEqual(x.shape, (4, 10))
        self.assertEqual(y.shape, (4, 10))
        self.assertEqual(x.dtype, torch.long)
        self.assertTrue(torch.equal(x[:, 1:], y[:, :-1]))

    def test_invalid_arguments_raise(self):
        with self.assertRaises(ValueError):
            GlobalBatchLoader(self.dataset, global_batch_size=0, seq_len=4, seed=0)
        loader = GlobalBatchLoader(self.dataset, global_batch_size=2, seq_len=4, seed=0)
        with self.assertRaises(ValueError):
            loader.get_batch(-1)


class TestSharding(unittest.TestCase):

    def setUp(self):
        self.batch = torch.arange(8 * 6).view(8, 6)

    def test_shards_partition_the_batch_in_rank_order(self):
        for dim, world_size in ((0, 4), (1, 3)):
            with self.subTest(dim=dim, world_size=world_size):
                shards = [shard_batch(self.batch, r, world_size, dim) for r in range(world_size)]
                self.assertTrue(torch.equal(torch.cat(shards, dim), self.batch))

    def test_micro_batches_partition_the_shard(self):
        targets = self.batch + 1
        x, y = shard_batch(self.batch, 1, 2), shard_batch(targets, 1, 2)
        micro = split_micro_batches(x, y, num_micro_batches=2)
        self.assertEqual(len(micro), 2)
        self.assertTrue(torch.equal(torch.cat([mx for mx, _ in micro]), x))
        self.assertTrue(torch.equal(torch.cat([my for _, my in micro]), y))
        self.assertEqual(micro[0][0].shape, (2, 6))

    def test_indivisible_sizes_raise_naming_the_numbers(self):
        with self.assertRaises(ValueError) as ctx:
            shard_batch(self.batch, 0, 3)
        self.assertIn("8", str(ctx.exception))
        self.assertIn("3", str(ctx.exception))
        with self.assertRaises(ValueError):
            shard_batch(self.batch, 4, 4)  # rank out of range
        with self.assertRaises(ValueError) as ctx:
            split_micro_batches(self.batch, self.batch, 3)
        self.assertIn("8", str(ctx.exception))
        self.assertIn("3", str(ctx.exception))


if __name__ == "__main__":
    unittest.main()
