"""A run never writes over another: a run directory that holds a run is refused, or moved aside.

``run_script`` and ``snapshot`` are shared with tests/test_checksums.py and tests/test_stops.py,
and so is the BASE run (``copy_of_base_run``), run once per process.
"""

import contextlib
import glob
import io
import json
import os
import resource
import shutil
import signal
import tempfile
import unittest
from typing import Dict, List, Optional, Tuple

from hypothesis import example, given, settings
from hypothesis import strategies as st

from scaletorch.models import build_model
from scaletorch.rules.errors import InputError
from scaletorch.rules.schema import NAME_BYTES, path_component
from scaletorch.trainer import Trainer, parse_args
from scaletorch.trainer.run_dir import MARKER, check_run_dir, hold, moved_aside
from tests.harness import NCCL_CHECKS, run_forked
from tests.test_examples import ROOT

C00 = "examples/00_single_device.py"
# chapter 00, 4 steps, a checkpoint every 2: config.yaml, metrics.jsonl, step 2 and step 4
BASE = ["--steps", "4", "--checkpoint.every", "2", "--logging.progress", "false"]


def run_script(script: str, *argv: str, code: Optional[str] = None,
               timeout: float = 300) -> Tuple[int, str, str]:
    """``python script ARGV`` from the repository root, one process of its own (no torchrun):
    (exit status, stdout, stderr). ``code``: Python run first in that process (e.g. a patch
    that simulates a full disk), then the script as ``__main__``.

    The process is forked from the suite's forkserver (tests/harness.py's ``run_forked``), not
    a new Python that imports torch again (about 3 s of a core): the library is imported there
    already, so ``code`` patches what a module looks up when it runs (``safe_files.write_all``,
    the script's own ``loss_fn``), as it would in a fresh Python."""
    env = {**os.environ, "PYTHONPATH": ROOT, **NCCL_CHECKS}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(name, None)
    if code is None:
        done = run_forked(script, *argv, env=env, timeout=timeout)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            runner = os.path.join(tmp, "runner.py")
            with open(runner, "w") as f:
                f.write(f"import runpy, sys\n{code}\nsys.argv = {[script, *argv]!r}\n"
                        f"runpy.run_path({script!r}, run_name='__main__')\n")
            done = run_forked(runner, env=env, timeout=timeout)
    return done.returncode, done.stdout, done.stderr


def snapshot(root: str) -> Dict[str, bytes]:
    """Every file under ``root``, by path relative to it: its bytes."""
    files = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, root)] = f.read()
    return files


def base_run(tmp: str) -> str:
    """Chapter 00's BASE run with run directory ``tmp``/00_single_device; returns that."""
    code, out, err = run_script(C00, *BASE, "--logging.run_dir", tmp)
    assert code == 0, out + err
    return os.path.join(tmp, "00_single_device")


_BASE = tempfile.TemporaryDirectory()  # removed when the process exits


def finished_base_run() -> str:
    """The BASE run, run once per process: this file's checks and tests/test_stops.py's each
    work on a copy of it (``copy_of_base_run``). Returns its run directory."""
    run = os.path.join(_BASE.name, "00_single_device")
    if not os.path.isdir(run):
        base_run(_BASE.name)
    return run


def copy_of_base_run(run_dir: str) -> str:
    """A copy of the finished BASE run under ``run_dir`` (a run of its own: its checkpoints
    and logs under its own directory); returns ``run_dir``/00_single_device."""
    run = os.path.join(run_dir, "00_single_device")
    shutil.copytree(finished_base_run(), run)
    return run


def metrics_lines(run: str) -> List[dict]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


class ARunDirectoryThatHoldsARunIsNeverWrittenOver(unittest.TestCase):
    """One finished run (BASE), copied for each check."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.finished = finished_base_run()
        cls.before = snapshot(cls.finished)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def copy(self, name: str) -> str:
        """A copy of the finished run at run_dir ``name``; returns the run_dir."""
        run_dir = os.path.join(self.tmp.name, name)
        copy_of_base_run(run_dir)
        return run_dir

    def test_rerun_without_resume_is_one_line_exit_2_and_the_old_run_byte_identical(self):
        run_dir = self.copy("rerun")
        code, out, err = run_script(C00, *BASE, "--logging.run_dir", run_dir)
        self.assertEqual(code, 2, out + err)
        self.assertEqual(out, "")
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertRegex(
            err, r"^error: logging.run_dir: '.*00_single_device' already holds a "
            r"run \(checkpoints, config.yaml, log.txt, ...\); nothing was written")
        for way in ("--resume", "--name", "--overwrite"):
            self.assertIn(way, err)
        self.assertEqual(snapshot(os.path.join(run_dir, "00_single_device")), self.before)
        self.assertEqual(os.listdir(run_dir), ["00_single_device"])

    def test_overwrite_moves_the_old_run_aside_byte_identical_and_starts_afresh(self):
        run_dir = self.copy("overwrite")
        code, out, err = run_script(C00, "--steps", "2", "--logging.progress", "false",
                                    "--logging.run_dir", run_dir, "--overwrite")
        self.assertEqual(code, 0, out + err)
        moved = glob.glob(os.path.join(run_dir, "00_single_device.old-*"))
        self.assertEqual(len(moved), 1, os.listdir(run_dir))
        self.assertIn(
            f"--overwrite: moved logging.run_dir {run_dir}/00_single_device aside to "
            f"{moved[0]}", out)
        self.assertEqual(snapshot(moved[0]), self.before)  # kept whole, not deleted
        fresh = os.path.join(run_dir, "00_single_device")
        self.assertEqual([m["step"] for m in metrics_lines(fresh)], [1, 2])  # a new run
        self.assertFalse(os.path.exists(os.path.join(fresh, "checkpoints")))

    def test_resume_appends_to_metrics_and_keeps_every_line_before(self):
        run_dir = self.copy("resume")
        run = os.path.join(run_dir, "00_single_device")
        cfg = parse_args([
            "--config", "examples/configs/00_single_device.yaml", "--logging.run_dir", run_dir,
            "--logging.progress", "false", "--steps", "6", "--resume"
        ])
        check_run_dir(cfg)  # continuing is allowed
        with contextlib.redirect_stdout(io.StringIO()):  # verbose: rank 0 writes metrics
            result = Trainer(cfg, build_model(cfg.model, 42), verbose=True).train()
        self.assertEqual(result.start_step, 4)
        with open(os.path.join(run, "metrics.jsonl"), "rb") as f:
            data = f.read()
        old = self.before["metrics.jsonl"]
        self.assertEqual(data[:len(old)], old)  # append-only
        self.assertEqual([m["step"] for m in metrics_lines(run)], [1, 2, 3, 4, 5, 6])

    def test_overwrite_with_resume_and_a_checkpoint_dir_of_another_run_are_refused(self):
        run_dir = self.copy("refusals")
        base = ["--config", "examples/configs/00_single_device.yaml", "--logging.run_dir"]
        both = parse_args([*base, run_dir, "--overwrite", "--resume"])
        with self.assertRaisesRegex(
                InputError, "--overwrite moves the run in .* aside and "
                "--resume latest continues it: give one of the two"):
            check_run_dir(both)
        # a fresh run directory, but checkpoints into the finished run's
        checkpoints = os.path.join(run_dir, "00_single_device", "checkpoints")
        other = parse_args([
            *base,
            os.path.join(run_dir, "fresh"), "--checkpoint.every", "2", "--checkpoint.dir",
            checkpoints
        ])
        # refused as inside the finished run's directory (its .scaletorch-run), before its files
        # are looked at
        with self.assertRaisesRegex(
                InputError, f"checkpoint.dir: '{checkpoints}' is inside the directory of another "
                r"run \('.*00_single_device', which carries .scaletorch-run\); nothing was written"
        ):
            check_run_dir(other)


class TheWritableProbeSurvivesAMoveAside(unittest.TestCase):
    """Under torchrun, rank 0's ``--overwrite`` renames the run directory while another rank
    probes it for writing (load_config's check_writable): a probe that loses its directory
    probes again, instead of failing that rank with exit status 2 and no line (seen once in
    the docs test, chapter 03 at 2 ranks)."""

    def test_a_probe_whose_directory_moves_away_probes_again(self):
        from unittest import mock

        from scaletorch.trainer import config as config_module
        real = tempfile.mkdtemp
        with tempfile.TemporaryDirectory() as root:
            run = os.path.join(root, "run")
            os.makedirs(run)
            calls: List[str] = []

            def moved_once(prefix: str, dir: str) -> str:  # noqa: A002 (mkdtemp's own name)
                calls.append(dir)
                if len(calls) == 1:  # rank 0 renames the directory under this probe
                    os.rename(run, run + ".old")
                    raise FileNotFoundError(2, "No such file or directory")
                return real(prefix=prefix, dir=dir)

            with mock.patch.object(config_module.tempfile, "mkdtemp", moved_once):
                config_module.check_writable("logging.run_dir", run)
            self.assertEqual(calls, [run, root])  # probed again, at the parent that remains

            deep = os.path.join(root, "a", "b", "c", "d")
            os.makedirs(deep)

            def moved_each_time(prefix: str, dir: str) -> str:  # noqa: A002
                # another run moves the probed directory away each time (only inside root/a)
                self.assertTrue(dir.startswith(os.path.join(root, "a", "")), dir)
                os.rename(dir, dir + ".moved")
                raise FileNotFoundError(2, "No such file or directory")

            with mock.patch.object(config_module.tempfile, "mkdtemp", moved_each_time):
                with self.assertRaisesRegex(InputError, "renamed or removed while it was probed"):
                    config_module.check_writable("logging.run_dir", deep)

            def refused(prefix: str, dir: str) -> str:  # noqa: A002
                raise FileNotFoundError(2, "No such file or directory")  # /proc's answer

            # the directory is still there: not a move but a filesystem that refuses entries
            with mock.patch.object(config_module.tempfile, "mkdtemp", refused):
                with self.assertRaisesRegex(
                        InputError, r"cannot write .*: .* exists but refuses new entries \(it "
                        r"answers 'No such file or directory'\); give a directory you can write "
                        r"with --logging.run_dir"):
                    config_module.check_writable("logging.run_dir", run)


class OverwriteMovesAsideAnyNameTheRuleAdmits(unittest.TestCase):
    """--overwrite renames a run directory to ``NAME.old-<time>``: for every name the rule of
    --name admits (up to NAME_BYTES bytes, 1 to 4 per character), moved twice in one second
    (the -2 suffix), the new name fits NAME_BYTES (the name cut, whole characters) and the
    run's files move with it. A rename the OS still refuses is one InputError line. Generated;
    15 examples (long: 200)."""

    @settings(max_examples=200 if os.environ.get("SCALETORCH_LONG_TESTS") == "1" else 15,
              deadline=None)
    @given(name=st.text(st.sampled_from("ab.-_ é漢😀"), min_size=1, max_size=100).filter(
        path_component().admits))
    @example(name="漢" * 85)  # 255 bytes: the probe's
    @example(name="😀" * 63 + "abc")
    def test_the_aside_name_fits_and_holds_the_run(self, name):
        with tempfile.TemporaryDirectory() as tmp:
            run = os.path.join(tmp, name)
            moved = []
            for _ in range(2):
                os.makedirs(run)
                open(os.path.join(run, MARKER), "w").close()
                moved.append(moved_aside(run))
            self.assertEqual(len(set(moved)), 2, moved)
            for target in moved:
                self.assertEqual(os.path.dirname(target), tmp)
                base = os.path.basename(target)
                self.assertLessEqual(len(base.encode("utf-8")), NAME_BYTES, base)
                self.assertTrue(name.startswith(base[:base.rindex(".old-")]), base)
                self.assertEqual(os.listdir(target), [MARKER])
            self.assertFalse(os.path.lexists(run))

    def test_a_rename_past_path_max_is_one_line(self):
        with tempfile.TemporaryDirectory() as tmp:
            deep = os.path.join(tmp, *["d" * 250] * ((4095 - len(tmp)) // 251))
            run = os.path.join(deep, "r" * (4094 - len(deep)))  # 4095 bytes: the longest path
            os.makedirs(run)
            with self.assertRaisesRegex(InputError, "cannot move .* aside .*nothing was moved"):
                moved_aside(run)
            self.assertTrue(os.path.isdir(run))


def _hold_with_room(run: str, limit: int) -> str:
    """``hold(run)`` in a forked child whose files may not grow past ``limit`` bytes
    (RLIMIT_FSIZE: the kernel refuses the bytes past it, as a full disk refuses those past
    its blocks): "" when the lock was taken, else the child's InputError (or what else it
    raised, with its type)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the test runner
        try:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a core dump
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
            hold("logging.run_dir", run)
            said = ""
        except InputError as err:
            said = str(err)
        except BaseException as err:  # noqa: B902 (reported to the parent, which fails)
            said = f"{type(err).__name__}: {err}"
        os.write(write, said.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        said = f.read().decode()
    os.waitpid(pid, 0)
    return said


class AFullDiskWhileTheMarkerIsWrittenLeavesNothing(unittest.TestCase):
    """A run takes its directory by writing its marker (``hold``). A disk that fills up during
    that write (any number of the marker's bytes fit, under new or existing directories) is
    one InputError line, and nothing is left half made: a new run's marker and the directories
    it made are removed; a run's existing marker keeps its bytes. Generated; 15 examples."""

    @settings(max_examples=200 if os.environ.get("SCALETORCH_LONG_TESTS") == "1" else 15,
              deadline=None)
    @given(room=st.integers(0, 300), depth=st.integers(0, 2), existing=st.booleans())
    def test_one_line_and_nothing_half_made(self, room, depth, existing):
        with tempfile.TemporaryDirectory() as tmp:
            run = os.path.join(tmp, *["parent"] * depth, "r")
            old = b""
            if existing:  # a finished run's marker: --resume takes it again
                os.makedirs(run)
                old = json.dumps({"pid": 1, "host": "h", "started": "t", "run": run}).encode()
                with open(os.path.join(run, MARKER), "wb") as f:
                    f.write(old)
            said = _hold_with_room(run, len(old) + room)
            if said == "":  # it fitted: this run's marker, whole
                with open(os.path.join(run, MARKER)) as f:
                    self.assertEqual(json.load(f)["run"], os.path.realpath(run))
                return
            self.assertRegex(
                said, r"^logging.run_dir: cannot write the run marker .*\(File "
                r"too large\); nothing was written: free space there")
            self.assertNotIn("\n", said)
            if existing:
                self.assertEqual(snapshot(tmp),
                                 {os.path.relpath(os.path.join(run, MARKER), tmp): old})
            else:
                self.assertEqual(os.listdir(tmp), [])


if __name__ == "__main__":
    unittest.main()
