"""Probe 54 round 5's learners' mistakes, as tests/test_grade.py grades them (one module for the
round: each block its own)."""

import time

import torch.distributed as dist

from scaletorch.parallel.loss_scale import update_scale as library_update_scale
from scaletorch.parallel.pipeline_schedules import micro_batch_loss as library_micro_batch_loss

MISTAKES = []
MUST_NOT = {}

# -- who caused a hang or a crash: the cause leads the verdict, not its consequences ----------


def micro_batch_loss_interrupted_on_rank_2(loss, m):
    """Rank 2 (the last stage) raises KeyboardInterrupt; its peers' connections then close."""
    if dist.get_rank() == 2:
        raise KeyboardInterrupt
    return library_micro_batch_loss(loss, m)


def update_scale_sleeps_on_rank_1(scale, clean_steps, found_inf, growth_interval):
    """Rank 1 sleeps an hour: no CPU, no collective; rank 0 waits for it in the next step's."""
    if dist.get_rank() == 1:
        time.sleep(3600)
    return library_update_scale(scale, clean_steps, found_inf, growth_interval)


MISTAKES += [("04", "micro_batch_loss", "micro_batch_loss_interrupted_on_rank_2",
              "micro_batch_loss raised on rank 2: KeyboardInterrupt (at grading_probe_r5.py:")]
MUST_NOT["micro_batch_loss_interrupted_on_rank_2"] = ["Connection closed", "gloo", "rank 0"]
# chapter, exercise, function, the words its verdict starts with (tests/test_grade.py's long
# phase: rank 0 waits out the collective timeout)
ASLEEP = ("08", "update_scale", "update_scale_sleeps_on_rank_1",
          "update_scale: rank 1 was stopped in update_scale_sleeps_on_rank_1 (grading_probe_r5.py:")
MUST_NOT["update_scale_sleeps_on_rank_1"] = ["after another rank had left", "flight recorder"]
