"""A pipeline rank's ZeRO wrappers, one per chunk, stepped by one optimizer (chapter 07).

Under pp > 1 a rank holds one or more chunks of the model (chapter 04; interleaved and V
schedules: several), and ``parallelize`` wraps each in its own ``ShardedDataParallel`` (chapter
02) over the same "dp_cp" group and stage. Chapter 02's ``ZeroOptimizer`` steps one wrapper;
``ZeroChunks`` shows it the chunks' wrappers as one: their shards in chunk order (the order of
the optimizer's state in a checkpoint), each chunk's gradients waited for, every unit gathered
after the step (stages 1, 2).
"""

from typing import Iterator, List, Sequence

from torch import nn

from scaletorch.parallel.flat_unit import FlatUnit
from scaletorch.parallel.zero import ShardedDataParallel


class ZeroChunks:
    """``zero.Sharded`` over ``wrappers``, a rank's chunks' ZeRO wrappers (one stage)."""

    def __init__(self, wrappers: Sequence[ShardedDataParallel]) -> None:
        stages = {w.zero_stage for w in wrappers}
        if len(stages) != 1:
            raise ValueError(f"one optimizer steps chunks of one ZeRO stage, got {sorted(stages)}")
        self.wrappers = list(wrappers)
        self.zero_stage = stages.pop()
        self.units: List[FlatUnit] = [u for w in self.wrappers for u in w.units]

    def parameters(self) -> Iterator[nn.Parameter]:
        for wrapper in self.wrappers:
            yield from wrapper.parameters()

    def finish_grad_sync(self) -> None:
        for wrapper in self.wrappers:
            wrapper.finish_grad_sync()

    def zero_grad_buffers(self) -> None:
        for wrapper in self.wrappers:
            wrapper.zero_grad_buffers()
