"""The activations a pipeline schedule holds, measured: bytes autograd saved per micro-batch.

Chapter 09's meter (its planner predicts these bytes), attached to a pipeline schedule from
outside: ``schedule.hooks.append(ActivationMeter(list(pipe.parameters()), enabled=True))``.
``micro_batch_of`` tells an outer ``saved_activation_peaks`` (activation_checkpointing.py)
which micro-batch each saved tensor belongs to, for any step, pipeline or not.
"""

from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Dict, Iterator, Sequence, Tuple

import torch
from torch import nn

from scaletorch.parallel.pipeline_runtime import PipelineSchedule, StageHooks


class ActivationMeter(StageHooks):
    """Bytes autograd saved in each (micro-batch, chunk)'s forward, alive until its last
    backward (W, or a full B) frees them: the activation memory a schedule holds, measured.

    ``with meter.forward(key): out = chunk(x)`` counts every saved tensor's storage once
    (parameters excluded: they are not activations); ``meter.release(key)`` when its graph goes.
    Off unless ``enabled``: its hooks would hide the saved tensors from any outer
    ``saved_tensors_hooks`` (autograd uses the innermost pair only), e.g. the benchmark's
    ``saved_activation_bytes``, and cost a little on every step.
    """

    def __init__(self, params: Sequence[torch.Tensor], enabled: bool = False) -> None:
        self.enabled = enabled
        self.param_storages = {p.untyped_storage().data_ptr() for p in params}
        self.live: Dict[tuple, Dict[int, int]] = {}  # key -> {storage pointer: bytes}
        self.peak_bytes = self.peak_count = 0

    def reset(self) -> None:
        self.live.clear()
        self.peak_bytes = self.peak_count = 0

    @contextmanager
    def forward(self, key: Tuple[int, int]) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        storages = self.live.setdefault(key, {})

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self.param_storages:
                storages[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
        self.peak_count = max(self.peak_count, len(self.live))
        self.peak_bytes = max(self.peak_bytes, self.bytes())

    def release(self, key: Tuple[int, int]) -> None:
        self.live.pop(key, None)

    def bytes(self) -> int:
        return sum(sum(storages.values()) for storages in self.live.values())


class MicroBatchTag(StageHooks):
    """The micro-batch whose forward began last on this rank (-1 before the first): what a
    tensor saved now belongs to, the loss after a last stage's forward included."""

    def __init__(self) -> None:
        self.current = -1

    def forward(self, key: Tuple[int, int]) -> ContextManager[Any]:
        self.current = key[0]
        return nullcontext()


@contextmanager
def micro_batch_of(step: Any, model: nn.Module) -> Iterator[Callable[[], int]]:
    """Within: a function that names the micro-batch this rank is running, for the Trainer's
    ``step`` (``forward_backward``) on ``model``. A pipeline schedule says which (a hook, each
    micro-batch's forward of each chunk); any other step runs one forward of ``model`` per
    micro-batch in turn, so each call of ``model`` begins the next one."""
    if isinstance(step, PipelineSchedule):
        tag = MicroBatchTag()
        step.hooks.append(tag)
        try:
            yield lambda: tag.current
        finally:
            step.hooks.remove(tag)
        return
    count = [-1]

    def begin(module: nn.Module, args: Any) -> None:
        count[0] += 1

    handle = model.register_forward_pre_hook(begin)
    try:
        yield lambda: count[0]
    finally:
        handle.remove()
