"""Probe 54 round 5's learners' mistakes that end in torch's own machinery, as tests/test_grade.py
grades them: a release that frees half of a unit's storage (its views then fail in a backward: told
with the bytes it left), a backward of a class made inside a function that returns a gradient of
the wrong shape (told at that backward, not at torch's engine), and an error whose message runs
to 200 lines (its first lines, then how many more)."""

import torch

from scaletorch.dist.functional import (gather_along_dim, reduce_from_parallel_region,
                                        reduce_scatter_along_dim)


def release_unit_half(flat):
    """Half of the storage handed back: the parameters' views reach past what is left."""
    storage = flat.untyped_storage()
    storage.resize_(storage.nbytes() // 2)


def exit_region_made_in_a_function(x, group, sequence_parallel):
    """g-bar's backward gathers along dim 0, not the sequence's dim 1 (classes made per call)."""

    class GBar(torch.autograd.Function):

        @staticmethod
        def forward(ctx, x):
            return reduce_scatter_along_dim(x.contiguous(), 1, group)

        @staticmethod
        def backward(ctx, dy):
            return gather_along_dim(dy.contiguous(), 0, group)

    if not sequence_parallel:
        return reduce_from_parallel_region(x, group)
    return GBar.apply(x)


def update_scale_says_a_lot(scale, clean_steps, found_inf, growth_interval):
    raise RuntimeError("the first line\n" + "\n".join(f"line {i}" for i in range(200)))


MISTAKES = [("02", "release_unit", "release_unit_half", "release_unit left "),
            ("03", "exit_region", "exit_region_made_in_a_function",
             "(in GBar.backward at grading_probe_r5_main.py:"),
            ("08", "update_scale", "update_scale_says_a_lot",
             "RuntimeError: the first line / line 0 / line 1 (198 more lines of the message) (at "
             "grading_probe_r5_main.py:")]
MUST_NOT = {
    "release_unit_half": ["setStorage", "graph.py"],
    "exit_region_made_in_a_function": ["graph.py"],
    "update_scale_says_a_lot": ["line 2\n", "line 199"]
}
