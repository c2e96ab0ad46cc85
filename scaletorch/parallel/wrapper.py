"""A wrapper that owns its state: ``self.module``'s keys, ``self.module``'s attributes.

Data-parallel wrappers (data_parallel.py) and ``ExpertParallel`` (expert_parallel.py) hold the
model as ``self.module``; their checkpoints must still use the model's own keys, so that a
checkpoint or a parity check compares names one to one, at any nesting (a pipeline's chunks
hold wrappers).
"""

from typing import Any, Dict, Iterable, Tuple

import torch
from torch import nn
from torch.nn.parameter import is_lazy


def _strip_module_prefix(module: nn.Module, state_dict: Dict[str, Any], prefix: str,
                         local_metadata: Any) -> None:
    """state_dict post-hook: ``<prefix>module.<name>`` -> ``<prefix><name>``."""
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)


def _add_module_prefix(module: nn.Module, state_dict: Dict[str, Any], prefix: str, *args:
                       Any) -> None:
    """load_state_dict pre-hook, the inverse: ``<prefix><name>`` -> ``<prefix>module.<name>``."""
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


class ModuleWrapper:
    """A mixin for modules that wrap ``self.module``: plain state_dict keys (no ``module.``)
    and attribute fall-through to the wrapped module.

    The keys are renamed by state-dict hooks, not by overriding ``state_dict`` and
    ``load_state_dict``: a container that holds wrappers (the pipeline's chunks) saves and
    loads them through nn.Module's recursion, which runs every submodule's hooks but never a
    submodule's own ``load_state_dict``. So a wrapper's checkpoint works alone and nested.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register_state_dict_post_hook(_strip_module_prefix)
        self.register_load_state_dict_pre_hook(_add_module_prefix)

    def __getattr__(self, name: str) -> Any:
        try:
            # a mixin: the nn.Module after it in the class's bases has __getattr__
            return super().__getattr__(name)  # type: ignore[misc]
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)  # e.g. model.num_parameters(), model.config


def refuse_wrapped(model: nn.Module, by: str) -> None:
    """Raise if ``model`` is, or holds, a data-parallel or ZeRO wrapper (its class sets
    ``data_parallel_wrapper``): a second wrap would shard or broadcast the first one's state."""
    for name, module in model.named_modules():
        if getattr(type(module), "data_parallel_wrapper", False):
            where = f" (at {name!r})" if name else ""
            raise ValueError(f"{by}: the model is already wrapped by {type(module).__name__}"
                             f"{where}: wrap the bare model once")


def refuse_lazy(named: Iterable[Tuple[str, torch.Tensor]], by: str,
                owner: str = "a Lazy module's") -> None:
    """Raise naming the first of ``named`` not initialised yet (``owner``: a LazyLinear): it
    has no shape to check, broadcast or shard until the module's first forward."""
    for name, tensor in named:
        if is_lazy(tensor):
            raise ValueError(f"{by}: {name} is not initialised yet ({owner}): run one forward "
                             f"before wrapping")


def refuse_unready(model: nn.Module, by: str) -> None:
    """At the wrap, before any collective (every rank raises alike): the parameter states a
    wrap cannot hold. A parameter or buffer not initialised yet (``refuse_lazy``, the module's
    class named); a parameter of a module built with ``sparse=True`` (nn.Embedding,
    nn.EmbeddingBag): its sparse gradient has no flat storage to average or shard."""
    for prefix, sub in model.named_modules():
        own = [(f"{prefix}.{n}" if prefix else n, t)
               for n, t in [*sub._parameters.items(), *sub._buffers.items()] if t is not None]
        refuse_lazy(own, by, type(sub).__name__)
        if getattr(sub, "sparse", False) is True and sub._parameters:
            name = next(n for n, t in own if isinstance(t, nn.Parameter))
            raise ValueError(f"{by}: {name} gets sparse gradients ({type(sub).__name__}, "
                             f"sparse=True): not supported; build it with sparse=False")
