"""The run's configuration as dataclasses: every knob, in sections that match the YAML files
in ``examples/configs``. Strategy code reads it from here without importing the trainer.

Loading (YAML, command line) and validation live in scaletorch/trainer/config.py; this module
holds the fields, their defaults and two rules that read them: the compute precision
(``resolve_precision``) and the recomputation mode (``recompute_mode``).
"""

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from scaletorch.models import LlamaConfig
from scaletorch.rules.recompute import RECOMPUTE, recompute_mode

__all__ = [
    "CheckpointConfig", "Config", "DataConfig", "LoggingConfig", "ParallelConfig", "PRECISIONS",
    "RECOMPUTE", "TrainingConfig", "autocast_dtype", "gpu_has_native_bf16", "recompute_mode",
    "resolve_precision"
]

PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # training.precision


@dataclass
class DataConfig:
    dataset: str = "synthetic"  # synthetic | text | bin
    path: Optional[str] = None  # the file for text and bin
    seq_len: int = 32
    global_batch_size: int = 8  # sequences per optimizer step, over all data-parallel ranks
    num_micro_batches: int = 1  # gradient accumulation steps (micro-batches per rank per step)
    seed: int = 1234  # the data seed: batch t is a function of (seed, t) only


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    data_parallel_size: int = 0  # 0: whatever the world size leaves; else must match it
    impl: str = "scaletorch"  # scaletorch (ours, by hand) | naive (01 only) | torch (native)
    bucket_size_mb: float = 25.0  # DDP gradient bucket size
    zero_stage: int = 0  # 0: plain data parallel; 1, 2, 3: ZeRO stages
    sequence_parallel: bool = False
    schedule: str = "1f1b"  # afab | 1f1b | interleaved | zb-h1 | zbv | dualpipev (chapter 04)
    virtual_pipeline_stages: int = 1
    cp_variant: str = "ring"  # ring | ulysses
    cp_attention: str = "auto"  # ring's blocks: auto (fused on CUDA, math elsewhere) | math | fused
    # none | selective (recompute the attention core) | full (each block); true/false: full/none
    activation_checkpointing: str = "none"
    # layers per global pipeline stage (pp x virtual stages entries); None: an even split
    layer_split: Optional[List[int]] = None
    # mixed precision (chapter 08): ZeRO-3's parameter all-gather dtype, gradients' wire dtype
    # auto (the compute dtype: what ZeRO-3 should gather, mixed_precision.py) | fp32 | bf16 | fp16
    param_dtype: str = "auto"
    reduce_dtype: str = "fp32"  # fp32 | bf16 | fp16


@dataclass
class TrainingConfig:
    steps: int = 100
    lr: float = 3e-3
    min_lr: float = 3e-4  # the cosine decays to this
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # global-norm clipping; 0 disables it
    # auto (bf16 on GPU, fp32 on CPU and under --check) | fp32 | bf16 | fp16
    precision: str = "auto"
    model_seed: int = 42  # one seed builds the same full model on every rank
    timeout_seconds: float = 300.0  # every collective fails after this instead of hanging
    fail_at_step: int = -1  # fault injection: kill rank ``fail_rank`` at this step (first try only)
    fail_rank: int = 0


@dataclass
class CheckpointConfig:
    every: int = 0  # save every N steps; 0: never
    dir: Optional[str] = None  # default: <run dir>/checkpoints
    resume: Optional[str] = None  # "latest" or a checkpoint directory
    keep_last: int = 2  # older checkpoints are deleted


@dataclass
class LoggingConfig:
    run_dir: str = "runs"
    name: str = "run"
    # --overwrite: a run directory (or checkpoint.dir) that already holds a run is moved aside
    # to <path>.old-<time>, never deleted; without it such a directory is refused
    overwrite: bool = False
    log_every: int = 10
    progress: bool = True  # tqdm bar on rank 0
    # a cluster file from scripts/plan.py --calibrate: the run ends with the planner's step time
    # beside the measured one (memory and wire bytes are compared without it)
    plan_cluster: str = ""
    # --profile STEPS: a torch.profiler trace of that many steps (after one of warm-up) per rank
    # in runs/<name>/profile/rank_<r>.json (chapter 11; scripts/plot.py profile draws it)
    profile_steps: int = 0


@dataclass
class Config:
    model: LlamaConfig = field(default_factory=LlamaConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    check: bool = False  # also run the single-device reference and compare

    @property
    def run_path(self) -> str:
        return os.path.join(self.logging.run_dir, self.logging.name)

    @property
    def checkpoint_path(self) -> str:
        return self.checkpoint.dir or os.path.join(self.run_path, "checkpoints")

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def resolve_precision(cfg: Config, device_type: str, bf16_native: Optional[bool] = None) -> str:
    """The precision the run computes in, "fp32", "bf16" or "fp16", on a device of ``device_type``
    ("cpu", "cuda", ...): ``training.precision``, with "auto" resolved: bf16 on a GPU that
    computes in bf16 natively (compute capability 8.0 and later: A100, H100, ...), fp32 on any
    other device and under --check. A V100 or T4 only emulates bf16 (slower than fp32, or an
    error under autocast); fp16 with a loss scale is its mixed precision, asked for by name.
    ``bf16_native`` defaults to what the current GPU says (tests inject it)."""
    precision = cfg.training.precision
    if precision not in PRECISIONS:
        raise ValueError(f"training.precision must be one of {', '.join(PRECISIONS)}, "
                         f"got {precision!r}")
    if precision == "auto":
        if device_type != "cuda" or cfg.check:
            return "fp32"
        if bf16_native is None:
            bf16_native = gpu_has_native_bf16()
        return "bf16" if bf16_native else "fp32"
    return precision


def autocast_dtype(cfg: Config, device_type: str) -> torch.dtype:
    """The dtype the Trainer's autocast computes matmuls in (fp32: no autocast): tensor and
    expert parallel send activations in it, as the matmul would cast them anyway."""
    return getattr(torch, _TORCH_NAMES[resolve_precision(cfg, device_type)])


_TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def gpu_has_native_bf16() -> bool:
    """Whether the current CUDA device computes in bf16 in hardware (not emulated). Call only
    where CUDA is present."""
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # a torch 2.x before the argument existed: ask the capability
        return torch.cuda.get_device_capability()[0] >= 8
