"""The communication ledger's name for a group, shared by the runtime and the planner.

The process-group manager makes one group per distinct set of ranks, so one group can serve
several kinds (with cp = 1 a "dp" group is its "dp_cp" group). The ledger names such a group
by the first of its kinds in ``LEDGER_NAME_ORDER``; the planner predicts the same labels.
"""

from typing import Sequence

# The kinds whose collectives name no kind at the call come first (tp, pp, and dp or dp_cp:
# DDP, ZeRO, the loss). "dp" before "dp_cp": with cp = 1 they are one group, called "dp"
# (chapter 01); only context parallel (chapter 05) makes "dp_cp" a group of its own.
LEDGER_NAME_ORDER = ("tp", "pp", "dp", "dp_cp", "cp", "ep", "edp", "embd")


def ledger_name(kinds: Sequence[str]) -> str:
    """The ledger's name for a group that serves ``kinds`` (see LEDGER_NAME_ORDER)."""
    return min(kinds, key=LEDGER_NAME_ORDER.index)


def gradient_group_name(context_parallel_size: int) -> str:
    """The ledger's name of the group gradients are averaged over (the dp_cp kind): "dp" when
    context_parallel_size is 1 (the same ranks as dp), "dp_cp" when it is larger."""
    return ledger_name(["dp", "dp_cp"] if context_parallel_size == 1 else ["dp_cp"])
