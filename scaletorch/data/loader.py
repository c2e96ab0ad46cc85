"""One global batch per step, then slices of it for each rank and micro-batch.

The global batch is a pure function of (seed, step): every rank builds the same one and keeps
its slice, and a run resumed at step t sees exactly the batches of an uninterrupted run. This
is what lets every parallel run be compared token for token with the single-device run.

    global batch (B, s) --shard_batch over data-parallel ranks--> (B/dp, s)
                        --split_micro_batches--> m x (B/dp/m, s)
"""

from typing import Callable, List, Optional, Protocol, Tuple

import numpy as np
import torch

from scaletorch.data.datasets import Dataset

# inputs, targets, position_ids (None without context parallel)
ShardedBatch = Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]
SequenceShard = Callable[[torch.Tensor, torch.Tensor], ShardedBatch]


class BatchSource(Protocol):
    """Where the Trainer reads each step's global batch: a ``GlobalBatchLoader``, or a dry
    run's batches of shapes only (scaletorch/trainer/dry_run.py)."""

    def get_batch(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        ...


class GlobalBatchLoader:
    """Deterministic global batches: ``get_batch(step)`` depends only on (seed, step)."""

    def __init__(self, dataset: Dataset, global_batch_size: int, seq_len: int, seed: int) -> None:
        if global_batch_size <= 0 or seq_len <= 0:
            raise ValueError(
                f"global_batch_size ({global_batch_size}) and seq_len ({seq_len}) must be "
                f"positive")
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.seq_len = seq_len
        self.seed = seed

    def get_batch(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """inputs, targets: int64 (global_batch_size, seq_len); targets = inputs shifted by 1."""
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        # A fresh generator per step: no state carried between calls, so call order and
        # resuming do not matter.
        rng = np.random.default_rng([self.seed, step])
        sample = self.dataset.sample(self.global_batch_size, self.seq_len + 1, rng)
        tokens = torch.from_numpy(np.ascontiguousarray(sample, dtype=np.int64))
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def shard_batch(tensor: torch.Tensor, rank: int, world_size: int, dim: int = 0) -> torch.Tensor:
    """The ``rank``-th of ``world_size`` equal contiguous chunks of ``tensor`` along ``dim``."""
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"rank ({rank}) must be in [0, world_size ({world_size}))")
    size = tensor.size(dim)
    if size % world_size != 0:
        raise ValueError(
            f"size {size} along dim {dim} is not divisible by world_size ({world_size})")
    chunk = size // world_size
    # contiguous: the shard may be sent through a collective, which needs dense memory.
    return tensor.narrow(dim, rank * chunk, chunk).contiguous()


def split_micro_batches(inputs: torch.Tensor, targets: torch.Tensor,
                        num_micro_batches: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Split (b, s) inputs and targets along the batch into ``num_micro_batches`` pairs."""
    if inputs.shape != targets.shape:
        raise ValueError(
            f"inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} differ in shape")
    if num_micro_batches <= 0 or inputs.size(0) % num_micro_batches != 0:
        raise ValueError(f"batch size {inputs.size(0)} is not divisible by num_micro_batches "
                         f"({num_micro_batches})")
    return list(zip(inputs.chunk(num_micro_batches), targets.chunk(num_micro_batches)))


def local_batch(inputs: torch.Tensor, targets: torch.Tensor, data_parallel_rank: int,
                data_parallel_size: int,
                shard_sequence: Optional[SequenceShard] = None) -> ShardedBatch:
    """This rank's part of the global batch: (B, s) -> its data-parallel slice (B/dp, s), then,
    with ``shard_sequence`` (context parallel), its tokens of each sequence (B/dp, s/cp).
    Returns (inputs, targets, position_ids), position_ids None without context parallel."""
    inputs = shard_batch(inputs, data_parallel_rank, data_parallel_size)
    targets = shard_batch(targets, data_parallel_rank, data_parallel_size)
    if shard_sequence is None:
        return inputs, targets, None
    return shard_sequence(inputs, targets)
