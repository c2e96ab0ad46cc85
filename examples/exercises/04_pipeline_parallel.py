"""Exercises of chapter 04 (doc/04_pipeline_parallel.md): the 1F1B loop and the micro-batch loss.

Each is scaletorch/parallel/pipeline_schedules.py's function with its body removed. Write one,
then

    python scripts/grade.py 04

runs chapter 04 on 3 gloo ranks (pp 3, 4 micro-batches) with your functions in place of the
library's, compares it with one device and says "passed" or what is wrong; it names the function
to write next. ``this_rank`` (a ``pipeline_schedules.PipelineRank``: a rank, which holds one
stage here) has ``this_rank.p``, ``this_rank.rank``, ``this_rank.forward(mb, x)``,
``this_rank.backward(mb, dy)`` and the named operations ``recv_forward``, ``send_forward``,
``recv_backward``, ``send_backward``, ``send_forward_recv_backward`` and
``send_backward_recv_forward``.
"""

from scaletorch.parallel.pipeline_schedules import PipelineRank, Scalar


def one_f_one_b(this_rank: "PipelineRank", m: int) -> None:
    """1F1B: rank r of p holds at most p - r activations (m >= p).

    Warm-up: p - r - 1 forwards. Steady state: one forward, one backward, each send posted
    with the receive that answers it. Cool-down: the last backwards. Messages are (b, s, h),
    the parameters' dtype, over "pp": activations to rank r + 1, gradients to rank r - 1.
    """
    raise NotImplementedError


def micro_batch_loss(loss: Scalar, m: int) -> Scalar:
    """The last stage's loss of one micro-batch (fp32, the mean over its b x s tokens) as its
    share of the step's loss, / m: the m backwards add up to the gradient of the mean over
    the whole batch. No communication."""
    raise NotImplementedError
