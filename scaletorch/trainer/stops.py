"""How a training run stops on purpose: Ctrl-C, SIGTERM, and a non-finite loss or gradient norm.

Each way the run ends with one line (the step, the last complete checkpoint, what to run
next) and an exit status of its own (``RunStopped``): 130 for Ctrl-C, 143 for SIGTERM (what
torchrun and schedulers send), 3 for a non-finite value. Ctrl-C and SIGTERM take one path: the
signal raises a KeyboardInterrupt (``Terminated`` for SIGTERM) where the run is, so a checkpoint
being written is removed unless whole (checkpoint.removed_unless_complete). The optimizer step
of a bad batch is not taken, so the last checkpoint holds finite weights. A closed stdout
(``| head`` ended) is a stop too: its line goes to stderr, with SIGPIPE's status, 141; so is
any other failure to write stdout (``> /dev/full``, an I/O error), with status 74. Stdout is
wrapped (``guard_stdout``) so that such a failure is told apart from one of the run's files.
"""

import contextlib
import errno
import math
import os
import shlex
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional, Tuple

from scaletorch.config import Config
from scaletorch.data.datasets import DataChanged
from scaletorch.rules.errors import (INTERRUPTED, NON_FINITE, OUTPUT_FAILED, PIPE_CLOSED,
                                     TERMINATED, RunStopped, Terminated)
from scaletorch.trainer.checkpoint import latest_checkpoint


def resume_command(argv: Optional[List[str]] = None) -> str:
    """The command line that continues this run: the same script and arguments, ``--resume``
    instead of ``--resume X`` or ``--overwrite``; through scripts/launch.sh under torchrun."""
    argv = list(sys.argv if argv is None else argv)
    args: List[str] = []
    rest = iter(argv[1:])
    for token in rest:
        if token == "--resume":
            following = next(rest, None)
            if following is not None and following.startswith("--"):
                args.append(following)
            continue
        if token.startswith("--resume=") or token == "--overwrite":
            continue
        args.append(token)
    args.append("--resume")
    if "LOCAL_WORLD_SIZE" not in os.environ:  # one process, started by python itself
        return shlex.join(["python", argv[0], *args])
    launch = ["scripts/launch.sh", argv[0], "--nproc-per-node", os.environ["LOCAL_WORLD_SIZE"]]
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // int(os.environ["LOCAL_WORLD_SIZE"])
    if nodes > 1:
        launch += ["--nnodes", str(nodes), "..."]  # the node flags it was started with
    return shlex.join([*launch, "--", *args])


def where_to_resume(cfg: Config) -> str:
    """The last complete checkpoint and the command that resumes it (or what to do without)."""
    path = latest_checkpoint(cfg.checkpoint_path)
    if path is None:
        return ("no checkpoint was saved (checkpoint.every "
                f"{cfg.checkpoint.every}); start again with --overwrite or a new --name")
    return f"last complete checkpoint {path}; resume with: {resume_command()}"


def check_finite(cfg: Config, step: int, rank: int, loss: float, grad_norm: float) -> None:
    """RunStopped (exit 3) unless the loss and the gradient norm of ``step`` are finite."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    path = latest_checkpoint(cfg.checkpoint_path)
    last = f"last good checkpoint {path}" if path else "no checkpoint was saved"
    raise RunStopped(
        f"error: step {step} on rank {rank}: the loss is {loss} and the gradient norm "
        f"{grad_norm}; stopped before the optimizer step ({last}); lower --training.lr or "
        f"check the data, then resume or start again", NON_FINITE)


# the signals that stop a run cleanly: (exception raised, how the line names it, exit status)
STOP_SIGNALS = {
    signal.SIGINT: (KeyboardInterrupt, "interrupted (Ctrl-C)", INTERRUPTED),
    signal.SIGTERM: (Terminated, "terminated (SIGTERM)", TERMINATED),
}


def on_stop_signal(signum: int, frame: object) -> None:
    """The handler of SIGINT and SIGTERM: the first one raises its exception where the run
    is; later ones are ignored (torchrun forwards the terminal's Ctrl-C to every rank, then
    may send SIGTERM: a second signal must not turn the clean stop into a traceback)."""
    for other in STOP_SIGNALS:
        signal.signal(other, signal.SIG_IGN)
    raise STOP_SIGNALS[signal.Signals(signum)][0]


GRACE_SECONDS = 10.0  # after a stop signal, the longest a rank waits for its clean stop
_setup: List[Config] = []  # the run's config, once catch_stop_signals is called
_wakeup: List[int] = []  # the write end of the watchdog's pipe, while it is armed
_ended: List[Tuple[Config, int]] = []  # (config, steps trained) once the loop has ended


class OutputFailed(OSError):
    """A write to stdout that failed (a closed pipe, a full disk, an I/O error), raised by
    ``guard_stdout``'s stream in place of the OSError: a stop, not a file of the run."""


class _GuardedOutput:
    """A text stream whose ``write`` and ``flush`` raise OutputFailed for any OSError; every
    other attribute is the wrapped stream's."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OutputFailed:
            raise
        except OSError as err:
            raise OutputFailed(err.errno, err.strerror) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OutputFailed:
            raise
        except OSError as err:
            raise OutputFailed(err.errno, err.strerror) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def guard_stdout() -> None:
    """Wrap ``sys.stdout`` (once) so that a failed write is an OutputFailed: the stop of a run
    whose output is gone (``output_closed``), whether the pipe closed or the disk is full."""
    if not isinstance(sys.stdout, _GuardedOutput):
        sys.stdout = _GuardedOutput(sys.stdout)


def is_output_failure(err: BaseException) -> bool:
    """Whether ``err`` is a failed write of the run's output (a broken pipe: always stdout)."""
    return isinstance(err, (OutputFailed, BrokenPipeError))


def catch_stop_signals(cfg: Optional[Config] = None, note: Optional[Callable[[RunStopped],
                                                                             Any]] = None) -> None:
    """Make SIGTERM, like Ctrl-C, raise in the main thread (``on_stop_signal``): a script calls
    it once its config is loaded, before any blocking setup (process groups, model build), so a
    SIGTERM then ends in one line too (``stopped``, through ``report_input_errors``).

    A Python handler runs only between bytecodes: a rank blocked in C++ (the rendezvous of
    init_process_group, a collective whose peer has stopped) would never run it, and torchrun
    would kill it with SIGKILL. So the signal also wakes a watchdog thread (signal's wakeup fd),
    which ends the process with the stop's line and status after GRACE_SECONDS. On a rank
    other than 0 the watchdog hands the stop to ``note`` (the launcher's error file): that rank
    may be the only one the signal reached."""
    if threading.current_thread() is not threading.main_thread():
        return
    if cfg is not None:
        _setup[:] = [cfg]
    guard_stdout()
    for signum in STOP_SIGNALS:
        signal.signal(signum, on_stop_signal)
    if _wakeup:  # armed already (load_config twice in one process)
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    _wakeup.append(write)
    threading.Thread(target=watch, args=(read, GRACE_SECONDS, os._exit, note), daemon=True,
                     name="stop-watchdog").start()


def release_stop_signals() -> None:
    """Undo ``catch_stop_signals`` (for a test that loads a config in its own process): the
    default handlers, no wakeup fd, the watchdog ended (its pipe closed)."""
    for signum in STOP_SIGNALS:
        signal.signal(signum,
                      signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    _setup.clear()
    _ended.clear()
    if isinstance(sys.stdout, _GuardedOutput):
        sys.stdout = sys.stdout._stream
    if _wakeup:
        signal.set_wakeup_fd(-1)
        os.close(_wakeup.pop())


def watch(read: int, grace: float, end: Callable[[int], Any],
          note: Optional[Callable[[RunStopped], Any]] = None) -> None:
    """The watchdog: wait for a stop signal's byte on ``read`` (the wakeup fd), then give the
    main thread ``grace`` seconds to stop cleanly; still running, rank 0 prints the stop's
    line (another rank hands it to ``note``) and ``end(status)`` ends the process (no cleanup
    can run in a blocked thread)."""
    while True:
        data = os.read(read, 64)
        if not data:
            return
        signums = [s for s in data if s in STOP_SIGNALS]
        if signums:
            break
    time.sleep(grace)
    if not _wakeup:  # released meanwhile (a test's own process)
        return
    stop = stopped(Terminated() if signums[0] == signal.SIGTERM else KeyboardInterrupt())
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{stop} (still blocked after {grace:g} s: ended there)", file=sys.__stderr__,
              flush=True)
    elif note is not None:  # this rank alone may have got the signal (a scheduler's kill)
        note(stop)
    end(stop.exit_code)


def stopped(err: BaseException) -> RunStopped:
    """The RunStopped of a KeyboardInterrupt (Ctrl-C) or Terminated (SIGTERM) outside the loop:
    in the setup of a run (``catch_stop_signals`` had its config), the step it would have
    started at and the checkpoint a resume starts from."""
    if is_output_failure(err):  # stdout failed in the setup (its first line, the plan)
        return output_closed(_setup[0] if _setup else None, None, err)
    _, how, code = STOP_SIGNALS[signal.SIGTERM if isinstance(err, Terminated) else signal.SIGINT]
    if not _setup and _ended:  # past the loop: the script's reports, the last files, teardown
        cfg, steps = _ended[0]
        kept = (f"every step was trained; the run's files are in {cfg.run_path}"
                if steps >= cfg.training.steps else where_to_resume(cfg))
        return RunStopped(
            f"{how} after step {steps} of {cfg.training.steps} was trained, while "
            f"the run was ending: {kept}", code)
    if not _setup:
        return RunStopped(how, code)
    cfg = _setup[0]
    return RunStopped(f"{how} {_before_first(cfg)}: {where_to_resume(cfg)}", code)


def _before_first(cfg: Config) -> str:
    """"before step N of M": the step a run in its setup would have started at."""
    path = latest_checkpoint(cfg.checkpoint_path)
    first = int(os.path.basename(path).rsplit("_", 1)[-1]) + 1 if path else 1
    return f"before step {first} of {cfg.training.steps}"


def output_closed(cfg: Optional[Config], step: Optional[int],
                  err: Optional[BaseException] = None) -> RunStopped:
    """The stop of a run whose stdout failed at ``step`` (None: in its setup): a pipe closed
    (``| head``: the reader ended), with SIGPIPE's status, or any other failed write (``err``:
    a full disk, an I/O error), with OUTPUT_FAILED. Stdout is pointed at /dev/null first, so
    that nothing written later (the buffer flushed at exit) raises again; the line goes to
    stderr."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    closed = err is None or getattr(err, "errno", None) == errno.EPIPE
    what = ("the output was closed (a broken pipe, e.g. | head)" if closed else
            f"the output could not be written ({getattr(err, 'strerror', None) or err})")
    if cfg is None:
        return RunStopped(f"stopped: {what}", PIPE_CLOSED if closed else OUTPUT_FAILED)
    where = _before_first(cfg) if step is None else f"at step {step} of {cfg.training.steps}"
    return RunStopped(f"stopped: {what} {where}: {where_to_resume(cfg)}",
                      PIPE_CLOSED if closed else OUTPUT_FAILED)


@contextmanager
def interruptible(cfg: Config, steps_done: List[int]) -> Iterator[None]:
    """Inside the block Ctrl-C (SIGINT) and SIGTERM raise RunStopped (exit 130, 143) naming
    the step reached (``steps_done[0]``, kept current by the caller) and the checkpoint a
    resume starts from; so does a data file changed under the run (DataChanged). After the
    first signal later ones are ignored (``on_stop_signal``). Any error raised once a signal
    arrived (a collective whose peer has already stopped) is the same stop."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread
        return
    seen: List[int] = []

    def on_signal(signum: int, frame: object) -> None:
        seen.append(signum)
        on_stop_signal(signum, frame)

    previous = {signum: signal.signal(signum, on_signal) for signum in STOP_SIGNALS}
    _setup.clear()  # past the setup: the loop's own line (below) names the step reached
    try:
        yield
    except (BrokenPipeError, OutputFailed) as err:
        if seen:  # a signal came first: its stop, below, is the one to report
            raise
        raise output_closed(cfg, steps_done[0], err) from None
    except BaseException as err:
        if not seen and isinstance(err, DataChanged):  # the data file was cut or rewritten
            raise DataChanged(f"{err} at step {steps_done[0]} of {cfg.training.steps}: "
                              f"{where_to_resume(cfg)}") from None
        if not seen and not isinstance(err, KeyboardInterrupt):
            raise
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        which = signal.Signals(
            seen[0]) if seen else (signal.SIGTERM if isinstance(err, Terminated) else signal.SIGINT)
        _, how, code = STOP_SIGNALS[which]
        raise RunStopped(
            f"{how} at step {steps_done[0]} of {cfg.training.steps}: {where_to_resume(cfg)}",
            code) from None
    if not seen:
        _ended[:] = [(cfg, steps_done[0])]  # a signal from here on names the steps trained
        for signum, handler in previous.items():
            signal.signal(signum, handler)
