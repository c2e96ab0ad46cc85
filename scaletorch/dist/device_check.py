"""A test mode that finds tensors a GPU run would hand to NCCL on the CPU.

An NCCL group takes CUDA tensors only: ``torch.randn(n)`` (no ``device=``) all-reduced over it
fails on a GPU, and passes on gloo, where the run's device is the CPU anyway. In this mode
(``SCALETORCH_CHECK_DEVICES=1``, entered by ``init_distributed``, or ``check_devices()``) a
torch function mode marks every tensor made on the host: by a factory without ``device=``
(``torch.randn``, ``zeros``, ``tensor``, ...), by ``.cpu()``, or by an op whose tensor inputs
are all marked. ``.to(device)`` unmarks. Every collective in ``comm`` then raises
``HostTensorError`` for a marked tensor: on a GPU it would have been a CPU tensor.
"""

import os
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

ENV = "SCALETORCH_CHECK_DEVICES"
_MARK = "_scaletorch_made_on_host"
FACTORIES = {
    torch.randn, torch.rand, torch.randint, torch.randperm, torch.zeros, torch.ones, torch.empty,
    torch.full, torch.arange, torch.linspace, torch.eye, torch.tensor, torch.as_tensor,
    torch.from_numpy, torch.scalar_tensor
}
MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.new_tensor}  # with a device: unmark


class HostTensorError(RuntimeError):
    """A tensor made on the host reached a collective (it would be a CPU tensor on a GPU)."""


def made_on_host(tensor: torch.Tensor) -> bool:
    return bool(getattr(tensor, _MARK, False))


def _mark(out: Any, value: bool) -> None:
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            try:
                setattr(t, _MARK, value)
            except (AttributeError, RuntimeError):  # a tensor type without a __dict__
                pass


def _names_device(func: Any, args: tuple, kwargs: dict) -> bool:
    """Does this call of ``.to``/``.cuda``/``.new_tensor`` name a device?"""
    if func is torch.Tensor.cuda or kwargs.get("device") is not None:
        return True
    return any(
        isinstance(a, (torch.device, str,
                       int)) and not isinstance(a, bool) or isinstance(a, torch.Tensor)
        for a in args[1:])


class HostTensorMode(TorchFunctionMode):
    """Marks the tensors a GPU run would have on the CPU (see the module's docstring)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in FACTORIES:
            if kwargs.get("device") is None:
                _mark(out, True)
        elif func in MOVES and _names_device(func, args, kwargs):
            _mark(out, False)
        elif func is torch.Tensor.cpu:
            _mark(out, True)
        else:
            inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            if inputs and all(made_on_host(t) for t in inputs):
                _mark(out, True)
        return out


_mode: Optional[HostTensorMode] = None


def enabled() -> bool:
    return _mode is not None


def enable_from_env() -> None:
    """Enter the mode for the rest of the process if ``SCALETORCH_CHECK_DEVICES=1``."""
    global _mode
    if _mode is None and os.environ.get(ENV, "0") == "1":
        _mode = HostTensorMode()
        _mode.__enter__()


@contextmanager
def check_devices() -> Iterator[None]:
    """The mode inside a ``with`` block (tests)."""
    global _mode
    outer, _mode = _mode, HostTensorMode()
    try:
        with _mode:
            yield
    finally:
        _mode = outer


def check(tensor: torch.Tensor, op: str) -> None:
    """Raise HostTensorError if ``tensor`` was made on the host (in the mode only)."""
    if _mode is not None and made_on_host(tensor):
        raise HostTensorError(f"{op} of a tensor {tuple(tensor.shape)} {tensor.dtype} made on the "
                              f"host (a factory without device=, or .cpu()): on a GPU it would be "
                              f"a CPU tensor, which an NCCL group refuses")
