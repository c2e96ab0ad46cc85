"""Data: token sources and the deterministic global-batch loader."""

from scaletorch.data.datasets import (DATASET_NAMES, BinDataset, ByteTextDataset, SyntheticMarkov,
                                      build_dataset)
from scaletorch.data.loader import GlobalBatchLoader, shard_batch, split_micro_batches

__all__ = [
    "DATASET_NAMES",
    "BinDataset",
    "ByteTextDataset",
    "GlobalBatchLoader",
    "SyntheticMarkov",
    "build_dataset",
    "shard_batch",
    "split_micro_batches",
]
