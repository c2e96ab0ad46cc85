"""A dry run: one rank of a world of any size runs the real training code, with nothing computed.

PyTorch's fake process group (``init_process_group("fake", ...)``) returns from every
collective at once, and tensors on the meta device carry shapes, dtypes and storage sizes but
no data. Under both, the real path runs unchanged as one chosen rank: the layout check, the
process-group manager, ``parallelize``, the Trainer's steps and the optimizer's, and its
checkpoint save when the run saves (``checkpoint.every``). Every tensor is allocated (as a
size) and every collective is issued with its real shape, so the ledger and the memory ledger
read what the rank would hold and send on a real cluster.

    dry_run(cfg, world, pp_rank)       -> DryRun: memory by kind and dtype, saved activations
                                          (one micro-batch's peak, the schedule's), the ledger
                                          of the last step, checkpoint bytes, seconds it took
    dry_run_report(cfg, world, runs)   -> each figure beside the planner's, with the ratio

Why the meta device and not ``FakeTensorMode``: on torch 2.13 ``Module.to`` of a fake
parameter fails (``swap_tensors`` refuses a tensor with a weak reference, which every fake
parameter has), and the tensor parallel layers move their new weights with ``.to``.

What needs values is kept out, each a host sync or a scaling limit on a real cluster: the
Trainer's ``float(loss)`` and ``float(grad_norm)`` (``Trainer.step_tensors`` stops before them),
the synthetic dataset's V x V transition matrix (``ShapeLoader`` hands out token ids of the
batch's shape instead), the log's straggler all-gather, the checkpoint's files (the Trainer's
save counts each file's bytes in a ``SizeCounter`` instead, no torch.save of meta tensors),
its manifest (rank 0 reads every rank's file) and the consolidated file's gather (a flag read
with ``.item()``; its bytes come from the reference's shapes). fp32 only: autocast has no meta
device.
"""

import argparse
import copy
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, cast

import torch
import torch.distributed as dist
from torch import nn

from scaletorch.data.loader import BatchSource
from scaletorch.dist import (ProcessGroupManager, destroy_pg_manager, get_ledger,
                             init_pg_manager_from_config)
from scaletorch.dist.pg_manager import RankGrid
from scaletorch.models import build_model
from scaletorch.models.moe import MoE
from scaletorch.parallel.activation_checkpointing import (apply_activation_checkpointing,
                                                          saved_activation_peaks)
from scaletorch.parallel.activation_meter import micro_batch_of
from scaletorch.parallel.expert_parallel import AllToAllDispatcher
from scaletorch.parallel.mixed_precision import precision_hooks
from scaletorch.parallel.parallelize import Parallelized, parallelize
from scaletorch.parallel.tied_embeddings import TiedEmbeddings
from scaletorch.parallel.vocab_padding import apply_tensor_parallel_padded
from scaletorch.plan.imbalance import hot_rank_line
from scaletorch.plan.layout import PlanLayout
from scaletorch.plan.layout import from_config as layout_of
from scaletorch.plan.memory import activation_bytes, checkpoint_bytes, state_bytes
from scaletorch.plan.model import ModelSpec
from scaletorch.plan.model import from_config as model_of
from scaletorch.plan.report import human, most_loaded
from scaletorch.plan.traffic import collectives
from scaletorch.rules.errors import OneLineParser
from scaletorch.trainer.checkpoint import SizeCounter, tensor_bytes
from scaletorch.trainer.config import Config, parse_args
from scaletorch.trainer.consolidated import consolidated_bytes
from scaletorch.trainer.memory_by_dtype import memory_by_dtype
from scaletorch.trainer.meta_kernels import fused_attention_tiles, shape_rules
from scaletorch.trainer.trainer import Trainer

KINDS = ("params", "grads", "optimizer", "buffers")
META = torch.device("meta")
# chapter 10's hook, typed as parallelize takes it (it converts a Llama, as parallelize passes)
RECOMPUTE = cast(Callable[[nn.Module, str], Any], apply_activation_checkpointing)


class ShapeLoader:
    """Global batches of token ids with the run's shape (B, s) and no values: what the step
    reads, without the synthetic dataset's V x V matrix (128256^2 float64 is 132 GB)."""

    def __init__(self, global_batch_size: int, seq_len: int) -> None:
        self.shape = (global_batch_size, seq_len)

    def get_batch(self, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """inputs, targets: int64 (global_batch_size, seq_len) on the meta device."""
        inputs = torch.empty(self.shape, dtype=torch.int64, device=META)
        return inputs, torch.empty_like(inputs)


def balanced(rows: int, parts: int) -> List[int]:
    """``rows`` split into ``parts`` as evenly as integers allow (the first ones get the rest)."""
    return [rows // parts + (i < rows % parts) for i in range(parts)]


def balance_routing(model: nn.Module) -> int:
    """Every MoE layer of ``model`` routes as a balanced router would: each expert gets
    k T / E of the k T assignments, and every ep rank receives as many as it sends. The real
    counts are values (a sync with the device, then data-dependent shapes); a dry run has none.
    Returns the number of MoE layers."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for layer in layers:
        dispatch = layer.dispatch_fn
        if isinstance(dispatch, AllToAllDispatcher):

            def tables(send: torch.Tensor, recv: torch.Tensor, rows: int) -> List[List[List[int]]]:
                world, local = send.shape  # [rank][its expert]: rows sent = rows received
                table = [balanced(n, local) for n in balanced(rows, world)]
                return [table, table]

            dispatch.host_tables = tables
        else:
            layer.dispatch_fn = lambda experts, routed, counts: experts(
                routed, balanced(routed.size(0), experts.num_experts))
    return len(layers)


@contextmanager
def fake_world(rank: int, world: int) -> Iterator[None]:
    """This process as ``rank`` of a world of ``world`` ranks, over PyTorch's fake process
    group: every group is created, every collective returns at once and moves nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

    if dist.is_initialized():
        raise RuntimeError("a dry run needs this process without a process group; one exists")
    # the meta device too: the dry run's tensors live there (batch_isend_irecv asks a group's
    # backend per device). Registered as a device of "fake": a "meta:fake,cpu:fake" string
    # works too, but its groups warn at teardown (hasHooks, torch 2.13), once per group.
    devices = dist.Backend.backend_capability["fake"]
    if "meta" not in devices:
        devices.append("meta")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def build_run(cfg: Config, pgm: ProcessGroupManager, device: torch.device,
              loader: Optional[BatchSource] = None) -> Tuple[Parallelized, Trainer]:
    """The reference model, parallelized with every later chapter's hooks (precision, tied
    embeddings, recomputation, vocabulary padding) over ``pgm``, and its silent Trainer: the
    run that the planner's ``--measure`` and the dry run both measure. On the meta device fp32
    runs without chapter 08's hooks (autocast has no meta device to ask) and the model and its
    shards are made there (sizes only); elsewhere the model is built on the CPU, as every
    script builds it."""
    meta = device == META
    hooks = None if meta else precision_hooks(cfg, device.type)
    with device if meta else nullcontext():
        model = build_model(cfg.model, seed=cfg.training.model_seed)
        par = parallelize(model, cfg, pgm, device, hooks, tied=TiedEmbeddings(),
                          recompute=RECOMPUTE, tensor_parallel=apply_tensor_parallel_padded)
    trainer = Trainer.from_parallelized(cfg, par, pgm, device=device, verbose=False, loader=loader,
                                        scaler=None if hooks is None else hooks.scaler)
    return par, trainer


def with_model(base: Config, model: ModelSpec) -> Config:
    """A copy of ``base`` with ``model``'s shapes (a planner's preset, say)."""
    cfg = copy.deepcopy(base)
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                 "num_attention_heads", "num_key_value_heads", "tie_word_embeddings", "num_experts",
                 "moe_top_k", "moe_layer_freq", "moe_intermediate_size"):
        setattr(cfg.model, name, getattr(model, name))
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, cfg.data.seq_len)
    return cfg


def run_config(base: Config, model: ModelSpec, layout: PlanLayout) -> Config:
    """``base`` with ``model``'s shapes and ``layout``'s sizes: what the trainer would check."""
    cfg = with_model(base, model)
    p, d = cfg.parallel, cfg.data
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, layout.seq_len)
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size = layout.tp, layout.pp
    p.context_parallel_size, p.expert_model_parallel_size = layout.cp, layout.ep
    p.data_parallel_size, p.zero_stage = layout.dp, layout.zero_stage
    p.virtual_pipeline_stages, p.schedule = layout.virtual_stages, layout.schedule
    p.sequence_parallel, p.layer_split = layout.sequence_parallel, layout.layer_split
    p.activation_checkpointing = layout.activation_checkpointing
    d.seq_len, d.num_micro_batches = layout.seq_len, layout.num_micro_batches
    d.global_batch_size = layout.global_batch
    return cfg


@dataclass
class DryRun:
    """One rank's figures. ``memory``: {kind: {dtype: bytes}} after the last step (kinds:
    params, grads, optimizer, buffers); ``gathered``: ZeRO-3's most bytes of full units held at
    once; ``saved``: the most bytes autograd kept for backward during one more step (the
    schedule's peak); ``micro_batch``: the most that one micro-batch's tensors held in it;
    ``wire`` and ``calls``: {(op, group, phase): wire bytes, calls} of the last step."""
    rank: int
    pp_rank: int
    memory: Dict[str, Dict[torch.dtype, int]]
    gathered: int
    saved: int
    micro_batch: int
    wire: Dict[Tuple[str, str, str], float] = field(default_factory=dict)
    calls: Dict[Tuple[str, str, str], int] = field(default_factory=dict)
    seconds: float = 0.0
    # asked to save (checkpoint.every > 0): this rank's file, {section: bytes} ("model",
    # "optimizer", "other": step, schedule, RNG), counted by the Trainer's own save; AdamW's
    # step counters (one fp32 scalar per parameter tensor) and the consolidated file's bytes
    checkpoint: Dict[str, int] = field(default_factory=dict)
    step_counters: int = 0
    consolidated: int = 0

    def total(self, kind: str) -> int:
        return sum(self.memory.get(kind, {}).values())


def stage_rank(cfg: Config, world: int, pp_rank: int) -> int:
    """The global rank at tp, cp and dp coordinate 0 of pipeline stage ``pp_rank``."""
    p = cfg.parallel
    grid = RankGrid(world, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                    p.context_parallel_size, p.expert_model_parallel_size)
    return grid.groups("pp")[0][pp_rank]


def dry_run(cfg: Config, world: int, pp_rank: int = 0, steps: int = 2) -> DryRun:
    """Run ``steps`` training steps (the last under saved-tensor hooks) as the rank of
    pipeline stage ``pp_rank`` (tp, cp, dp coordinates 0) of a world of ``world`` ranks, with
    fake collectives and fake tensors. ``cfg`` is the run's config, as a script loads it."""
    start = time.perf_counter()
    rank = stage_rank(cfg, world, pp_rank)
    ledger = get_ledger()
    with fake_world(rank, world), shape_rules():
        pgm = init_pg_manager_from_config(cfg.parallel)
        try:
            loader = ShapeLoader(cfg.data.global_batch_size, cfg.data.seq_len)
            par, trainer = build_run(cfg, pgm, META, loader)
            balance_routing(par.model)
            fused_attention_tiles(par.model)
            ledger.clear()
            for _ in range(steps - 1):
                trainer.step_tensors()
            # the last step under the saved-tensor hooks: its peak is the schedule's, and each
            # micro-batch's own peak is what one forward left (through all the rank's chunks)
            with micro_batch_of(par.forward_backward, par.model) as tag:
                saved, peaks, _ = saved_activation_peaks(par.model, trainer.step_tensors, tag)
            last = trainer.step - 1
            wire: Dict[Tuple[str, str, str], float] = {}
            calls: Dict[Tuple[str, str, str], int] = {}
            for r in ledger.select(step=last):
                key = (r.op, r.group, r.phase)
                wire[key] = wire.get(key, 0.0) + r.wire_bytes
                calls[key] = calls.get(key, 0) + 1
            memory = memory_by_dtype(trainer.model, trainer.optimizer)
            # ZeRO-3's most full units at once, in any one wrapper (each chunk has its own)
            gathered = max(getattr(m, "peak_gathered_bytes", 0) for m in trainer.model.modules())
            stage = pgm.pipeline_model_parallel_rank
            files = saved_files(cfg, trainer)
        finally:
            destroy_pg_manager()
            ledger.clear()
    return DryRun(rank, stage, memory, gathered, saved, max(peaks.values(), default=0), wire, calls,
                  time.perf_counter() - start, *files)


def saved_files(cfg: Config, trainer: Trainer) -> Tuple[Dict[str, int], int, int]:
    """When the run saves checkpoints: the Trainer's own save (its state dict, its barriers)
    with this rank's file counted, not written: ({section: bytes}, AdamW's step counters'
    bytes, the consolidated file's bytes on global rank 0). Else ({}, 0, 0)."""
    if not cfg.checkpoint.every:
        return {}, 0, 0
    trainer.checkpoint_sizes = SizeCounter()
    trainer.save()
    (sections, ) = trainer.checkpoint_sizes.files.values()
    model, optimizer = sections.pop("model"), sections.pop("optimizer")
    counters = tensor_bytes([s["step"] for s in trainer.optimizer.state.values() if "step" in s])
    return {"model": model, "optimizer": optimizer, "other": sum(sections.values())}, \
        counters, consolidated_bytes(cfg.model)


# ---- beside the planner ---------------------------------------------------------------------


def planned(cfg: Config, world: int) -> Tuple[ModelSpec, PlanLayout]:
    """The planner's model and layout of ``cfg`` on ``world`` ranks, in the precision the
    trainer runs (fp32 states; scaletorch's bf16 is autocast over fp32 states)."""
    precision = "fp32" if cfg.training.precision in ("auto", "fp32") else "autocast"
    return model_of(cfg.model), layout_of(cfg, world, precision)


def _ratio(predicted: float, measured: float) -> str:
    if predicted == measured:
        return "="
    return f"x{predicted / measured:.4f}" if measured else "-"


def _dtypes(held: Dict[torch.dtype, int]) -> str:
    return " ".join(f"{str(d).replace('torch.', '')}" for d in sorted(held, key=str)) or "-"


def dry_run_report(cfg: Config, world: int, runs: List[DryRun], moe_imbalance: float = 1.0) -> str:
    """Each run's memory by kind (with its dtypes), peak saved activations and wire bytes and
    calls per (op, group, phase), each beside the planner's prediction and their ratio
    (predicted / dry run; "=" when equal); with ``moe_imbalance`` > 1, the hot ep rank's rows."""
    model, layout = planned(cfg, world)
    lines = [
        f"dry run of {model_line(model)} on {world:,} ranks: {layout.describe()} "
        f"s{layout.seq_len}"
    ]
    lines.append(f"the planner's most-loaded pipeline rank: {most_loaded(model, layout)}")
    if moe_imbalance != 1.0:
        lines.append(hot_rank_line(model, replace(layout, moe_imbalance=moe_imbalance)))
    head = f"{'what':<38}{'planner':>16}{'dry run':>16}  ratio"
    for run in runs:
        plan_states = state_bytes(model, layout, run.pp_rank)
        lines += ["", f"pp rank {run.pp_rank} (global rank {run.rank}), {run.seconds:.1f} s", head]
        for kind in KINDS[:3]:
            held = run.memory.get(kind, {})
            lines.append(_row(f"{kind} ({_dtypes(held)})", plan_states[kind], run.total(kind)))
        lines.append(_row("zero-3 gathered units (peak)", plan_states["buffers"], run.gathered))
        buffers = run.memory.get("buffers", {})
        lines.append(f"{'buffers (' + _dtypes(buffers) + ')':<38}{'-':>16}"
                     f"{human(run.total('buffers')):>16}  (registered: the planner has none)")
        acts = activation_bytes(model, layout, run.pp_rank)
        lines.append(
            _row("activations saved (peak, micro-batch)", acts["micro_batch"], run.micro_batch))
        lines.append(_row("activations saved (peak, schedule)", acts["saved"], run.saved))
        if run.checkpoint:  # the weights (a ZeRO rank's shard) and AdamW's m and v
            files = checkpoint_bytes(model, layout, run.pp_rank)
            lines.append(_row("checkpoint file: model", files["model"], run.checkpoint["model"]))
            lines.append(
                _row("checkpoint file: optimizer (m, v)", files["optimizer"],
                     run.checkpoint["optimizer"] - run.step_counters))
            lines.append(f"{'checkpoint file: steps, schedule, RNG':<38}{'-':>16}"
                         f"{human(run.checkpoint['other'] + run.step_counters):>16}")
            lines.append(
                _row("consolidated file (global rank 0)", files["consolidated"], run.consolidated))
        plan_wire: Dict[Tuple[str, str, str], float] = {}
        plan_calls: Dict[Tuple[str, str, str], int] = {}
        for c in collectives(model, layout, run.pp_rank):
            key = (c.op, c.group, c.phase)
            plan_wire[key] = plan_wire.get(key, 0.0) + c.wire
            plan_calls[key] = plan_calls.get(key, 0) + c.calls
        for key in sorted(set(plan_wire) | set(run.wire), key=lambda k: (k[1], k[2], k[0])):
            op, group, phase = key
            what = f"wire {group} {op}" + ("" if phase == "compute" else f" ({phase})")
            lines.append(
                _row(what, plan_wire.get(key, 0.0), run.wire.get(key, 0.0)) +
                f"  calls {plan_calls.get(key, 0):,} / {run.calls.get(key, 0):,}")
    return "\n".join(lines)


def model_line(model: ModelSpec) -> str:
    return f"a model of {model.num_parameters():,} parameters ({model.num_layers} layers)"


def _row(what: str, predicted: float, measured: float) -> str:
    return (f"{what:<38}{human(predicted):>16}{human(measured):>16}  "
            f"{_ratio(predicted, measured)}")


# ---- the command: examples/07_nd_parallel.py --dry-run and scripts/plan.py --dry-run ---------

STAGES_HELP = ("the pipeline ranks to run: heaviest (the planner's most-loaded, the default), "
               "all, or a list such as 0,15")


def stages(cfg: Config, world: int, which: str) -> List[int]:
    """The pipeline ranks ``which`` names: "heaviest", "all" or "0,15" (ValueError else)."""
    pp = cfg.parallel.pipeline_model_parallel_size
    if which == "heaviest":
        return [most_loaded(*planned(cfg, world))]
    if which == "all":
        return list(range(pp))
    try:
        ranks = [int(r) for r in which.split(",")]
    except ValueError:
        raise ValueError(f"--dry-run {which!r}: {STAGES_HELP}") from None
    bad = [r for r in ranks if not 0 <= r < pp]
    if bad:
        raise ValueError(f"--dry-run {which}: pipeline rank {bad[0]} is not in 0..{pp - 1} "
                         f"(pipeline_model_parallel_size {pp})")
    return ranks


def check_dry_run(cfg: Config) -> None:
    """What the dry run cannot run, refused before it starts (ValueError naming the value)."""
    if cfg.training.precision not in ("auto", "fp32"):
        raise ValueError(f"training.precision {cfg.training.precision}: the dry run runs fp32 "
                         f"only (autocast has no meta device)")
    for key in ("moe_capacity_factor", "moe_bias_rate"):  # the drops, the bias's moves
        if cfg.model.num_experts and getattr(cfg.model, key) > 0:
            raise ValueError(f"model.{key} {getattr(cfg.model, key)}: what it does depends on "
                             f"the router's values, which a dry run has not; set 0")
    if cfg.parallel.impl == "torch":
        raise ValueError("parallel.impl torch: the dry run runs this repository's strategies "
                         "(PyTorch's own collectives bypass the ledger)")


def dry_run_text(cfg: Config, world: int, which: str = "heaviest", steps: int = 2,
                 moe_imbalance: float = 1.0) -> str:
    """The dry run of ``cfg`` on ``world`` ranks, the pipeline ranks ``which`` names, as text:
    ``dry_run_report`` and the wall time."""
    check_dry_run(cfg)
    _, layout = planned(cfg, world)  # the layout's sizes divide the world (ValueError naming them)
    replace(layout, moe_imbalance=moe_imbalance)  # 1 <= it <= ep (ValueError naming it)
    start = time.perf_counter()
    runs = [dry_run(cfg, world, r, steps) for r in stages(cfg, world, which)]
    return (dry_run_report(cfg, world, runs, moe_imbalance) +
            f"\ndry run: {len(runs)} rank(s), {steps} steps each, "
            f"{time.perf_counter() - start:.0f} s on this CPU")


def main(argv: List[str], default_config: str, description: str) -> int:
    """``--dry-run [STAGES] --world-size N [--preset NAME]`` and a script's config flags: the
    dry run's report on stdout; a mistake is one "error:" line and exit status 2."""
    from scaletorch.plan.model import preset

    parser = OneLineParser(description=description, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--dry-run", nargs="?", const="heaviest", help=STAGES_HELP)
    parser.add_argument("--world-size", type=int, help="ranks of the world (required)")
    parser.add_argument("--preset", help="the planner's model instead of the config's")
    parser.add_argument("--dry-run-steps", type=int, default=2, help="steps per rank")
    parser.add_argument("--moe-imbalance", type=float, default=1.0,
                        help="max/mean rows per ep rank assumed (chapter 06b): the hot rank's")
    try:
        args, rest = parser.parse_known_args(argv)
        if args.world_size is None:
            raise ValueError("--dry-run needs --world-size N: the world whose rank runs here")
        cfg = parse_args(rest, default_config, description)
        if args.preset is not None:
            cfg = with_model(cfg, preset(args.preset))
        if args.world_size < 1 or args.dry_run_steps < 1:
            raise ValueError(f"--world-size ({args.world_size}) and --dry-run-steps "
                             f"({args.dry_run_steps}) must be positive")
        text = dry_run_text(cfg, args.world_size, args.dry_run or "heaviest", args.dry_run_steps,
                            args.moe_imbalance)
    except (ValueError, FileNotFoundError, argparse.ArgumentError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(text)
    return 0
