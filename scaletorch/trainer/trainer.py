"""The shared training step of chapters 07 on, and the state every run keeps.

    for step in range(start, steps):
        inputs, targets = loader.get_batch(step)        # the same global batch on every rank
        loss = forward_backward(inputs, targets)        # the strategy's step (see step.py)
        grad_norm = clip_grad_norm(max_norm)            # global norm, however params are split
        optimizer.step(); scheduler.step()
        log, checkpoint

Chapters 00-06 write that loop in their script, inside ``start_run`` (run.py: the run
directory, resume, metrics, checkpoints and stops); ``Trainer.train`` runs the same ``Run``
around this shared step. A strategy changes the model (wrapping or sharding it) and, where it
must, passes its own ``loss_fn`` (tensor parallel's vocab-parallel loss, for the default step),
``forward_backward`` (pipeline schedules), ``clip_grad_norm`` (sharded parameters) or
``optimizer`` (ZeRO). Everything else stays the same, which is what makes the runs comparable.
"""

import math
import os
import signal
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Tuple, cast

import torch
from torch import nn

from scaletorch.data import GlobalBatchLoader, build_dataset
from scaletorch.data.loader import BatchSource
from scaletorch.dist import ProcessGroupManager, comm, get_ledger, restart_count
from scaletorch.dist.dtensor import is_dtensor
from scaletorch.models import loss_fn, moe_aux_loss
from scaletorch.parallel.grad_norm import clip_replicated
from scaletorch.parallel.mixed_precision import DynamicLossScaler, scale_backward
from scaletorch.parallel.moe_balance import BiasBalancer, bias_state, load_bias_state
from scaletorch.parallel.moe_load import measured_step
from scaletorch.parallel.step import ForwardBackward, LossFn, make_data_parallel_step
from scaletorch.rules.errors import InputError
from scaletorch.trainer import checkpoint as ckpt
from scaletorch.trainer.config import Config
from scaletorch.trainer.precision import autocast, resolve_precision
from scaletorch.trainer.resume_check import record
from scaletorch.trainer.run import Run, TrainResult
from scaletorch.trainer.stops import check_finite

if TYPE_CHECKING:
    from scaletorch.parallel.parallelize import Parallelized
    from scaletorch.trainer.dcp_async import AsyncSaver


def build_optimizer(cfg: Config, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    t = cfg.training
    return torch.optim.AdamW(params, lr=t.lr, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)


def lr_at(cfg: Config, step: int) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr``."""
    t = cfg.training
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))


def _the_scripts_step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("a run from start_run trains with the script's own loop, not the "
                       "Trainer's step")


def start_run(cfg: Config, model: nn.Module, optimizer: torch.optim.Optimizer,
              pgm: Optional[ProcessGroupManager] = None, verbose: bool = True,
              quiet: bool = False) -> Run:
    """The run around a script's own training loop (chapters 00-06; run.py shows the loop):
    the run directory, resume, the lr schedule, metrics, log lines, checkpoints and stops.
    ``model`` and ``optimizer`` are what the script trains and steps; their state is what a
    checkpoint saves and a resume loads. Use it as ``with start_run(...) as run:``.
    ``verbose=False``: no run directory, nothing printed (a ``--check`` reference);
    ``quiet=True``: the run directory written, nothing printed (06b's remedies: one table)."""
    if resolve_precision(cfg, next(model.parameters()).device.type) == "fp16":
        raise InputError("training.precision fp16 needs a loss scale, which this chapter's "
                         "loop does not have: run examples/08_mixed_precision.py")
    trainer = Trainer(cfg, model, pgm, optimizer=optimizer, forward_backward=_the_scripts_step,
                      verbose=verbose)
    trainer.quiet = quiet
    return Run(trainer, TrainResult())


def build_loader(cfg: Config) -> GlobalBatchLoader:
    dataset = build_dataset(cfg.data.dataset, cfg.model.vocab_size, cfg.data.seed,
                            path=cfg.data.path)
    return GlobalBatchLoader(dataset, cfg.data.global_batch_size, cfg.data.seq_len, cfg.data.seed)


class Trainer:
    """Runs ``cfg.training.steps`` optimizer steps of ``model`` on the global batches.

    ``pgm`` is the process-group manager; ``None`` means a plain single-device run that
    touches no process group (the reference of every parity check). Only global rank 0
    prints, shows the progress bar and writes ``runs/<name>/{config.yaml,metrics.jsonl,log.txt}``
    (log.txt: every line it prints, and the details a run without ``--verbose`` keeps off
    stdout: the fp32 precision note, the plan and straggler lines); ``verbose=False``
    silences it entirely.
    """

    def __init__(self, cfg: Config, model: nn.Module, pgm: Optional[ProcessGroupManager] = None, *,
                 device: Optional[torch.device] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None,
                 forward_backward: Optional[ForwardBackward] = None, loss_fn: LossFn = loss_fn,
                 clip_grad_norm: Optional[Callable[[float], torch.Tensor]] = None,
                 scaler: Optional[DynamicLossScaler] = None, verbose: bool = True,
                 loader: Optional[BatchSource] = None) -> None:
        self.cfg = cfg
        self.model = model
        self.pgm = pgm
        self.device = device or next(model.parameters()).device
        self.rank = comm.group_rank() if pgm is not None else 0
        self.world_size = comm.group_size() if pgm is not None else 1
        self.verbose = verbose and self.rank == 0
        self.quiet = False  # True: log.txt only, nothing on stdout (start_run's quiet)
        self.loader: BatchSource = loader or build_loader(cfg)  # a dry run's: shapes only
        self.optimizer = optimizer or build_optimizer(cfg, model.parameters())
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_at(cfg, step) / cfg.training.lr
            if cfg.training.lr > 0 else 0.0)
        fp16 = resolve_precision(cfg, self.device.type) == "fp16"
        if forward_backward is None:
            # fp16: a loss scale, agreed over the world (alone on one device: pgm None)
            scaler = DynamicLossScaler(agree=pgm is not None) if fp16 else None
            aux_loss: Callable = moe_aux_loss
            if scaler is not None:  # backward from scale x each loss, their values unscaled
                loss_fn, aux_loss = (cast(LossFn, scale_backward(loss_fn, scaler)),
                                     cast(Callable, scale_backward(moe_aux_loss, scaler)))
            if pgm is None:
                forward_backward = make_data_parallel_step(model, cfg.data.num_micro_batches, 0, 1,
                                                           None, loss_fn, aux_loss=aux_loss)
            else:
                forward_backward = make_data_parallel_step(model, cfg.data.num_micro_batches,
                                                           pgm.data_parallel_rank,
                                                           pgm.data_parallel_world_size,
                                                           pgm.gradient_sync_group, loss_fn,
                                                           aux_loss=aux_loss)
        if fp16 and scaler is None:
            raise ValueError("training.precision fp16: this step does not scale the loss (pass "
                             "the DynamicLossScaler its forward_backward uses: after parallelize, "
                             "Trainer.from_parallelized(..., scaler=precision.scaler))")
        self.scaler = scaler
        # model.moe_bias_rate: 06b's routing bias, saved beside the weights (layouts hold params)
        self.balancer: Optional[BiasBalancer] = None
        if cfg.model.num_experts > 0 and cfg.model.moe_bias_rate > 0:
            self.balancer = BiasBalancer(model, cfg.model.moe_bias_rate, persistent=False)
            forward_backward = measured_step(forward_backward, self.balancer.update)
        self.forward_backward = forward_backward
        self.clip_grad_norm = clip_grad_norm or self._clip_replicated
        self.step = 0
        # a dry run's: checkpoints counted there (bytes per file), not written
        self.checkpoint_sizes: Optional[ckpt.SizeCounter] = None
        # what parallelize built (from_parallelized): where each tensor lives, for dcp checkpoints
        self.parallelized: Optional["Parallelized"] = None
        self.async_saver: Optional["AsyncSaver"] = None  # --checkpoint.async_save's write
        if cfg.checkpoint.async_save:  # DCP's modules are imported only by the runs that use them
            from scaletorch.trainer import dcp_async
            self.async_saver = dcp_async.AsyncSaver()
        self._log: Optional[str] = None  # rank 0's log.txt in the run directory, from train()

    @classmethod
    def from_parallelized(cls, cfg: Config, par: "Parallelized", pgm: ProcessGroupManager, *,
                          device: Optional[torch.device] = None, verbose: bool = True,
                          loader: Optional[BatchSource] = None,
                          scaler: Optional[DynamicLossScaler] = None) -> "Trainer":
        """The Trainer of what ``scaletorch.parallel.parallelize`` returned: its model, its
        step (data parallel or pipeline), its global-norm clipping and (ZeRO) optimizer.
        ``scaler``: fp16's, the one chapter 08's hooks gave the step (``precision.scaler``)."""
        trainer = cls(cfg, par.model, pgm, device=device, optimizer=par.optimizer,
                      forward_backward=par.forward_backward, clip_grad_norm=par.clip_grad_norm,
                      scaler=scaler, verbose=verbose, loader=loader)
        trainer.parallelized = par
        return trainer

    def _clip_replicated(self, max_norm: float) -> torch.Tensor:
        """Global norm when every rank holds whole, already-synchronized gradients.

        The same fp32 sum of squares as every sharded layout (grad_norm.py), not
        torch.nn.utils.clip_grad_norm_: on CPU its per-tensor norm (torch._foreach_norm) is
        off by 1e-5 relative on a 1.6M-element gradient (GPT-2's vocabulary at hidden 32),
        and through the clipping factor that alone broke 1e-5 parity with the sharded runs.
        """
        params = [p for p in self.model.parameters() if p.grad is not None]
        if any(is_dtensor(p) for p in params):  # FSDP2 alone (chapter 02): shards
            return torch.nn.utils.clip_grad_norm_(params, max_norm)  # DTensor's global norm
        return clip_replicated(params, max_norm)  # every rank holds every gradient

    # ---- checkpoints -------------------------------------------------------------------

    def state_dict(self) -> dict:
        state = {
            "step": self.step,
            "model": ckpt.local_tensors(self.model.state_dict()),
            "optimizer": ckpt.local_tensors(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "rng": ckpt.rng_state(),
        }
        if self.scaler is not None:  # fp16: the loss scale resumes where it was
            state["scaler"] = self.scaler.state_dict()
        if self.balancer is not None:
            state["moe_bias"] = bias_state(self.balancer)
        return state

    def load_state_dict(self, state: dict, name: str = "the checkpoint") -> None:
        """Load what ``state_dict`` returned (``name``: where it came from, for an error)."""
        ckpt.load_model_and_optimizer(self.model, self.optimizer, state, name)
        saved_lr = self.load_schedule(state["scheduler"])
        changed = self._apply_adamw_settings()
        ckpt.set_rng_state(state["rng"])
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
        if self.balancer is not None and "moe_bias" in state:  # else it starts at 0
            load_bias_state(self.balancer, state["moe_bias"], name)
        self.step = state["step"]
        self.note_changed_settings(saved_lr, changed)

    def note_changed_settings(self, saved_lr: float, changed: Dict[str, Tuple[float,
                                                                              float]]) -> None:
        """One line per setting a resume changed: the lr the checkpoint's run had, and
        {key: (checkpoint's, this run's)} of AdamW's betas and weight decay. Call after
        ``self.step`` is the resumed step (a per-rank or a sharded checkpoint)."""
        if saved_lr != self.cfg.training.lr:
            self._print(f"training.lr changed from {saved_lr:g} to {self.cfg.training.lr:g} at "
                        f"resume: from step {self.step} the learning rate follows "
                        f"{self.cfg.training.lr:g}'s schedule")
        for key, (before, now) in changed.items():
            self._print(f"training.{key} changed from {before:g} to {now:g} at resume")

    def _apply_adamw_settings(self) -> Dict[str, Tuple[float, float]]:
        """Set this run's betas and weight decay on the optimizer, whose loaded state brought
        the checkpoint's; returns {key: (checkpoint's, this run's)} of those that differ."""
        t, changed = self.cfg.training, {}
        for group in self.optimizer.param_groups:
            now = {"beta1": t.beta1, "beta2": t.beta2, "weight_decay": t.weight_decay}
            before = ckpt.adamw_settings(group)
            changed.update({k: (before[k], now[k]) for k in now if before[k] != now[k]})
            group["betas"], group["weight_decay"] = (t.beta1, t.beta2), t.weight_decay
        return changed

    def load_schedule(self, state: dict) -> float:
        """Load the LambdaLR ``state`` of a checkpoint at this run's ``training.lr``; returns
        the lr the checkpoint's run had. LambdaLR's state holds its base lr, and the optimizer's
        holds the lr of the step it saved: both are set anew, so a resume with another
        ``--training.lr`` (or min_lr, warmup, steps) trains at the value the user asked for."""
        self.scheduler.load_state_dict(state)
        saved = float(self.scheduler.base_lrs[0])
        step, lr = self.scheduler.last_epoch, self.cfg.training.lr
        self.scheduler.base_lrs = [lr for _ in self.optimizer.param_groups]
        for group, rate in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
            group["initial_lr"], group["lr"] = lr, lr * rate(step)
        self.scheduler._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        return saved

    def maybe_resume(self) -> None:
        """Load ``checkpoint.resume`` ("latest" or a directory), if set.

        After torchrun restarts a failed job (``--max-restarts``) every rank resumes from the
        latest valid checkpoint by itself, so the restarted run continues where it stopped.
        """
        resume = self.cfg.checkpoint.resume
        if not resume and self.pgm is not None and restart_count() > 0:
            resume = "latest"
            self._print(f"torchrun restart {restart_count()}: resuming from the latest "
                        f"checkpoint in {self.cfg.checkpoint_path}")
        if not resume:
            return
        path: Optional[str] = resume
        if resume == "latest":
            path, skipped = ckpt.latest_valid_checkpoint(self.cfg.checkpoint_path)
            for message in skipped:
                self._print(message)
        if path is None and restart_count() == 0:  # asked for, and there is none (load_config
            raise ckpt.nothing_to_resume(self.cfg.checkpoint_path, skipped)  # refused it first)
        if path is None:
            self._print(f"no checkpoint in {self.cfg.checkpoint_path}: starting from step 0")
            return
        if ckpt.read_manifest(path).get("format") == "dcp":  # pieces: any layout reads them
            from scaletorch.trainer import dcp_checkpoint
            dcp_checkpoint.load_sharded(path, self, self._sharded(f"resuming {path}"))
        else:
            self.load_state_dict(
                ckpt.load_checkpoint(path, self.rank, self.world_size, self.layout()),
                f"checkpoint file {ckpt.rank_file(path, self.rank)!r}")
        self._print(f"resumed from {path} at step {self.step}")

    def layout(self) -> dict:
        """The sizes that decide which shard each rank holds (``checkpoint.run_layout``), and
        the run's config, which a resume compares with its own (resume_check.py)."""
        return {**ckpt.run_layout(self.cfg, self.world_size), "config": record(self.cfg)}

    def _sharded(self, what: str) -> "Parallelized":
        """What parallelize built, which a dcp checkpoint needs (InputError naming ``what``)."""
        if self.parallelized is None:
            raise InputError(f"{what} needs a model built by parallelize (chapter 07's script and "
                             f"later): this script writes --checkpoint.format per-rank")
        return self.parallelized

    def save(self) -> str:
        # a dry run's save counts this rank's state as a per-rank file (meta tensors are not
        # written): a dcp file holds the same pieces, less the replicas another rank writes
        dcp = self.cfg.checkpoint.format == "dcp" and self.checkpoint_sizes is None
        if dcp and self.async_saver is not None:  # written while training goes on (dcp_async.py)
            return self.async_saver.start(self.cfg.checkpoint_path, self.step, self,
                                          self._sharded("--checkpoint.format dcp"),
                                          self.cfg.checkpoint.keep_last, self.layout())
        if dcp:
            from scaletorch.trainer import dcp_checkpoint
            return dcp_checkpoint.save_sharded_checkpoint(self.cfg.checkpoint_path, self.step, self,
                                                          self._sharded("--checkpoint.format dcp"),
                                                          self.cfg.checkpoint.keep_last,
                                                          self.layout())
        return ckpt.save_checkpoint(self.cfg.checkpoint_path, self.step, self.state_dict(),
                                    self.rank, self.world_size, self.cfg.checkpoint.keep_last,
                                    layout=self.layout(), counter=self.checkpoint_sizes)

    # ---- the loop ----------------------------------------------------------------------

    def _print(self, message: str, detail: bool = False, bar: Any = None) -> None:
        """Rank 0's line: always into the run directory's log.txt; on stdout (above the progress
        ``bar``, if any) unless it is a ``detail`` (the precision, plan and straggler lines)
        and the run is not ``--verbose``."""
        if not self.verbose:
            return
        if self._log is not None:
            with open(self._log, "a") as f:  # a line at a time: nothing to close on a failure
                f.write(message + "\n")
        if self.quiet or (detail and not self.cfg.logging.verbose):
            return
        if bar is not None:
            bar.write(message)
        else:
            print(message, flush=True)

    def train_step(self) -> tuple[float, float]:
        """One optimizer step on global batch ``self.step``; returns (loss, grad norm).

        Its two host syncs read them before the optimizer can take a bad step (the log needs
        the numbers too): a non-finite value stops the run there, fp16's own skip aside."""
        values: List[float] = []

        def read_and_check(loss: Any, grad_norm: torch.Tensor, overflow: bool) -> None:
            values.extend((float(loss), float(grad_norm)))
            if not overflow:
                check_finite(self.cfg, self.step + 1, self.rank, values[0], values[1])

        self.step_tensors(before_update=read_and_check)
        return values[0], values[1]

    def step_tensors(
        self, before_update: Optional[Callable[[Any, torch.Tensor, bool], None]] = None
    ) -> tuple[Any, torch.Tensor]:
        """The step with no host sync of its own: (loss, grad norm) as the step left them (a
        dry run's fake tensors have no values to read, scaletorch/trainer/dry_run.py).
        ``before_update(loss, grad norm, overflow)`` runs after clipping, before the update."""
        loss, grad_norm = self.update(*self.batch(), before_update)
        self.end_step()
        return loss, grad_norm

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``self.step``'s global batch (inputs, targets), each (b, s), on the device."""
        get_ledger().set_step(self.step)
        inputs, targets = self.loader.get_batch(self.step)
        return inputs.to(self.device), targets.to(self.device)

    def update(
        self, inputs: torch.Tensor, targets: torch.Tensor,
        before_update: Optional[Callable[[Any, torch.Tensor, bool], None]] = None
    ) -> tuple[Any, torch.Tensor]:
        """The shared step on one global batch: forward and backward, clip, optimizer step."""
        self.optimizer.zero_grad(set_to_none=True)
        with autocast(self.cfg, self.device):  # the precision the reference uses too
            loss = self.forward_backward(inputs, targets)
        # fp16: divide by the loss scale; an inf or NaN on any rank skips the step everywhere
        overflow = self.scaler is not None and self.scaler.unscale_and_check(
            self.model.parameters())
        max_norm = self.cfg.training.grad_clip or math.inf  # 0 disables clipping
        grad_norm = self.clip_grad_norm(max_norm)
        if before_update is not None:
            before_update(loss, grad_norm, overflow)
        if not overflow:
            self.optimizer.step()
        if self.scaler is not None:
            self.scaler.update(overflow)
        return loss, grad_norm

    def end_step(self) -> None:
        """After the optimizer step: the learning rate of the next one, the step count."""
        self.scheduler.step()
        self.step += 1

    def _maybe_inject_failure(self) -> None:
        """``--fail-at-step K --fail-rank R``: rank R dies abruptly at step K, on the first try.

        SIGKILL, not an exception: no cleanup runs, as when a machine or a process is lost.
        """
        t = self.cfg.training
        if (t.fail_at_step == self.step and self.rank == t.fail_rank and restart_count() == 0
                and self.pgm is not None):
            print(f"rank {self.rank}: injected failure at step {self.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def train(self) -> TrainResult:
        """Run the steps left (after a resume) with the shared step, in a ``Run`` (run.py):
        the run directory, metrics, log lines, checkpoints and stops."""
        result = TrainResult()
        with Run(self, result) as run:
            for inputs, targets in run.batches():
                self.update(inputs, targets, run.record)
        return result
