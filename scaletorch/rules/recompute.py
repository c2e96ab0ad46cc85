"""Activation recomputation's modes, as the config and the planner both name them."""

from typing import Any

RECOMPUTE = ("none", "selective", "full")


def recompute_mode(value: Any) -> str:
    """``parallel.activation_checkpointing`` as none | selective | full (true/false: full/none,
    as older configs wrote it)."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if value is True or value is False:
        return "full" if value else "none"
    if value in RECOMPUTE:
        return value
    raise ValueError(f"activation_checkpointing must be one of none, selective, full "
                     f"(or true/false), got {value!r}")
