"""The package layering, read from the code: no import cycle, no upward import, a torch-free
planner. Every import statement counts, wherever it sits (top level, inside a function, under
TYPE_CHECKING): a function-level import that dodges a cycle at run time is still a cycle for a
reader, who must open both files to follow either.

The layers, lowest first (doc/design.md draws the same map):

    rules, schedule    pure Python: shared rules of the runtime and the planner (no torch)
    dist, models, data torch building blocks
    plan               the planner (no torch)
    config             the run's configuration dataclasses
    parallel           the strategies
    trainer            the training loop, checkpoints, the parity check
    scripts, examples  on top
"""

import ast
import os
import unittest
from typing import Dict, List, Set

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# package -> the scaletorch packages it may import (itself always allowed)
ALLOWED = {
    "scaletorch.rules": set(),
    "scaletorch.schedule": {"scaletorch.rules"},
    "scaletorch.dist": {"scaletorch.rules", "scaletorch.schedule"},
    "scaletorch.models": {"scaletorch.rules", "scaletorch.dist"},
    "scaletorch.data": {"scaletorch.rules"},
    "scaletorch.plan": {"scaletorch.rules", "scaletorch.schedule"},
    "scaletorch.config": {"scaletorch.rules", "scaletorch.models", "scaletorch.data"},
}
BELOW_PARALLEL = set(ALLOWED) | {"scaletorch.config"}
ALLOWED["scaletorch.parallel"] = BELOW_PARALLEL
ALLOWED["scaletorch.trainer"] = BELOW_PARALLEL | {"scaletorch.parallel"}
TORCH_FREE = ("scaletorch.rules", "scaletorch.schedule", "scaletorch.plan")


def python_files(*folders: str) -> List[str]:
    out = []
    for folder in folders:
        for d, _, names in os.walk(os.path.join(ROOT, folder)):
            out += [os.path.join(d, n) for n in sorted(names) if n.endswith(".py")]
    return out


def module_of(path: str) -> str:
    name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return name[:-len(".__init__")] if name.endswith(".__init__") else name


def imported_names(path: str) -> Set[str]:
    """Every module an import statement in ``path`` names: ``from a import b`` names a.b where b
    is a module, else a (the package whose ``__init__`` defines b)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    names: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                names.add(sub if is_module(sub) else node.module)
    return names


def is_module(name: str) -> bool:
    base = os.path.join(ROOT, *name.split("."))
    return os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py"))


def package_of(module: str) -> str:
    """scaletorch.parallel.zero -> scaletorch.parallel; scaletorch.config -> itself."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "scaletorch" else parts[0]


def import_graph() -> Dict[str, Set[str]]:
    """{module: the project modules it imports}, over scaletorch/ and scripts/."""
    files = {module_of(p): p for p in python_files("scaletorch", "scripts")}
    graph: Dict[str, Set[str]] = {}
    for module, path in files.items():
        graph[module] = {n for n in imported_names(path) if n in files and n != module}
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


class LayeringTest(unittest.TestCase):

    def test_no_import_cycle_between_modules_or_packages(self) -> None:
        graph = import_graph()
        self.assertGreater(len(graph), 60)  # every module was read
        self.assertEqual(cycles(graph), [], "modules that import each other")
        packages: Dict[str, Set[str]] = {}
        for module, targets in graph.items():
            src = package_of(module)
            packages.setdefault(src, set()).update(package_of(t) for t in targets)
        for src in packages:
            packages[src].discard(src)
        self.assertEqual(cycles(packages), [], "packages that import each other")

    def test_no_upward_import(self) -> None:
        upward = []
        checked = 0
        for module, targets in import_graph().items():
            src = package_of(module)
            if src not in ALLOWED:
                continue  # scripts sit on top and may import anything
            for target in targets:
                dst = package_of(target)
                checked += 1
                if dst != src and dst not in ALLOWED[src]:
                    upward.append(f"{module} imports {target}")
        self.assertGreater(checked, 100)
        self.assertEqual(upward, [])

    def test_rules_schedule_and_planner_import_no_torch(self) -> None:
        offenders = []
        files = 0
        for path in python_files("scaletorch"):
            if module_of(path).startswith(TORCH_FREE):
                files += 1
                heavy = {n for n in imported_names(path) if n.split(".")[0] in ("torch", "numpy")}
                offenders += [f"{module_of(path)} imports {n}" for n in sorted(heavy)]
        self.assertGreater(files, 8)
        self.assertEqual(offenders, [])

    def test_cycle_finder_finds_a_planted_cycle(self) -> None:
        graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
        self.assertEqual(cycles(graph), [["a", "b", "c"]])
        self.assertEqual(cycles({"a": {"b"}, "b": set()}), [])


if __name__ == "__main__":
    unittest.main()
