"""BatchNorm over data-parallel ranks: per-channel statistics of the whole global batch.

BatchNorm normalises each channel by the mean and variance of the batch it sees. Under data
parallel a rank sees B/N images, so plain BatchNorm uses its shard's statistics, and the run is
no longer the single-device run. Synchronised BatchNorm sums over the N ranks of
``pgm.gradient_sync_group`` instead:

    rank 0  x0 (B/N, C, H, W) --sum, sum of squares, count--+
    rank 1  x1 (B/N, C, H, W) --sum, sum of squares, count--+--all-reduce--> mean, var of all B
    ...                                                     |                (every rank alike)

    forward   all-reduce [sum x, sum x^2, count]          2C + 1 floats per BN layer
    backward  all-reduce [sum dy, sum dy * x_hat]          2C     floats per BN layer

so a step adds (4C + 1) fp32 elements per layer to the ledger, name "bn": a ring all-reduce
moves 2 (N-1)/N x 4 (4C + 1) bytes per rank for it. The count rides along so that unequal
shards would still weigh each image once (torch's SyncBatchNorm gathers it too).

Running buffers: every rank computes the same global mean and variance, so with
synchronised statistics the running mean and variance stay equal on every rank with no extra
traffic (a test checks it to the bit). With per-rank statistics (``average_running_stats``),
our wrappers average the buffers over the group after each step: the average of the shards'
means is the global mean, so running_mean is the single-device one; running_var misses the
spread of the means between ranks. torch's DDP broadcasts rank 0's buffers instead (1/N of the
data). Statistics in fp32 always: under autocast the input is cast up, the output back.

``torch.nn.SyncBatchNorm`` is PyTorch's version (``mode="torch"``). Its kernels
(batch_norm_stats, ...) exist for GPUs only, so on CPU it raises; ours runs on any device.
"""

from typing import Any, List, Optional, Tuple, cast

import torch
import torch.distributed as dist
from torch import nn

from scaletorch.dist import comm

BN_MODES = ("per-rank", "sync", "torch")
Group = Optional[dist.ProcessGroup]


class _SyncBatchNormFunction(torch.autograd.Function):
    """forward: normalise by the group's statistics (one all-reduce); backward: one all-reduce.

    x (b, C, H, W) -> y (b, C, H, W); weight, bias (C,). The gradients of weight and bias are
    this rank's own sums: the data-parallel wrapper averages them as any other gradient.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                running_mean: torch.Tensor, running_var: torch.Tensor, eps: float, momentum: float,
                group: Group) -> torch.Tensor:
        # [core: bn-forward]
        x32 = x.float()
        dims = [0] + list(range(2, x.dim()))  # every dim but the channel's
        count = x32.new_full((1, ), x.numel() // x.size(1))
        stats = torch.cat([x32.sum(dims), (x32 * x32).sum(dims), count])  # (2C + 1,)
        comm.all_reduce(stats, group, name="bn")
        c = x.size(1)
        n = stats[-1]
        mean = stats[:c] / n  # (C,)
        var = (stats[c:2 * c] / n - mean * mean).clamp_min(0)  # biased, what normalises
        with torch.no_grad():  # the unbiased variance, as nn.BatchNorm2d keeps it
            running_mean.lerp_(mean, momentum)
            running_var.lerp_(var * n / (n - 1).clamp_min(1), momentum)
        shape = [1, c] + [1] * (x.dim() - 2)
        invstd = torch.rsqrt(var + eps)
        x_hat = (x32 - mean.view(shape)) * invstd.view(shape)
        # [end: bn-forward]
        ctx.save_for_backward(x_hat, weight, invstd, n)
        ctx.group, ctx.dtype = group, x.dtype
        return (x_hat * weight.float().view(shape) + bias.float().view(shape)).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        x_hat, weight, invstd, n = ctx.saved_tensors
        dy = dy.float()
        dims = [0] + list(range(2, dy.dim()))
        c = dy.size(1)
        shape = [1, c] + [1] * (dy.dim() - 2)
        # [core: bn-backward]
        local = torch.cat([dy.sum(dims), (dy * x_hat).sum(dims)])  # (2C,)
        grad_bias, grad_weight = local[:c].clone(), local[c:].clone()  # this rank's own
        comm.all_reduce(local, ctx.group, name="bn")  # the whole batch's sums
        mean_dy, mean_dy_xhat = (local[:c] / n).view(shape), (local[c:] / n).view(shape)
        scale = (weight.float() * invstd).view(shape)
        dx = scale * (dy - mean_dy - x_hat * mean_dy_xhat)
        # [end: bn-backward]
        return (dx.to(ctx.dtype), grad_weight.to(weight.dtype), grad_bias.to(weight.dtype), None,
                None, None, None, None)


class SyncBatchNorm(nn.BatchNorm2d):
    """nn.BatchNorm2d whose training statistics are those of the whole group's batch.

    In eval mode, or on a group of one rank, it is nn.BatchNorm2d itself. Same parameters and
    buffers (names and shapes), so a checkpoint moves between the two.
    """

    def __init__(self, num_features: int, group: Group = None, eps: float = 1e-5,
                 momentum: float = 0.1) -> None:
        super().__init__(num_features, eps=eps, momentum=momentum)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or comm.group_size(self.group) == 1:
            return super().forward(x)
        cast(torch.Tensor, self.num_batches_tracked).add_(1)  # a buffer: tracked stats
        return _SyncBatchNormFunction.apply(x, self.weight, self.bias, self.running_mean,
                                            self.running_var, self.eps, self.momentum, self.group)


def convert_batchnorm(model: nn.Module, mode: str, group: Group) -> nn.Module:
    """Replace every nn.BatchNorm2d of ``model`` in place for ``mode``; returns ``model``.

    "per-rank": unchanged; "sync": our SyncBatchNorm over ``group``; "torch":
    torch.nn.SyncBatchNorm over ``group`` (GPU only). Weights and buffers are copied, so call it
    on the reference model before a data-parallel wrapper or ZeRO takes its parameters.
    """
    if mode not in BN_MODES:
        raise ValueError(f"batchnorm mode must be one of {', '.join(BN_MODES)}, got {mode!r}")
    if mode == "per-rank":
        return model
    if mode == "torch":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model, group)
    for name, child in list(model.named_children()):
        if type(child) is nn.BatchNorm2d:
            sync = SyncBatchNorm(child.num_features, group, child.eps, float(child.momentum or 0))
            sync.load_state_dict(child.state_dict())
            sync.to(child.weight.device)
            setattr(model, name, sync)
        else:
            convert_batchnorm(child, mode, group)
    return model


@torch.no_grad()
def average_running_stats(model: nn.Module, group: Group) -> None:
    """Per-rank statistics: make each BN layer's running mean and variance the group's
    average (one all-reduce of 2C elements per layer, name "bn"), so every rank keeps one."""
    n = comm.group_size(group)
    if n == 1:
        return
    for module in model.modules():
        mean, var = getattr(module, "running_mean", None), getattr(module, "running_var", None)
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and mean is not None:
            var = cast(torch.Tensor, var)  # torch keeps both or neither (track_running_stats)
            both = torch.cat([mean, var])
            comm.all_reduce(both, group, name="bn")
            both.div_(n)
            c = module.num_features
            mean.copy_(both[:c])
            var.copy_(both[c:])


def sync_bn_elements(channels: List[int], world_size: int) -> int:
    """Elements our SyncBatchNorm all-reduces per step (one forward, one backward) for BN
    layers of ``channels``: sum of 4C + 1; 0 on one rank (nothing to synchronise)."""
    return 0 if world_size == 1 else sum(4 * c + 1 for c in channels)
