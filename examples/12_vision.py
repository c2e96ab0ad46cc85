"""Chapter 12: a ResNet under data parallel and ZeRO / FSDP, with BatchNorm across ranks.

    scripts/launch.sh examples/12_vision.py --nproc-per-node 2 -- --steps 10 --check
    scripts/launch.sh examples/12_vision.py --nproc-per-node 2 -- --batchnorm per-rank --check
    scripts/launch.sh examples/12_vision.py --nproc-per-node 4 -- --zero-stage 3 --check
    scripts/launch.sh examples/12_vision.py --nproc-per-node 2 -- --impl torch --zero-stage 3
    scripts/launch.sh examples/12_vision.py --nproc-per-node 2 -- --data-folder DIR --resize 32

Chapters 01 and 02 on an image classifier. BatchNorm normalises by the statistics of the batch
it sees, so each data-parallel rank normalises by its own B/N images (``--batchnorm per-rank``)
and the run leaves the single-device one. ``--batchnorm sync`` (the default) all-reduces the
per-channel sums over the data-parallel ranks (scaletorch/parallel/sync_batchnorm.py);
``torch`` is torch.nn.SyncBatchNorm (GPU only). Prints the BatchNorm traffic of the last step
beside its formula and the images per second; ``--check`` trains the same steps on one device
and compares losses, weights and running buffers.
"""

import argparse
import os
import sys
import time
from typing import List, Optional

import torch
from torch import nn

from scaletorch.data.images import ImageBatchLoader, ImageFolder, SyntheticImages
from scaletorch.dist import (destroy_distributed, destroy_pg_manager, get_ledger, init_distributed,
                             init_pg_manager, restart_count)
from scaletorch.models import ResNetConfig, build_resnet, tiny_resnet_config
from scaletorch.parallel.sync_batchnorm import BN_MODES, sync_bn_elements
from scaletorch.parallel.vision_parallel import parallelize_resnet
from scaletorch.rules.errors import InputError, OneLineParser
from scaletorch.rules.schema import check_value, path_component
from scaletorch.trainer.config import report_input_errors
from scaletorch.trainer.parity import report_parity, report_weight_parity
from scaletorch.trainer.precision import TOLERANCES
from scaletorch.trainer.run_dir import check_free, hold, moved_aside
from scaletorch.trainer.vision_loop import (PRECISIONS, VisionSettings, is_buffer, single_device,
                                            train_resnet)


def parse(argv: Optional[List[str]]) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--impl", choices=("ours", "torch"), default="ours")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=0)
    p.add_argument("--batchnorm", choices=BN_MODES, default="sync")
    p.add_argument("--model", choices=("tiny", "resnet18"), default="tiny")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--image-size", type=int, default=16, help="synthetic images (224: ImageNet)")
    p.add_argument("--num-classes", type=int, default=4, help="synthetic images")
    p.add_argument("--data-folder", default=None, help="DIR/<class>/<image> instead of synthetic")
    p.add_argument("--resize", type=int, default=None, help="resize folder images to S x S")
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--precision", choices=tuple(PRECISIONS), default="fp32")
    p.add_argument("--checkpoint-every", type=int, default=0, help="runs/<name>/checkpoints")
    p.add_argument("--resume", action="store_true", help="from the newest valid checkpoint")
    p.add_argument("--overwrite", action="store_true", help="move runs/<name> aside, kept")
    p.add_argument("--kill-at-step", type=int, default=-1, help="SIGKILL rank 0 there, once")
    p.add_argument("--name", "--logging.name", dest="name", default="12_vision",
                   help="RUN_DIR/<name>: metrics, checkpoints")
    p.add_argument("--logging.run_dir", dest="run_dir", default="runs",
                   help="where runs go, as in every chapter")
    p.add_argument("--check", action="store_true", help="compare with a single-device run")
    p.add_argument("--seed", type=int, default=1234, help="data and augmentation")
    p.add_argument("--validate-only", action="store_true", help="check the inputs, then exit")
    p.add_argument("--world-size", type=int, default=None, help="with --validate-only")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace, world_size: int) -> None:
    """Every refusal before a process group exists: an InputError names the value."""
    check_value("--name", args.name, str, path_component())  # one directory under runs/
    if args.steps < 1 or args.global_batch_size < 1 or args.lr <= 0:
        raise InputError(f"--steps ({args.steps}), --global-batch-size "
                         f"({args.global_batch_size}) and --lr ({args.lr}) must be positive")
    if args.global_batch_size % world_size:
        raise InputError(f"--global-batch-size {args.global_batch_size} is not divisible by the "
                         f"{world_size} data-parallel ranks")
    if args.impl == "torch" and args.zero_stage not in (0, 3):
        raise InputError(f"--impl torch has DDP (--zero-stage 0) and fully_shard (3), got "
                         f"--zero-stage {args.zero_stage}")
    if args.batchnorm == "torch" and not torch.cuda.is_available():
        raise InputError("--batchnorm torch (torch.nn.SyncBatchNorm) runs on GPUs only: its "
                         "kernels have no CPU version; --batchnorm sync is ours, on any device")


def dataset(args: argparse.Namespace) -> object:
    if args.data_folder is None:
        return SyntheticImages(args.num_classes, args.image_size, args.seed)
    return ImageFolder(args.data_folder, args.resize)  # checks every file's header first


def build(args: argparse.Namespace, num_classes: int, image_size: int) -> nn.Module:
    if args.model == "tiny":
        cfg = tiny_resnet_config(num_classes, image_size)
    else:
        cfg = ResNetConfig(num_classes=num_classes, image_size=image_size)
    cfg.channels_last = args.channels_last
    return build_resnet(cfg, seed=42)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv)
    world_size = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    try:
        check_args(args, world_size)
        data = dataset(args)
        check_free("--name", os.path.join(args.run_dir, args.name), args.resume, args.overwrite)
    except (InputError, ValueError) as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        else:  # let rank 0 print the line first
            time.sleep(5)
        return 2
    if args.validate_only:  # scripts/launch.sh's pre-flight, before torchrun starts a rank
        return 0
    run_dir = os.path.join(args.run_dir, args.name)
    if args.overwrite and restart_count() == 0 and os.path.isdir(run_dir) and \
            int(os.environ.get("RANK", "0")) == 0:  # the old run is kept, renamed
        print(f"--overwrite: moved {run_dir} aside to {moved_aside(run_dir)}", flush=True)
    try:
        hold("--name", run_dir)  # this run's lock on runs/<name>, for its whole life
    except InputError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    sys.excepthook = report_input_errors  # a file's fault found later: the same one line
    env = init_distributed()
    pgm = init_pg_manager()
    pgm.log_topology()
    os.makedirs(run_dir, exist_ok=True)
    settings = VisionSettings(steps=args.steps, lr=args.lr, precision=args.precision,
                              checkpoint_dir=os.path.join(run_dir, "checkpoints"),
                              checkpoint_every=args.checkpoint_every, resume=args.resume,
                              kill_at_step=args.kill_at_step,
                              metrics_path=os.path.join(run_dir, "metrics.jsonl"))
    num_classes, image_size = data.num_classes, data.image_size  # type: ignore[attr-defined]
    loader = ImageBatchLoader(data, args.global_batch_size, args.seed)

    model = build(args, num_classes, image_size).to(env.device)
    channels = [m.num_features for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    psi = sum(p.numel() for p in model.parameters())  # before sharding takes them
    # the new line: BatchNorm mode, then chapter 01's DDP or chapter 02's ZeRO / FSDP2
    run = parallelize_resnet(model, pgm, args.impl, args.zero_stage, args.batchnorm, args.lr)
    n = pgm.gradient_sync_world_size
    layout = dict(impl=args.impl, zero_stage=args.zero_stage, batchnorm=args.batchnorm)
    if env.rank == 0:
        print(f"ResNet ({args.model}): {psi:,} "
              f"parameters, {len(channels)} BatchNorm layers, images {image_size}x{image_size}, "
              f"{num_classes} classes; {n} data-parallel ranks, impl {args.impl}, zero stage "
              f"{args.zero_stage}, batchnorm {args.batchnorm}")
    result = train_resnet(run, loader, settings, pgm, env.device, layout)

    # What this chapter is about: the statistics' traffic, against its formula
    last = args.steps - 1
    if env.rank == 0 and result.losses:
        shown = list(range(result.start_step, args.steps, max(1, args.steps // 5)))
        for step in shown + ([last] if shown[-1] != last else []):
            print(f"step {step:>4}  loss {result.losses[step - result.start_step]:.4f}")
        elements = get_ledger().total(group="bn", step=last)
        wire = get_ledger().total(group="bn", step=last, field="wire_bytes")
        want = sync_bn_elements(channels, n) if args.batchnorm == "sync" else 0
        torch_ddp = args.impl == "torch" and args.zero_stage == 0  # it broadcasts buffers itself
        if args.batchnorm == "per-rank" and n > 1 and not torch_ddp:
            want = 2 * sum(channels)  # our wrappers average the running buffers: 2C per layer
        print(f"BatchNorm traffic in step {last} (ledger, name bn): {elements:,.0f} elements, "
              f"{wire:,.0f} wire bytes; formula {want:,} elements, "
              f"{2 * (n - 1) / n * 4 * want:,.0f} wire bytes")
        steady = result.step_seconds[1:] or result.step_seconds
        rate = args.global_batch_size * len(steady) / sum(steady)
        print(f"images/s: {rate:.1f} (global batch {args.global_batch_size}, {n} ranks)")

    ok = True
    full = run.full_state()  # collective: every rank gathers, rank 0 compares
    if args.check and env.rank == 0:
        ref = single_device(build(args, num_classes, image_size).to(env.device), args.lr)
        plain = VisionSettings(steps=args.steps, lr=args.lr, precision=args.precision)
        expected = train_resnet(ref, loader, plain, None, env.device)
        # the parity lines of every chapter, and the running buffers' as a third
        # fp32: the sums in another order, ulps a step; bf16: its rounding (precision.py)
        tolerance, precision = TOLERANCES[args.precision], args.precision
        ok = report_parity(result.losses, expected.losses[result.start_step:], tolerance, precision)
        reference = ref.full_state()
        for kind in ("weight", "buffer"):
            mine = {k: v for k, v in full.items() if is_buffer(k) == (kind == "buffer")}
            theirs = {k: reference[k] for k in mine}
            ok = report_weight_parity(mine, theirs, args.steps, tolerance, precision, kind=kind) \
                and ok
    destroy_pg_manager()
    destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
