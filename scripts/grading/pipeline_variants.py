"""Chapter 04's planted mistakes (scripts/grading/pipeline.py grades them): the library's
one_f_one_b and micro_batch_loss, each with one learner's mistake. scripts/grading/variants.py
names them all (``PLANTED``) and gives each one's ``Source``."""

from typing import Any, Dict, Tuple

import torch
import torch.distributed as dist

# ---- chapter 04: one_f_one_b --------------------------------------------------------------


def one_f_one_b_sends_first(stage: Any, m: int) -> None:
    warmup = min(stage.p - stage.rank - 1, m)
    for mb in range(warmup):
        stage.send_forward(mb, stage.forward(mb, stage.recv_forward(mb)))
    x = stage.recv_forward(warmup) if warmup < m else None
    for i in range(m - warmup):
        y = stage.forward(warmup + i, x)
        stage.send_forward(warmup + i, y)  # a send alone: the next rank is sending too
        dx = stage.backward(i, stage.recv_backward(i))
        stage.send_backward(i, dx)  # ...its gradient, before receiving the activation
        x = stage.recv_forward(warmup + i + 1) if warmup + i + 1 < m else None
    for mb in range(m - warmup, m):
        stage.send_backward(mb, stage.backward(mb, stage.recv_backward(mb)))


def _one_f_one_b(stage: Any, m: int, warmup: int, cool_down_receives: bool = True) -> None:
    """The library's loop with the given warm-up (and cool-down without its receives)."""
    for mb in range(warmup):
        stage.send_forward(mb, stage.forward(mb, stage.recv_forward(mb)))
    x = stage.recv_forward(warmup) if warmup < m else None
    for i in range(m - warmup):
        y = stage.forward(warmup + i, x)
        dx = stage.backward(i, stage.send_forward_recv_backward(warmup + i, y, i))
        if warmup + i + 1 < m:
            x = stage.send_backward_recv_forward(i, dx, warmup + i + 1)
        else:
            stage.send_backward(i, dx)
    for mb in range(m - warmup, m):
        dy = stage.recv_backward(mb) if cool_down_receives else None
        stage.send_backward(mb, stage.backward(mb, dy))


def one_f_one_b_warmup_too_long(stage: Any, m: int) -> None:
    _one_f_one_b(stage, m, min(stage.p - stage.rank, m))  # p - r: one forward too many


def one_f_one_b_warmup_too_short(stage: Any, m: int) -> None:
    _one_f_one_b(stage, m, max(stage.p - stage.rank - 2, 0))  # p - r - 2: one too few


def one_f_one_b_cool_down_without_recv(stage: Any, m: int) -> None:
    _one_f_one_b(stage, m, min(stage.p - stage.rank - 1, m), cool_down_receives=False)


# ---- chapter 04: micro_batch_loss ----------------------------------------------------------


def micro_batch_loss_not_divided(loss: torch.Tensor, m: int) -> torch.Tensor:
    return loss  # m micro-batch means add up to m x the batch's mean


def micro_batch_loss_divided_twice(loss: torch.Tensor, m: int) -> torch.Tensor:
    return loss / m / m


def micro_batch_loss_by_ranks(loss: torch.Tensor, m: int) -> torch.Tensor:
    return loss / dist.get_world_size()  # the number of pipeline ranks, not of micro-batches


# (chapter, exercise, variant) -> words its diagnosis must contain
CATALOGUE: Dict[Tuple[str, str, str], str] = {
    ("04", "one_f_one_b", "one_f_one_b_warmup_too_long"):
    "rank 0's warm-up ran 3 forwards before the steady state (F0 F1 F2 F3 B0 B1 ...): 1F1B warms "
    "up with p - r - 1 = 2; one more holds 4 activations at once, not p - r = 3",
    ("04", "one_f_one_b", "one_f_one_b_warmup_too_short"):
    "rank 0's warm-up ran 1 forwards before the steady state (F0 F1 B0 F2 ...): 1F1B warms up with "
    "p - r - 1 = 2; one fewer and the ranks take turns",
    ("04", "one_f_one_b", "one_f_one_b_cool_down_without_recv"):
    "rank 0 ran the backward of micro-batch 2 in step 0 without its gradient: in the cool-down, "
    "recv_backward(2) from rank 1 first",
    ("04", "micro_batch_loss", "micro_batch_loss_not_divided"):
    "gradients are 4x the reference in step 0 (its grad norm): each micro-batch's loss is a mean",
    ("04", "micro_batch_loss", "micro_batch_loss_divided_twice"):
    "gradients are 0.25x the reference in step 0 (its grad norm) = 1/m: divided by m = 4 twice",
    ("04", "micro_batch_loss", "micro_batch_loss_by_ranks"):
    "gradients are 1.33x the reference in step 0 (its grad norm): divided by p = 3, the pipeline",
}
# Variants that deadlock: one world each; the phrases their diagnosis must contain (the ranks,
# the operations they wait in, their peers, why).
HANGS: Dict[Tuple[str, str, str], Tuple[str, ...]] = {
    ("04", "one_f_one_b", "one_f_one_b_sends_first"):
    ("hang in step 0: rank 0 waits in send_forward(mb 2 -> rank 1) at pipeline_variants.py:",
     "rank 1 waits in send_forward(mb 1 -> rank 2) at pipeline_variants.py:",
     "rank 2 waits in send_backward(mb 0 -> rank 1) at pipeline_variants.py:", "(all send first)"),
}
