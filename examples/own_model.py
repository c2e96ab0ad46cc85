"""Chapters 01 and 02 on your own model: our DDP, sharded optimizer and ZeRO-3 beside PyTorch's.

    torchrun --nproc-per-node 2 examples/own_model.py --steps 5

A plain MLP that nobody here wrote, built on every rank with another seed (the wrappers make
the replicas equal: the first rank's). Each strategy trains it for ``--steps`` AdamW steps on
its 1/N of every batch; the table prints the largest deviation of its final weights from the
same model trained on one device (rank 0's seed, the whole batch), ours beside PyTorch's.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from scaletorch.parallel.data_parallel_any_module import apply_data_parallel_any
from scaletorch.parallel.sharded_optimizer import ShardedOptimizer
from scaletorch.parallel.zero import ZeroAdamW
from scaletorch.parallel.zero_any_module import apply_zero_any
from scaletorch.rules.errors import OneLineParser

ADAMW = dict(lr=1e-2, weight_decay=0.1)


class MLP(nn.Module):

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, rank: int,
          world: int) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        optimizer.zero_grad()
        F.mse_loss(model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        optimizer.step()


def ours(strategy: str, model: nn.Module):
    """(the model to call, its optimizer, a function returning the full weights): ours."""
    # [core: ours-ddp]
    if strategy == "DDP":
        model = apply_data_parallel_any(model, None)  # bucketed; broadcasts rank 0's weights
        return model, torch.optim.AdamW(model.parameters(), **ADAMW), model.state_dict
    # [end: ours-ddp]
    # [core: ours-zero]
    if strategy == "ZeRO-1":
        model = apply_data_parallel_any(model, None)
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
        return model, opt, model.state_dict
    model = apply_zero_any(model)  # ZeRO-3, one unit per child, over the world
    return model, ZeroAdamW(model, ADAMW["lr"], (0.9, 0.999), ADAMW["weight_decay"]), \
        model.full_state_dict
    # [end: ours-zero]


def theirs(strategy: str, model: nn.Module):
    """The same three with PyTorch's DDP, ZeroRedundancyOptimizer and FSDP2."""
    # [core: torch-ddp]
    if strategy == "DDP":
        model = DistributedDataParallel(model)
        return model, torch.optim.AdamW(model.parameters(), **ADAMW), model.module.state_dict
    # [end: torch-ddp]
    # [core: torch-zero]
    if strategy == "ZeRO-1":
        model = DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **ADAMW)
        return model, opt, model.module.state_dict
    for p in model.parameters():  # FSDP2 shards each rank's own values: start from rank 0's
        dist.broadcast(p.data, src=0)
    for layer in (model.fc1, model.fc2, model.out):
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), **ADAMW), \
        lambda: {k: v.full_tensor() for k, v in model.state_dict().items()}
    # [end: torch-zero]


def main() -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    steps = parser.parse_args().steps
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = MLP()  # rank 0's model, trained on one device with the whole batch
    train(reference, torch.optim.AdamW(reference.parameters(), **ADAMW), steps, 0, 1)
    want = reference.state_dict()
    rows = []
    for strategy in ("DDP", "ZeRO-1", "ZeRO-3"):
        row = []
        for apply in (ours, theirs):
            torch.manual_seed(rank)  # every rank builds its own model: rank 0's is the one
            model, optimizer, weights = apply(strategy, MLP())
            train(model, optimizer, steps, rank, world)
            row.append(
                max((w.detach().cpu() - want[k]).abs().max().item() for k, w in weights().items()))
        rows.append((strategy, *row))
    if rank == 0:
        print(f"{world} ranks, {steps} AdamW steps; largest |weight - one device's|:")
        print(f"{'strategy':<8} {'ours':>9} {'torch':>9}   (torch: DDP, "
              f"ZeroRedundancyOptimizer, fully_shard)")
        for strategy, a, b in rows:
            print(f"{strategy:<8} {a:9.1e} {b:9.1e}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
