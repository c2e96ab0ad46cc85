"""Chapter 04's causes of a hang or a raise, in the learner's terms (probe 54 round 5): which
message a rank computed and never sent (the ranks waiting for it are no "all receive first"), a
send of torch.distributed's own that nobody receives (at the learner's line), a rank's own
KeyboardInterrupt (not its peers' broken connections), and the divisor micro_batch_loss was
measured to use at several m (m - 1 = p at pp 3, m = 4). The diagnoses from measurements given
by hand; in the long phase, each of tests/grading_probe_r5.py's HANGS_04 in a world of its own."""

import unittest

from scripts import grade
from scripts.grading.pipeline_diagnoses import divisor_diagnosis, gradient_diagnosis, hang_diagnosis
from tests import grading_probe_r5
from tests.test_grade import LONG, PROBED_R5, SHORT_HANG_TIMEOUT, patched

M = 4


def _stuck(call, wants, actions, sent, sends=False, own=None):
    return {
        "stuck": {
            "step": 0,
            "call": call,
            "sends": sends,
            "recvs": not sends,
            "wants": wants,
            "where": "04_pipeline_parallel.py:35",
            "waited": 4.0,
            "limit": 4.0,
            "actions": actions,
            "messages": {
                "sent": sent,
                "received": []
            },
            **({
                "own": own
            } if own is not None else {})
        }
    }


class PipelineHangCauses(unittest.TestCase):

    def test_a_gradient_never_sent_is_named_not_all_receive_first(self):
        # the last steady send_backward forgotten (rank 2 left the loop, rank 1 moved on)
        runs = [
            _stuck("recv_backward(mb 2 <- rank 1)", [["gradient", 2, 1]],
                   ["F0", "F1", "F2", "B0", "F3", "B1", "B2"], []),
            _stuck("recv_backward(mb 3 <- rank 2)", [["gradient", 3, 2]],
                   ["F0", "F1", "B0", "F2", "B1", "F3", "B2"],
                   [["gradient", 0, 0, 0], ["gradient", 1, 0, 1]]),
            {
                "hung": True,
                "step": 0,
                "in": "all_reduce over group 'pp' (3 ranks)",
                "actions": ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"],
                "messages": {
                    "sent": [["gradient", k, 1, k] for k in range(3)],
                    "received": []
                }
            },
        ]
        text = hang_diagnosis(runs, M)
        self.assertIn(
            "rank 2 ran the backward of micro-batch 3 but never sent its gradient to "
            "rank 1 (send_backward(3, ...); it sent micro-batch 0, 1, 2)", text)
        self.assertIn(
            "rank 1 ran the backward of micro-batch 2 but never sent its gradient to "
            "rank 0", text)
        self.assertNotIn("all receive first", text)

    def test_every_rank_receiving_first_is_still_told_so(self):
        # no rank ran what the other waits for: a cycle of receives
        runs = [
            _stuck("recv_backward(mb 0 <- rank 1)", [["gradient", 0, 1]], [], []),
            _stuck("recv_forward(mb 0 <- rank 0)", [["activation", 0, 0]], [], [])
        ]
        self.assertIn("(all receive first): one of them must send first", hang_diagnosis(runs, M))

    def test_a_send_of_torchs_own_nobody_receives_is_named_at_its_line(self):
        runs = [
            _stuck("torch.distributed.send(to rank 1, tag 77)", [], [], [], sends=True, own=1),
            _stuck("recv_forward(mb 0 <- rank 0)", [["activation", 0, 0]], [], []),
            _stuck("recv_forward(mb 0 <- rank 1)", [["activation", 0, 1]], [], [])
        ]
        text = hang_diagnosis(runs, M)
        self.assertIn(
            "rank 1 posts no receive for rank 0's torch.distributed.send(to rank 1, "
            "tag 77) at 04_pipeline_parallel.py:35: it waits in recv_forward", text)
        self.assertNotIn("all receive first", text)

    def test_the_divisor_measured_at_several_m_tells_m_minus_1_from_p(self):
        head = "gradients are 1.33x"
        text = divisor_diagnosis(head, {k: 1 / (k - 1) for k in (2, 3, 4, 5, 8)}, M)
        self.assertIn(
            "divides it by 3 at m = 4 (1 at m = 2, 2 at m = 3, 4 at m = 5, 7 at m = 8)"
            ": it divides by m - 1", text)
        self.assertIn("3 whatever m is", divisor_diagnosis(head, {k: 1 / 3 for k in (2, 4)}, M))
        self.assertIsNone(divisor_diagnosis(head, {k: 1 / k for k in (2, 3, 4)}, M))
        # both 4/3x at pp 3: the divisor measured at other m tells them apart
        ref = {"grad_norms": [1.0], "grads": {}}
        for divisor, words in ((lambda k: k - 1, "it divides by m - 1"),
                               (lambda k: 3, "divided by p = 3, the pipeline ranks?")):
            runs = [{
                "grad_norms": [4 / 3],
                "scales": {
                    k: 1 / divisor(k)
                    for k in (2, 3, 4, 5)
                }
            } for _ in range(3)]
            self.assertIn(words, gradient_diagnosis(runs, ref, M))


class GradeAPipelineHangsCause(unittest.TestCase):
    """tests/grading_probe_r5.py's HANGS_04, one world each at the short message timeout."""

    @unittest.skipUnless(LONG, "long phase")
    def test_the_rank_that_did_not_send_or_raised_is_named(self):
        module, _ = grade.CHAPTERS["04"]
        for exercise, function, phrases in grading_probe_r5.HANGS_04:
            with patched(module, "HANG_TIMEOUT", SHORT_HANG_TIMEOUT):
                verdict, = module.grade([{exercise: (PROBED_R5, function)}])
            self.assertFalse(verdict.passed, function)
            for phrase in phrases:
                self.assertIn(phrase, verdict.text, function)
            for wrong in grading_probe_r5.MUST_NOT[function]:
                self.assertNotIn(wrong, verdict.text, function)
