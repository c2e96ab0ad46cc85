"""Chapter 12 rows: synchronised BatchNorm, ours beside torch.nn.SyncBatchNorm, and images/s.

One world of ``args.world_size`` ranks trains copies of one ResNet under our DDP, one per
BatchNorm mode, their steps alternating (timing.alternate): ours synchronised against per-rank
statistics (what synchronising costs) and against torch.nn.SyncBatchNorm. torch's kernels
exist for GPUs only, so on a CPU its row says so instead of a ratio. Then worlds of 1, 2 and 4
ranks each train the synchronised model alone: images per second of the global batch (an
absolute rate on a shared CPU: read it beside the 1-rank row of the same run).

    python scripts/benchmark.py --only vision --steps 5 --repeats 2
"""

import time
from typing import Dict, List

import torch

from scaletorch.data.images import ImageBatchLoader, SyntheticImages
from scaletorch.dist import comm, destroy_pg_manager, get_ledger, init_pg_manager
from scaletorch.models import ResNetConfig, build_resnet, classification_loss
from scaletorch.parallel.vision_parallel import parallelize_resnet
from scripts.benchmarks import timing

MODEL = ResNetConfig(num_classes=10, image_size=32, stem_channels=16, channels=[16, 32],
                     blocks=[1, 1], imagenet_stem=False)
IMAGES_PER_RANK, WARMUP, SCALING_WORLDS = 8, 2, (1, 2, 4)


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", comm.group_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def _trainer(pgm, mode: str, device: torch.device):
    """One step of our DDP on the ResNet with BatchNorm ``mode``, on this rank's images."""
    run = parallelize_resnet(build_resnet(MODEL, 0).to(device), pgm, "ours", 0, mode, 1e-3)
    n, rank = pgm.data_parallel_world_size, pgm.data_parallel_rank
    loader = ImageBatchLoader(SyntheticImages(MODEL.num_classes, MODEL.image_size, 1),
                              IMAGES_PER_RANK * n, 1)
    images, labels = loader.local_batch(0, rank, n)
    images, labels = images.to(device), labels.to(device)

    def step() -> None:
        run.optimizer.zero_grad(set_to_none=True)
        classification_loss(run.model(images), labels).backward()
        run.model.finish_grad_sync()
        run.optimizer.step()
        run.after_step()

    return step


def _side_by_side(rank: int, world: int, samples: int) -> Dict[str, object]:
    pgm = init_pg_manager()
    device = _device()
    modes = ["sync", "per-rank"] + (["torch"] if device.type == "cuda" else [])
    steps = {mode: _trainer(pgm, mode, device) for mode in modes}
    times, wire = timing.alternate(modes, samples, WARMUP, lambda m: steps[m](),
                                   lambda m: get_ledger().total(group="bn", field="elements"))
    times = timing.max_over_ranks(times)
    destroy_pg_manager()
    return {"times": times, "bn_elements": wire, "device": device.type}


def _images_per_second(rank: int, world: int, samples: int) -> float:
    pgm = init_pg_manager()
    step = _trainer(pgm, "sync", _device())
    for _ in range(WARMUP):
        step()
    comm.barrier()
    start = time.perf_counter()
    for _ in range(samples):
        step()
    comm.barrier()
    seconds = time.perf_counter() - start
    destroy_pg_manager()
    return IMAGES_PER_RANK * world * samples / seconds


def run(args) -> List[dict]:
    from scaletorch.dist.spawn import run_distributed  # gloo ranks, as the tests spawn them

    world = getattr(args, "world_size", 2)
    samples = timing.samples(args)
    result = run_distributed(_side_by_side, world, samples, timeout=900)[0]
    times = result["times"]
    common = {"ranks": world, "steps": samples}
    rows = [
        timing.versus("vision sync BN (ours) / per-rank BN", times["sync"], times["per-rank"],
                      "measured", **common)
    ]
    if "torch" in times:
        rows.append(
            timing.versus("vision sync BN ours / torch.nn.SyncBatchNorm", times["sync"],
                          times["torch"], "<= 1.1", **common))
    else:
        rows.append({
            "name": "vision sync BN ours / torch.nn.SyncBatchNorm",
            "ratio": "",
            "target": "skipped: torch's kernels need a GPU",
            **common
        })
    one = None
    for n in SCALING_WORLDS:
        rate = run_distributed(_images_per_second, n, samples, timeout=900)[0]
        one = one or rate
        rows.append({
            "name": f"vision images/s, {n} / 1 rank (sync BN, our DDP)",
            "ratio": rate / one,
            "target": "measured",
            "ranks": n,
            "steps": samples,
            "images_s": rate
        })
    return rows
