"""A chapter's core names no later chapter's concern: later chapters attach from outside.

``FORBIDDEN`` maps each core module to the identifiers it must not contain: names of a later
chapter's concern (a variable, argument, attribute, function, class or import). Only code is
read, with ``ast``: a comment or a docstring may say where a later chapter attaches.
"""

import ast
import os
import unittest
from typing import Dict, Iterator, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Chapter 08's compute dtype attaches to tensor parallel from mixed_precision.py (a subclass of
# the norm and of the embedding, swapped in by ``tensor_parallel_wire_in_compute``).
COMPUTE_DTYPE = [
    "compute_dtype", "to_compute", "_to_compute", "autocast", "is_autocast_enabled",
    "get_autocast_dtype", "autocast_dtype", "wire_dtype", "bfloat16", "float16", "mixed_precision"
]
FORBIDDEN: Dict[str, List[str]] = {
    "scaletorch/parallel/tensor_parallel.py": COMPUTE_DTYPE,
    "scaletorch/parallel/tensor_parallel_layers.py": COMPUTE_DTYPE,
}


def identifiers(tree: ast.AST) -> Iterator[Tuple[str, int]]:
    """(name, line) of every identifier the code uses or defines."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.id, node.lineno
        elif isinstance(node, ast.Attribute):
            yield node.attr, node.lineno
        elif isinstance(node, ast.arg):
            yield node.arg, node.lineno
        elif isinstance(node, ast.keyword) and node.arg is not None:
            yield node.arg, node.lineno
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.name, node.lineno
        elif isinstance(node, ast.alias):
            for part in node.name.split("."):
                yield part, node.lineno
            if node.asname:
                yield node.asname, node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module:
            for part in node.module.split("."):
                yield part, node.lineno


def violations(source: str, path: str, names: List[str]) -> List[str]:
    """One "path:line: name" per forbidden identifier in ``source``, in line order."""
    banned = set(names)
    found = {(line, name) for name, line in identifiers(ast.parse(source)) if name in banned}
    return [f"{path}:{line}: {name}" for line, name in sorted(found)]


class CoreNamesTest(unittest.TestCase):

    def test_core_modules_name_no_later_chapter(self) -> None:
        for path, names in FORBIDDEN.items():
            with self.subTest(module=path), open(os.path.join(ROOT, path)) as f:
                found = violations(f.read(), path, names)
                self.assertEqual(found, [],
                                 f"{path} names a later chapter's concern: " + "; ".join(found))

    def test_a_planted_name_is_caught_with_its_line_but_not_in_a_docstring(self) -> None:
        source = ('"""compute_dtype in a docstring is prose."""\n'
                  "# compute_dtype in a comment too\n"
                  "def f(x, compute_dtype=None):\n"
                  "    return x.to(compute_dtype)\n")
        self.assertEqual(violations(source, "m.py", ["compute_dtype"]),
                         ["m.py:3: compute_dtype", "m.py:4: compute_dtype"])
        self.assertEqual(violations("from torch import autocast\n", "m.py", ["autocast"]),
                         ["m.py:1: autocast"])


if __name__ == "__main__":
    unittest.main()
