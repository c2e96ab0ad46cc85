"""Data: token sources, images (chapter 12) and the deterministic global-batch loaders."""

from scaletorch.data.datasets import (DATASET_NAMES, BinDataset, ByteTextDataset, SyntheticMarkov,
                                      build_dataset)
from scaletorch.data.images import ImageBatchLoader, ImageFolder, SyntheticImages
from scaletorch.data.loader import (GlobalBatchLoader, SequenceShard, ShardedBatch, local_batch,
                                    shard_batch, split_micro_batches)
from scaletorch.data.tokenizer import ByteTokenizer, HFTokenizer, bin_dtype, load_tokenizer

__all__ = [
    "DATASET_NAMES",
    "BinDataset",
    "ByteTokenizer",
    "ByteTextDataset",
    "GlobalBatchLoader",
    "HFTokenizer",
    "ImageBatchLoader",
    "ImageFolder",
    "SequenceShard",
    "SyntheticImages",
    "ShardedBatch",
    "SyntheticMarkov",
    "bin_dtype",
    "build_dataset",
    "load_tokenizer",
    "local_batch",
    "shard_batch",
    "split_micro_batches",
]
