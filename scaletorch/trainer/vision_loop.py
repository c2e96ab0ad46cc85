"""Chapter 12's training loop: a ResNet classifier on image batches, and its resume.

The language-model ``Trainer`` is built around a ``Config`` whose model is a Llama and whose
batches are token sequences (its loader, loss, reference check and checkpoint layout read
them), so a classifier does not fit it without a second case in each. This loop is the same
loop for images, and reuses what is not about tokens: the checkpoint files (per-rank, with
checksums and a manifest), precision's autocast dtypes, the ledger's steps.

    for step in range(start, steps):
        images, labels = loader.local_batch(step, dp_rank, dp)   # this rank's B/dp images
        loss = cross_entropy(model(images), labels)               # BatchNorm: per-rank or sync
        loss.backward(); clip; optimizer.step(); after_step()     # per-rank: average buffers
        every ``checkpoint_every`` steps: save model (buffers too) and optimizer

Every rank's loss is the mean over its B/dp images; data parallel averages the gradients, so
the step is the one of the mean over all B, as on one device.
"""

import json
import math
import os
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from scaletorch.data.images import ImageBatchLoader
from scaletorch.dist import ProcessGroupManager, comm, get_ledger, restart_count
from scaletorch.models import classification_loss
from scaletorch.parallel.grad_norm import clip_replicated
from scaletorch.parallel.vision_parallel import ParallelResNet
from scaletorch.trainer import checkpoint as ckpt
from scaletorch.trainer.precision import DTYPES

PRECISIONS = {k: DTYPES[k] for k in ("fp32", "bf16")}  # the autocast dtype (None: none)


@dataclass
class VisionSettings:
    steps: int = 10
    lr: float = 3e-3
    grad_clip: float = 1.0  # 0: no clipping
    precision: str = "fp32"  # fp32 | bf16 (autocast; BatchNorm statistics stay fp32)
    checkpoint_dir: Optional[str] = None  # per-rank checkpoints here, and resume from here
    checkpoint_every: int = 0  # 0: none
    keep_last: int = 2  # older checkpoints are deleted
    # "latest" (the newest valid one in checkpoint_dir) or a checkpoint directory; None: none
    resume: Optional[str] = None
    # fault injection: SIGKILL rank fail_rank at this step, on the first try only; -1: never
    fail_at_step: int = -1
    fail_rank: int = 0
    metrics_path: Optional[str] = None  # rank 0 appends one JSON line per step


@dataclass
class VisionResult:
    losses: List[float] = field(default_factory=list)  # global mean loss of each step run
    grad_norms: List[float] = field(default_factory=list)
    step_seconds: List[float] = field(default_factory=list)
    start_step: int = 0


def single_device(model: nn.Module, lr: float) -> ParallelResNet:
    """The reference: the plain model, AdamW, the local norm; nothing after a step."""
    params = list(model.parameters())
    return ParallelResNet(
        model, torch.optim.AdamW(params, lr=lr, weight_decay=0.0),
        lambda max_norm: clip_replicated(params, max_norm), lambda: {
            k: v.detach().cpu().clone()
            for k, v in model.state_dict().items()
        }, lambda: None)


def _state(run: ParallelResNet, step: int) -> Dict[str, Any]:
    return {
        "model": ckpt.local_tensors(run.model.state_dict()),
        "optimizer": ckpt.local_tensors(run.optimizer.state_dict()),
        "step": step
    }


def resume(run: ParallelResNet, settings: VisionSettings, rank: int, world_size: int,
           layout: Dict[str, Any]) -> int:
    """Load ``settings.resume`` (or after a torchrun restart the latest checkpoint in
    ``settings.checkpoint_dir``); the step to start at."""
    path = settings.resume or ("latest" if restart_count() > 0 else None)
    if path == "latest" and settings.checkpoint_dir:
        path, _ = ckpt.latest_valid_checkpoint(settings.checkpoint_dir)
    if path is None or path == "latest":  # nothing saved before the restart: from step 0
        return 0
    state = ckpt.load_checkpoint(path, rank, world_size, layout)
    ckpt.load_model_and_optimizer(run.model, run.optimizer, state)
    return int(state["step"])


def train_resnet(run: ParallelResNet, loader: ImageBatchLoader, settings: VisionSettings,
                 pgm: Optional[ProcessGroupManager], device: torch.device,
                 layout: Optional[Dict[str,
                                       Any]] = None, stop_at: Optional[int] = None) -> VisionResult:
    """Train ``settings.steps`` steps (from the last checkpoint, if any); ``pgm`` None: one
    device. ``stop_at``: return before that step as a killed run would (tests)."""
    # pgm None: one device, even inside a distributed run (--check's reference on rank 0)
    group = pgm.gradient_sync_group if pgm is not None else None
    dp_rank, dp = (comm.group_rank(group), comm.group_size(group)) if pgm else (0, 1)
    rank, world = (comm.group_rank(), comm.group_size()) if pgm else (0, 1)
    result = VisionResult()
    result.start_step = resume(run, settings, rank, world, layout or {})
    dtype = PRECISIONS[settings.precision]
    max_norm = settings.grad_clip if settings.grad_clip > 0 else math.inf
    for step in range(result.start_step, settings.steps):
        if stop_at is not None and step == stop_at:
            break
        if step == settings.fail_at_step and rank == settings.fail_rank and restart_count() == 0:
            print(f"rank {rank}: injected failure at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # as a lost machine: no exit, no last save
        get_ledger().set_step(step)
        start = time.perf_counter()
        images, labels = loader.local_batch(step, dp_rank, dp)
        run.model.train()
        amp = torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()
        with amp:
            logits = run.model(images.to(device))
        loss = classification_loss(logits, labels.to(device))
        loss.backward()
        finish = getattr(run.model, "finish_grad_sync", None)
        if finish is not None:
            finish()
        norm = run.clip_grad_norm(max_norm)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        run.after_step()
        mean = loss.detach().float().reshape(1)
        if pgm is not None:
            with get_ledger().paused():  # the loss for the log, not training traffic
                comm.all_reduce(mean, group)
        result.losses.append(mean.item() / dp)
        result.grad_norms.append(float(norm))
        result.step_seconds.append(time.perf_counter() - start)
        if settings.checkpoint_dir and settings.checkpoint_every and \
                (step + 1) % settings.checkpoint_every == 0:
            ckpt.save_checkpoint(settings.checkpoint_dir, step + 1, _state(run, step + 1), rank,
                                 world, keep_last=settings.keep_last, layout=layout)
        if settings.metrics_path and rank == 0:
            wire = get_ledger().total(step=step, field="wire_bytes") if pgm else 0.0
            with open(settings.metrics_path, "a") as f:
                f.write(
                    json.dumps(
                        dict(step=step, loss=result.losses[-1], grad_norm=result.grad_norms[-1],
                             wire_bytes=wire)) + "\n")
    return result


def is_buffer(key: str) -> bool:
    """A BatchNorm running statistic or its step count, not a parameter."""
    return "running_" in key or "num_batches" in key


def largest_deviation(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """{"weight", "buffer"}: the largest |a - b| over parameters and over running buffers
    (num_batches_tracked, a count, must be equal: any difference counts as inf)."""
    if sorted(a) != sorted(b):
        raise ValueError(f"the states hold different keys: {sorted(set(a) ^ set(b))}")
    out = {"weight": 0.0, "buffer": 0.0}
    for key in a:
        kind = "buffer" if is_buffer(key) else "weight"
        diff = (a[key].double() - b[key].double()).abs().max().item()
        if "num_batches" in key and diff != 0:
            diff = math.inf
        out[kind] = max(out[kind], diff)
    return out


def makedirs_for(path: Optional[str]) -> None:
    if path:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
