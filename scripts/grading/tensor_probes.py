"""Chapter 03's cross-entropy probes that come first (scripts/grading/tensor.py gives the rest):
the loss's dtype for fp32 and bf16 logits, and the ranks whose loss is that of shards offset by
the world rank; ``probe``, one call of the learner's cross-entropy against one device's."""

from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from scaletorch.dist import comm
from scaletorch.models import loss_fn

# fp32: a learner's all-reduce or loss may add the same numbers in another order, a few ulps of
# values below 10 (ulp at 8: 9.5e-7); a wrong operator is off by a factor or a shape.
RTOL, ATOL = 1e-5, 1e-5


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=RTOL, atol=ATOL)


def probe(
    fn: Callable, logits: torch.Tensor, targets: torch.Tensor, group: Any, grad_output: float = 1.0
) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """(learner's loss, its gradient of this rank's shard, the reference loss and gradient) of
    full logits (b, s, V) computed on one device, this rank holding its vocabulary shard; the
    loss's output gradient is ``grad_output``."""
    rank, n = comm.group_rank(group), comm.group_size(group)
    full = logits.clone().requires_grad_()
    want = loss_fn(full, targets)
    want_grad, = torch.autograd.grad(want, full, torch.tensor(grad_output))
    mine = logits.chunk(n, dim=-1)[rank].clone().requires_grad_()
    got = fn(mine, targets.clone(), group)
    grad = torch.autograd.grad(got, mine, torch.full_like(got, grad_output))[0] \
        if got.requires_grad else None
    return got.detach(), grad, want.detach(), want_grad.chunk(n, dim=-1)[rank]


def dtype_off(fn: Callable, group: Any, vocab: int) -> Optional[str]:
    """The loss's dtype given fp32, then bf16 logits: the fp32 mean both times (any float dtype
    in), else what came back, before any value is judged (a bf16 loss is off by its rounding)."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 4, vocab, generator=gen)
    targets = torch.randint(0, vocab, (2, 4), generator=gen)
    n, r = comm.group_size(group), comm.group_rank(group)
    for dtype in (torch.float32, torch.bfloat16):
        full = logits.to(dtype)
        got = fn(full.chunk(n, dim=-1)[r].clone().requires_grad_(), targets.clone(), group)
        if got.dtype != torch.float32:
            want = float(loss_fn(full.float(), targets))
            same = " (the logits' dtype)" if got.dtype == dtype else ""
            return (f"given {dtype} logits, the loss came back in {got.dtype}{same}, "
                    f"{float(got.detach()):.4f}, where the fp32 mean is {want:.4f}: whatever "
                    f"the logits' dtype, the loss is their fp32 mean; compute it in fp32 and "
                    f"return it without casting it")
    return None


def ranks_off(fn: Callable, group: Any, vocab: int) -> Optional[str]:
    """Which world ranks' loss is off for targets in every shard, when they are exactly the
    ranks whose world rank is not their tp rank and each equals the loss of shards offset by
    the world rank (r V/tp with r = dist.get_rank()): that, else None (one all-reduce over the
    world, on every rank alike)."""
    n, t, world = comm.group_size(group), comm.group_rank(group), dist.get_world_size()
    shard, gen = vocab // n, torch.Generator().manual_seed(1)
    members = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    logits = torch.randn(2, 4, vocab, generator=gen)
    targets = torch.arange(8).view(2, 4) * vocab // 8  # ids in every shard
    got, _, want, _ = probe(fn, logits, targets, group)
    # shard s's rank takes a target's logit at target - members[s] V/tp, when in its shard
    local = targets.unsqueeze(-1) - torch.tensor(members) * shard  # (2, 4, n)
    held = (local >= 0) & (local < shard)
    ids = torch.arange(n) * shard + local.clamp(0, shard - 1)
    # a target no rank holds adds 0 to the target logit: to the logit itself, or to the logit
    # less the max when the code shifts before it picks (both are right when a rank holds it)
    offset = [(torch.logsumexp(x, -1) - (x.gather(-1, ids) * held).sum(-1)).mean()
              for x in (logits, logits - logits.amax(-1, keepdim=True))]
    seen = torch.zeros(world, 3 + world)  # (rank, [off, world-rank offset, its tp rank, members])
    me = dist.get_rank()
    seen[me, :3] = torch.tensor(
        [float(not close(got, want)),
         float(any(close(got, o) for o in offset)), t])
    seen[me, 3 + torch.tensor(members)] = 1.0
    comm.all_reduce(seen, None)
    groups = [[k for k in range(world) if seen[r, 3 + k]] for r in range(world)]
    off = [r for r in range(world) if seen[r, 0]]
    # a tp group's loss is its ranks' sum: off wherever one of its ranks' world rank is not its
    # tp rank
    moved = [r for r in range(world) if any(int(seen[k, 2]) != k for k in groups[r])]
    if not off or off != moved or not all(seen[r, 1] for r in off):
        return None

    def named(ranks: List[int]) -> str:
        return " and ".join(map(str, ranks))

    where = ", ".join(f"rank {r}: tp rank {int(seen[r, 2])} of the tp group {groups[r]}"
                      for r in off)
    right = [r for r in range(world) if r not in off]
    return (f"the loss is off on ranks {named(off)} ({where}) and right on ranks {named(right)}, "
            f"whose world rank is their tp rank: it is the loss of shards offset by the world "
            f"rank (dist.get_rank()), not the tp group's; take the rank from ``group``")
