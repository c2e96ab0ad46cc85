"""``--impl`` means one thing everywhere: the glossary's table lists the values each chapter
accepts, and each script's own checks (``--validate-only``, in this process, no ranks) accept
exactly those and refuse the others with one ``error:`` line."""

import contextlib
import functools
import importlib.util
import io
import os
import re
import sys
import tempfile
import unittest
from typing import Any, Dict, List, Tuple

from scripts import doc_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPLS = ("naive", "ours", "torch")  # config.py's one_of for parallel.impl
# the smallest world each script runs at, and what it needs beside it
LAYOUT: Dict[str, Tuple[int, List[str]]] = {
    "07_nd_parallel": (4, ["--tp", "2", "--pp", "2"]),
    "00_single_device": (1, []),
    "10_real_model": (1, []),
    "08_mixed_precision": (2, ["--zero-stage", "0"]),  # naive is data parallel, not ZeRO
}


@functools.lru_cache(maxsize=None)
def example(script: str) -> Any:
    """The module of examples/SCRIPT.py, loaded once (its main() is not run)."""
    spec = importlib.util.spec_from_file_location(f"example_{script}",
                                                  os.path.join(ROOT, "examples", f"{script}.py"))
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def exit_status(script: str, impl: str, run_dir: str) -> Tuple[int, str]:
    """The script's ``main()`` with ``--impl impl --validate-only``: (exit status, stderr)."""
    world, extra = LAYOUT.get(script, (2, []))
    module = example(script)
    argv = [
        f"examples/{script}.py", "--impl", impl, *extra, "--validate-only", "--world-size",
        str(world), "--logging.run_dir", run_dir
    ]
    err, old = io.StringIO(), sys.argv
    sys.argv = argv
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            status = module.main()
    except SystemExit as stop:
        status = stop.code
    finally:
        sys.argv = old
    return int(status or 0), err.getvalue()


class EachChapterAcceptsTheImplValuesItsTableLists(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.table = doc_names.impl_table()
        cls.cwd = os.getcwd()
        os.chdir(ROOT)  # the scripts name their default configs from the root
        cls.results: Dict[Tuple[str, str], Tuple[int, str]] = {}
        with tempfile.TemporaryDirectory() as run_dir:
            for script in cls.table:
                for impl in IMPLS:
                    cls.results[script, impl] = exit_status(script, impl, run_dir)

    @classmethod
    def tearDownClass(cls):
        os.chdir(cls.cwd)

    def test_the_table_lists_every_numbered_script(self):
        scripts = {
            f[:-3]
            for f in os.listdir(os.path.join(ROOT, "examples"))
            if re.match(r"^\d\d[a-z]?_\w+\.py$", f)
        }
        self.assertEqual(set(self.table), scripts)

    def test_each_script_accepts_exactly_its_values_and_refuses_the_rest_in_one_line(self):
        for (script, impl), (status, stderr) in sorted(self.results.items()):
            with self.subTest(script=script, impl=impl):
                if impl in self.table[script]:
                    self.assertEqual(status, 0, stderr)
                else:
                    self.assertEqual(status, 2, f"{script} accepted --impl {impl}")
                    self.assertEqual(len(stderr.strip().splitlines()), 1, stderr)
                    self.assertTrue(stderr.startswith("error: "), stderr)
                    # the line names the value it refuses (04's once spoke of cp and ep only)
                    self.assertRegex(stderr, rf"impl '?{impl}'?\b")


if __name__ == "__main__":
    unittest.main()
