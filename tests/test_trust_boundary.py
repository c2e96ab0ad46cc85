"""No code runs from a file: the code of scaletorch/, scripts/ and examples/, read as syntax.

A reader that can execute what a file holds (pickle's, torch.load without weights_only=True,
YAML's full or unsafe loaders, np.load with allow_pickle=True, marshal, shelve, eval or exec)
appears nowhere but in ALLOWED, each with the reason it reads no file a user hands us, or
reads it with an allow-list. Every other file is read through scaletorch/rules/boundary.py.
"""

import ast
import os
import unittest
from typing import List, Tuple

from tests.test_layering import ROOT, python_files

# (file, call): why it may stay. Nothing else may call a reader that could run code.
ALLOWED = {
    ("scaletorch/dist/spawn.py", "torch.load(weights_only=False)"):
    "bytes the test harness's parent process pickled in memory for its own ranks (the "
    "function's arguments and results), passed through a pipe: never a file",
    ("scaletorch/dist/flight_recorder.py", "pickle.loads"):
    "the bytes torch's C++ returns in this process (_dump_fr_trace); its JSON dump has no "
    "stacks. The dump is written as JSON, and a pickle dump is refused unread",
    ("scaletorch/trainer/dcp_pieces.py", "pickle.Unpickler"):
    "DCP's .metadata, with find_class restricted to DCP's own dataclasses and torch dtypes "
    "(_MetadataUnpickler): the one documented allow-list unpickler",
}

CODE_READERS = {
    "pickle.load", "pickle.loads", "pickle.Unpickler", "_pickle.load", "_pickle.loads",
    "cPickle.load", "cPickle.loads", "dill.load", "dill.loads", "cloudpickle.load",
    "cloudpickle.loads", "joblib.load", "marshal.load", "marshal.loads", "shelve.open", "yaml.load",
    "yaml.load_all", "yaml.unsafe_load", "yaml.unsafe_load_all", "yaml.full_load",
    "yaml.full_load_all", "yaml.Loader", "yaml.UnsafeLoader", "yaml.FullLoader", "yaml.CLoader",
    "yaml.UnsafeLoader", "eval", "exec", "compile", "pandas.read_pickle", "pd.read_pickle",
    "torch.serialization.load", "np.lib.format.read_array"
}


def dotted(node: ast.AST) -> str:
    """``a.b.c`` of a Name or Attribute chain, "" for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def keyword_is(call: ast.Call, name: str, value: object) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value == value
               for k in call.keywords)


def code_readers(source: str, path: str) -> List[Tuple[int, str]]:
    """(line, what) of every use of a reader that could run code in ``source``."""
    found = []
    aliases = {}  # "from pickle import load as l" -> {"l": "pickle.load"}
    tree = ast.parse(source, path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.Attribute)):
            name = dotted(node)
            head, _, rest = name.partition(".")
            name = aliases.get(head, head) + (f".{rest}" if rest else "")
            name = name.replace("numpy.", "np.")
            if name in CODE_READERS and not (name in ("eval", "exec", "compile")
                                             and not _called(tree, node)):
                found.append((node.lineno, name))
        if isinstance(node, ast.Call):
            name = dotted(node.func)
            head, _, rest = name.partition(".")
            name = aliases.get(head, head) + (f".{rest}" if rest else "")
            if name == "torch.load" and not keyword_is(node, "weights_only", True):
                found.append((node.lineno, "torch.load(weights_only=False)" if keyword_is(
                    node, "weights_only", False) else "torch.load without weights_only=True"))
            if name in ("np.load", "numpy.load") and not keyword_is(node, "allow_pickle", False) \
                    and any(k.arg == "allow_pickle" for k in node.keywords):
                found.append((node.lineno, "np.load(allow_pickle=True)"))
    return found


def _called(tree: ast.AST, name_node: ast.AST) -> bool:
    """Whether ``name_node`` is the function of a call (``eval(...)``, not ``model.eval``)."""
    return any(isinstance(n, ast.Call) and n.func is name_node for n in ast.walk(tree))


def scan() -> List[str]:
    offenders = []
    for path in python_files("scaletorch", "scripts", "examples"):
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        with open(path, encoding="utf-8") as f:
            for line, what in code_readers(f.read(), path):
                if (rel, what) not in ALLOWED:
                    offenders.append(f"{rel}:{line} {what}")
    return offenders


class NoReaderRunsCodeFromAFile(unittest.TestCase):

    def test_no_reader_that_could_run_code_outside_the_allow_list(self):
        self.assertGreater(len(python_files("scaletorch", "scripts", "examples")), 150)
        self.assertEqual(scan(), [], "read files through scaletorch/rules/boundary.py")

    def test_each_allowed_use_is_still_there(self):
        # an entry whose code went away must leave the list, so the list stays the truth
        found = set()
        for rel, _ in ALLOWED:
            with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
                found.update((rel, what) for _, what in code_readers(f.read(), rel))
        self.assertEqual(set(ALLOWED) - found, set())

    def test_the_scan_finds_planted_readers(self):
        planted = """
import pickle, yaml, marshal, shelve
import numpy as np
from pickle import loads as undo
import torch
pickle.load(open("f", "rb"))
undo(b"")
torch.load("f")
torch.load("f", weights_only=False)
torch.load("f", weights_only=True)  # fine
yaml.load("a", Loader=yaml.FullLoader)
yaml.safe_load("a")  # fine
np.load("f", allow_pickle=True)
np.load("f")  # fine
marshal.loads(b"")
shelve.open("f")
eval(open("f").read())
model.eval()  # fine
class U(pickle.Unpickler): pass
"""
        found = [what for _, what in code_readers(planted, "planted.py")]
        self.assertEqual(
            sorted(found),
            sorted([
                "pickle.load", "pickle.loads", "torch.load without weights_only=True",
                "torch.load(weights_only=False)", "yaml.load", "yaml.FullLoader",
                "np.load(allow_pickle=True)", "marshal.loads", "shelve.open", "eval",
                "pickle.Unpickler"
            ]))


if __name__ == "__main__":
    unittest.main()
