"""Chapter 02's planted mistakes (scripts/grading/zero.py grades them): the library's
reduce_scatter_mean, gather_unit and release_unit, each with one learner's mistake.
scripts/grading/variants.py names them all (``PLANTED``) and gives each one's ``Source``."""

from typing import Dict, Optional, Tuple

import torch

from scaletorch.dist import comm
from scaletorch.dist.comm import Group

# ---- chapter 02: reduce_scatter_mean ---------------------------------------------------------


def reduce_scatter_sum(full: torch.Tensor, out: torch.Tensor, group: Group) -> Optional[comm.Work]:
    sent = full if full.dtype == out.dtype else full.to(out.dtype)
    return comm.reduce_scatter_tensor(out, sent, group, async_op=True)  # the sum, never / N


def reduce_scatter_divided_twice(full: torch.Tensor, out: torch.Tensor,
                                 group: Group) -> Optional[comm.Work]:
    full.div_(comm.group_size(group))
    comm.reduce_scatter_tensor(out, full, group)
    out.div_(comm.group_size(group))  # the mean's 1/N a second time
    return None


def reduce_scatter_by_all_reduce(full: torch.Tensor, out: torch.Tensor,
                                 group: Group) -> Optional[comm.Work]:
    full.div_(comm.group_size(group))
    comm.all_reduce(full, group)  # every rank receives every shard's mean
    rank, size = comm.group_rank(group), out.numel()
    out.copy_(full[rank * size:(rank + 1) * size])
    return None


def reduce_scatter_own_only(full: torch.Tensor, out: torch.Tensor,
                            group: Group) -> Optional[comm.Work]:
    rank, size = comm.group_rank(group), out.numel()
    out.copy_(full[rank * size:(rank + 1) * size])  # this rank's gradients, never combined
    return None


# ---- chapter 02: gather_unit ------------------------------------------------------------------


def gather_without_storage(flat: torch.Tensor, shard: torch.Tensor, group: Group,
                           async_op: bool = False) -> Optional[comm.Work]:
    # a released flat has 0 bytes: the all-gather would write into freed memory
    return comm.all_gather_into_tensor(flat, shard, group, async_op=async_op)


def gather_own_shard_only(flat: torch.Tensor, shard: torch.Tensor, group: Group,
                          async_op: bool = False) -> Optional[comm.Work]:
    if flat.untyped_storage().nbytes() == 0:
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
    rank, size = comm.group_rank(group), shard.numel()
    flat[rank * size:(rank + 1) * size].copy_(shard)  # the other ranks' shards never come
    return None


def gather_reversed(flat: torch.Tensor, shard: torch.Tensor, group: Group,
                    async_op: bool = False) -> Optional[comm.Work]:
    if flat.untyped_storage().nbytes() == 0:
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
    shards = flat.new_empty(flat.numel())
    comm.all_gather_into_tensor(shards, shard, group)
    # the shards placed last rank first: rank r's at (N - 1 - r) S
    flat.copy_(shards.view(comm.group_size(group), -1).flip(0).reshape(-1))
    return None


# ---- chapter 02: release_unit -----------------------------------------------------------------


def release_never(flat: torch.Tensor) -> None:
    pass  # every unit stays gathered: the whole model on every rank


def release_by_zeroing(flat: torch.Tensor) -> None:
    flat.zero_()  # the values go, the memory stays


def release_by_resizing_the_tensor(flat: torch.Tensor) -> None:
    flat.resize_(0)  # the tensor's shape, not its storage


# (chapter, exercise, variant) -> words its diagnosis must contain
CATALOGUE: Dict[Tuple[str, str, str], str] = {
    ("02", "reduce_scatter_mean", "reduce_scatter_sum"):
    "the shards' gradients are 2.00x the reference on every rank: the sum over the N = 2 ranks, "
    "not divided by N",
    ("02", "reduce_scatter_mean", "reduce_scatter_divided_twice"):
    "the shards' gradients are 0.50x the reference on every rank: divided by N = 2 twice",
    ("02", "reduce_scatter_mean", "reduce_scatter_by_all_reduce"):
    "crossed as an all-reduce of its P' elements",
    ("02", "reduce_scatter_mean", "reduce_scatter_own_only"):
    "step 0 held 0 reduce-scatters over dp for 4 units",
    ("02", "gather_unit", "gather_without_storage"):
    "gather_unit all-gathered into a released flat (0 of its",
    ("02", "gather_unit", "gather_own_shard_only"):
    "holding values no rank sent: all-gather every rank's shard into flat",
    ("02", "gather_unit", "gather_reversed"):
    "on rank 0 with group rank 1's shard (rank 2's) at offset 0 S: group rank r's shard belongs",
    ("02", "release_unit", "release_never"):
    "the whole model",
    ("02", "release_unit", "release_by_zeroing"):
    "release_unit zeroed flat but left its",
    ("02", "release_unit", "release_by_resizing_the_tensor"):
    "release_unit changed flat's shape from",
}
