"""Learners' functions a probe of the grader wrote, beside tests/grading_other_ways.py's.

``MISTAKES``: (chapter, exercise, function, words): each must fail, its diagnosis holding the
words: what was measured, and a cause only where the measurement determines it (a release
that rebinds flat: the bytes the parameters still hold; a combine that applies the regrouping
again, not its inverse; a mean load floored; a contiguous slice_ids off by one, which is not
zigzag's rule at 3 ranks; a scale halved by floor division, 0 from a scale of 1).
``ALTERNATIVES``: a correct ring_forward whose file's slice_ids and
merge are wrong: it must pass, each exercise judged on its own.
"""

import torch
import torch.distributed as dist

from scaletorch.dist.all_to_all import all_to_all
from scaletorch.parallel.expert_parallel import by_local_expert
from scaletorch.parallel.ring_attention import KV_TAG


def release_unit_rebinds(flat):
    """flat.data rebound to an empty tensor: the parameters, views of the old storage, keep
    every byte of it (the grader once said 0 bytes were left)."""
    flat.data = torch.empty(0, dtype=flat.dtype)


def combine_tokens_forward_order_again(out, send_table, recv_table, group):
    """'Undoes' the regrouping with by_local_expert's order itself, not its inverse."""
    back = out[by_local_expert(recv_table, out.device)]
    return all_to_all(back, [sum(s) for s in send_table], [sum(r) for r in recv_table], group, "ep")


@torch.no_grad()
def update_bias_floor_mean(bias, load, rate):
    """The mean load floored: right while the mean is whole, wrong at [3, 2, 2, 3]."""
    mean = load.sum() // load.numel()
    bias += rate * torch.sign(mean - load).to(bias.dtype)


def slice_ids(cp_rank, cp_size, order="zigzag"):
    """Zigzag right; contiguous off by one, (r, r + 1): zigzag's pair at 2 ranks, not at 3."""
    if order == "zigzag":
        return cp_rank, 2 * cp_size - 1 - cp_rank
    return cp_rank, cp_rank + 1


def merge(out, lse, tile_out, tile_lse):
    """Wrong: each tile's output weighted by the other tile's share."""
    new = torch.logaddexp(lse, tile_lse)
    return (torch.exp(tile_lse - new).unsqueeze(-1) * out +
            torch.exp(lse - new).unsqueeze(-1) * tile_out, new)


def ring_forward_own_helpers(q, kv, group, order, tile):
    """Correct ring (batch_isend_irecv, waited at once) that calls this file's wrong slice_ids
    and merge: the grader gives it the library's, and it passes."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    half = q.size(2) // 2
    acc = [None, None]
    cur = kv
    for t in range(n):
        if t < n - 1:
            nxt = torch.empty_like(cur)
            works = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, cur.contiguous(), dist.get_global_rank(group, (r + 1) % n),
                           group, KV_TAG),
                dist.P2POp(dist.irecv, nxt, dist.get_global_rank(group, (r - 1) % n), group, KV_TAG)
            ])
            for work in works:
                work.wait()
        mine, theirs = slice_ids(r, n, order), slice_ids((r - t) % n, n, order)
        for qi in range(2):
            for ki in range(2):
                if theirs[ki] > mine[qi]:
                    continue
                k, v = (cur[i][:, :, ki * half:(ki + 1) * half] for i in range(2))
                o, lse = tile(q[:, :, qi * half:(qi + 1) * half], k, v, theirs[ki] == mine[qi])
                o, lse = o.float(), lse.float()
                acc[qi] = (o, lse) if acc[qi] is None else merge(*acc[qi], o, lse)
        if t < n - 1:
            cur = nxt
    return torch.cat([acc[0][0], acc[1][0]], dim=2), torch.cat([acc[0][1], acc[1][1]], dim=2)


def update_scale_floor_halves(scale, clean_steps, found_inf, growth_interval):
    """Halves by floor division: right from 512, 0 from a scale of 1."""
    if found_inf:
        return scale // 2, 0
    clean_steps += 1
    return (scale * 2.0, 0) if clean_steps == growth_interval else (scale, clean_steps)


ALTERNATIVES = [("05", "ring_forward", "ring_forward_own_helpers")]
MISTAKES = [
    ("02", "release_unit", "release_unit_rebinds",
     "left 8,192 bytes allocated in the storage the parameters view (flat now has a new one "
     "of 0)"),
    ("06", "combine_tokens", "combine_tokens_forward_order_again",
     "the rows went back in by_local_expert's order, the regrouping applied a second time"),
    ("06b", "update_bias", "update_bias_floor_mean",
     "moved the bias by [-0.1, 0.0, 0.0, -0.1] in the probe with load [3.0, 2.0, 2.0, 3.0] "
     "(mean 2.5), the rule by [-0.1, 0.1, 0.1, -0.1]"),
    ("05", "slice_ids", "slice_ids",
     "slice_ids(1, 2, 'contiguous') returned (1, 2), the library (2, 3) (wrong in 6 of the 10"),
    ("08", "update_scale", "update_scale_floor_halves",
     "update_scale(scale=1, clean_steps=0, found_inf=True, growth_interval=2) returned (0, 0), "
     "the library's (0.5, 0)"),
]
