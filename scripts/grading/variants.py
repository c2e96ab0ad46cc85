"""The grader's catalogue of planted bugs: the reference solutions, each with one learner's mistake.

Each variant stands in for an exercise (examples/exercises/) and must get its own diagnosis from
scripts/grade.py, not a generic failure. Each chapter's variants are in a module of their own
(``MODULES``: ddp_variants.py for 01, ... balance_variants.py for 06b); this one gathers them:
``CATALOGUE`` maps (chapter, exercise, variant) to the words its diagnosis must contain,
``STOPPING`` and ``HANGS`` the variants that stop or deadlock the world, ``source(variant)`` the
``Source`` a spawned rank loads it by (the module that defines it, so that a diagnosis names
the variant's own file and line). tests/test_grade.py runs them all, one world per chapter.
"""

from types import ModuleType
from typing import Dict, List, Tuple

from scripts.grading import (balance_variants, context_variants, ddp_variants, expert_variants,
                             loss_scale_variants, pipeline_variants, tensor_variants, zero_variants)
from scripts.grading.learner import Source

MODULES: List[ModuleType] = [
    ddp_variants, zero_variants, tensor_variants, pipeline_variants, context_variants,
    expert_variants, balance_variants, loss_scale_variants
]
# (chapter, exercise, variant) -> words its diagnosis must contain
CATALOGUE: Dict[Tuple[str, str, str], str] = {
    key: words
    for module in MODULES
    for key, words in module.CATALOGUE.items()
}
# Variants that stop the world (gloo aborts a rank on mismatched collectives): one world each,
# after the catalogue's; the pattern its diagnosis must match
STOPPING: Dict[Tuple[str, str, str], str] = dict(ddp_variants.STOPPING)
# Variants that deadlock: one world each; the phrases their diagnosis must contain
HANGS: Dict[Tuple[str, str, str], Tuple[str, ...]] = dict(pipeline_variants.HANGS)
PLANTED = [*CATALOGUE, *STOPPING, *HANGS]  # (chapter, exercise, variant) of every variant


def source(variant: str) -> Source:
    """(the module defining ``variant``, its name): what a rank loads the variant by."""
    module = next((m for m in MODULES if callable(getattr(m, variant, None))), None)
    if module is None:
        raise KeyError(f"no planted variant {variant!r}")
    return module.__name__, variant
