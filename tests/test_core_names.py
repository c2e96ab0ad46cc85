"""A core module names no later chapter's concern: later chapters attach from outside.

Each core module of chapters 01-05 lists the names it must not contain as identifiers (a
variable, attribute, argument, function or class name: comments and strings are not read).
A name matches whole words of an identifier: "meter" matches ``self.meter`` and
``ActivationMeter``, not ``parameters``. The pipeline runtime learns of MoE losses, activation
meters, message dtypes and tied embeddings through ``StageHooks`` that those chapters register
(expert_parallel.py, activation_meter.py, mixed_precision.py, tied_embeddings.py). Tensor
parallel learns of chapter 08's compute dtype the same way: mixed_precision.py swaps in
subclasses of its norm and embedding (``tensor_parallel_wire_in_compute``); of chapter 10's
vocabulary padding through ``parallelize(..., tensor_parallel=apply_tensor_parallel_padded)``
(vocab_padding.py pads the reference's tables, then swaps in a head that masks the padding);
of chapter 06's MoE blocks through its ``plan`` argument (chapter 07's ``tensor_parallel_plan``
keeps the experts whole); of chapter 10's tied head not at all (``parallelize`` ties it again
after the split; native.py after DTensor's, and gathers the logits a pipeline's loss takes).
Data parallel learns of chapter 08's reduce dtype by subclasses of the DDP wrappers
(``apply_data_parallel_in``); chapter 01's overlap chart records through ``record_overlap``
(overlap_chart.py); a model nobody here wrote (any dtype, torch DDP's flags) through the
subclasses of data_parallel_any_module.py.
Expert parallel (06) learns of chapter 08's compute dtype the same way
(``expert_parallel_wire_in_compute`` swaps in a dispatcher whose ``outgoing`` casts), and ring
attention turns autocast off only where the device has one (a meta tensor's has none).
ZeRO (02) learns of chapter 08's dtypes through a subclass whose ``new_unit`` builds the
``FlatUnit`` subclass that zero_mixed_precision.py defines, and of chapter 10's tied weights
through zero_tied.py's subclass, which points borrowers at a unit's tensors and gathers and
frees them with the unit that borrows them. Its optimizer steps one wrapper; chapter 07's
pipeline chunks, a wrapper each, reach it as one (zero_chunks.py's ``ZeroChunks``). The full
weights for ``--check`` (dist/full_state.py) name no later chapter either.

A few values are a later chapter's too, as string literals (``STRINGS``): tensor parallel's
report takes the bytes of an activation element (the script asks trainer/precision.py's
``activation_element_size``), not chapter 08's precision names; no module of chapter 05 asks
for the meta device (the dry run gives the rings their fused tiles from outside:
trainer/meta_kernels.py's ``fused_attention_tiles``).

What stays, and why. Ring attention's kernel choice ("auto", "math", "fused",
attention_kernels.py) is chapter 05's own lesson: its page teaches the math tiles and the fused
ones and which device runs which. So is turning autocast off around the merges: the
log-sum-exp statistics stay fp32 whatever the caller's dtype, as flash attention's do (doc/05
explains why bf16 merge weights fail). Expert parallel's ``host_tables`` is a hook whose
default is chapter 06's one wait for the device (the count tables to the host, doc/06); the
dry run's balanced tables attach through it. Data parallel's buckets refuse a parameter that
is not fp32 (chapter 01's wrappers accumulate in fp32): a refusal, not a branch;
data_parallel_any_module.py's subclass buckets any dtype from outside, and chapter 08's
reduce dtype is ddp_reduce_dtype.py's subclass.
"""

import ast
import io
import os
import re
import tokenize
import unittest
from typing import Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# later chapters' concerns that a pipeline module (04, 04b) must not name
_PIPELINE = [
    "aux_loss", "moe", "expert", "meter", "wire", "wire_dtype", "compute_dtype", "autocast",
    "scaler", "scale_backward", "after_backward", "tied", "shared_embedding", "embedding_group",
    "precision", "recompute", "checkpointing"
]
# chapter 08's compute dtype, which tensor parallel (03) must not name
_COMPUTE_DTYPE = [
    "compute_dtype", "to_compute", "autocast", "autocast_dtype", "wire_dtype", "bfloat16",
    "float16", "mixed_precision"
]
# chapter 10's vocabulary padding (vocab_padding.py), which tensor parallel must not name either
# nor chapter 06's MoE (07 passes a plan that keeps it whole), nor chapter 10's tied head (07
# ties it again), nor the plain logits of 07's pipelines (native.py gathers them)
_TENSOR = _COMPUTE_DTYPE + [
    "pad", "vocab_pad", "padded", "padding", "moe", "expert", "dense", "tie", "tied", "pipeline",
    "vocab_parallel_logits", "precision"
]
# chapter 08's reduce dtype, chapter 01's overlap chart, chapter 05's dp x cp group (chapter
# 01 asks pg_manager for ``gradient_sync_group``) and what only a model nobody here wrote needs
# (data_parallel_any_module.py: other dtypes' buckets, torch DDP's flags), which data parallel
# must not name
_DATA_PARALLEL = [
    "reduce_dtype", "wire", "precision", "bfloat16", "float16", "autocast", "timeline", "timer",
    "mark", "recording", "launches", "overlap", "with_context", "dp_cp", "float64", "promote_types",
    "find_unused", "broadcast_buffers", "held"
]
# later chapters' concerns that ZeRO's unit, wrapper and optimizers (02) must not name: chapter
# 10's tied weights (zero_tied.py points borrowers at a unit's tensors), chapter 08's dtypes
# (zero_mixed_precision.py's FlatUnit subclass) and chapter 07's several wrappers per rank, one
# per pipeline chunk (zero_chunks.py)
_ZERO = [
    "users", "tied", "shared_embedding", "borrowers", "borrows", "gathered_with", "make_unit",
    "param_dtype", "reduce_dtype", "wire", "policy", "precision", "autocast", "compute_dtype",
    "bfloat16", "float16", "wrappers", "chunks"
]
# later chapters' concerns that context parallel (05) must not name. It may name autocast: the
# ring turns it off around its merge, which keeps the log-sum-exp statistics in fp32 whatever
# the caller's dtype (the ring's own numerics, as flash attention's are).
_CONTEXT = sorted({n for n in _PIPELINE + _COMPUTE_DTYPE + ["is_meta"] if n != "autocast"})
# chapter 08's compute dtype (mixed_precision.py swaps in a dispatcher that casts the routed
# tokens, ``expert_parallel_wire_in_compute``), which expert parallel (06) must not name
_EXPERT = _COMPUTE_DTYPE + ["is_meta"]
# the differentiable collectives: chapter 03's f, f-bar, g, g-bar; 05's and 06's all-to-all
_COLLECTIVES = _COMPUTE_DTYPE + ["pad", "padded", "tied", "is_meta", "expert", "moe"]
FORBIDDEN: Dict[str, List[str]] = {
    "scaletorch/parallel/context_parallel.py": _CONTEXT,
    "scaletorch/parallel/ring_attention.py": _CONTEXT,
    "scaletorch/parallel/attention_kernels.py": _CONTEXT,
    "scaletorch/parallel/data_parallel.py": _DATA_PARALLEL,
    "scaletorch/parallel/gradient_sync.py": _DATA_PARALLEL,
    "scaletorch/parallel/pipeline_schedules.py": _PIPELINE,
    "scaletorch/parallel/pipeline_runtime.py": _PIPELINE,
    "scaletorch/parallel/pipeline_parallel.py": _PIPELINE,
    "scaletorch/parallel/tensor_parallel.py": _TENSOR,
    "scaletorch/parallel/tensor_parallel_layers.py": _TENSOR,
    "scaletorch/parallel/tensor_parallel_dtensor.py": [n for n in _TENSOR if n != "pipeline"],
    "scaletorch/parallel/flat_unit.py": _ZERO,
    "scaletorch/parallel/zero.py": _ZERO,
    "scaletorch/parallel/sharded_optimizer.py": _ZERO,
    "scaletorch/parallel/expert_parallel.py": _EXPERT,
    "scaletorch/dist/functional.py": _COLLECTIVES,
    "scaletorch/dist/all_to_all.py": _COLLECTIVES,
    "scaletorch/dist/full_state.py": _COLLECTIVES,
}
# values a core module must not hold as a string literal: chapter 08's precision names, the dry
# run's meta device
_PRECISIONS, _META = ["fp32", "bf16", "fp16", "auto"], ["meta"]
STRINGS: Dict[str, List[str]] = {
    "scaletorch/parallel/tensor_parallel.py": _PRECISIONS + _META,
    "scaletorch/parallel/tensor_parallel_layers.py": _PRECISIONS + _META,
    "scaletorch/parallel/context_parallel.py": _META,
    "scaletorch/parallel/ring_attention.py": _META,
    "scaletorch/parallel/attention_kernels.py": _META,
    "scaletorch/parallel/expert_parallel.py": _PRECISIONS + _META,
    "scaletorch/parallel/data_parallel.py": _PRECISIONS + _META,
    "scaletorch/parallel/zero.py": _PRECISIONS + _META,
    "scaletorch/parallel/flat_unit.py": _PRECISIONS + _META,
}


def words(identifier: str) -> List[str]:
    """``identifier``'s words, lower case: snake_case and CamelCase split alike."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", identifier)
    return [w.lower() for w in spaced.split("_") if w]


def contains(identifier: str, name: str) -> bool:
    """Whether ``name``'s words occur in a row among ``identifier``'s words."""
    have, want = words(identifier), words(name)
    return any(have[i:i + len(want)] == want for i in range(len(have) - len(want) + 1))


def offending(source: str, names: List[str]) -> List[Tuple[str, str, int]]:
    """(identifier, forbidden name, line) for every identifier of ``source`` that names one."""
    found = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NAME:
            found += [(token.string, name, token.start[0]) for name in names
                      if contains(token.string, name)]
    return found


def literals(source: str, values: List[str]) -> List[Tuple[str, int]]:
    """(value, line) for every plain string literal of ``source`` equal to one of ``values``
    (f-strings and docstrings are text, not values compared with)."""
    found = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.STRING and token.string[:1] in "\"'":
            value = ast.literal_eval(token.string)
            if value in values:
                found.append((value, token.start[0]))
    return found


class CoreModulesNameNoLaterChapter(unittest.TestCase):

    def test_the_matcher_reads_identifiers_by_whole_words_and_skips_comments_and_strings(self):
        source = ("x = self.meter  # meter\nparameters = 'tied'\n"
                  "class ActivationMeter: pass\ny = moe_aux_loss\n")
        self.assertEqual(offending(source, ["meter", "tied", "aux_loss"]),
                         [("meter", "meter", 1), ("ActivationMeter", "meter", 3),
                          ("moe_aux_loss", "aux_loss", 4)])

    def test_no_core_module_names_a_later_chapters_concern(self):
        for path, names in FORBIDDEN.items():
            with self.subTest(module=path):
                with open(os.path.join(ROOT, path)) as f:
                    found = offending(f.read(), names)
                self.assertEqual([], [
                    f"{path}:{line}: identifier {identifier!r} names {name!r}"
                    for identifier, name, line in found
                ])

    def test_no_core_module_holds_a_later_chapters_value(self):
        self.assertEqual(literals("x = 'meta'\ny = f'meta'\nz = \"fp32\"\n", ["meta", "fp32"]),
                         [("meta", 1), ("fp32", 3)])
        for path, values in STRINGS.items():
            with self.subTest(module=path):
                with open(os.path.join(ROOT, path)) as f:
                    found = literals(f.read(), values)
                self.assertEqual([],
                                 [f"{path}:{line}: the literal {value!r}" for value, line in found])


class APipelineRankIsNotCalledAStage(unittest.TestCase):
    """One name, one meaning (the glossary): a stage is a run of layers, a ``PipelineRank`` is
    a rank that holds one or more of them. No parameter annotated ``PipelineRank`` in the
    package, the examples or the exercises is named ``stage`` (the schedules' loops were)."""

    def test_parameters_of_type_pipeline_rank_are_not_named_stage(self):
        found = []
        for top in ("scaletorch", "examples"):
            for root, _, files in os.walk(os.path.join(ROOT, top)):
                for name in (f for f in files if f.endswith(".py")):
                    path = os.path.join(root, name)
                    with open(path) as f:
                        tree = ast.parse(f.read())
                    for node in ast.walk(tree):
                        if isinstance(node, ast.arg) and node.annotation is not None and \
                                "PipelineRank" in ast.unparse(node.annotation) and \
                                node.arg == "stage":
                            found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}")
        self.assertEqual(found, [])


if __name__ == "__main__":
    unittest.main()
