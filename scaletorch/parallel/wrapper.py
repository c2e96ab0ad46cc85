"""A wrapper that owns its state: ``self.module``'s keys, ``self.module``'s attributes.

Data-parallel wrappers (data_parallel.py) and ``ExpertParallel`` (expert_parallel.py) hold the
model as ``self.module``; their checkpoints must still use the model's own keys, so that a
checkpoint or a parity check compares names one to one, at any nesting (a pipeline's chunks
hold wrappers).
"""

from typing import Any, Dict

from torch import nn


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
