"""Probe 54 round 4's learners' mistakes, as tests/test_grade.py grades them: inference mode
entered in one exercise and never left (the job fails with the setting it left; the jobs after it
start without it: tests/test_grade_job_state.py), and a micro_batch_loss that makes a new tensor
of ``loss.item()`` (its backward reaches no model: told at the learner's return line before the
run, not as the hang the pipeline's messages would then be)."""

import torch

from scaletorch.parallel.moe_balance import biased_top_k as library_biased_top_k

_HELD = []  # the learner's guard, kept: a guard dropped at once leaves the mode as it found it


def biased_top_k_leaves_inference_mode_on(probs, bias, k):
    """Right choices, but inference mode stays on for every job after it."""
    if not _HELD:
        _HELD.append(torch.inference_mode())
        _HELD[0].__enter__()
    return library_biased_top_k(probs, bias, k)


def micro_batch_loss_from_item(loss, m):
    """The loss's value, as a new tensor: its graph starts here, so no gradient reaches a stage."""
    return torch.tensor(loss.item(), requires_grad=True) / m


MISTAKES = [("04", "micro_batch_loss", "micro_batch_loss_from_item",
             "micro_batch_loss, checked before the run: its backward does not reach the loss "
             "it was given (in the backward of the loss micro_batch_loss returned at "
             "grading_probe_r4.py:"),
            ("06b", "biased_top_k", "biased_top_k_leaves_inference_mode_on",
             "biased_top_k left torch's inference mode at True (it was False)")]
MUST_NOT = {"micro_batch_loss_from_item": ["hang", "pipeline_schedules.py"]}
