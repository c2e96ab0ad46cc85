"""Probe 54 round 5's learners' mistakes, as tests/test_grade.py grades them (one module for the
round's helpers: each block its own)."""

import time

import torch
import torch.distributed as dist

from scaletorch.dist import comm
from scaletorch.parallel import pipeline_schedules
from scaletorch.parallel.loss_scale import unscale_and_check as library_unscale_and_check
from scaletorch.parallel.loss_scale import update_scale as library_update_scale
from scaletorch.parallel.tensor_parallel_layers import \
    vocab_parallel_cross_entropy as library_cross_entropy

# ---- chapter 04 (pipeline) ------------------------------------------------------------------
# At pp 3 with m = 4, m - 1 = p: the gradient's factor (4/3) cannot tell a division by m - 1
# from one by p. The grader calls micro_batch_loss at several m before the run and says which
# divisor it measured. The two hangs: a rank that ran a backward and never sent its gradient
# (no rank received first: nothing was out of order), and rank 0's send of torch.distributed's
# own that nobody receives (named at its line). The raise: rank 2's own KeyboardInterrupt, not
# its peers' broken connections.


def micro_batch_loss_by_m_minus_1(loss, m):
    """Divides by m - 1 (3 at m = 4: p at pp 3)."""
    return loss / (m - 1)


def one_f_one_b_last_steady_send_forgotten(rank, m):
    """1F1B whose steady state never sends the gradient of its last backward."""
    warm = min(rank.p - rank.rank - 1, m)
    steady = m - warm
    for mb in range(warm):
        rank.send_forward(mb, rank.forward(mb, rank.recv_forward(mb)))
    x = rank.recv_forward(warm) if steady > 0 else None
    for i in range(steady):
        y = rank.forward(warm + i, x)
        dx = rank.backward(i, rank.send_forward_recv_backward(warm + i, y, i))
        if i + 1 < steady:
            x = rank.send_backward_recv_forward(i, dx, warm + i + 1)
        # else: rank.send_backward(i, dx) forgotten
    for mb in range(steady, m):
        rank.send_backward(mb, rank.backward(mb, rank.recv_backward(mb)))


def one_f_one_b_unanswered_send(rank, m):
    """Rank 0 first sends a tensor of its own that no rank receives, then the library's 1F1B."""
    if dist.get_rank() == 0:
        dist.send(torch.ones(4), dst=1, tag=77)
    return pipeline_schedules.one_f_one_b(rank, m)


def micro_batch_loss_interrupted_on_rank_2(loss, m):
    """Rank 2 raises KeyboardInterrupt; its peers then lose their connections to it."""
    if dist.get_rank() == 2:
        raise KeyboardInterrupt
    return loss / m


MISTAKES_04 = [("04", "micro_batch_loss", "micro_batch_loss_by_m_minus_1",
                "divides it by 3 at m = 4 (1 at m = 2, 2 at m = 3, 4 at m = 5, 7 at m = 8): it "
                "divides by m - 1"),
               ("04", "micro_batch_loss", "micro_batch_loss_interrupted_on_rank_2",
                "micro_batch_loss raised on rank 2: KeyboardInterrupt (at grading_probe_r5.py:")]
# (function, the words its verdict must hold): each graded in a world of its own (a hang or a
# rank that stopped ends the world), in the long phase
HANGS_04 = [("one_f_one_b", "one_f_one_b_last_steady_send_forgotten", [
    "rank 2 ran the backward of micro-batch 3 but never sent its gradient to rank 1",
    "rank 1 ran the backward of micro-batch 2 but never sent its gradient to rank 0"
]),
            ("one_f_one_b", "one_f_one_b_unanswered_send", [
                "rank 0 waits in torch.distributed.send(to rank 1, tag 77) at grading_probe_r5.py:",
                "rank 1 posts no receive for rank 0's torch.distributed.send(to rank 1, tag 77)"
            ])]
MUST_NOT_04 = {
    "micro_batch_loss_by_m_minus_1": ["divided by p", "pipeline ranks"],
    "one_f_one_b_last_steady_send_forgotten": ["all receive first", "must send first"],
    "one_f_one_b_unanswered_send": ["all receive first", "__exit__", "run.py"],
    "micro_batch_loss_interrupted_on_rank_2": ["Connection closed", "rank 0", "c10d", "gloo"],
}
# ---- end of chapter 04 ----------------------------------------------------------------------

# ---- g14b: chapters 01, 03, 08 ------------------------------------------------------------


def average_divided_while_in_flight(grads, group):
    """One flat all-reduce, divided before its wait: the division races with the sum (the
    gradients come out a mix of mean and sum, or right when the race happens to go well)."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    work = comm.all_reduce(flat, group, async_op=True)
    flat /= comm.group_size(group)
    work.wait()
    off = 0
    for g in grads:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()


def cross_entropy_cast_to_logits_dtype(logits, targets, group):
    """The right loss, cast back to the logits' dtype: bf16 logits give a bf16 loss."""
    return library_cross_entropy(logits, targets, group).to(logits.dtype)


def cross_entropy_returned_in_bf16(logits, targets, group):
    """The right loss, always returned in bf16: off by its rounding, not by a target's shard."""
    return library_cross_entropy(logits, targets, group).to(torch.bfloat16)


def unscale_and_check_skipped_when_alone(grads, scale, group, agree=True):
    """With agree=False neither unscaled nor checked: every inf and NaN found with agree=True."""
    if not agree:
        return False
    return library_unscale_and_check(grads, scale, group, agree)


MISTAKES_G14B = [
    ("01", "average_gradients", "average_divided_while_in_flight",
     "while that tensor's all-reduce was in flight (launched with async_op=True"),
    ("03", "vocab_parallel_cross_entropy", "cross_entropy_cast_to_logits_dtype",
     "given torch.bfloat16 logits, the loss came back in torch.bfloat16 (the logits' dtype)"),
    ("03", "vocab_parallel_cross_entropy", "cross_entropy_returned_in_bf16",
     "given torch.float32 logits, the loss came back in torch.bfloat16"),
    ("08", "unscale_and_check", "unscale_and_check_skipped_when_alone",
     "did not find it with agree=False, yet with agree=True the check found every one"),
]
MUST_NOT_G14B = {
    "cross_entropy_returned_in_bf16": ["target", "shard"],
    "unscale_and_check_skipped_when_alone": ["look at every element"],
}
# ---- end of g14b ---------------------------------------------------------------------------

# ---- who caused a hang: the cause leads the verdict, not its consequences (g14c) ------------


def update_scale_sleeps_on_rank_1(scale, clean_steps, found_inf, growth_interval):
    """Rank 1 sleeps an hour: no CPU, no collective; rank 0 waits for it in the next step's."""
    if dist.get_rank() == 1:
        time.sleep(3600)
    return library_update_scale(scale, clean_steps, found_inf, growth_interval)


# chapter, exercise, function, the words its verdict starts with (tests/test_grade_stop_reports.py's
# long phase: rank 0 waits out the collective timeout)
ASLEEP = ("08", "update_scale", "update_scale_sleeps_on_rank_1",
          "update_scale: rank 1 was stopped in update_scale_sleeps_on_rank_1 (grading_probe_r5.py:")
MUST_NOT_ASLEEP = {
    "update_scale_sleeps_on_rank_1": ["after another rank had left", "flight recorder"]
}
# ---- end of g14c ---------------------------------------------------------------------------

MISTAKES = [*MISTAKES_04, *MISTAKES_G14B]
MUST_NOT = {**MUST_NOT_04, **MUST_NOT_G14B, **MUST_NOT_ASLEEP}
