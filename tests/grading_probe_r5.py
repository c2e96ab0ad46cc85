"""Probe 54 round 5's learners' mistakes, as tests/test_grade.py grades them (one module for the
round's helpers: each block its own)."""

import torch
import torch.distributed as dist

from scaletorch.parallel import pipeline_schedules

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
                "divides by m - 1")]
# (function, the words its verdict must hold): each graded in a world of its own (a hang or a
# rank that stopped ends the world), in the long phase
HANGS_04 = [("one_f_one_b", "one_f_one_b_last_steady_send_forgotten", [
    "rank 2 ran the backward of micro-batch 3 but never sent its gradient to rank 1",
    "rank 1 ran the backward of micro-batch 2 but never sent its gradient to rank 0"
]),
            ("one_f_one_b", "one_f_one_b_unanswered_send", [
                "rank 0 waits in torch.distributed.send(to rank 1, tag 77) at grading_probe_r5.py:",
                "rank 1 posts no receive for rank 0's torch.distributed.send(to rank 1, tag 77)"
            ]),
            ("micro_batch_loss", "micro_batch_loss_interrupted_on_rank_2",
             ["micro_batch_loss raised on rank 2: KeyboardInterrupt (at grading_probe_r5.py:"])]
MUST_NOT_04 = {
    "micro_batch_loss_by_m_minus_1": ["divided by p", "pipeline ranks"],
    "one_f_one_b_last_steady_send_forgotten": ["all receive first", "must send first"],
    "one_f_one_b_unanswered_send": ["all receive first", "__exit__", "run.py"],
    "micro_batch_loss_interrupted_on_rank_2": ["Connection closed", "rank 0", "c10d"],
}
# ---- end of chapter 04 ----------------------------------------------------------------------

MISTAKES = [*MISTAKES_04]
MUST_NOT = {**MUST_NOT_04}
