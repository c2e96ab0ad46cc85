"""Chapter 06's planted mistakes (scripts/grading/expert.py grades them): the library's
dispatch_tokens and combine_tokens, each with one learner's mistake. scripts/grading/variants.py
names them all (``PLANTED``) and gives each one's ``Source``."""

from typing import Any, Dict, List, Tuple

import torch

from scaletorch.dist import comm
from scaletorch.dist.all_to_all import all_to_all
from scaletorch.dist.comm import Group
from scaletorch.parallel.expert_parallel import by_local_expert

# ---- chapter 06: dispatch_tokens -----------------------------------------------------------


def dispatch_not_regrouped(routed: torch.Tensor, send_table: List[List[int]],
                           recv_table: List[List[int]], group: Group) -> torch.Tensor:
    send_splits, recv_splits = [sum(r) for r in send_table], [sum(r) for r in recv_table]
    return all_to_all(routed, recv_splits, send_splits, group, "ep")  # still by source rank


def dispatch_not_differentiable(routed: torch.Tensor, send_table: List[List[int]],
                                recv_table: List[List[int]], group: Group) -> torch.Tensor:
    send_splits, recv_splits = [sum(r) for r in send_table], [sum(r) for r in recv_table]
    received = routed.new_empty((sum(recv_splits), routed.shape[1]))
    comm.all_to_all_single(received, routed.detach(), recv_splits, send_splits, group,
                           name="ep")  # torch.distributed's: autograd does not see it
    return received[by_local_expert(recv_table, routed.device)]


def dispatch_without_exchange(routed: torch.Tensor, send_table: List[List[int]],
                              recv_table: List[List[int]], group: Group) -> torch.Tensor:
    return routed  # every token stays on its rank, whoever holds its expert


class _AllToAllSplitsKept(torch.autograd.Function):
    """An all-to-all whose backward sends the gradients with the forward's splits."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, output_splits: List[int], input_splits: List[int],
                group: Group) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty((sum(output_splits), x.shape[1]))
        comm.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group, name="ep")
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits
        out = grad.new_empty((sum(output_splits), grad.shape[1]))
        comm.all_to_all_single(out, grad.contiguous(), output_splits, input_splits, ctx.group,
                               name="ep")  # the splits not swapped
        return out, None, None, None


def dispatch_backward_not_swapped(routed: torch.Tensor, send_table: List[List[int]],
                                  recv_table: List[List[int]], group: Group) -> torch.Tensor:
    send_splits, recv_splits = [sum(r) for r in send_table], [sum(r) for r in recv_table]
    received = _AllToAllSplitsKept.apply(routed, recv_splits, send_splits, group)
    return received[by_local_expert(recv_table, routed.device)]


# ---- chapter 06: combine_tokens ------------------------------------------------------------


def combine_not_put_back(out: torch.Tensor, send_table: List[List[int]],
                         recv_table: List[List[int]], group: Group) -> torch.Tensor:
    send_splits, recv_splits = [sum(r) for r in send_table], [sum(r) for r in recv_table]
    return all_to_all(out, send_splits, recv_splits, group, "ep")  # rows still by expert


def combine_not_differentiable(out: torch.Tensor, send_table: List[List[int]],
                               recv_table: List[List[int]], group: Group) -> torch.Tensor:
    send_splits, recv_splits = [sum(r) for r in send_table], [sum(r) for r in recv_table]
    by_rank = out[torch.argsort(by_local_expert(recv_table, out.device))].detach()
    combined = out.new_empty((sum(send_splits), out.shape[1]))
    comm.all_to_all_single(combined, by_rank, send_splits, recv_splits, group, name="ep")
    return combined


def combine_without_exchange(out: torch.Tensor, send_table: List[List[int]],
                             recv_table: List[List[int]], group: Group) -> torch.Tensor:
    return out[torch.argsort(by_local_expert(recv_table, out.device))]  # never sent home


class _AllToAllAveragedBack(torch.autograd.Function):
    """An all-to-all whose backward sends the gradients back, then averages them over the group
    as if they were data-parallel gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, output_splits: List[int], input_splits: List[int],
                group: Group) -> torch.Tensor:
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return all_to_all(x, output_splits, input_splits, group, "ep").detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None, None, None]:
        output_splits, input_splits = ctx.splits
        back = all_to_all(grad, input_splits, output_splits, ctx.group, "ep")
        return back / comm.group_size(ctx.group), None, None, None  # not a mean: a route


def combine_backward_averaged(out: torch.Tensor, send_table: List[List[int]],
                              recv_table: List[List[int]], group: Group) -> torch.Tensor:
    send_splits, recv_splits = [sum(r) for r in send_table], [sum(r) for r in recv_table]
    by_rank = out[torch.argsort(by_local_expert(recv_table, out.device))]
    return _AllToAllAveragedBack.apply(by_rank, send_splits, recv_splits, group)


# (chapter, exercise, variant) -> words its diagnosis must contain
CATALOGUE: Dict[Tuple[str, str, str], str] = {
    ("06", "dispatch_tokens", "dispatch_not_regrouped"):
    "rank 0's experts got the right 235 tokens in step 0, but not grouped by local expert",
    ("06", "dispatch_tokens", "dispatch_not_differentiable"):
    "the dispatched tokens carry no gradient back",
    ("06", "dispatch_tokens", "dispatch_backward_not_swapped"):
    "the backward's all-to-all raised \"Split sizes doesn't match total dim 0 size\" in step 0: "
    "the gradients of the rows received from rank i go back to rank i",
    ("06", "dispatch_tokens", "dispatch_without_exchange"):
    "rank 0's experts got 256 rows in step 0, the ranks routed 235 to them",
    ("06", "combine_tokens", "combine_not_put_back"):
    "got back outputs of other tokens in step 0: undo the regrouping by local expert",
    ("06", "combine_tokens", "combine_not_differentiable"):
    "the combined outputs carry no gradient back to the experts",
    ("06", "combine_tokens", "combine_backward_averaged"):
    "returns the library's rows, but step 0's gradient norm is 0.999",
    ("06", "combine_tokens", "combine_without_exchange"):
    "returned 235 rows on rank 0 in step 0, for its 256 routed rows: send each output back",
}
