"""What every training run needs and no chapter teaches, as calls from the script's own loop.

Chapters 00-06 write their step in the script; this module keeps the rest out of it:

    with start_run(cfg, model, optimizer, pgm) as run:  # run directory, resume, Ctrl-C
        for inputs, targets in run.batches():            # step run.step's global batch (b, s)
            ...                                          # the chapter's forward and backward
            grad_norm = clip(...)
            run.record(loss, grad_norm)                  # log them; a NaN stops the run here
            optimizer.step()
    result = run.result                                  # losses, grad norms, start step

- entering the block makes the run directory (config.yaml, metrics.jsonl, log.txt), resumes
  from ``--resume`` (or after a torchrun restart) and starts the profiler;
- ``batches()`` yields each remaining step's global batch, the same on every rank. When the
  loop asks for the next one the step is over: the learning-rate schedule moves on, the
  step's metrics and log line are written (with the straggler note) and a checkpoint if due;
- ``record`` reads the loss and the gradient norm before the optimizer step, so a
  non-finite value stops the run with the last good checkpoint on disk (stops.py);
- leaving the block closes the files and prints the planner's line; an error inside a step
  says which step failed and the last collective issued; Ctrl-C stops with one line.

``Trainer.train`` (chapters 07 on) runs the same object around the Trainer's shared step.
"""

import json
import os
import statistics
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Iterator, List, Optional, Tuple, Type

import torch
import torch.distributed as dist

from scaletorch.dist import comm, get_ledger, meet_before_first_step
from scaletorch.dist.straggler import straggler_report
from scaletorch.rules.errors import clip
from scaletorch.rules.safe_files import WriteError
from scaletorch.trainer.config import save_config
from scaletorch.trainer.plan_line import plan_report
from scaletorch.trainer.precision import precision_note, resolve_precision
from scaletorch.trainer.profiling import profiler
from scaletorch.trainer.run_dir import continues, keep_metrics_to
from scaletorch.trainer.stops import check_finite, interruptible


@dataclass
class TrainResult:
    """What a run measured: per step its loss, grad norm and times."""
    losses: List[float] = field(default_factory=list)  # global mean loss of each step run
    grad_norms: List[float] = field(default_factory=list)
    start_step: int = 0  # > 0 when resumed from a checkpoint
    step_seconds: List[float] = field(default_factory=list)  # this rank's wall time of each step
    busy_seconds: List[float] = field(default_factory=list)  # the same, less collective waits


class Run:
    """The bookkeeping around one run of ``trainer``'s model and optimizer (see the module)."""

    def __init__(self, trainer: Any, result: TrainResult) -> None:
        # trainer: a Trainer (trainer.py), which imports this module; Any keeps one direction
        self.trainer = trainer
        self.cfg = trainer.cfg
        self.result = result
        self._stack = ExitStack()
        self._metrics: Any = None
        self._bar: Any = None
        self._prof: Optional[torch.profiler.profile] = None
        self._reached = [0]  # the step reached, for the line Ctrl-C prints
        self._window: List[float] = []  # busy seconds of the steps since the last log line
        self._recorded: Optional[Tuple[float, float]] = None
        self._in_step = False

    @property
    def step(self) -> int:
        """The step the loop is at (0-based; a resumed run starts at the checkpoint's)."""
        return self.trainer.step

    def __enter__(self) -> "Run":
        trainer, cfg = self.trainer, self.cfg
        if trainer.verbose:
            os.makedirs(cfg.run_path, exist_ok=True)
            trainer._log = os.path.join(cfg.run_path, "log.txt")
        if cfg.check:  # rank 0, once; on screen when a precision is asked for or is not fp32
            asked = cfg.training.precision != "auto"
            fp32 = resolve_precision(cfg, trainer.device.type) == "fp32"
            trainer._print(precision_note(cfg, trainer.device.type), detail=fp32 and not asked)
        if cfg.checkpoint.format == "dcp" and cfg.checkpoint.every:
            trainer._sharded("--checkpoint.format dcp")  # refused before the first step
        trainer.maybe_resume()
        self.result.start_step = trainer.step
        self._reached[0] = trainer.step
        if trainer.verbose:
            if continues(cfg):  # the steps after the checkpoint leave metrics.jsonl
                moved = keep_metrics_to(cfg.run_path, trainer.step)
                if moved is not None:
                    trainer._print(moved)
            save_config(cfg, self._config_file())
            # append-only, a line at a time: what a run logged survives a later failure (a
            # fresh run never finds one, since load_config refuses to reuse a run directory)
            self._metrics = self._stack.enter_context(
                open(os.path.join(cfg.run_path, "metrics.jsonl"), "a", buffering=1))
        # A bar only on a terminal: in a log file its redraws are noise; the log lines remain.
        if (trainer.verbose and not trainer.quiet and cfg.logging.progress
                and trainer.step < cfg.training.steps and sys.stderr.isatty()):
            from tqdm import tqdm
            self._bar = tqdm(total=cfg.training.steps, initial=trainer.step, desc="train",
                             unit="step", dynamic_ncols=True)
            self._stack.callback(self._bar.close)
        self._stack.enter_context(interruptible(cfg, self._reached))
        self._prof = profiler(cfg.run_path, comm.group_rank(), cfg.logging.profile_steps)
        if self._prof is not None:
            self._stack.enter_context(self._prof)
        return self

    def batches(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """(inputs, targets), each (global batch, seq_len) on the run's device, for every step
        left; the work after a step (schedule, metrics, log, checkpoint) runs on the next ask."""
        trainer, cfg = self.trainer, self.cfg
        if trainer.pgm is not None and trainer.step < cfg.training.steps:
            # the ranks end their setup seconds apart on a busy host: under a short timeout the
            # first step's collective would time out (dist/init.py)
            meet_before_first_step(cfg.training.timeout_seconds)
        while trainer.step < cfg.training.steps:
            self._reached[0] = trainer.step
            start, waited = time.perf_counter(), comm.waited()
            lr = trainer.scheduler.get_last_lr()[0]
            trainer._maybe_inject_failure()
            self._recorded, self._in_step = None, True
            yield trainer.batch()
            self._in_step = False
            if self._recorded is None:
                raise RuntimeError("the step's loop did not call run.record(loss, grad_norm) "
                                   "before the optimizer step")
            trainer.end_step()  # the lr schedule's next step
            self._reached[0] = trainer.step  # trained: a stop in its log or save names it
            self._log_step(lr, time.perf_counter() - start, comm.waited() - waited)

    def record(self, loss: Any, grad_norm: Any, overflow: bool = False) -> None:
        """Read this step's loss and gradient norm (tensors or floats) for the log; a
        non-finite one stops the run (exit 3) before the optimizer step, unless ``overflow``
        (fp16's scaler skips that step by itself)."""
        self._recorded = (float(loss), float(grad_norm))
        if not overflow:
            check_finite(self.cfg, self.trainer.step + 1, self.trainer.rank, *self._recorded)

    def _log_step(self, lr: float, elapsed: float, waited: float) -> None:
        trainer, cfg, result = self.trainer, self.cfg, self.result
        if self._recorded is None:  # batches() checks it first; a script's loop may not
            raise RuntimeError(f"step {trainer.step + 1}: run.record(loss, grad_norm) was not "
                               f"called before the next batch")
        loss, grad_norm = self._recorded
        result.step_seconds.append(elapsed)
        result.busy_seconds.append(elapsed - waited)
        # the run's first step warms up; the profiler's steps run slower (its own work)
        if trainer.step - 1 > result.start_step + (cfg.logging.profile_steps if self._prof else 0):
            self._window.append(result.busy_seconds[-1])
        if self._prof is not None:
            self._prof.step()
        result.losses.append(loss)
        result.grad_norms.append(grad_norm)
        # bytes this rank sent in the step's collectives (our ledger: not torch's); none
        # without process groups (the --check reference, after the run's steps)
        wire = get_ledger().total(step=trainer.step -
                                  1, field="wire_bytes") if trainer.pgm is not None else 0.0
        tokens_per_s = cfg.data.global_batch_size * cfg.data.seq_len / elapsed
        record = dict(step=trainer.step, loss=loss, lr=lr, grad_norm=grad_norm,
                      tokens_per_s=tokens_per_s, wire_bytes=wire)
        if self._metrics is not None:
            try:
                self._metrics.write(json.dumps(record) + "\n")
            except OSError as err:  # a full disk: one line, not a traceback
                raise WriteError(f"could not write {clip(self._metrics.name)}: {err.strerror}; the "
                                 f"lines before this step's are kept") from None
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{loss:.4f}")
        if trainer.step % cfg.logging.log_every == 0 or trainer.step == cfg.training.steps:
            trainer._print(
                f"step {trainer.step:5d} | loss {loss:.4f} | lr {lr:.2e} | "
                f"grad norm {grad_norm:.3f} | {tokens_per_s:,.0f} tok/s", bar=self._bar)
            straggler = self._straggler_line()  # every rank: an all-gather
            if straggler is not None:
                trainer._print(straggler, detail=True, bar=self._bar)
        if cfg.checkpoint.every and trainer.step % cfg.checkpoint.every == 0:
            path = trainer.save()
            trainer._print(f"{'writing' if cfg.checkpoint.async_save else 'saved'} checkpoint "
                           f"{path}")

    def _straggler_line(self) -> Optional[str]:
        """At a log line: every rank's median busy time over the steps since the last one,
        all-gathered over the world; rank 0's line names a rank > 10% over the others."""
        if self.trainer.pgm is None or self.trainer.world_size < 2:
            return None
        busy = statistics.median(self._window) if self._window else 0.0
        self._window.clear()
        return straggler_report(busy, self.trainer.device)

    def _config_file(self) -> str:
        """Where this run's config goes: config.yaml, or beside it when resuming a run that
        has one, config.resume_<step>.yaml (what a run left is never written over)."""
        first = os.path.join(self.cfg.run_path, "config.yaml")
        if not os.path.exists(first):
            return first
        return os.path.join(self.cfg.run_path, f"config.resume_{self.trainer.step:07d}.yaml")

    def __exit__(self, kind: Optional[Type[BaseException]], err: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        trainer, raised = self.trainer, err
        if err is None and trainer.async_saver is not None:
            try:  # the last async checkpoint counts once whole
                finished = trainer.async_saver.finish()
                if finished is not None:
                    trainer._print(f"saved checkpoint {finished}")
            except BaseException as failed:  # noqa: B902 - handed to interruptible below
                err = failed
        if self._in_step and isinstance(err, (RuntimeError, dist.DistError)):
            # a collective failed (a peer died or timed out): say where
            r = get_ledger().last
            last = (f"; the last collective issued was {r.op} over group '{r.group}' "
                    f"({r.group_size} ranks)") if r is not None else ""
            wrapped = RuntimeError(f"rank {trainer.rank}: step {trainer.step} failed{last}: {err}")
            wrapped.__cause__ = err
            err = wrapped
        # interruptible turns an error after Ctrl-C into the stop's one line (RunStopped)
        self._stack.__exit__(type(err) if err else None, err, err.__traceback__ if err else None)
        if err is None:
            self._finish()
        elif err is not raised:
            raise err

    def _finish(self) -> None:
        trainer, cfg, result = self.trainer, self.cfg, self.result
        if self._prof is not None:
            n = cfg.logging.profile_steps
            trainer._print(f"profile: {n} step{'s' if n > 1 else ''} per rank in "
                           f"{os.path.join(cfg.run_path, 'profile')}/rank_<r>.json")
        if trainer.verbose and trainer.pgm is not None and result.step_seconds:  # chapter 09
            report = plan_report(cfg, trainer.world_size, trainer.pgm.pipeline_model_parallel_rank,
                                 trainer.model, trainer.optimizer, trainer.step - 1,
                                 result.step_seconds)
            if report:  # asked for by a cluster file, else a detail
                trainer._print(report, detail=not cfg.logging.plan_cluster)
