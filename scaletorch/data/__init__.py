"""Data: token sources and the deterministic global-batch loader."""

from scaletorch.data.datasets import (DATASET_NAMES, BinDataset, ByteTextDataset, SyntheticMarkov,
                                      build_dataset)
from scaletorch.data.loader import GlobalBatchLoader, shard_batch, split_micro_batches
from scaletorch.data.tokenizer import ByteTokenizer, HFTokenizer, bin_dtype, load_tokenizer

__all__ = [
    "DATASET_NAMES",
    "BinDataset",
    "ByteTokenizer",
    "ByteTextDataset",
    "GlobalBatchLoader",
    "HFTokenizer",
    "SyntheticMarkov",
    "bin_dtype",
    "build_dataset",
    "load_tokenizer",
    "shard_batch",
    "split_micro_batches",
]
