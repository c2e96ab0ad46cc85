"""A run that must stop says so in one line and keeps what it had: Ctrl-C (exit 130), a full
disk during a save (exit 2), a non-finite loss (exit 3)."""

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import unittest
from typing import Any, List, Tuple
from unittest import mock

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scaletorch.models import build_model
from scaletorch.rules.errors import RunStopped, Terminated
from scaletorch.trainer import Trainer
from scaletorch.trainer import checkpoint as ckpt
from scaletorch.trainer import parse_args, run_dir
from scaletorch.trainer.stops import catch_stop_signals, release_stop_signals, stopped, watch
from tests.harness import NCCL_CHECKS, launch_forked, run_forked, start_forked, under_torchrun
from tests.test_examples import NO_PREFLIGHT, ROOT
from tests.test_run_dirs import BASE, C00, copy_of_base_run, metrics_lines, run_script, snapshot

# The run's logs: a later run may add lines, never change or remove one.
APPEND_ONLY = ("metrics.jsonl", "log.txt")
# the run directory's owner marker: each run that takes the directory (a resume too) writes
# its own pid and start time there (scaletorch/trainer/run_dir.py)
OWNER = run_dir.MARKER
C01 = "examples/01_ddp.py"
LONG = os.environ.get("SCALETORCH_LONG_TESTS") == "1"
CTRL_C = re.compile(r"^interrupted \(Ctrl-C\) at step (\d+) of \d+: last complete checkpoint "
                    r"(\S+); resume with: (.+ --resume)$")


def interrupt_forked_after_checkpoints(script: str, args: List[str],
                                       checkpoints: int) -> Tuple[int, str, str]:
    """``python script args`` as one process (``start_forked``); once it printed
    ``checkpoints`` "saved checkpoint" lines, SIGINT to it, as a terminal's Ctrl-C (the run has
    no other process). (exit status, stdout, stderr)."""
    env = {**os.environ, "PYTHONPATH": ROOT, **NCCL_CHECKS, **NO_PREFLIGHT}
    with tempfile.TemporaryDirectory() as pipes:
        out_path, err_path = os.path.join(pipes, "stdout"), os.path.join(pipes, "stderr")
        os.mkfifo(out_path)
        open(err_path, "w").close()
        proc = start_forked(script, *args, stdout=out_path, stderr=err_path, env=env)
        lines, saved = [], 0
        try:
            with open(out_path) as out:  # until the process ends (it holds the other end)
                for line in out:
                    lines.append(line)
                    if line.startswith("saved checkpoint"):
                        saved += 1
                        if saved == checkpoints:
                            os.kill(proc.pid, signal.SIGINT)
            proc.join(120)
        finally:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)
                proc.join()
        with open(err_path) as f:
            err = f.read()
    return proc.exitcode, "".join(lines), err


def interrupt_after_checkpoints(cmd: List[str], checkpoints: int,
                                sigterm: bool = False) -> Tuple[int, str, str]:
    """Start ``cmd`` in a session of its own, and once it printed ``checkpoints`` "saved
    checkpoint" lines send SIGINT to the session, as a terminal's Ctrl-C does to its foreground
    processes (here: launch.sh's torchrun and every rank); with ``sigterm``, SIGTERM to the
    command's process alone, as a scheduler stops a job (torchrun passes it on to the ranks).
    (exit status, stdout, stderr)."""
    # launch.sh's pre-flight skipped: the stop comes after two checkpoints, long after it
    env = {**os.environ, "PYTHONPATH": ROOT, **NCCL_CHECKS, **NO_PREFLIGHT}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=env)
    lines, saved = [], 0
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            saved += line.startswith("saved checkpoint")
            if saved == checkpoints:
                if sigterm:
                    os.kill(proc.pid, signal.SIGTERM)
                else:
                    os.killpg(proc.pid, signal.SIGINT)
                break
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, "".join(lines) + stdout, stderr


# The end of a script that patches the library, then runs chapter 01 as ``__main__`` on a rank
# of ``launch_forked``, ending as Python ends it: an exception that escapes goes to the
# script's ``sys.excepthook`` (load_config's report_input_errors: one line, its status), which
# launch_forked's ranks would not call (they print the traceback, status 1).
RUN_01 = """
import runpy
import sys
sys.argv = ['examples/01_ddp.py', *sys.argv[1:]]
try:
    runpy.run_path('examples/01_ddp.py', run_name='__main__')
except Exception as err:
    sys.excepthook(type(err), err, err.__traceback__)
    sys.exit(1)
"""


class CtrlCEndsWithOneLineAndTheLastCheckpointResumes(unittest.TestCase):

    def check_stop(self, code: int, out: str, err: str) -> Tuple[int, str, str]:
        """The exit status, no traceback, exactly one line about the stop, naming a whole
        checkpoint; returns (step reached, checkpoint, resume command)."""
        self.assertEqual(code, 130, out + err)
        self.assertNotIn("Traceback", out + err)
        stops = [line for line in (out + err).splitlines() if "interrupted" in line.lower()]
        self.assertEqual(len(stops), 1, out + err)
        self.assertEqual(err.splitlines()[-1], stops[0])  # the last thing printed
        match = CTRL_C.match(stops[0])
        self.assertIsNotNone(match, stops[0])
        step, path, command = int(match[1]), match[2], match[3]
        ckpt.verify_checkpoint(path)  # whole
        return step, path, command

    def test_one_process(self):
        with tempfile.TemporaryDirectory() as tmp:
            code, out, err = interrupt_forked_after_checkpoints(C00, [
                "--steps", "100000", "--checkpoint.every", "2", "--logging.progress", "false",
                "--logging.run_dir", tmp
            ], 2)
            step, path, command = self.check_stop(code, out, err)
            self.assertTrue(command.startswith(f"python {C00} --steps 100000"), command)
            run = os.path.join(tmp, "00_single_device")
            # metrics.jsonl holds every step that finished
            self.assertEqual([m["step"] for m in metrics_lines(run)], list(range(1, step + 1)))
            # the first checkpoint resumes: the same run, continued one step past it; the
            # steps after it leave metrics.jsonl for a side file, so each step is there once
            first = ckpt.list_checkpoints(os.path.join(run, "checkpoints"))[0]
            done = int(first[-7:])
            self.assertLess(done, step)
            cfg = parse_args([
                "--config", "examples/configs/00_single_device.yaml", "--logging.run_dir", tmp,
                "--logging.progress", "false", "--steps",
                str(done + 1), "--resume", first
            ])
            with contextlib.redirect_stdout(io.StringIO()):
                result = Trainer(cfg, build_model(cfg.model, 42), verbose=True).train()
            self.assertEqual((result.start_step, len(result.losses)), (done, 1))
            self.assertEqual([m["step"] for m in metrics_lines(run)], list(range(1, done + 2)))
            with open(os.path.join(run, f"metrics.after-step-{done}.jsonl")) as f:
                self.assertEqual([json.loads(line)["step"] for line in f],
                                 list(range(done + 1, step + 1)))

    @under_torchrun
    def test_through_torchrun(self):
        with tempfile.TemporaryDirectory() as tmp:
            code, out, err = interrupt_after_checkpoints([
                "bash", "scripts/launch.sh", "examples/01_ddp.py", "--nproc-per-node", "2", "--",
                "--steps", "100000", "--checkpoint.every", "2", "--logging.progress", "false",
                "--logging.run_dir", tmp
            ], 2)
            _, _, command = self.check_stop(code, out, err)
            self.assertTrue(
                command.startswith("scripts/launch.sh examples/01_ddp.py --nproc-per-node 2 -- "
                                   "--steps 100000"), command)


SIGTERM = re.compile(r"^terminated \(SIGTERM\) at step (\d+) of \d+: last complete checkpoint "
                     r"(\S+); resume with: (.+ --resume)$")


class AStopDuringASaveNamesTheStepTrainedAndLeavesNoPartOfIt(unittest.TestCase):
    """In this process: SIGINT or SIGTERM (raised for real, through the run's handler) at a
    generated point of a generated checkpoint's save. The line names the step trained and the
    last complete checkpoint apart; the step being saved leaves no directory, empty or not."""

    # where in the save the signal comes: serializing (no file yet), the rank's file written,
    # the manifest about to be written
    POINTS = ("serialize", "rank_file", "manifest")

    @settings(max_examples=60 if LONG else 4, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(save=st.integers(1, 2), point=st.sampled_from(POINTS),
           signum=st.sampled_from([signal.SIGINT, signal.SIGTERM]))
    def test_line_and_no_partial_checkpoint(self, save, point, signum):
        every, steps = 1, save + 1
        with tempfile.TemporaryDirectory() as tmp:
            cfg = parse_args([
                "--config", "examples/configs/00_single_device.yaml", "--logging.run_dir", tmp,
                "--logging.progress", "false", "--steps",
                str(steps), "--checkpoint.every",
                str(every)
            ])
            target = ckpt.step_dir(cfg.checkpoint_path, every * save)
            real = {
                "serialize": torch.save,
                "rank_file": ckpt.write_checksummed,
                "manifest": ckpt.write_manifest
            }[point]

            def stop_there(*args, **kwargs):
                saving = {
                    "serialize": os.path.isdir(target),  # makedirs(target) came first
                    "rank_file": os.path.dirname(str(args[0])) == target,
                    "manifest": len(args) > 1 and args[1] == target
                }[point]
                result = real(*args, **kwargs) if point == "rank_file" or not saving else None
                if saving:
                    signal.raise_signal(signum)
                return result

            where = {
                "serialize": (torch, "save"),
                "rank_file": (ckpt, "write_checksummed"),
                "manifest": (ckpt, "write_manifest")
            }[point]
            with mock.patch.object(*where, stop_there), \
                    contextlib.redirect_stdout(io.StringIO()):
                with self.assertRaises(RunStopped) as stopped:
                    Trainer(cfg, build_model(cfg.model, 42), verbose=True).train()
            how = "interrupted (Ctrl-C)" if signum == signal.SIGINT else "terminated (SIGTERM)"
            last = (
                f"last complete checkpoint {ckpt.step_dir(cfg.checkpoint_path, every * (save - 1))}"
                if save > 1 else "no checkpoint was saved")
            message = str(stopped.exception)
            self.assertTrue(message.startswith(f"{how} at step {every * save} of {steps}: {last}"),
                            message)
            self.assertEqual(stopped.exception.exit_code, 130 if signum == signal.SIGINT else 143)
            self.assertFalse(os.path.exists(target), os.listdir(cfg.checkpoint_path))
            run = cfg.run_path
            self.assertEqual([m["step"] for m in metrics_lines(run)],
                             list(range(1, every * save + 1)))


class ASignalDuringSetupIsOneLineEvenWhenARankIsBlocked(unittest.TestCase):
    """In this process: a stop before the loop (process groups, model build) names the step
    the run would have started at and its checkpoint; a rank blocked in C++ (which never runs
    a Python handler) is ended by the watchdog with the same line and status."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.cfg = parse_args([
            "--config", "examples/configs/00_single_device.yaml", "--logging.run_dir",
            self.tmp.name, "--checkpoint.every", "2"
        ])
        self.saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        catch_stop_signals(self.cfg)

    def tearDown(self):
        release_stop_signals()
        for signum, handler in self.saved.items():
            signal.signal(signum, handler)
        self.tmp.cleanup()

    def test_before_step_1_no_checkpoint(self):
        for err, how, code in ((Terminated(), "terminated (SIGTERM)", 143),
                               (KeyboardInterrupt(), "interrupted (Ctrl-C)", 130)):
            stop = stopped(err)
            self.assertEqual((str(stop), stop.exit_code),
                             (f"{how} before step 1 of 200: no checkpoint was saved "
                              f"(checkpoint.every 2); start again with --overwrite or a new "
                              f"--name", code))

    def test_after_the_loop_the_line_names_the_steps_trained(self):
        # Ctrl-C while the script reports, writes its last files or tears down (probe 53:
        # the line was a bare "interrupted (Ctrl-C)", or none, for a run that had finished)
        from scaletorch.trainer.stops import interruptible
        for steps, kept in ((12, "no checkpoint was saved (checkpoint.every 2); start again "
                             "with --overwrite or a new --name"),
                            (200, f"every step was trained; the run's files are in "
                             f"{self.cfg.run_path}")):
            with interruptible(self.cfg, [steps]):
                pass
            for err, how, code in ((Terminated(), "terminated (SIGTERM)", 143),
                                   (KeyboardInterrupt(), "interrupted (Ctrl-C)", 130)):
                stop = stopped(err)
                self.assertEqual((str(stop), stop.exit_code),
                                 (f"{how} after step {steps} of 200 was trained, while the run "
                                  f"was ending: {kept}", code))

    def test_the_watchdog_ends_a_blocked_rank_with_the_line_and_status(self):
        read, write = os.pipe()
        os.write(write, bytes([signal.SIGCHLD, signal.SIGTERM]))  # the first is no stop
        ends: List[int] = []
        err = io.StringIO()
        with mock.patch.object(sys, "__stderr__", err):
            watch(read, 0.01, ends.append)
        os.close(read)
        os.close(write)
        self.assertEqual(ends, [143])
        self.assertEqual(
            err.getvalue(), "terminated (SIGTERM) before step 1 of 200: no checkpoint was "
            "saved (checkpoint.every 2); start again with --overwrite or a new --name (still "
            "blocked after 0.01 s: ended there)\n")
        # on another rank the line goes to the launcher's error file (``note``): this rank may be
        # the only one the signal reached, and rank 0 may die blocked without a word
        read, write = os.pipe()
        os.write(write, bytes([signal.SIGTERM]))
        notes: List[Any] = []
        with mock.patch.object(sys, "__stderr__", err), \
                mock.patch.dict(os.environ, {"RANK": "1"}):
            watch(read, 0.01, ends.append, notes.append)
        os.close(read)
        os.close(write)
        self.assertEqual(ends, [143, 143])
        self.assertEqual([n.exit_code for n in notes], [143])
        self.assertTrue(str(notes[0]).startswith("terminated (SIGTERM) before step 1 of 200"))
        self.assertEqual(err.getvalue().count("terminated"), 1)  # rank 1 prints nothing itself


class SigtermTakesCtrlCsPath(unittest.TestCase):

    @under_torchrun
    def test_through_torchrun_one_line_exit_143_and_only_whole_checkpoints(self):
        with tempfile.TemporaryDirectory() as tmp:
            code, out, err = interrupt_after_checkpoints([
                "bash", "scripts/launch.sh", C01, "--nproc-per-node", "2", "--", "--steps",
                "100000", "--checkpoint.every", "2", "--logging.progress", "false",
                "--logging.run_dir", tmp, "--logging.log_every", "1"
            ], 2, sigterm=True)
            self.assertEqual(code, 143, out + err)
            self.assertNotIn("Traceback", out + err)
            stops = [line for line in (out + err).splitlines() if "SIGTERM" in line]
            self.assertEqual(len(stops), 1, out + err)  # rank 0's line; torchrun's are quiet
            self.assertEqual(err.splitlines()[-1], stops[0])
            match = SIGTERM.match(stops[0])
            self.assertIsNotNone(match, stops[0])
            step, path = int(match[1]), match[2]
            ckpt.verify_checkpoint(path)  # whole; and no partial one beside it
            run = os.path.join(tmp, "01_ddp")
            checkpoints = ckpt.list_checkpoints(os.path.join(run, "checkpoints"))
            self.assertEqual(sorted(os.listdir(os.path.join(run, "checkpoints"))),
                             [os.path.basename(c) for c in checkpoints])
            self.assertEqual([m["step"] for m in metrics_lines(run)], list(range(1, step + 1)))

    @under_torchrun
    def test_a_sigterm_to_rank_1_alone_is_its_line_once_from_the_launcher(self):
        """Rank 1 alone stopped (a scheduler's kill): rank 0, blocked in a collective with it,
        is ended by torchrun without a line, so rank 1's line goes to its error file and
        scripts/torchrun.py prints it once (its ``stop_line``); when rank 0 stopped with its
        own line, nothing more. The rank's exit runs in a forked child (it ends with _exit)."""
        import importlib.util

        from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

        from scaletorch.rules.errors import TERMINATED
        from scaletorch.trainer.config import report_input_errors
        spec = importlib.util.spec_from_file_location("torchrun_script",
                                                      os.path.join(ROOT, "scripts/torchrun.py"))
        torchrun = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(torchrun)
        line = "terminated (SIGTERM) at step 11 of 40: last complete checkpoint ck; resume: x"
        with tempfile.TemporaryDirectory() as tmp:
            error_file, printed = os.path.join(tmp, "error.json"), os.path.join(tmp, "stderr")
            pid = os.fork()
            if pid == 0:  # rank 1 of 2 under torchrun, its stop reported
                fd = os.open(printed, os.O_WRONLY | os.O_CREAT)
                os.dup2(fd, 2)
                os.environ.update(RANK="1", WORLD_SIZE="2", TORCHELASTIC_ERROR_FILE=error_file)
                try:
                    report_input_errors(RunStopped, RunStopped(line, TERMINATED), None)
                finally:
                    os._exit(99)
            _, status = os.waitpid(pid, 0)
            self.assertEqual(os.waitstatus_to_exitcode(status), TERMINATED)
            with open(printed) as f:
                self.assertEqual(f.read(), "")  # quiet: rank 0 or the launcher says it
            rank1 = ProcessFailure(1, pid, TERMINATED, error_file)
            # rank 0 ended by torchrun (the stop is the news); rank 0 stopped with its own line;
            # rank 0 raised (exit 1) and torchrun's own SIGTERM stopped rank 1 between steps:
            # the failure is the news (seen once in chapter 11's raise run)
            for rank0_exit, said in ((-signal.SIGTERM, (f"{line} (rank 1 got the signal)",
                                                        TERMINATED)), (TERMINATED, ("", 0)),
                                     (1, ("", 0))):
                rank0 = ProcessFailure(0, 1, rank0_exit, os.path.join(tmp, "none.json"))
                self.assertEqual(torchrun.stop_line({0: rank0, 1: rank1}), said)


class AFullDiskDuringASaveKeepsThePreviousCheckpointAndTheMetrics(unittest.TestCase):
    """The BASE run (checkpoints at steps 2 and 4) resumed to step 8, with the disk full when
    step 6's file is half written (``write_all`` patched, as a full disk fails a write)."""

    FULL_DISK = """
import errno
from scaletorch.rules import safe_files
def write_all(f, data):
    if "step_0000006" in f.name:
        f.write(data[:len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")
    f.write(data)
safe_files.write_all = write_all
"""

    def test_one_line_naming_the_file_no_partial_files_and_nothing_before_changed(self):
        with tempfile.TemporaryDirectory() as tmp:
            run = copy_of_base_run(tmp)  # the BASE run, run once per process
            before = snapshot(run)
            code, out, err = run_script(C00, *BASE[2:], "--steps", "8", "--logging.run_dir", tmp,
                                        "--resume", code=self.FULL_DISK)
            self.assertEqual(code, 2, out + err)
            self.assertNotIn("Traceback", out + err)
            self.assertEqual(len(err.splitlines()), 1, err)
            step6 = ckpt.step_dir(os.path.join(run, "checkpoints"), 6)
            self.assertIn(
                f"error: could not write '{ckpt.rank_file(step6, 0)}': No space left on "
                f"device (free space there); its partial files were removed", err)
            after = snapshot(run)
            self.assertFalse(os.path.exists(step6))  # no partial file, no empty directory
            for name, data in before.items():  # both checkpoints and config.yaml unchanged
                if name not in APPEND_ONLY + (OWNER, ):
                    self.assertEqual(after[name], data, name)
            for name in APPEND_ONLY:  # only appended to
                self.assertTrue(after[name].startswith(before[name]), name)
            self.assertEqual([m["step"] for m in metrics_lines(run)], [1, 2, 3, 4, 5, 6])
            self.assertEqual(
                ckpt.latest_valid_checkpoint(os.path.join(run, "checkpoints"))[0],
                ckpt.step_dir(os.path.join(run, "checkpoints"), 4))

    def test_two_ranks_each_name_their_file_and_keep_what_they_had(self):
        # 01 at 2 ranks: steps 2 and 4 saved, then the resumed run finds the disk full while
        # each rank writes its step 6 file (one disk, one node: every rank's write fails). The
        # ranks forked, as torchrun starts them: what each rank says and leaves is theirs.
        # Under torchrun the user sees rank 0's line alone (rank 1 waits, and torchrun ends
        # it, its own notes of a status 2 dropped): tests/test_layout_errors.py's launch
        # without the pre-flight shows that road, the same for every refusal of status 2.
        with tempfile.TemporaryDirectory() as tmp:
            wrapper = os.path.join(tmp, "full_disk_01_ddp.py")
            with open(wrapper, "w") as f:
                f.write(self.FULL_DISK + RUN_01)
            args = [*BASE, "--logging.run_dir", tmp]
            out, code = launch_forked(C01, 2, *args, env=NO_PREFLIGHT)  # the run before
            self.assertEqual(code, 0, out[-3000:])
            run = os.path.join(tmp, "01_ddp")
            before = snapshot(run)
            out, code = launch_forked(wrapper, 2, *args, "--steps", "8", "--resume",
                                      env=NO_PREFLIGHT)
            self.assertEqual(code, 2, out[-3000:])
            self.assertNotIn("Traceback", out)
            errors = [line for line in out.splitlines() if line.lower().startswith("error")]
            step6 = ckpt.step_dir(os.path.join(run, "checkpoints"), 6)
            # rank 0's line at once, then rank 1's after its wait (which torchrun cuts short)
            self.assertEqual(len(errors), 2, out[-3000:])
            for rank, line in enumerate(errors):
                self.assertIn(
                    f"error: could not write '{ckpt.rank_file(step6, rank)}': No space left on "
                    f"device (free space there); its partial files were removed", line)
            self.assertEqual(out.splitlines()[-2:], errors)  # the last things printed
            after = snapshot(run)
            self.assertFalse(os.path.exists(step6))  # no rank left a partial file
            self.assertFalse([name for name in after if ".tmp." in name], sorted(after))
            for name, data in before.items():  # both checkpoints and config.yaml unchanged
                if name not in APPEND_ONLY + (OWNER, ):
                    self.assertEqual(after[name], data, name)
            for name in APPEND_ONLY:  # only appended to
                self.assertTrue(after[name].startswith(before[name]), name)
            self.assertEqual([m["step"] for m in metrics_lines(run)], [1, 2, 3, 4, 5, 6])
            self.assertEqual(
                ckpt.latest_valid_checkpoint(os.path.join(run, "checkpoints"))[0],
                ckpt.step_dir(os.path.join(run, "checkpoints"), 4))


class ANonFiniteLossStopsTheRun(unittest.TestCase):
    """The BASE run resumed to step 8 with a NaN planted in step 6's loss (the loss function
    patched before the trainer binds it)."""

    NAN_AT_STEP_6 = """
import math
import runpy
import sys
import scaletorch.models as models
from scaletorch.dist import get_ledger
real = models.loss_fn
def loss_fn(*args, **kwargs):
    loss = real(*args, **kwargs)
    return loss * math.nan if get_ledger().step == 5 else loss  # the trainer counts from 0
models.loss_fn = loss_fn
"""

    def test_one_line_with_step_rank_and_checkpoint_exit_3_and_nothing_before_changed(self):
        with tempfile.TemporaryDirectory() as tmp:
            run = copy_of_base_run(tmp)  # the BASE run, run once per process
            before = snapshot(run)
            code, out, err = run_script(C00, *BASE[2:], "--steps", "8", "--logging.run_dir", tmp,
                                        "--resume", code=self.NAN_AT_STEP_6)
            self.assertEqual(code, 3, out + err)
            self.assertNotIn("Traceback", out + err)
            self.assertEqual(len(err.splitlines()), 1, err)
            step4 = ckpt.step_dir(os.path.join(run, "checkpoints"), 4)
            self.assertRegex(
                err, rf"^error: step 6 on rank 0: the loss is nan and the gradient norm nan; "
                rf"stopped before the optimizer step \(last good checkpoint {re.escape(step4)}\)")
            after = snapshot(run)
            for name, data in before.items():  # both checkpoints and config.yaml unchanged
                if name not in APPEND_ONLY + (OWNER, ):
                    self.assertEqual(after[name], data, name)
            # no checkpoint of the bad step; the resumed run's config beside the first one
            self.assertEqual(sorted(after), sorted([*before, "config.resume_0000004.yaml"]))
            for name in APPEND_ONLY:  # only appended to
                self.assertTrue(after[name].startswith(before[name]), name)
            self.assertEqual([m["step"] for m in metrics_lines(run)], [1, 2, 3, 4, 5])

    def test_through_torchrun_every_rank_stops_at_the_same_step(self):
        # 01 at 2 ranks, a NaN in step 4's loss on every rank: the global gradient norm is NaN
        with tempfile.TemporaryDirectory() as tmp:
            wrapper = os.path.join(tmp, "nan_01_ddp.py")
            with open(wrapper, "w") as f:
                f.write(
                    self.NAN_AT_STEP_6.replace("== 5", "== 3") +
                    "sys.argv = ['examples/01_ddp.py', *sys.argv[1:]]\n"
                    "runpy.run_path('examples/01_ddp.py', run_name='__main__')\n")
            # torchrun (scripts/torchrun.py, as launch.sh runs it: its exit status 3 without a
            # report is part of the claim) forked from the forkserver, its ranks new Pythons;
            # launch.sh's own steps: tests/test_launch.py, and the SIGTERM test above
            done = run_forked("scripts/torchrun.py", "--nproc-per-node", "2", "--max-restarts", "0",
                              "--standalone", wrapper, "--steps", "6", "--checkpoint.every", "2",
                              "--logging.progress", "false", "--logging.run_dir", tmp,
                              "--logging.log_every", "1", env={
                                  **os.environ, "PYTHONPATH": ROOT,
                                  **NCCL_CHECKS
                              }, timeout=300)
            out, code = done.stdout + done.stderr, done.returncode
            self.assertEqual(code, 3, out[-3000:])
            self.assertNotIn("Traceback", out)
            stops = [line for line in out.splitlines() if line.startswith("error:")]
            step2 = ckpt.step_dir(os.path.join(tmp, "01_ddp", "checkpoints"), 2)
            self.assertEqual(stops, [
                f"error: step 4 on rank 0: the loss is nan and the gradient norm nan; stopped "
                f"before the optimizer step (last good checkpoint {step2}); lower --training.lr "
                f"or check the data, then resume or start again"
            ])
            ckpt.verify_checkpoint(step2)
            run = os.path.join(tmp, "01_ddp")
            self.assertEqual([m["step"] for m in metrics_lines(run)], [1, 2, 3])
            self.assertEqual(sorted(os.listdir(os.path.join(run, "checkpoints"))), ["step_0000002"])


if __name__ == "__main__":
    unittest.main()

CLOSED_OUTPUT = """
import sys
from scaletorch.config import Config
from scaletorch.trainer.config import report_input_errors
from scaletorch.trainer.stops import catch_stop_signals, interruptible
sys.excepthook = report_input_errors
cfg = Config()
cfg.logging.run_dir = sys.argv[1]
catch_stop_signals(cfg)  # as load_config does: stdout guarded, the setup's stops named
if sys.argv[2:] == ["setup"]:
    print("model: ...", flush=True)  # a script's first line, before the loop
steps = [0]
with interruptible(cfg, steps):
    while True:  # a run printing a line per step, as Trainer._print does
        steps[0] += 1
        print(f"step {steps[0]}", flush=True)
"""


class AClosedOutputIsACleanStop(unittest.TestCase):
    """A run whose stdout is a pipe closed by its reader (``| head -N``, generated N) stops
    as a signal does: one line on stderr naming the step reached and what a resume starts
    from, SIGPIPE's status 141, no traceback. One small process per example (no model; forked
    from the suite's forkserver, ``start_forked``): 1 in the suite, 20 long. Any other failed
    write of stdout (``> /dev/full``: ENOSPC), in the setup or the loop, is the same stop with
    status 74."""

    @staticmethod
    def ended(proc: Any, tmp: str) -> Tuple[int, str]:
        """(exit status, stderr) of ``proc`` (run_closed_output's) once ended (killed at 60 s)."""
        proc.join(60)
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()
        with open(os.path.join(tmp, "stderr")) as f:
            return proc.exitcode, f.read()

    def run_closed_output(self, tmp: str, stdout: str, *args: str) -> Any:
        """CLOSED_OUTPUT as a script in ``tmp``, started with its stdout at ``stdout``."""
        script = os.path.join(tmp, "closed_output.py")
        with open(script, "w") as f:
            f.write(CLOSED_OUTPUT)
        open(os.path.join(tmp, "stderr"), "w").close()
        return start_forked(script, tmp, *args, stdout=stdout, stderr=os.path.join(tmp, "stderr"),
                            env={
                                **os.environ, "PYTHONPATH": ROOT
                            })

    @settings(max_examples=20 if os.environ.get("SCALETORCH_LONG_TESTS") == "1" else 1,
              deadline=None)
    @given(lines=st.integers(0, 50))
    def test_head_ends_the_run_with_one_line_and_status_141(self, lines):
        with tempfile.TemporaryDirectory() as tmp:
            pipe = os.path.join(tmp, "stdout")
            os.mkfifo(pipe)  # the pipe `| head` reads: its reader this test
            proc = self.run_closed_output(tmp, pipe)
            try:
                with open(pipe) as out:
                    for _ in range(lines):
                        out.readline()
            finally:
                code, err = self.ended(proc, tmp)
            self.assertEqual(code, 141, err)
            self.assertEqual(len(err.splitlines()), 1, err)
            self.assertRegex(
                err, r"^stopped: the output was closed .* at step \d+ of \d+: "
                r"no checkpoint was saved")

    def test_a_full_device_ends_the_run_with_one_line_and_status_74(self):
        for where, said in (("setup", "before step 1 of"), ("loop", "at step 1 of")):
            with self.subTest(where=where), tempfile.TemporaryDirectory() as tmp:
                code, err = self.ended(self.run_closed_output(tmp, "/dev/full", where), tmp)
                self.assertEqual(code, 74, err)
                self.assertEqual(len(err.splitlines()), 1, err)
                self.assertRegex(
                    err, rf"^stopped: the output could not be written \(No space left on "
                    rf"device\) {said} \d+: no checkpoint was saved")
