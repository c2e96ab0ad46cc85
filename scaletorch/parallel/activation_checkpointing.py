"""Activation checkpointing: keep each block's input, recompute the block in backward.

Without it autograd keeps every intermediate of every block (attention scores, MLP
activations, norms) from forward until backward; with it a block keeps only its input
(b, s, h) (and RoPE's cos/sin), and its forward runs again when backward reaches it, its
collectives included (tp all-reduces, the cp ring, the ep all-to-alls). Chapter 10 attaches it
to chapter 07's ``parallelize`` from outside (``recompute=apply_activation_checkpointing``),
which applies it after the strategies that change a block and before the pipeline cuts the
blocks. ``saved_activation_bytes`` measures what it saves.

Two modes (``parallel.activation_checkpointing``; true/false in older configs are full/none):
- ``full``: checkpoint each block, as above;
- ``selective`` (Korthikanti et al. 2022): checkpoint only the attention core (scores, softmax,
  the weighted sum: ``Attention.attention_fn``), which holds the b x a x s^2 scores but costs
  few FLOPs to redo; the block keeps its other activations and only the core runs again.
  Under context parallel the core is the ring, so its K/V passes are redone too.
"""

import weakref
from typing import Any, Callable, Dict, Hashable, List, Set, Tuple, Union, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from scaletorch.config import recompute_mode
from scaletorch.dist import get_ledger
from scaletorch.models import Llama
from scaletorch.models.llama import Attention
from scaletorch.parallel.memory_report import storage_key


# [core: recompute]
class _Checkpointed:
    """A block's forward that keeps only its inputs and recomputes the rest in backward.

    The recomputation's collectives are real traffic: the ledger books them under the phase
    "recompute", apart from the forward's."""

    def __init__(self, forward: Callable) -> None:
        self.forward = forward

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        first = True

        def run(*inputs: Any) -> Any:  # checkpoint calls it once in forward, again to recompute
            nonlocal first
            if first:
                first = False
                return self.forward(*inputs)
            with get_ledger().in_phase("recompute"):
                return self.forward(*inputs)

        return checkpoint(run, *args, use_reentrant=False)


def apply_activation_checkpointing(model: Llama, mode: Union[str, bool] = "full") -> Llama:
    """``full``: checkpoint every transformer block: per block only its input (b, s, h) (and
    RoPE's cos/sin) stays alive between forward and backward; the block's forward runs again in
    backward, collectives included. ``selective``: checkpoint each block's attention core
    (q, k, v in, the attention output out). ``none`` (or False): nothing. Parameter names
    (state dicts) are unchanged."""
    mode = recompute_mode(mode)
    for block in model.layers if mode != "none" else []:
        if mode == "full" and not isinstance(block.forward, _Checkpointed):
            block.forward = _Checkpointed(block.forward)
        attn = cast(Attention, block.self_attn)  # torch types submodules Tensor | Module
        if mode == "selective" and not isinstance(attn.attention_fn, _Checkpointed):
            attn.attention_fn = _Checkpointed(attn.attention_fn)
    return model


# [end: recompute]
class _Saved:
    """What autograd holds in place of a saved tensor while ``saved_activation_bytes`` watches:
    the tensor, and (through a weakref finalizer) word of when autograd lets it go.

    It holds the tensor detached (the same storage, no grad_fn): an op's saved *output* held
    with its grad_fn would make a cycle (node -> this -> output -> node) that only running the
    node breaks, so the nodes a split backward never runs (zero-bubble W's stop at the
    weights; the input's own path was run by B) would stay alive and be counted forever."""
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()


def weight_storages(model: nn.Module) -> Set[int]:
    """``storage_key`` of every weight: the parameters, and the plain tensors that ZeRO-3 puts
    in their place (views of its gathered units, flat_unit.py). Autograd saves them as a
    matmul's input, but they are model states, not activations."""
    keys = {storage_key(p) for p in model.parameters()}
    for module in model.modules():
        keys.update(
            storage_key(v) for v in vars(module).values()
            if torch.is_tensor(v) and v.requires_grad and not isinstance(v, nn.Parameter))
    return keys


def saved_activation_bytes(model: nn.Module, fn: Callable[[], Any]) -> Tuple[int, Any]:
    """The most bytes of tensors autograd kept for backward at one time while ``fn()`` ran
    (distinct storages, parameters excluded), and fn's result: what activation checkpointing
    saves. For a forward alone that is everything it saved; for a whole step (forward and
    backward of several micro-batches, or a pipeline schedule) the peak, since backward frees
    what it used."""
    peak, _, out = saved_activation_peaks(model, fn, lambda: None)
    return peak, out


def saved_activation_peaks(model: nn.Module, fn: Callable[[], Any],
                           tag: Callable[[], Hashable]) -> Tuple[int, Dict[Hashable, int], Any]:
    """``saved_activation_bytes``, and the most bytes each tag's tensors held at one time:
    ``tag()`` names, when autograd saves a tensor, what it belongs to (a micro-batch, say:
    ``activation_meter.micro_batch_of``). Returns (peak, {tag: its peak}, fn's result)."""
    params = weight_storages(model)
    live: Dict[int, List[Any]] = {}  # storage address -> [bytes, saved tensors using it, tag]
    current, peak = 0, 0
    by_tag: Dict[Hashable, int] = {}
    peaks: Dict[Hashable, int] = {}

    def release(ptr: int) -> None:
        nonlocal current
        live[ptr][1] -= 1
        if live[ptr][1] == 0:
            size, _, owner = live.pop(ptr)
            current -= size
            by_tag[owner] -= size

    def pack(t: torch.Tensor) -> Any:
        nonlocal current, peak
        storage = t.untyped_storage()
        ptr = storage_key(t)  # a fake tensor's data pointer is 0: the storage object's address
        if ptr in params:
            return t
        entry = live.setdefault(ptr, [storage.nbytes(), 0, tag()])
        if entry[1] == 0:  # a storage counts once, however many saved views share it
            current += entry[0]
            peak = max(peak, current)
            owner = entry[2]
            by_tag[owner] = by_tag.get(owner, 0) + entry[0]
            peaks[owner] = max(peaks.get(owner, 0), by_tag[owner])
        entry[1] += 1
        saved = _Saved(t)
        weakref.finalize(saved, release, ptr)
        return saved

    def unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        out = fn()
    return peak, peaks, out
