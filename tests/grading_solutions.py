"""Learners' functions for the grader's tests (tests/test_grade.py), none from the catalogue.

``ALTERNATIVES``: correct solutions written another way than the library's (torch.distributed
directly, in place, another order, another API, a batch of point-to-point ops); each must pass.
``BROKEN``: functions that crash, hang or raise on one rank; each must be attributed to its own
exercise and rank, and the exercises after it keep their verdicts.
"""

import os
import signal

import torch.distributed as dist

from scaletorch.dist import comm


# ---- crashes, hangs, errors (chapter 01's average_gradients) -------------------------------


def segfault_on_rank_1(grads, group):
    """Rank 1 dies of a segfault in its first call."""
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    for g in grads:
        comm.all_reduce(g, group)
        g /= comm.group_size(group)


def hang_on_rank_1(grads, group):
    """Rank 1 waits for a message rank 0 never sends."""
    if dist.get_rank() == 1:
        dist.recv(grads[0].clone(), src=0)
    for g in grads:
        comm.all_reduce(g, group)
        g /= comm.group_size(group)


def raise_on_rank_1(grads, group):
    """Rank 1 raises in its first call."""
    if dist.get_rank() == 1:
        raise ValueError("the learner's own error")
    for g in grads:
        comm.all_reduce(g, group)
        g /= comm.group_size(group)
