"""The grader (scripts/grade.py) on a learner's file itself, with no world started.

A file that does not compile or import is named with its line, exception and message before any
rank starts (generated: each chapter's file x a kind of break x where it is); each stub of
examples/exercises/ has the signature and the docstring of the library function it stands for,
so they cannot drift; a chapter without exercises is a user error.
"""

import ast
import contextlib
import inspect
import io
import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest

from hypothesis import given, settings
from hypothesis import strategies as st

from scripts import grade
from scripts.grading import file_check, runner
from scripts.grading.learner import load
from tests.test_planted_bugs import patched

LONG = os.environ.get("SCALETORCH_LONG_TESTS") == "1"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A broken learner's file, by kind: (what is inserted before a top-level statement, the line
# the message must name counted from it, None for a process that ends with no line to name,
# the exception and words of its message). A file that ends its process as it is imported once
# ended the grader with it: no verdict, and exit status 0 for sys.exit(0) and os._exit(0).
BROKEN = {
    "SyntaxError": ("x = = 1", 0, "SyntaxError", "invalid syntax"),
    "IndentationError": ("if True:\nx = 1", 1, "IndentationError", "expected an indented block"),
    "ImportError": ("from torch import no_such_name_here", 0, "ImportError", "no_such_name_here"),
    "NameError": ("no_such_name_here", 0, "NameError", "no_such_name_here"),
    "ValueError": ("int('seven')", 0, "ValueError", "'seven'"),
    "input": ("input()", 0, "EOFError", "EOF"),  # stdin closed: no wait for a reader
    "exit0": ("import sys\nsys.exit(0)", 1, "SystemExit", "exit code 0"),
    "exit3": ("import sys\nsys.exit(3)", 1, "SystemExit", "exit code 3"),
    "exit_text": ("raise SystemExit('x')", 0, "SystemExit", "exit code 'x'"),
    "exit_none": ("exit()", 0, "SystemExit", "exit code None"),
    "KeyboardInterrupt": ("raise KeyboardInterrupt", 0, "KeyboardInterrupt", "imported"),
    "os._exit0": ("import os\nos._exit(0)", None, "", "exit status 0"),
    "os._exit5": ("import os\nos._exit(5)", None, "", "exit status 5"),
    "SIGKILL":
    ("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", None, "", "killed by SIGKILL"),
}


def _broken_copy(d: str, chapter: str, snippet: str, where: int):
    """(a copy of ``chapter``'s exercise file in ``d`` with ``snippet`` before one of its
    top-level statements, picked by ``where``; the 1-based line the snippet starts at)."""
    _, path = grade.CHAPTERS[chapter]
    with open(os.path.join(ROOT, path)) as f:
        lines = f.read().splitlines()
    tree = ast.parse("\n".join(lines))
    starts = [
        min([n.lineno] + [x.lineno for x in getattr(n, "decorator_list", [])]) for n in tree.body
    ] + [len(lines) + 1]
    at = starts[where % len(starts)]
    broken = os.path.join(d, os.path.basename(path))
    with open(broken, "w") as f:
        f.write("\n".join(lines[:at - 1] + snippet.split("\n") + lines[at - 1:]) + "\n")
    return broken, at


def _grade_broken(chapter: str, broken: str):
    """(grade.py's exit status for ``chapter`` with ``broken`` as its exercise file, the lines
    it printed); a world that starts fails the test."""
    module, _ = grade.CHAPTERS[chapter]
    out = io.StringIO()

    def no_world(*args):
        raise AssertionError("a world started on a file that does not import")

    with patched(grade, "CHAPTERS", {**grade.CHAPTERS, chapter: (module, broken)}), \
            patched(runner, "_one_world", no_world), contextlib.redirect_stdout(out):
        status = grade.main([chapter])
    return status, out.getvalue().splitlines()


class GradeABrokenFile(unittest.TestCase):
    """Generated: a chapter's exercise file x a kind of break (a statement that does not
    compile, fails at import, exits or ends the process as it is imported) x where it is: the
    grader says the file does not compile or import, with its line, exception and message,
    before any world starts (a rank would stop on it in whichever exercise it was, and the
    exercise's verdict named another cause), and exits 1, never 0 without a verdict."""

    @settings(max_examples=200 if os.environ.get("SCALETORCH_LONG_TESTS") == "1" else 20,
              deadline=None)
    @given(chapter=st.sampled_from(sorted(grade.CHAPTERS)), kind=st.sampled_from(sorted(BROKEN)),
           where=st.integers(0, 10**6))
    def test_the_file_line_and_message_no_world(self, chapter, kind, where):
        snippet, offset, exception, words = BROKEN[kind]
        with tempfile.TemporaryDirectory() as d:
            broken, at = _broken_copy(d, chapter, snippet, where)
            status, said = _grade_broken(chapter, broken)
        self.assertEqual(status, 1, said)
        self.assertEqual(len(said), 3, said)  # the chapter's line, the file's, the verdict
        self.assertEqual(said[2], f"chapter {chapter}: not yet (fix the file first)")
        self.assertIn(words, said[1])
        if offset is None:  # the process ended: no exception, no line to name
            self.assertIn(f"does not compile or import: {broken}: the file ended the process",
                          said[1])
            return
        self.assertIn(f"does not compile or import: {broken}:{at + offset}: {exception}: ", said[1])
        self.assertIn(snippet.split("\n")[offset].strip(), said[1])  # the line itself

    def test_an_import_that_does_not_finish_is_named_at_the_limit(self):
        with tempfile.TemporaryDirectory() as d:
            broken, _ = _broken_copy(d, "01", "while True:\n    pass", 0)
            with patched(file_check, "IMPORT_LIMIT", 1.0):  # the loop spins a core till then
                status, said = _grade_broken("01", broken)
        self.assertEqual(status, 1, said)
        self.assertIn(f"{broken}: importing the file did not finish within 1 s", said[1])

    def test_a_chapter_without_a_verdict_is_not_passed(self):
        module, _ = grade.CHAPTERS["01"]
        out = io.StringIO()
        with patched(module, "grade", lambda jobs: []), \
                patched(file_check, "import_error", lambda *args: None), \
                contextlib.redirect_stdout(out):
            self.assertEqual(grade.main(["01"]), 1)
        self.assertIn("  no exercise was graded", out.getvalue().splitlines())


class StubsMatchTheLibrary(unittest.TestCase):

    def test_each_stub_has_its_library_function_signature_and_docstring(self):
        for chapter, (module, path) in grade.CHAPTERS.items():
            for exercise in module.EXERCISES:
                stub = load((os.path.join(ROOT, path), exercise))
                library = load((module.LIBRARY, exercise))
                self.assertEqual(inspect.signature(stub), inspect.signature(library), exercise)
                self.assertEqual(stub.__doc__, library.__doc__, exercise)
                with self.assertRaises(NotImplementedError):
                    stub(*[None] * len(inspect.signature(stub).parameters))

    def test_a_chapter_without_exercises_is_a_user_error(self):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.assertEqual(grade.main(["99"]), 2)
        self.assertEqual(
            err.getvalue(), "error: chapter '99' has no exercises; chapters with "
            "exercises: 01, 02, 03, 04, 05, 06, 06b, 08 (or all)\n")


if __name__ == "__main__":
    unittest.main()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_FORKS_A_SLEEPER = """
import multiprocessing, multiprocessing.forkserver, os, sys, time
from scripts.grading import job_state
job_state.adopt_orphans()
before = job_state.children()

def rank(path):  # a learner's function that forks a process of its own, in a new session
    pid = os.fork()
    if pid == 0:
        os.setsid()
        time.sleep(60)
        os._exit(0)
    with open(path, "w") as f:
        f.write(str(pid))

ctx = multiprocessing.get_context("fork")
other = ctx.Process(target=time.sleep, args=(30,))  # a rank of another world (--mutants' threads)
other.start()
server = multiprocessing.get_context("forkserver")  # --mutants forks its ranks from one
served = server.Process(target=time.sleep, args=(0,))
served.start()
served.join()
proc = ctx.Process(target=rank, args=(sys.argv[1],))
proc.start()
proc.join()
time.sleep(0.2)  # the sleeper, its rank gone, is now this process's child
print(job_state.end_orphans(before), other.is_alive(),
      os.path.exists(f"/proc/{multiprocessing.forkserver._forkserver._forkserver_pid}"))
other.kill()
"""


class GraderProcesses(unittest.TestCase):
    """No process a rank started outlives its world; Ctrl-C ends the grader in one line."""

    def test_a_process_a_rank_forked_is_ended_with_its_world(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "pid")
            out = subprocess.run([sys.executable, "-c", _FORKS_A_SLEEPER, path], cwd=ROOT,
                                 capture_output=True, text=True, timeout=60, env={
                                     **os.environ, "PYTHONPATH": ROOT
                                 })
            self.assertEqual(out.returncode, 0, out.stderr)
            with open(path) as f:
                sleeper = int(f.read())
        # the other world's rank and the forkserver live on
        self.assertEqual(out.stdout.strip(), f"[{sleeper}] True True")
        self.assertFalse(os.path.exists(f"/proc/{sleeper}"))

    @unittest.skipUnless(LONG, "long phase: a chapter's world started and stopped by Ctrl-C")
    def test_ctrl_c_ends_the_grader_in_one_line_and_its_ranks_with_it(self):
        # chapter 04's world runs 3 steps on 3 ranks, then 4 ranks: tens of seconds to stop it in
        grader = subprocess.Popen([sys.executable, "scripts/grade.py", "04", "--solution"],
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, start_new_session=True)  # its own terminal group
        ranks: set = set()
        deadline = time.monotonic() + 120
        while not ranks and time.monotonic() < deadline and grader.poll() is None:
            time.sleep(0.2)
            ranks = {p for p in _children_of(grader.pid) if "spawn_main" in _args(p)}
        self.assertTrue(ranks, "no rank started within 120 s")
        time.sleep(1.0)
        os.killpg(grader.pid, signal.SIGINT)  # what Ctrl-C sends: the grader and its ranks
        out, err = grader.communicate(timeout=60)
        self.assertEqual(grader.returncode, 130, out + err)
        self.assertNotIn("Traceback", out + err)
        self.assertEqual(err.strip().splitlines()[-1],
                         "grade: stopped by Ctrl-C; the exercises not graded yet have no verdict")
        time.sleep(0.5)
        self.assertEqual([p for p in ranks if os.path.exists(f"/proc/{p}")], [])


def _children_of(pid: int) -> list:
    found = []
    for p in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{p}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(p))
        except OSError:
            continue
    return found


def _args(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except OSError:
        return ""
