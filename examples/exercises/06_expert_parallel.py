"""Exercises of chapter 06 (doc/06_expert_parallel.md): send tokens to their experts and back.

Each is scaletorch/parallel/expert_parallel.py's function with its body removed. Write one, then

    python scripts/grade.py 06

runs chapter 06 on 4 gloo ranks (ep 2 x edp 2: the ep group is not the world; 4 experts, top-2,
2 experts per rank) with your function in place of the library's. Each call is compared with the
library's on the same inputs, then one call on uneven tables with some zero counts, forward and
backward; it says "passed" or what is wrong, and names the function to write next. The collective is
scaletorch.dist.all_to_all's ``all_to_all(x, output_split_sizes, input_split_sizes, group,
"ep")``: rows of dim 0, differentiable (its backward is the reverse all-to-all).
``by_local_expert(recv_table, device)`` (expert_parallel.py) gives the regrouping's order.
"""

from typing import List

from scaletorch.dist.all_to_all import all_to_all  # noqa: F401 - the collective to call
from scaletorch.dist.comm import Group
from scaletorch.parallel.expert_parallel import by_local_expert  # noqa: F401 - the order
from scaletorch.parallel.expert_parallel import ForMyExperts, Routed  # the shapes (jaxtyping)


def dispatch_tokens(routed: Routed, send_table: List[List[int]], recv_table: List[List[int]],
                    group: Group) -> ForMyExperts:
    """Send each routed token to the ep rank of its expert: routed (N, h), grouped by global
    expert, so send_table[j][l] rows (j, l in order) are for expert l of ep rank j;
    recv_table[i][l]: rows ep rank i sends to my local expert l. One differentiable all-to-all
    over ``group`` ("ep", P ranks; backward: the reverse), then the received rows regrouped
    by local expert: returns (M, h), M = sum of recv_table, expert 0's rows first."""
    raise NotImplementedError


def combine_tokens(out: ForMyExperts, send_table: List[List[int]], recv_table: List[List[int]],
                   group: Group) -> Routed:
    """Bring each expert output back to its token's rank: out (M, h), grouped by local expert
    as ``dispatch_tokens`` returned the tokens; the regrouping undone (rows by source rank
    again), then the reverse all-to-all over ``group`` ("ep", differentiable): returns (N, h),
    row n the output for routed row n of this rank."""
    raise NotImplementedError
