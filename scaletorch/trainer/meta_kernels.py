"""Faster meta kernels for the dry run: the same shapes, dtypes, strides and storage sizes.

On the meta device torch 2.13 runs most ops' kernels as Python decompositions (``torch._refs``,
``torch._meta_registrations``). Each call takes 0.1-3 ms. A dry run's step of the 405B makes
about 12,000 of them, most with shapes seen before: every layer and micro-batch repeats its ops.
``shape_rules()`` registers, for the run only:

- every functional aten op (no mutation, no view, no alias in its result): torch's own meta
  kernel behind a cache. The first call with given input shapes, strides, dtypes and arguments
  runs it; later calls allocate a result of the shape, strides and dtype it gave. A result that
  ``empty_strided`` would not reproduce (an offset, a storage of another size, an input's
  storage, a non-tensor) is never cached: torch's kernel runs each time;
- logaddexp by a shape rule (ring attention's merges: its decomposition calls further ops);
- normal_ as a no-op (the model's init: there are no values to draw).

``fused_attention_tiles(model)`` gives ring attention the CPU's fused tile kernel: the meta
device has no kernel of its own to pick, and the math tiles' many ops per tile (the s x s
scores) would be slower for the same messages and saved tensors.

Meta kernels see no values, so a result's metadata is a function of its inputs' metadata and
the other arguments: the cache returns what torch's kernel would.
"""

from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Optional, Set, Tuple

import torch
from torch import nn

from scaletorch.parallel.ring_attention import RingAttention

META = torch.device("meta")
# torch's activate_meta leaves these to their C++ kernels (recursion or autograd mismatches)
_NOT_PYTHON = {
    "aten::empty_strided", "aten::clone", "aten::_to_copy", "aten::copy_", "aten::constant_pad_nd",
    "aten::rot90", "aten::as_strided_scatter"
}
_PLAIN = (bool, int, float, str, torch.dtype, torch.device, torch.memory_format, torch.layout)
Spec = Tuple[torch.Size, Tuple[int, ...], torch.dtype]
# (op, args' key, kwargs' key) -> the result's spec or (tuple or list, specs); kept across
# runs (a pure function of the key)
_RESULTS: Dict[Tuple[str, Any, Any], Any] = {}


class _Uncached(Exception):
    """An argument or result the cache does not describe exactly."""


def _key(x: Any, storages: Set[int]) -> Any:
    """A hashable description of an argument: a meta tensor's shape, strides, dtype and offset
    (its storage recorded in ``storages``), a plain value with its type (1, 1.0 and True differ
    in dtype promotion), lists and tuples item by item."""
    if isinstance(x, torch.Tensor):
        if x.device != META or x.layout != torch.strided:
            raise _Uncached  # a wrapped Python number (CPU) promotes unlike a 0-dim tensor
        storages.add(x.untyped_storage()._cdata)
        return (x.shape, x.stride(), x.dtype, x.storage_offset())
    if isinstance(x, (list, tuple)):
        return (type(x), tuple(_key(i, storages) for i in x))
    if x is None or isinstance(x, _PLAIN):
        return (type(x), x)
    raise _Uncached


def _empty(spec: Spec) -> torch.Tensor:
    shape, stride, dtype = spec
    return torch.empty_strided(shape, stride, dtype=dtype, device=META)


def _spec(t: Any, storages: Set[int]) -> Spec:
    """``t``'s shape, strides and dtype, when ``_empty`` of them is ``t`` but for identity: a
    fresh meta tensor at offset 0 whose storage has the same bytes."""
    if (not isinstance(t, torch.Tensor) or t.device != META or t.layout != torch.strided
            or t.storage_offset() or t.untyped_storage()._cdata in storages):
        raise _Uncached
    spec = (t.shape, t.stride(), t.dtype)
    if _empty(spec).untyped_storage().nbytes() != t.untyped_storage().nbytes():
        raise _Uncached
    return spec


def cached(name: str, kernel: Callable[..., Any]) -> Callable[..., Any]:
    """``kernel`` (op ``name``'s meta kernel) behind ``_RESULTS``."""

    def run(*args: Any, **kwargs: Any) -> Any:
        storages: Set[int] = set()
        try:
            key = (name, _key(args, storages), _key(tuple(sorted(kwargs.items())), storages))
        except _Uncached:
            return kernel(*args, **kwargs)
        spec = _RESULTS.get(key)
        if isinstance(spec, tuple) and isinstance(spec[0], torch.Size):
            return _empty(spec)
        if spec is not None:  # a tuple or list of results
            kind, specs = spec
            return kind([_empty(s) for s in specs])
        out = kernel(*args, **kwargs)
        try:
            if isinstance(out, torch.Tensor):
                _RESULTS[key] = _spec(out, storages)
            elif isinstance(out, (tuple, list)):  # a named tuple's fields reach the dispatcher
                kind = list if isinstance(out, list) else tuple  # as a plain tuple's
                _RESULTS[key] = (kind, tuple(_spec(o, storages) for o in out))
        except _Uncached:
            pass
        return out

    return run


def functional_meta_kernels() -> Iterator[Tuple[torch._ops.OpOverload, Callable[..., Any]]]:
    """Each functional aten op with the Python meta kernel torch registered for it, chosen as
    torch's ``activate_meta`` chooses (meta, then post- and pre-autograd decompositions)."""
    from torch._decomp import global_decomposition_table

    kernels: Dict[Any, Callable[..., Any]] = {}
    for kind in ("meta", "post_autograd", "pre_autograd"):
        for op, fn in global_decomposition_table[kind].items():
            kernels.setdefault(op, fn)
    for op, fn in kernels.items():
        if not isinstance(op, torch._ops.OpOverload):
            continue
        name = op.name()
        if (name.startswith("aten::") and name not in _NOT_PYTHON and not op.is_view
                and not op._schema.is_mutable and all(r.alias_info is None
                                                      for r in op._schema.returns)
                and not torch._C._dispatch_has_kernel_for_dispatch_key(
                    name, "CompositeImplicitAutograd")):
            yield op, fn


def _logaddexp_shape(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """logaddexp's result on the meta device: the broadcast shape, the promoted dtype."""
    dtype = torch.result_type(a, b)
    if a.shape == torch.broadcast_shapes(a.shape, b.shape):
        return torch.empty_like(a, dtype=dtype)  # a's strides, as the elementwise kernel keeps
    return torch.empty(torch.broadcast_shapes(a.shape, b.shape), dtype=dtype, device=META)


def _normal_shape(tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, *,
                  generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """normal_ on the meta device: the tensor itself (no values to draw)."""
    return tensor


@contextmanager
def shape_rules() -> Iterator[None]:
    """The faster meta kernels (module docstring), registered for the run, then torch's
    again. logaddexp: 1,984 merges in a cp 16 step of the 8B, 3 ms a call uncached; normal_: 0.7 s
    of the 405B's 0.9 s build (built twice: the run's model and the consolidated file's count);
    the cache: about half of the rest (tests/test_dry_run.py's 14 runs: 46-63 s of a core to 28 s
    on a loaded 2-core host, every figure the same)."""
    scoped = getattr(torch.library, "_scoped_library", None)  # torch's private helper
    if scoped is None:  # a torch without it: torch's own meta kernels, slower, the same result
        yield
        return
    with scoped("aten", "IMPL") as lib:  # removed on exit
        lib.impl("logaddexp", _logaddexp_shape, "Meta")
        lib.impl("normal_", _normal_shape, "Meta")
        for op, kernel in functional_meta_kernels():
            if op.name() != "aten::logaddexp":
                lib.impl(op, cached(op.name(), kernel), "Meta")
        yield


def fused_attention_tiles(model: nn.Module) -> None:
    """Every ring attention of ``model`` that would pick its kernel ("auto", "fused") runs the
    CPU's fused one, as a GPU runs a fused kernel; "math" asked by name stays."""
    for module in model.modules():
        fn = getattr(module, "attention_fn", None)
        if isinstance(fn, RingAttention) and fn.kernel in ("auto", "fused"):
            fn.kernel = "cpu_flash"
