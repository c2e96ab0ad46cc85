"""Each chapter's core is on one screen, near its script, and its page shows it.

For chapters 01-06 (and 04b) ``CORES`` lists every source excerpt the chapter's page shows
(``<!-- excerpt: FILE NAME -->``, the code between ``# [core: NAME]`` and ``# [end: NAME]``)
with the calls that reach it from the script. The test holds that:

- every excerpt is at most 80 lines (one screen; doc/design.md), and its page shows it
  (scripts/check_docs.py checks that the page's copy equals the source);
- every excerpt a page of 01-06 shows is in the table, and every page shows at least one;
- each call of the path is true: the script (or the module before) names the function or
  class, and the module of that call defines it; the last call is defined in the excerpt, or
  is the class the excerpt's methods belong to;
- a core is at most two modules from its script (script -> the strategy's module -> the core);
  the communication wrapper it calls (role "wrapper") one more.

``PageOrderTest`` holds the pages to issue 41's order: the idea with a drawn diagram first, the
core's excerpt before any output, evidence, then one Limits section, the Exercises last.

    python -m tests.test_core_screen --table   # the table: chapter, core, lines, steps, path
"""

import ast
import os
import re
import sys
import unittest
from typing import Dict, List, Optional, Set, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCREEN = 80  # lines of one excerpt
STEPS = {"core": 2, "wrapper": 3}  # modules from the script to it, at most

SCRIPT = {
    "01": "examples/01_ddp.py",
    "02": "examples/02_fsdp.py",
    "03": "examples/03_tensor_parallel.py",
    "04": "examples/04_pipeline_parallel.py",
    "04b": "examples/04b_zero_bubble.py",
    "05": "examples/05_context_parallel.py",
    "06": "examples/06_expert_parallel.py",
}
PAGE = {
    "01": "doc/01_ddp.md",
    "02": "doc/02_fsdp.md",
    "03": "doc/03_tensor_parallel.md",
    "04": "doc/04_pipeline_parallel.md",
    "04b": "doc/04b_zero_bubble.md",
    "05": "doc/05_context_parallel.md",
    "06": "doc/06_expert_parallel.md",
}
P = "scaletorch/parallel/"
# (chapter, excerpt name, role, the calls from the script: [(module, "names it calls there")])
CORES: List[Tuple[str, str, str, List[Tuple[str, str]]]] = [
    ("01", "gradient-sync", "core", [(P + "data_parallel.py", "apply_data_parallel"),
                                     (P + "gradient_sync.py", "average_gradients "
                                      "launch_full_buckets wait_for_buckets")]),
    ("02", "zero3-hooks", "core", [(P + "zero.py", "apply_zero"),
                                   (P + "zero.py", "ShardedDataParallel")]),
    ("02", "zero-collectives", "core", [(P + "zero.py", "apply_zero"),
                                        (P + "zero.py", "ShardedDataParallel"),
                                        (P + "flat_unit.py", "reduce_scatter_mean gather_unit "
                                         "release_unit")]),
    ("02", "zero-step", "core", [(P + "zero.py", "ZeroAdamW"), (P + "zero.py", "ZeroOptimizer")]),
    ("03", "regions", "core", [(P + "tensor_parallel.py", "apply_tensor_parallel"),
                               (P + "tensor_parallel_layers.py", "ColumnParallelLinear "
                                "RowParallelLinear"),
                               (P + "tensor_parallel_layers.py", "enter_region exit_region")]),
    ("03", "column-forward", "core", [(P + "tensor_parallel.py", "apply_tensor_parallel"),
                                      (P + "tensor_parallel_layers.py", "ColumnParallelLinear")]),
    ("03", "row-forward", "core", [(P + "tensor_parallel.py", "apply_tensor_parallel"),
                                   (P + "tensor_parallel_layers.py", "RowParallelLinear")]),
    ("03", "f-and-f-bar", "wrapper", [(P + "tensor_parallel.py", "apply_tensor_parallel"),
                                      (P + "tensor_parallel_layers.py", "ColumnParallelLinear"),
                                      (P + "tensor_parallel_layers.py", "enter_region"),
                                      ("scaletorch/dist/functional.py", "copy_to_parallel_region"),
                                      ("scaletorch/dist/functional.py", "_CopyToParallelRegion")]),
    ("03", "cross-entropy", "core",
     [(P + "tensor_parallel.py", "tensor_parallel_loss_fn"),
      (P + "tensor_parallel_layers.py", "vocab_parallel_cross_entropy"),
      (P + "tensor_parallel_layers.py", "_VocabParallelCrossEntropy")]),
    ("04", "schedules", "core", [(P + "pipeline_schedules.py", "PipelineLoop"),
                                 (P + "pipeline_schedules.py", "afab one_f_one_b")]),
    ("04b", "plan-executor", "core", [(P + "pipeline_runtime.py", "PipelineSchedule")]),
    ("04b", "posting-order", "core", [(P + "pipeline_runtime.py", "PipelineSchedule"),
                                      ("scaletorch/schedule/simulate.py", "posting_program")]),
    ("05", "ulysses", "core", [(P + "context_parallel.py", "apply_context_parallel"),
                               (P + "context_parallel.py", "UlyssesAttention")]),
    ("05", "zigzag-positions", "core", [(P + "context_parallel.py", "apply_context_parallel"),
                                        (P + "context_parallel.py", "zigzag_positions")]),
    ("05", "zigzag", "core", [(P + "context_parallel.py", "apply_context_parallel"),
                              (P + "ring_attention.py", "RingAttention"),
                              (P + "ring_attention.py", "_RingAttention"),
                              (P + "ring_attention.py", "ring_forward"),
                              (P + "ring_attention.py", "slice_ids")]),
    ("05", "ring-step", "core", [(P + "context_parallel.py", "apply_context_parallel"),
                                 (P + "ring_attention.py", "RingAttention"),
                                 (P + "ring_attention.py", "_RingAttention"),
                                 (P + "ring_attention.py", "ring_forward")]),
    ("05", "merge", "core", [(P + "context_parallel.py", "apply_context_parallel"),
                             (P + "ring_attention.py", "RingAttention"),
                             (P + "ring_attention.py", "_RingAttention"),
                             (P + "ring_attention.py", "ring_forward"),
                             (P + "ring_attention.py", "merge")]),
    ("06", "dispatch-and-combine", "core", [(P + "expert_parallel.py", "shard_experts"),
                                            (P + "expert_parallel.py", "AllToAllDispatcher"),
                                            (P + "expert_parallel.py",
                                             "dispatch_tokens combine_tokens")]),
]
EXCERPT = re.compile(r"^<!--\s*excerpt:\s*(\S+)\s+(\S+)\s*-->\s*$", re.M)


def read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def region(path: str, name: str) -> Tuple[int, int]:
    """(first, last) line numbers (1-based) of the code between the markers of ``name``."""
    lines = read(path).splitlines()
    marks = [
        i for i, line in enumerate(lines)
        if line.strip() in (f"# [core: {name}]", f"# [end: {name}]")
    ]
    if len(marks) != 2:
        raise AssertionError(f"{path}: no markers '# [core: {name}]' ... '# [end: {name}]'")
    first, last = marks[0] + 1, marks[1] - 1  # 0-based, markers left out
    while not lines[first].strip():
        first += 1
    while not lines[last].strip():
        last -= 1
    return first + 1, last + 1


def used_names(path: str) -> Set[str]:
    """The names ``path`` uses: variables, attributes, imported names (not its definitions)."""
    out: Set[str] = set()
    for node in ast.walk(ast.parse(read(path), path)):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            out.update(a.asname or a.name for a in node.names)
    return out


def definitions(path: str) -> Dict[str, Tuple[int, int]]:
    """{name: (first line, last line)} of every function and class ``path`` defines."""
    out: Dict[str, Tuple[int, int]] = {}
    for node in ast.walk(ast.parse(read(path), path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.setdefault(node.name, (node.lineno, node.end_lineno or node.lineno))
    return out


def in_region(path: str, name: str, span: Tuple[int, int]) -> bool:
    """``name`` is defined inside ``span``, or is the class whose methods ``span`` holds."""
    where: Optional[Tuple[int, int]] = definitions(path).get(name)
    if where is None:
        return False
    inside = span[0] <= where[0] <= span[1]
    return inside or where[0] < span[0] and span[1] <= where[1]


def excerpt_file(chapter: str, name: str) -> str:
    """The source file the chapter's page shows excerpt ``name`` of."""
    for path, shown in EXCERPT.findall(read(PAGE[chapter])):
        if shown == name:
            return path
    raise AssertionError(f"{PAGE[chapter]} shows no excerpt '{name}'")


def steps(chapter: str, calls: List[Tuple[str, str]]) -> int:
    """Modules crossed from the script: each call into another module than the one before."""
    count, here = 0, SCRIPT[chapter]
    for module, _ in calls:
        count += module != here
        here = module
    return count


def functions(path: str, span: Tuple[int, int]) -> List[str]:
    """The functions and classes defined inside ``span``; a method as Class.method."""
    out: List[str] = []
    for node in ast.parse(read(path), path).body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            continue
        if span[0] <= node.lineno <= span[1]:
            out.append(node.name)
        elif isinstance(node, ast.ClassDef):
            out += [
                f"{node.name}.{item.name}" for item in node.body
                if isinstance(item, ast.FunctionDef) and span[0] <= item.lineno <= span[1]
            ]
    return out


def table() -> str:
    """The closing note's table: per chapter each core, its functions, lines and path."""
    rows = [
        "chapter | excerpt | file: lines (count) | functions | steps | calls from the script",
        "--- | --- | --- | --- | --- | ---"
    ]
    for chapter, name, role, calls in CORES:
        path = excerpt_file(chapter, name)
        first, last = region(path, name)
        path_text = " -> ".join([os.path.basename(SCRIPT[chapter])] + [
            f"{os.path.basename(module)[:-3]}.{names.split()[0]}" +
            (" ..." if len(names.split()) > 1 else "") for module, names in calls
        ])
        rows.append(f"{chapter} | {name} ({role}) | {path[len('scaletorch/'):]}: {first}-{last} "
                    f"({last - first + 1}) | {', '.join(functions(path, (first, last)))} | "
                    f"{steps(chapter, calls)} | {path_text}")
    return "\n".join(rows)


class CoreOnOneScreenTest(unittest.TestCase):

    def test_each_core_is_at_most_80_lines_and_its_page_shows_it(self) -> None:
        for chapter, name, _, _ in CORES:
            path = excerpt_file(chapter, name)
            first, last = region(path, name)
            with self.subTest(chapter=chapter, core=name):
                self.assertLessEqual(last - first + 1, SCREEN, f"{path} '{name}'")

    def test_the_table_lists_every_excerpt_of_the_pages_and_each_page_shows_one(self) -> None:
        listed = {(chapter, name) for chapter, name, _, _ in CORES}
        for chapter, page in PAGE.items():
            # the script's own loop (examples/..., issue 53) is the script, not a core below it
            shown = {(chapter, name)
                     for path, name in EXCERPT.findall(read(page))
                     if not path.startswith("examples/")}
            with self.subTest(page=page):
                self.assertTrue(shown, f"{page} shows no core excerpt")
                self.assertEqual(shown - listed, set(), f"{page}: excerpts not in CORES")

    def test_each_call_on_the_path_is_real_and_the_last_is_the_core(self) -> None:
        for chapter, name, _, calls in CORES:
            caller = SCRIPT[chapter]
            for module, names in calls:
                used, defined = used_names(caller), definitions(module)
                for called in names.split():
                    with self.subTest(chapter=chapter, core=name, call=called):
                        self.assertIn(called, used, f"{caller} does not call {called}")
                        self.assertIn(called, defined, f"{module} does not define {called}")
                caller = module
            path = excerpt_file(chapter, name)
            span = region(path, name)
            last_module, last_names = calls[-1]
            with self.subTest(chapter=chapter, core=name):
                self.assertEqual(last_module, path)
                for called in last_names.split():
                    self.assertTrue(in_region(path, called, span),
                                    f"{called} is not in {path}'s excerpt '{name}'")

    def test_a_core_is_at_most_two_modules_from_its_script(self) -> None:
        for chapter, name, role, calls in CORES:
            with self.subTest(chapter=chapter, core=name):
                self.assertLessEqual(steps(chapter, calls), STEPS[role])

    def test_a_call_the_caller_never_makes_is_caught(self) -> None:
        """The rule can fail: chapter 02's script does not call gather_unit itself, and
        FlatUnit (a class of flat_unit.py) is not in the collectives' excerpt."""
        self.assertNotIn("gather_unit", used_names(SCRIPT["02"]))
        span = region(P + "flat_unit.py", "zero-collectives")
        self.assertFalse(in_region(P + "flat_unit.py", "FlatUnit", span))
        self.assertTrue(in_region(P + "flat_unit.py", "gather_unit", span))


def sections(page: str) -> List[Tuple[str, int]]:
    """The page's "## " headings outside fences, with their line numbers."""
    out, fenced = [], False
    for i, line in enumerate(read(page).splitlines()):
        fenced = fenced != line.startswith("```")
        if not fenced and line.startswith("## "):
            out.append((line[3:], i))
    return out


def first_line(page: str, prefix: str) -> int:
    """The first line of ``page`` that starts with ``prefix`` (-1: none)."""
    return next((i for i, line in enumerate(read(page).splitlines()) if line.startswith(prefix)),
                -1)


# Pages whose sections between the idea and the core still name a source file (issue 41, item
# 5): none now. doc/06's single-device layer is a subsection of its idea.
CODE_BEFORE_CORE: Set[str] = set()


class PageOrderTest(unittest.TestCase):
    """Issue 41's order: the problem, the idea (a drawn diagram), the core from the source, run
    it, what it prints, evidence, limits; a chapter's exercises last."""

    def test_each_page_explains_before_it_measures_and_ends_with_limits_then_exercises(
            self) -> None:
        for chapter, page in PAGE.items():
            heads = sections(page)
            names = [name for name, _ in heads]
            excerpt = first_line(page, "<!-- excerpt:")
            limits = [k for k, name in enumerate(names) if "imits" in name]
            evidence = [k for k, name in enumerate(names) if name.startswith("Evidence")]
            with self.subTest(page=page):
                self.assertGreater(excerpt, heads[0][1], f"{page}: no core excerpt after the idea")
                core = max(k for k, (_, line) in enumerate(heads) if line < excerpt)
                self.assertTrue(names[0].startswith("The idea"), names[0])
                self.assertTrue(
                    read(page).split("## ", 2)[1].count("```\n") >= 2,
                    f"{page}: the idea has no drawn diagram (a plain fence)")
                self.assertLess(excerpt, first_line(page, "```text"), "output before the core")
                self.assertEqual(len(limits), 1, f"{page}: one Limits section")
                self.assertTrue(evidence and max(evidence) < limits[0], "evidence, then limits")
                self.assertEqual(names[limits[0] + 1:], ["Exercises"][:len(names) - limits[0] - 1])
                self.assertEqual(names[-1] if "Exercises" in names else "Exercises", "Exercises")
                if chapter not in CODE_BEFORE_CORE:
                    self.assertEqual([n for n in names[1:core] if ".py" in n], [],
                                     f"{page}: code before the core")


if __name__ == "__main__":
    if "--table" in sys.argv:
        print(table())
    else:
        unittest.main()
