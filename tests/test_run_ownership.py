"""A run directory belongs to one run (scaletorch/trainer/run_dir.py, doc/bad_inputs.md).

A live run's lock refuses a second run of its name, naming the holder; two runs started at
once leave every step once; --overwrite moves only a run's directory; --name is one path
component under logging.run_dir, for every kind of path string (hypothesis); a resume moves
the metrics lines after its step aside.
"""

import fcntl
import json
import os
import signal
import stat
import tempfile
import unicodedata
import unittest
from concurrent.futures import ThreadPoolExecutor

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from scaletorch.rules.errors import InputError
from scaletorch.rules.schema import path_component
from scaletorch.trainer.config import parse_args
from scaletorch.trainer.run_dir import MARKER, hold, keep_metrics_to, release
from tests.harness import run_forked
from tests.test_bad_inputs import run_in_process
from tests.test_examples import ROOT
from tests.test_run_dirs import C00, metrics_lines

LONG = os.environ.get("SCALETORCH_LONG_TESTS") == "1"
EXAMPLES = 2000 if LONG else 25
HOLDER = {"pid": 4242, "host": "elsewhere", "started": "2026-01-02 03:04:05 UTC"}
IN_USE = ("is in use by another run (pid 4242 on host elsewhere, started 2026-01-02 03:04:05 "
          "UTC); nothing was written: wait for it to end, or give another --name")


def held_by_another_run(run: str) -> int:
    """Make ``run`` a directory a live run holds: its marker, locked on a descriptor of its
    own (flock locks one open file, so this process's own checks see it held). Returns it."""
    os.makedirs(run, exist_ok=True)
    fd = os.open(os.path.join(run, MARKER), os.O_RDWR | os.O_CREAT)
    os.write(fd, json.dumps(HOLDER).encode())
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


class ALiveRunsDirectoryIsRefusedNamingItsHolder(unittest.TestCase):
    """In this process, through the pre-flight's road (``--validate-only``)."""

    def test_held_refused_with_resume_and_overwrite_too_then_free_once_it_ends(self):
        with tempfile.TemporaryDirectory() as tmp:
            run = os.path.join(tmp, "00_single_device")
            fd = held_by_another_run(run)
            for extra in ([], ["--resume"], ["--overwrite"]):
                with self.subTest(extra=extra):
                    code, out = run_in_process(C00, ["--logging.run_dir", tmp, *extra])
                    self.assertEqual((code, out),
                                     (2, f"error: logging.run_dir: {run!r} {IN_USE}\n"))
            os.close(fd)  # the run ended: its lock went with it, the marker stays
            self.assertEqual(run_in_process(C00, ["--logging.run_dir", tmp]), (0, ""))

    def test_overwrite_moves_only_a_directory_a_run_made(self):
        with tempfile.TemporaryDirectory() as tmp:
            mine = os.path.join(tmp, "mine")
            os.makedirs(mine)
            open(os.path.join(mine, "notes.txt"), "w").close()
            code, out = run_in_process(C00,
                                       ["--logging.run_dir", tmp, "--name", "mine", "--overwrite"])
            self.assertEqual(code, 2, out)
            self.assertEqual(
                out, f"error: logging.run_dir: {mine!r} was not made by a run (it "
                f"has no {MARKER}): --overwrite moves aside only a run's directory; "
                f"give another --name, or move it yourself\n")
            self.assertEqual(os.listdir(mine), ["notes.txt"])  # untouched


class TwoRunsStartedAtOnceWriteEveryStepOnce(unittest.TestCase):

    def test_one_runs_the_other_is_refused_in_one_line(self):
        with tempfile.TemporaryDirectory() as tmp:
            args = [C00, "--steps", "6", "--logging.progress", "false", "--logging.run_dir", tmp]
            env = {**os.environ, "PYTHONPATH": ROOT}

            def run(_: int) -> tuple:
                # `python C00 ...`: a process of its own, forked from the suite's forkserver
                proc = run_forked(*args, env=env, timeout=300)
                return proc.returncode, proc.stdout, proc.stderr

            with ThreadPoolExecutor(max_workers=2) as pool:  # both started at once
                done = list(pool.map(run, range(2)))
            codes = sorted(code for code, _, _ in done)
            self.assertEqual(codes, [0, 2], done)
            refused = next(err for code, _, err in done if code == 2)
            self.assertEqual(len(refused.splitlines()), 1, refused)
            # started at once, the second meets the first's lock, named or taken a moment before
            # its owner wrote who it is (run_dir.py; once in a full suite), or, had the first
            # already ended, its finished run: never both writing
            self.assertRegex(
                refused, r"^error: logging.run_dir: '.*' (is in use by another run \((pid \d+ on "
                r"host .+, started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC|a process that has not "
                r"yet said who it is)\)|already holds a run)")
            steps = [m["step"] for m in metrics_lines(os.path.join(tmp, "00_single_device"))]
            self.assertEqual(steps, [1, 2, 3, 4, 5, 6])


BREAKING = ("Cc", "Cf", "Cs", "Zl", "Zp")  # control, format, surrogate, line/paragraph breaks
# every kind of path string: separators, dots, absolute paths, control characters, unicode,
# long ones, YAML-looking text
PATHLIKE = st.one_of(
    st.sampled_from([
        ".", "..", "/", "/abs", "../x", "a/../b", "./a", "a/", "~", "~root", "a\\b", "C:\\x",
        "\x00", "a\nb", "-x", "[", "null", "..a", "a..", " ", "x" * 100, "x" * 101, "é" * 50, "*x",
        "a: b", "日" * 85, "日" * 86, "é" * 100, "a\x85b", "\u200b", "a\u2028", "\u2029", "\ud800",
        "\ufeffa", "-", "--", "123", "true", "a\x1fb"
    ]),
    st.text(alphabet=st.sampled_from("./\\~-_ aZ0\x00\n\t\x7fé:*\x85\u2028\u200b日"), min_size=0,
            max_size=8),
    st.text(min_size=0, max_size=130),
)


class RunNamesAreOnePathComponent(unittest.TestCase):
    """Any --name: one line ``error:`` and exit 2, or accepted as a directory directly under
    logging.run_dir (never outside it, never run_dir itself)."""

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(name=PATHLIKE)
    def test_a_name_is_refused_in_one_line_or_a_child_of_run_dir(self, name):
        with tempfile.TemporaryDirectory() as tmp:
            code, out = run_in_process(C00, ["--logging.run_dir", tmp, f"--name={name}"])
            if code == 0:
                self.assertEqual(out, "")
                where = os.path.normpath(os.path.join(tmp, name))
                self.assertEqual(os.path.dirname(where), tmp, name)
                self.assertNotIn(name, ("", ".", ".."))
                self.assertLessEqual(len(name), 100)
                self.assertLessEqual(len(name.encode("utf-8")), 255)  # a file name's bytes
                self.assertFalse([c for c in name if unicodedata.category(c) in BREAKING], name)
            else:
                self.assertEqual(code, 2, out)
                self.assertEqual(len(out.splitlines()), 1, out)
                self.assertTrue(out.startswith("error: "), out)
            self.assertEqual(os.listdir(tmp), [])  # the pre-flight writes nothing

    @settings(max_examples=EXAMPLES, deadline=None)
    @given(name=st.text(min_size=1, max_size=40))
    @example(name="123")
    @example(name="-")
    @example(name="--")
    @example(name="true")
    @example(name="[1, 2]")
    @example(name="null")
    def test_a_name_on_the_command_line_is_the_text_typed(self, name):
        """"--name 123" is the name "123", "--name -" the name "-": never what YAML reads. A
        name the rule admits lands as typed; any other is refused in one line."""
        if not path_component().admits(name):
            with self.assertRaises(ValueError) as refused:  # InputError is one
                parse_args([f"--name={name}"])
            self.assertNotIn("\n", str(refused.exception))
            return
        self.assertEqual(parse_args([f"--name={name}"]).logging.name, name)

    def test_a_directory_that_cannot_be_made_is_one_line(self):
        """``hold`` turns the OS's refusal (here ENAMETOOLONG) into an InputError."""
        with tempfile.TemporaryDirectory() as tmp:
            with self.assertRaises(InputError) as refused:
                hold("logging.run_dir", os.path.join(tmp, "x" * 300))
            self.assertIn("File name too long", str(refused.exception))
            self.assertEqual(os.listdir(tmp), [])
        release()


class AResumeKeepsEachStepOnceInTheMetrics(unittest.TestCase):

    def test_lines_after_the_resumed_step_move_to_a_side_file(self):
        with tempfile.TemporaryDirectory() as run:
            lines = [json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 7)]
            with open(os.path.join(run, "metrics.jsonl"), "w") as f:
                f.write("".join(lines) + '{"step": 7, "lo')  # half a line, from a kill
            said = keep_metrics_to(run, 4)
            side = os.path.join(run, "metrics.after-step-4.jsonl")
            self.assertEqual(
                said, f"resumed at step 4: 3 line(s) of metrics.jsonl after it "
                f"moved to {side}")
            with open(os.path.join(run, "metrics.jsonl")) as f:
                self.assertEqual(f.read(), "".join(lines[:4]))
            with open(side) as f:
                self.assertEqual(f.read(), "".join(lines[4:]) + '{"step": 7, "lo')
            self.assertIsNone(keep_metrics_to(run, 4))  # nothing after it now: nothing moves
            with open(os.path.join(run, "metrics.jsonl"), "a") as f:
                f.write(lines[4])
            keep_metrics_to(run, 4)  # a second resume at 4: a side file of its own
            self.assertTrue(os.path.exists(os.path.join(run, "metrics.after-step-4-2.jsonl")))

    @settings(max_examples=200 if os.environ.get("SCALETORCH_LONG_TESTS") == "1" else 15,
              deadline=None)
    @given(bad=st.one_of(
        st.sampled_from([
            "1e400", "-1e400", "Infinity", "-Infinity", "NaN", "true", "false", "null", '"2"',
            "[1, 2]", "{}", "2.9", "2.0", "-1", "1" * 5000
        ]),
        st.floats(allow_nan=False, allow_infinity=False).map(repr),  # 2.0 too: no int
        st.integers(max_value=-1).map(str)))
    def test_a_line_whose_step_is_no_step_moves_aside(self, bad):
        """Generated: a step that is no non-negative int (infinite, NaN, a float, a bool, a
        string, a list, negative, 5000 digits) moves aside as half a line does; never an
        OverflowError or ValueError traceback, never kept as the step it rounds to."""
        with tempfile.TemporaryDirectory() as run:
            good = "".join(json.dumps({"step": s}) + "\n" for s in (1, 2))
            with open(os.path.join(run, "metrics.jsonl"), "w") as f:
                f.write(good + f'{{"step": {bad}}}\n')
            said = keep_metrics_to(run, 4)
            self.assertIn("1 line(s)", said)
            with open(os.path.join(run, "metrics.jsonl")) as f:
                self.assertEqual(f.read(), good)


if __name__ == "__main__":
    unittest.main()

FILE_KINDS = ("directory", "fifo", "symlink")
RUN_FILES = ("metrics.jsonl", "log.txt", "config.yaml", MARKER)


def _plant(path: str, kind: str) -> None:
    """Put something that is not a regular file at ``path``: a directory, a FIFO (whose plain
    open would block for ever) or a symlink to a file elsewhere."""
    if kind == "directory":
        os.makedirs(path)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        target = path + ".elsewhere"
        open(target, "w").close()
        os.symlink(target, path)


class FilesInARunDirectoryMustBeRegularFiles(unittest.TestCase):
    """Every file a run opens in its directory (metrics.jsonl, log.txt, config.yaml, the
    marker), replaced by a directory, a FIFO or a symlink, new run or --resume: one line naming
    that file, exit 2, no hang (an alarm would fire), nothing written. Generated pairs."""

    @settings(max_examples=24 if not LONG else 200, deadline=None)
    @given(name=st.sampled_from(RUN_FILES), kind=st.sampled_from(FILE_KINDS), resume=st.booleans())
    def test_each_file_of_each_kind_is_one_line_naming_it(self, name, kind, resume):
        with tempfile.TemporaryDirectory() as tmp:
            run = os.path.join(tmp, "r")
            os.makedirs(run)
            _plant(os.path.join(run, name), kind)
            before = sorted(os.listdir(run))
            signal.alarm(20)  # a FIFO opened without O_NONBLOCK would hang here
            try:
                code, out = run_in_process(C00, ["--logging.run_dir", tmp, "--name", "r"] +
                                           (["--resume"] if resume else []))
            finally:
                signal.alarm(0)
            self.assertEqual(code, 2, out)
            self.assertEqual(len(out.splitlines()), 1, out)
            self.assertTrue(out.startswith("error: "), out)
            self.assertIn(os.path.join(run, name), out)
            self.assertIn("not a regular file", out)
            self.assertEqual(sorted(os.listdir(run)), before)


class WhatStandsWhereARunDirectoryGoesIsNamed(unittest.TestCase):
    """A file, FIFO, socket or device where the run directory or checkpoint.dir goes, or above
    it: one line naming it as what it is, and the option that fits. Generated; 12 cases."""

    KINDS = {"file": stat.S_IFREG, "fifo": stat.S_IFIFO, "socket": stat.S_IFSOCK, "device": 0}
    ADVICE = {"run": "another --name", "ck": "another --checkpoint.dir", "up": "--logging.run_dir"}

    @settings(max_examples=12 if not LONG else 100, deadline=None)
    @given(kind=st.sampled_from(sorted(KINDS)), where=st.sampled_from(sorted(ADVICE)))
    def test_named_as_what_it_is(self, kind, where):
        with tempfile.TemporaryDirectory() as tmp:
            spot = os.path.join(tmp, "x")
            (os.symlink(os.devnull, spot) if kind == "device" else  # a symlink to a device
             os.mknod(spot, 0o600 | self.KINDS[kind]))
            by = {"run": ["--name", "x"], "ck": ["--checkpoint.dir", spot, "--checkpoint.every=1"]}
            argv = ["--logging.run_dir", os.path.join(spot, "runs") if where == "up" else tmp]
            code, out = run_in_process(C00, argv + by.get(where, []))
            self.assertEqual((code, len(out.splitlines())), (2, 1), out)
            says = {"fifo": "FIFO", "device": "character device"}.get(kind, kind)
            link = kind == "device" and where != "up"  # the directory itself: "a symlink"
            self.assertIn(f"'{spot}' is a {'symlink' if link else says}", out)
            self.assertIn(self.ADVICE[where], out)
            self.assertEqual(os.listdir(tmp), ["x"])


class AdviceIsBuiltFromWhatWasFound(unittest.TestCase):
    """The refusal of an occupied or held directory offers only ways on that work there:
    --overwrite only for a directory a run made (its marker), and the option that names
    another directory of that kind (--name for a run directory, --checkpoint.dir for a shared
    checkpoint directory), and for a shared one only when its marker names this run.
    Generated: marker or not, whose, which directory, held or not."""

    @settings(max_examples=20 if not LONG else 200, deadline=None)
    @given(marked=st.booleans(), shared=st.booleans(), live=st.booleans(), overwrite=st.booleans(),
           ours=st.booleans())
    def test_the_advice_holds_for_the_directory_found(self, marked, shared, live, overwrite, ours):
        with tempfile.TemporaryDirectory() as tmp:
            target = os.path.join(tmp, "ckpt" if shared else "r")
            os.makedirs(target)
            open(os.path.join(target, "step_0000001" if shared else "notes.txt"), "w").close()
            fd = held_by_another_run(target) if live and marked else None
            if marked and fd is None:  # a finished run's: this one's (same name) or another's
                run = os.path.realpath(os.path.join(tmp, "r" if ours else "another"))
                with open(os.path.join(target, MARKER), "w") as f:
                    json.dump(dict(HOLDER, run=run), f)
            argv = ["--logging.run_dir", tmp, "--name", "r"]
            if shared:
                argv += ["--checkpoint.dir", target, "--checkpoint.every", "1"]
            code, out = run_in_process(C00, argv + (["--overwrite"] if overwrite else []))
            if fd is not None:
                os.close(fd)
            if overwrite and marked and fd is None and (ours or not shared):  # moved aside
                self.assertEqual((code, out), (0, ""))
                return
            if shared and marked and fd is None and not ours:  # never continued nor moved
                self.assertRegex(out, "belongs to the run in .*another.*, not to this run")
                self.assertNotIn("--overwrite to move", out)
            self.assertEqual(code, 2, out)
            self.assertEqual(len(out.splitlines()), 1, out)
            other = "--checkpoint.dir" if shared else "--name"
            self.assertRegex(out, f"give (a new|another) {other}")
            self.assertNotIn("give another --name" if shared else "--checkpoint.dir", out)
            if not marked:
                self.assertNotIn("--overwrite to move", out)
            self.assertEqual(os.listdir(target) != [], True)


class ARunWritesOnlyInDirectoriesOfItsOwn(unittest.TestCase):
    """A run directory or checkpoint.dir that is a symlink (to a directory, or dangling),
    another run's directory given as checkpoint.dir, or a directory inside a run's, live or
    finished: one line naming it (in use, a symlink, another run's, inside another run), exit
    2, with --resume or --overwrite too, and nothing written, moved or created. Generated; 25
    examples."""

    KINDS = {
        "run": ["symlink", "dangling", "inside_live", "inside_done"],
        "checkpoints":
        ["symlink", "dangling", "other_run", "other_live", "inside_live", "inside_done"]
    }
    SAYS = {
        "inside_done": "is inside the directory of another run",
        "symlink": "is a symlink",
        "dangling": "is a symlink",
        "other_run": "belongs to the run in",
        "other_live": "is in use by another run",
        "inside_live": "is in use by another run"
    }

    @settings(max_examples=EXAMPLES, deadline=None)
    @given(where=st.sampled_from(["run", "checkpoints"]), which=st.integers(0, 5),
           flag=st.sampled_from([[], ["--resume"], ["--overwrite"]]))
    def test_one_line_and_nothing_moved(self, where, which, flag):
        kind = self.KINDS[where][which % len(self.KINDS[where])]
        with tempfile.TemporaryDirectory() as tmp:
            elsewhere, victim = os.path.join(tmp, "elsewhere"), os.path.join(tmp, "victim")
            os.makedirs(elsewhere)
            os.makedirs(os.path.join(victim, "checkpoints", "step_0000001"))
            open(os.path.join(victim, "log.txt"), "w").close()
            fd = None
            if kind.endswith("live"):
                fd = held_by_another_run(victim)
            else:  # a finished run's directory: its marker names it
                with open(os.path.join(victim, MARKER), "w") as f:
                    json.dump(dict(HOLDER, run=os.path.realpath(victim)), f)
            link = os.path.join(tmp, "link")
            if kind in ("symlink", "dangling"):
                os.symlink(elsewhere if kind == "symlink" else os.path.join(tmp, "gone"), link)
            argv = ["--logging.run_dir", tmp, "--name", "r"]
            if where == "run":
                argv = [
                    "--logging.run_dir", victim, "--name", "r"
                ] if kind.startswith("inside") else ["--logging.run_dir", tmp, "--name", "link"]
            else:
                target = {
                    "other_run": victim,
                    "other_live": victim,
                    "inside_live": os.path.join(victim, "checkpoints"),
                    "inside_done": os.path.join(victim, "checkpoints", "sub")
                }.get(kind, link)
                argv += ["--checkpoint.dir", target, "--checkpoint.every", "1"]
            before = sorted(os.listdir(tmp)), sorted(os.listdir(victim))
            try:
                code, out = run_in_process(C00, argv + flag)
            finally:
                if fd is not None:
                    os.close(fd)
            self.assertEqual(code, 2, out)
            self.assertEqual(len(out.splitlines()), 1, out)
            self.assertTrue(out.startswith("error: "), out)
            if not (kind == "other_run" and flag == ["--resume"]):  # continues it, if it can
                self.assertIn(self.SAYS[kind], out)
            self.assertEqual((sorted(os.listdir(tmp)), sorted(os.listdir(victim))), before)
            self.assertEqual(os.listdir(elsewhere), [])
