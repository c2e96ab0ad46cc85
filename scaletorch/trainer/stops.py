"""How a training run stops on purpose: Ctrl-C, and a loss or gradient norm that is not finite.

Either way the run ends with one line (the step, the last complete checkpoint, what to run
next) and an exit status of its own (``RunStopped``): 130 for Ctrl-C, 3 for a non-finite value.
The optimizer step of the bad batch is not taken, so the last checkpoint holds finite weights.
"""

import math
import os
import shlex
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Iterator, List, Optional

from scaletorch.config import Config
from scaletorch.rules.errors import INTERRUPTED, NON_FINITE, RunStopped
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


@contextmanager
def interruptible(cfg: Config, steps_done: List[int]) -> Iterator[None]:
    """Inside the block Ctrl-C (SIGINT) raises RunStopped (exit 130) naming the step reached
    (``steps_done[0]``, kept current by the caller). After the first SIGINT later ones are
    ignored: torchrun forwards the terminal's to every rank, and a second one must not turn
    the clean stop into a traceback. Any error raised once SIGINT arrived (a collective whose
    peer has already stopped) is the same stop."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread
        return
    seen: List[bool] = []

    def on_sigint(signum: int, frame: object) -> None:
        if not seen:
            seen.append(True)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    except BaseException as err:
        if not seen and not isinstance(err, KeyboardInterrupt):
            raise
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise RunStopped(
            f"interrupted (Ctrl-C) at step {steps_done[0]} of "
            f"{cfg.training.steps}: {where_to_resume(cfg)}", INTERRUPTED) from None
    if not seen:
        signal.signal(signal.SIGINT, previous)
