"""A layout as the planner sees it: the sizes of every axis and the per-step knobs.

The same knobs as ``parallel`` and ``data`` in a run's config (scaletorch/trainer/config.py),
with the data-parallel size explicit and the batch given per micro-batch:

    world = tp x cp x dp x pp           global batch = dp x m x b sequences of s tokens

``from_config`` reads a run's config (duck-typed: nothing is imported from the trainer).
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from scaletorch.rules.group_names import gradient_group_name
from scaletorch.rules.recompute import RECOMPUTE, recompute_mode
# the schedules' names: ZERO_BUBBLE split B and W (chapter 04b), V_SHAPED hold stages r and
# 2p - 1 - r (the planner's modules import them from here)
from scaletorch.schedule.placement import SCHEDULES, V_SHAPED, ZERO_BUBBLE  # noqa: F401

# bytes per parameter: (working parameters, gradients, optimizer state incl. fp32 master)
PRECISION_BYTES: Dict[str, tuple] = {
    "fp32": (4, 4, 8),  # fp32 training: parameters, gradients, Adam m and v
    "bf16": (2, 2, 12),  # bf16 copy + bf16 gradients; fp32 master, m, v (ZeRO's K = 12)
    "bf16-fp32-grads": (2, 4, 12),  # gradients accumulated in fp32 (Megatron; 18 B/param)
    "autocast": (4, 4, 8),  # this repository's bf16: fp32 weights, bf16 autocast compute
}
ACTIVATION_BYTES = {"fp32": 4, "bf16": 2, "bf16-fp32-grads": 2, "autocast": 2}

# How a run's code is written, which sets what autograd keeps and which kernels run:
# "scaletorch" (this repository: the ledger-exact formulas) or "torchtitan" (PyTorch's own
# trainer: FSDP2 with fp32 sharded parameters and bf16 compute, flash attention through SDPA,
# an fp32 loss, its checkpointing modes; eager unless ``compiled``).
FRAMEWORKS = ("scaletorch", "torchtitan")
# Recomputation the planner knows beyond the trainer's none | selective | full (torchtitan
# only): "op" (torchtitan's per-op selective checkpointing: a block keeps every other matmul's
# output and the attention output, the rest is recomputed) and "every-N" (torchtitan's
# per-layer selective checkpointing: every N-th block fully recomputed, the others keep all).
FRAMEWORK_RECOMPUTE = ("op", )
FP8 = ("none", "matmul", "matmul+all-gather")


def every_n(mode: str) -> int:
    """N of an "every-N" recomputation mode, 0 for any other mode."""
    if mode.startswith("every-") and mode[6:].isdigit() and int(mode[6:]) >= 1:
        return int(mode[6:])
    return 0


@dataclass
class PlanLayout:
    """tp, pp, cp, ep, dp: group sizes (ep is carved out of dp x cp, as in the trainer)."""
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    zero_stage: int = 0
    virtual_stages: int = 1
    schedule: str = "1f1b"
    num_micro_batches: int = 1
    micro_batch_size: int = 1  # b: sequences per micro-batch per data-parallel rank
    seq_len: int = 2048
    sequence_parallel: bool = False
    activation_checkpointing: str = "none"  # none | selective | full
    precision: str = "fp32"
    flash_attention: bool = False  # True: attention keeps out + log-sum-exp, not s x s scores
    cp_variant: str = "ring"
    layer_split: Optional[List[int]] = field(default=None)
    bucket_size_mb: float = 25.0  # DDP's gradient buckets (parallel.bucket_size_mb)
    framework: str = "scaletorch"  # FRAMEWORKS
    compiled: bool = False  # torch.compile: a block's elementwise ops fused into few kernels
    fp8: str = "none"  # none | matmul | matmul+all-gather (torchao float8, torchtitan only)
    # max over mean rows per ep rank of an MoE layer (1: the balanced router the traffic and
    # compute assume; measured by chapter 06b's LoadMeter, or assumed): time.imbalance_seconds
    moe_imbalance: float = 1.0

    def __post_init__(self) -> None:
        sizes = {
            "tp": self.tp,
            "pp": self.pp,
            "cp": self.cp,
            "ep": self.ep,
            "dp": self.dp,
            "virtual_stages": self.virtual_stages,
            "micro_batches": self.num_micro_batches,
            "micro_batch_size": self.micro_batch_size,
            "seq_len": self.seq_len
        }
        bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or v <= 0}
        if bad:
            raise ValueError("sizes must be positive integers, got " +
                             ", ".join(f"{k} {v}" for k, v in bad.items()))
        choices = {
            "zero_stage": (self.zero_stage, (0, 1, 2, 3)),
            "schedule": (self.schedule, SCHEDULES),
            "precision": (self.precision, tuple(PRECISION_BYTES)),
            "framework": (self.framework, FRAMEWORKS),
            "fp8": (self.fp8, FP8),
        }
        mode = self.activation_checkpointing
        if self.framework == "scaletorch" and mode not in RECOMPUTE:
            raise ValueError(f"the planner's activation_checkpointing must be one of "
                             f"{', '.join(RECOMPUTE)} for this repository's trainer, got "
                             f"{mode!r} (op and every-N: --framework torchtitan)")
        if mode not in RECOMPUTE + FRAMEWORK_RECOMPUTE and not every_n(mode):
            raise ValueError(f"the planner's activation_checkpointing must be one of "
                             f"{', '.join(RECOMPUTE + FRAMEWORK_RECOMPUTE)} or every-N (N >= 1), "
                             f"got {mode!r}")
        if self.framework == "scaletorch" and (self.compiled or self.fp8 != "none"):
            raise ValueError(f"compiled {self.compiled} and fp8 {self.fp8!r} are torchtitan's: "
                             "this repository's trainer runs neither (--framework torchtitan)")
        for name, (value, allowed) in choices.items():
            if value not in allowed:
                raise ValueError(f"the planner's {name} must be one of "
                                 f"{', '.join(map(str, allowed))}, got {value!r}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"expert parallel size {self.ep} must divide data x context "
                             f"parallel ({self.dp} x {self.cp})")
        if not 1.0 <= self.moe_imbalance <= self.ep:
            raise ValueError(f"moe_imbalance (max/mean rows per ep rank) {self.moe_imbalance} "
                             f"must be between 1 (even) and ep ({self.ep}: one rank computes "
                             f"everything)")
        if self.seq_len % self.cp:
            raise ValueError(f"seq_len {self.seq_len} is not divisible by cp {self.cp}")
        if not self.bucket_size_mb > 0:
            raise ValueError(f"bucket_size_mb must be positive, got {self.bucket_size_mb}")

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def dp_cp(self) -> int:
        return self.dp * self.cp

    @property
    def gradient_group(self) -> str:
        """The ledger's name of the dp_cp group: "dp" at cp 1, "dp_cp" when cp > 1."""
        return gradient_group_name(self.cp)

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.dp * self.num_micro_batches * self.micro_batch_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def describe(self) -> str:
        ac = "" if self.activation_checkpointing == "none" else \
            f" ac={self.activation_checkpointing}"
        vs = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        vs += f" {self.schedule}" if self.schedule in ZERO_BUBBLE else ""
        return (f"tp{self.tp} cp{self.cp} pp{self.pp}{vs} dp{self.dp}" +
                (f" ep{self.ep}" if self.ep > 1 else "") +
                (f" zero{self.zero_stage}" if self.zero_stage else "") +
                (" sp" if self.sequence_parallel else "") + ac +
                f" m{self.num_micro_batches} b{self.micro_batch_size}" +
                ("" if self.framework == "scaletorch" else f" {self.framework}") +
                (" compiled" if self.compiled else "") +
                ("" if self.fp8 == "none" else f" fp8={self.fp8}") +
                ("" if self.moe_imbalance == 1.0 else f" imbalance={self.moe_imbalance:g}"))

    def as_dict(self) -> Dict[str, Any]:
        return dict(self.__dict__)


def from_config(cfg: Any, world_size: int, precision: str = "fp32") -> PlanLayout:
    """The layout a run of ``cfg`` on ``world_size`` ranks uses (the data-parallel size is what
    the world leaves, as in the trainer)."""
    p, d = cfg.parallel, cfg.data
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * \
        p.context_parallel_size
    if world_size % model_parallel:
        raise ValueError(f"world size {world_size} is not divisible by tp x pp x cp "
                         f"({model_parallel})")
    dp = world_size // model_parallel
    if d.global_batch_size % (dp * d.num_micro_batches):
        raise ValueError(f"global batch {d.global_batch_size} is not divisible by dp ({dp}) x "
                         f"micro-batches ({d.num_micro_batches})")
    return PlanLayout(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                      cp=p.context_parallel_size, ep=p.expert_model_parallel_size, dp=dp,
                      zero_stage=p.zero_stage, virtual_stages=p.virtual_pipeline_stages,
                      schedule=p.schedule, num_micro_batches=d.num_micro_batches,
                      micro_batch_size=d.global_batch_size // (dp * d.num_micro_batches),
                      seq_len=d.seq_len, sequence_parallel=p.sequence_parallel,
                      activation_checkpointing=recompute_mode(p.activation_checkpointing),
                      precision=precision, cp_variant=p.cp_variant,
                      layer_split=list(p.layer_split) if p.layer_split else None,
                      bucket_size_mb=p.bucket_size_mb)
