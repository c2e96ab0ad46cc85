"""The run's configuration as dataclasses: every knob, in sections that match the YAML files
in ``examples/configs``. Strategy code reads it from here without importing the trainer.

Each field declares its rule beside it (``checked(default, rule)``, scaletorch/rules/schema.py):
its range, its choices, a path, the settings under which it is read. Loading (YAML, command
line) and the checks live in scaletorch/trainer/config.py; this module holds the fields, their
defaults, their rules and two functions that read them: the compute precision
(``resolve_precision``) and the recomputation mode (``recompute_mode``).
"""

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from scaletorch.models import LlamaConfig
from scaletorch.rules.recompute import RECOMPUTE, recompute_mode
from scaletorch.rules.schema import (MAX_LAYERS, MAX_MICRO_BATCHES, PRINTED, REFUSED, RESHARD,
                                     SILENT, Rule, at_least, checked, count, creatable_dir,
                                     existing_file, fraction, one_of, path_component, positive,
                                     seed_range, unless)

__all__ = [
    "CheckpointConfig", "Config", "DataConfig", "LoggingConfig", "ParallelConfig", "PRECISIONS",
    "RECOMPUTE", "TrainingConfig", "VisionConfig", "VisionRunConfig", "autocast_dtype",
    "gpu_has_native_bf16", "recompute_mode", "resolve_precision"
]

PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # training.precision
# parallel.param_dtype (or auto), parallel.reduce_dtype; fp64 is a name only, which the
# precision policy refuses saying why (wider than the fp32 master weights)
DTYPES = ("fp32", "bf16", "fp16", "fp64")
SCHEDULES = ("afab", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")  # parallel.schedule


@dataclass
class DataConfig:
    dataset: str = checked("synthetic", one_of("synthetic", "text", "bin"), resume=REFUSED)
    # the file for text and bin; given with the synthetic dataset, it would be ignored
    path: Optional[str] = checked(None, unless(existing_file(), "dataset", "synthetic"),
                                  resume=REFUSED)
    seq_len: int = checked(32, positive(), resume=REFUSED)
    # sequences per optimizer step, over all data-parallel ranks
    global_batch_size: int = checked(8, positive(), resume=REFUSED)
    # gradient accumulation steps (micro-batches per rank per step)
    num_micro_batches: int = checked(1, count(MAX_MICRO_BATCHES), resume=PRINTED)
    # the data seed: batch t is a function of (seed, t)
    seed: int = checked(1234, seed_range(), resume=REFUSED)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = checked(1, positive(), resume=RESHARD)
    pipeline_model_parallel_size: int = checked(1, positive(), resume=RESHARD)
    context_parallel_size: int = checked(1, positive(), resume=RESHARD)
    # experts split over ep ranks: a dense model (num_experts 0) has none
    expert_model_parallel_size: int = checked(1, unless(positive(), "model.num_experts", 0),
                                              resume=RESHARD)
    # 0: whatever the world size leaves; else must match it
    data_parallel_size: int = checked(0, at_least(0), resume=RESHARD)
    # ours, by hand | plain data parallel (01 only) | torch's native strategies
    impl: str = checked("ours", one_of("ours", "naive", "torch"), resume=RESHARD)
    # DDP's gradient bucket size: naive data parallel has no buckets, ZeRO its own flat units
    bucket_size_mb: float = checked(
        25.0, unless(unless(positive(), "impl", "naive"), "zero_stage", 1, 2, 3), resume=PRINTED)
    # 0: plain data parallel; 1-3: ZeRO
    zero_stage: int = checked(0, one_of(0, 1, 2, 3), resume=RESHARD)
    # splits the activations over the tensor-parallel group: nothing to split at tp 1
    sequence_parallel: bool = checked(False, unless(Rule(), "tensor_model_parallel_size", 1),
                                      resume=PRINTED)
    # chapter 04's options, read by a pipeline only (pp > 1)
    schedule: str = checked("1f1b", unless(one_of(*SCHEDULES), "pipeline_model_parallel_size", 1),
                            resume=RESHARD)
    virtual_pipeline_stages: int = checked(
        1, unless(count(MAX_LAYERS), "pipeline_model_parallel_size", 1), resume=RESHARD)
    # chapter 05's options, read by context parallel only (cp > 1)
    cp_variant: str = checked("ring", unless(one_of("ring", "ulysses"), "context_parallel_size", 1),
                              resume=PRINTED)
    # the ring's attention-tile kernel: auto (fused on CUDA, math elsewhere) | math | fused;
    # Ulysses has no tiles
    cp_attention: str = checked(
        "auto",
        unless(unless(one_of("auto", "math", "fused"), "cp_variant", "ulysses"),
               "context_parallel_size", 1), resume=PRINTED)
    # none | selective (recompute the attention core) | full (each block); true/false: full/none
    activation_checkpointing: str = checked("none", one_of(*RECOMPUTE), resume=PRINTED)
    # layers per global pipeline stage (pp x virtual stages entries); None: an even split
    layer_split: Optional[List[int]] = checked(
        None, unless(positive(), "pipeline_model_parallel_size", 1), resume=RESHARD)
    # mixed precision (chapter 08): ZeRO-3's parameter all-gather dtype, gradients' wire dtype
    # auto (the compute dtype: what ZeRO-3 should gather, mixed_precision.py) | fp32 | bf16 | fp16;
    # ZeRO-3 alone gathers parameters (stages 0-2 keep the fp32 master whole)
    param_dtype: str = checked("auto", unless(one_of("auto", *DTYPES), "zero_stage", 0, 1, 2),
                               resume=PRINTED)
    reduce_dtype: str = checked("fp32", one_of(*DTYPES), resume=PRINTED)


@dataclass
class TrainingConfig:
    steps: int = checked(100, positive(), resume=PRINTED)
    lr: float = checked(3e-3, at_least(0), resume=PRINTED)
    min_lr: float = checked(3e-4, at_least(0), resume=PRINTED)  # the cosine decays to this
    warmup_steps: int = checked(10, at_least(0), resume=PRINTED)
    weight_decay: float = checked(0.1, at_least(0), resume=PRINTED)
    beta1: float = checked(0.9, fraction(), resume=PRINTED)  # AdamW's betas, in [0, 1)
    beta2: float = checked(0.95, fraction(), resume=PRINTED)
    # global-norm clipping; 0 disables it
    grad_clip: float = checked(1.0, at_least(0), resume=PRINTED)
    # auto (bf16 on GPU, fp32 on CPU and under --check) | fp32 | bf16 | fp16
    precision: str = checked("auto", one_of(*PRECISIONS), resume=PRINTED)
    # one seed builds the same full model everywhere
    model_seed: int = checked(42, seed_range(), resume=PRINTED)
    # every collective fails after this instead of hanging
    timeout_seconds: float = checked(300.0, positive(), resume=SILENT)
    # fault injection: kill rank ``fail_rank`` at this step (first try only); -1: never
    fail_at_step: int = checked(-1, at_least(-1), resume=PRINTED)
    fail_rank: int = checked(0, unless(at_least(0), "fail_at_step", -1), resume=PRINTED)


@dataclass
class CheckpointConfig:
    every: int = checked(0, at_least(0), resume=PRINTED)  # save every N steps; 0: never
    # default: <run dir>/checkpoints
    dir: Optional[str] = checked(None, creatable_dir(), resume=SILENT)
    # "latest" or a checkpoint that exists (check_resume reads it before the run starts)
    resume: Optional[str] = checked(None, Rule(path="checkpoint"), resume=SILENT)
    # older checkpoints are deleted; without checkpoints (every 0) there is nothing to keep
    keep_last: int = checked(2, unless(at_least(1), "every", 0), resume=PRINTED)
    # per-rank: each rank's own state, resumes at the same layout only (bit-identical);
    # dcp: torch.distributed.checkpoint's pieces of the full tensors, resumes at any layout
    format: str = checked("per-rank", one_of("per-rank", "dcp"), resume=PRINTED)
    # dcp: write each checkpoint in a thread while training goes on (at most one in flight)
    async_save: bool = checked(False, unless(Rule(), "format", "per-rank"), resume=PRINTED)


@dataclass
class LoggingConfig:
    run_dir: str = checked("runs", creatable_dir(), resume=SILENT)
    # runs/<name>: one path component (scaletorch/trainer/run_dir.py owns the directory)
    name: str = checked("run", path_component(), resume=SILENT)
    # --overwrite: a run directory (or checkpoint.dir) that already holds a run is moved aside
    # to <path>.old-<time>, never deleted; without it such a directory is refused
    overwrite: bool = checked(False, resume=SILENT)
    log_every: int = checked(10, positive(), resume=PRINTED)
    progress: bool = checked(True, resume=SILENT)  # tqdm bar on rank 0
    # a cluster file from scripts/plan.py --calibrate: the run ends with the planner's step time
    # beside the measured one (memory and wire bytes are compared without it); "": none
    plan_cluster: str = checked("", existing_file(), resume=SILENT)
    # --profile STEPS: a torch.profiler trace of that many steps (after one of warm-up) per rank
    # in runs/<name>/profile/rank_<r>.json (chapter 11; scripts/plot.py profile draws it)
    profile_steps: int = checked(0, at_least(0), resume=PRINTED)
    # --verbose: also print the details every run writes to runs/<name>/log.txt (the planner's
    # prediction beside the measurement, the straggler line, the fp32 precision note)
    verbose: bool = checked(False, resume=SILENT)


@dataclass
class Config:
    model: LlamaConfig = field(default_factory=LlamaConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    # also run the single-device reference and compare
    check: bool = checked(False, resume=PRINTED)

    @property
    def run_path(self) -> str:
        return os.path.join(self.logging.run_dir, self.logging.name)

    @property
    def checkpoint_path(self) -> str:
        return self.checkpoint.dir or os.path.join(self.run_path, "checkpoints")

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class VisionConfig:
    """Chapter 12's own section: the ResNet, its BatchNorm across ranks and its images."""
    model: str = checked("tiny", one_of("tiny", "resnet18"), resume=REFUSED)
    # per-rank: each rank's own B/N images | sync: sums all-reduced (ours) | torch: SyncBatchNorm
    batchnorm: str = checked("sync", one_of("per-rank", "sync", "torch"), resume=PRINTED)
    channels_last: bool = checked(False, resume=PRINTED)
    image_size: int = checked(16, at_least(8), resume=REFUSED)  # synthetic images (224: ImageNet)
    num_classes: int = checked(4, at_least(2), resume=REFUSED)  # synthetic images
    # DIR/<class>/<image> instead of synthetic images, resized to resize x resize if given
    data_folder: Optional[str] = checked(None, resume=REFUSED)
    resize: Optional[int] = checked(None, unless(positive(), "data_folder", None), resume=REFUSED)


@dataclass
class VisionRunConfig(Config):
    """Chapter 12's config: every section of Config (its Llama ``model`` unread), and ``vision``."""
    vision: VisionConfig = field(default_factory=VisionConfig)


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
