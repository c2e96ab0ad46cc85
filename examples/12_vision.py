"""Chapter 12: a ResNet under data parallel and ZeRO / FSDP, with BatchNorm across ranks.

    scripts/launch.sh examples/12_vision.py --nproc-per-node 2 -- --steps 10 --check
    scripts/launch.sh examples/12_vision.py --nproc-per-node 2 -- --vision.batchnorm per-rank
    scripts/launch.sh examples/12_vision.py --nproc-per-node 4 -- --zero-stage 3 --check
    scripts/launch.sh examples/12_vision.py --nproc-per-node 2 -- --impl torch --zero-stage 3
    scripts/launch.sh examples/12_vision.py --nproc-per-node 2 -- --vision.data_folder DIR \\
        --vision.resize 32

Chapters 01 and 02 on an image classifier, with every chapter's interface (``--config``, the
dotted overrides, ``--logging.run_dir``, the parity lines); its own settings are the config's
``vision`` section. BatchNorm normalises by the statistics of the batch it sees, so each
data-parallel rank normalises by its own B/N images (``--vision.batchnorm per-rank``) and the
run leaves the single-device one. ``sync`` (the default) all-reduces the per-channel sums over
the data-parallel ranks (scaletorch/parallel/sync_batchnorm.py); ``torch`` is
torch.nn.SyncBatchNorm (GPU only). Prints the BatchNorm traffic of the last step beside its
formula and the images per second; ``--check`` trains the same steps on one device and compares
losses, weights, gradient norms and running buffers.
"""

import os
import sys
from typing import Any

import torch
from torch import nn

from scaletorch.config import VisionRunConfig
from scaletorch.data.images import ImageBatchLoader, ImageFolder, SyntheticImages
from scaletorch.dist import (destroy_distributed, destroy_pg_manager, get_ledger, init_distributed,
                             init_pg_manager_from_config)
from scaletorch.models import ResNetConfig, build_resnet, tiny_resnet_config
from scaletorch.parallel.sync_batchnorm import sync_bn_elements
from scaletorch.parallel.vision_parallel import parallelize_resnet
from scaletorch.trainer import load_config, report_norm_parity, report_parity, report_weight_parity
from scaletorch.trainer.checkpoint import run_layout
from scaletorch.trainer.config import save_config
from scaletorch.trainer.precision import NORM_TOLERANCES, TOLERANCES, resolve_precision
from scaletorch.trainer.resume_check import record
from scaletorch.trainer.vision_loop import VisionSettings, is_buffer, single_device, train_resnet

HELP = ("Chapter 12: a ResNet under data parallel (--impl ours | torch) and ZeRO / FSDP "
        "(--zero-stage), its BatchNorm per rank or synchronised (--vision.batchnorm)")
# what the shared config holds and this chapter never reads: given, it is refused in one line
UNREAD = {
    "model.": "chapter 12's model is a ResNet, vision.model",
    "data.dataset": "the images are synthetic, or vision.data_folder",
    "data.path": "an image folder is vision.data_folder",
    "data.seq_len": "images have no sequence",
    "data.num_micro_batches": "one batch per step here",
    "training.min_lr": "a constant learning rate here",
    "training.warmup_steps": "a constant learning rate here",
    "training.weight_decay": "AdamW without weight decay here",
    "training.beta1": "AdamW's default betas here",
    "training.beta2": "AdamW's default betas here",
    "training.model_seed": "the ResNet's seed is fixed (42)",
    "checkpoint.format": "per-rank checkpoints only here",
    "checkpoint.async_save": "per-rank checkpoints only here",
    **{
        f"logging.{key}": "runs/<name>/metrics.jsonl holds each step; the script prints its lesson"
        for key in ("log_every", "progress", "plan_cluster", "profile_steps", "verbose")
    },
}


def limits(cfg: Any, world_size: int) -> None:
    """This chapter's scope (load_config checks it with the layout, before anything starts)."""
    p = cfg.parallel
    if max(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size,
           p.expert_model_parallel_size) > 1:
        raise ValueError("12_vision is data parallel only (with ZeRO): tp, pp, cp and ep are "
                         "the language model's, chapters 03 to 07")
    if p.impl == "naive":  # the glossary's table: ours and torch here
        raise ValueError("12_vision runs --impl ours (our DDP and ZeRO) or torch (DDP, "
                         "fully_shard), got --impl naive: the naive DDP is chapter 01's")
    if p.impl == "torch" and p.zero_stage not in (0, 3):
        raise ValueError(f"--impl torch has DDP (--zero-stage 0) and fully_shard (3), got "
                         f"--zero-stage {p.zero_stage}")
    if cfg.training.precision == "fp16":
        raise ValueError("12_vision runs fp32 or bf16: fp16's loss scale is chapter 08's")
    if p.reduce_dtype != "fp32" or p.param_dtype != "auto":
        raise ValueError("12_vision keeps parameters and gradients in fp32: "
                         "parallel.param_dtype and reduce_dtype are chapter 08's")
    if cfg.vision.batchnorm == "torch" and not torch.cuda.is_available():
        raise ValueError("--vision.batchnorm torch (torch.nn.SyncBatchNorm) runs on GPUs only: "
                         "its kernels have no CPU version; sync is ours, on any device")
    dataset(cfg)  # an image folder: every file's header read, one line naming what is wrong


def dataset(cfg: Any) -> Any:
    v = cfg.vision
    if v.data_folder is None:
        return SyntheticImages(v.num_classes, v.image_size, cfg.data.seed)
    return ImageFolder(v.data_folder, v.resize)  # checks every file's header first


def build(cfg: Any, num_classes: int, image_size: int) -> nn.Module:
    if cfg.vision.model == "tiny":
        model_cfg = tiny_resnet_config(num_classes, image_size)
    else:
        model_cfg = ResNetConfig(num_classes=num_classes, image_size=image_size)
    model_cfg.channels_last = cfg.vision.channels_last
    return build_resnet(model_cfg, seed=42)


def main(argv: Any = None) -> int:
    cfg = load_config("examples/configs/12_vision.yaml", HELP, limits, argv, unread=UNREAD,
                      config_class=VisionRunConfig)
    env = init_distributed(cfg.training.timeout_seconds)
    p, v, t = cfg.parallel, cfg.vision, cfg.training
    pgm = init_pg_manager_from_config(p, t.timeout_seconds)
    pgm.log_topology()
    if env.rank == 0:  # as every chapter's run: its settings beside its metrics
        save_config(cfg, os.path.join(cfg.run_path, "config.yaml"))
    precision = resolve_precision(cfg, env.device.type)  # auto: fp32 on a CPU and under --check
    # the checkpoint's layout and settings, which a resume is checked against (as 00-11's)
    layout = {**run_layout(cfg, env.world_size), "config": record(cfg)}
    settings = VisionSettings(steps=t.steps, lr=t.lr, grad_clip=t.grad_clip, precision=precision,
                              checkpoint_dir=cfg.checkpoint_path,
                              checkpoint_every=cfg.checkpoint.every,
                              keep_last=cfg.checkpoint.keep_last, resume=cfg.checkpoint.resume,
                              fail_at_step=t.fail_at_step, fail_rank=t.fail_rank,
                              metrics_path=os.path.join(cfg.run_path, "metrics.jsonl"))
    data = dataset(cfg)
    num_classes, image_size = data.num_classes, data.image_size
    loader = ImageBatchLoader(data, cfg.data.global_batch_size, cfg.data.seed)

    model = build(cfg, num_classes, image_size).to(env.device)
    channels = [m.num_features for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    psi = sum(p.numel() for p in model.parameters())  # before sharding takes them
    # the new line: BatchNorm mode, then chapter 01's DDP or chapter 02's ZeRO / FSDP2
    run = parallelize_resnet(model, pgm, p.impl, p.zero_stage, v.batchnorm, t.lr)
    n = pgm.gradient_sync_world_size
    if env.rank == 0:
        print(f"ResNet ({v.model}): {psi:,} "
              f"parameters, {len(channels)} BatchNorm layers, images {image_size}x{image_size}, "
              f"{num_classes} classes; {n} data-parallel ranks, impl {p.impl}, zero stage "
              f"{p.zero_stage}, batchnorm {v.batchnorm}")
    result = train_resnet(run, loader, settings, pgm, env.device, layout)

    # What this chapter is about: the statistics' traffic, against its formula
    last = t.steps - 1
    if env.rank == 0 and result.losses:
        shown = list(range(result.start_step, t.steps, max(1, t.steps // 5)))
        for step in shown + ([last] if shown[-1] != last else []):
            print(f"step {step:>4}  loss {result.losses[step - result.start_step]:.4f}")
        elements = get_ledger().total(group="bn", step=last)
        wire = get_ledger().total(group="bn", step=last, field="wire_bytes")
        want = sync_bn_elements(channels, n) if v.batchnorm == "sync" else 0
        torch_ddp = p.impl == "torch" and p.zero_stage == 0  # it broadcasts buffers itself
        if v.batchnorm == "per-rank" and n > 1 and not torch_ddp:
            want = 2 * sum(channels)  # our wrappers average the running buffers: 2C per layer
        print(f"BatchNorm traffic in step {last} (ledger, name bn): {elements:,.0f} elements, "
              f"{wire:,.0f} wire bytes; formula {want:,} elements, "
              f"{2 * (n - 1) / n * 4 * want:,.0f} wire bytes")
        steady = result.step_seconds[1:] or result.step_seconds
        batch = cfg.data.global_batch_size
        rate = batch * len(steady) / sum(steady)
        print(f"images/s: {rate:.1f} (global batch {batch}, {n} ranks)")

    ok = True
    full = run.full_state()  # collective: every rank gathers, rank 0 compares
    if cfg.check and env.rank == 0:
        ref = single_device(build(cfg, num_classes, image_size).to(env.device), t.lr)
        plain = VisionSettings(steps=t.steps, lr=t.lr, grad_clip=t.grad_clip, precision=precision)
        expected = train_resnet(ref, loader, plain, None, env.device)
        # every chapter's three parity lines, and the running buffers' as a fourth
        # fp32: the sums in another order, ulps a step; bf16: its rounding (precision.py)
        tolerance, start = TOLERANCES[precision], result.start_step
        ok = report_parity(result.losses, expected.losses[start:], tolerance, precision)
        reference = ref.full_state()
        weights = {k: x for k, x in full.items() if not is_buffer(k)}
        ok = report_weight_parity(weights, {k: reference[k]
                                            for k in weights}, t.steps, tolerance, precision) and ok
        ok = report_norm_parity(result.grad_norms, expected.grad_norms[start:],
                                NORM_TOLERANCES[precision], precision) and ok
        buffers = {k: x for k, x in full.items() if is_buffer(k)}
        ok = report_weight_parity(buffers, {k: reference[k]
                                            for k in buffers}, t.steps, tolerance, precision,
                                  kind="buffer") and ok
    destroy_pg_manager()
    destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
