"""``--show-schedule`` of chapters 04 and 04b: each rank's actions and messages, no ranks needed.

Chapter 04 traces its loop (``pipeline_schedules.ScheduleTrace``): an action, then the named
operations it calls before the next one. Chapter 04b prints its runtime's data: each action
between the message it waits for and the one it sends. Both scripts print and exit.
"""

import importlib.util
import os
import re
import tempfile
import unittest

from tests.harness import run_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# 1F1B at p = 2, m = 4: rank 0 warms up with one forward, rank 1 with none; each steady-state
# forward sends its activation and receives a gradient in one batch
LOOP_1F1B = """\
rank 0: F0 send_forward(mb 0 -> rank 1)
rank 0: F1 send_forward_recv_backward(mb 1 -> rank 1, mb 0 <- rank 1)
rank 0: B0
rank 0: F2 send_forward_recv_backward(mb 2 -> rank 1, mb 1 <- rank 1)
rank 0: B1
rank 0: F3 send_forward_recv_backward(mb 3 -> rank 1, mb 2 <- rank 1)
rank 0: B2 recv_backward(mb 3 <- rank 1)
rank 0: B3
rank 1: recv_forward(mb 0 <- rank 0)
rank 1: F0
rank 1: B0 send_backward_recv_forward(mb 0 -> rank 0, mb 1 <- rank 0)
rank 1: F1
rank 1: B1 send_backward_recv_forward(mb 1 -> rank 0, mb 2 <- rank 0)
rank 1: F2
rank 1: B2 send_backward_recv_forward(mb 2 -> rank 0, mb 3 <- rank 0)
rank 1: F3
rank 1: B3 send_backward(mb 3 -> rank 0)
"""

# the same schedule as 04b's data: the message an action waits for, the action, what it sends
PLAN_1F1B = """\
rank 0: F0 send_forward(mb 0 -> rank 1)
rank 0: F1 send_forward(mb 1 -> rank 1)
rank 0: recv_backward(mb 0 <- rank 1) B0
rank 0: F2 send_forward(mb 2 -> rank 1)
rank 0: recv_backward(mb 1 <- rank 1) B1
rank 0: F3 send_forward(mb 3 -> rank 1)
rank 0: recv_backward(mb 2 <- rank 1) B2
rank 0: recv_backward(mb 3 <- rank 1) B3
rank 1: recv_forward(mb 0 <- rank 0) F0
rank 1: B0 send_backward(mb 0 -> rank 0)
rank 1: recv_forward(mb 1 <- rank 0) F1
rank 1: B1 send_backward(mb 1 -> rank 0)
rank 1: recv_forward(mb 2 <- rank 0) F2
rank 1: B2 send_backward(mb 2 -> rank 0)
rank 1: recv_forward(mb 3 <- rank 0) F3
rank 1: B3 send_backward(mb 3 -> rank 0)
"""


def script_main(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def show(name: str, *args: str) -> str:
    with tempfile.TemporaryDirectory() as run_dir:  # the tests write no runs/ in the checkout
        status, out, err = run_main(script_main(name), "--show-schedule", "--world-size", "2",
                                    "--logging.run_dir", run_dir, *args)
    if status != 0 or err:
        raise AssertionError(f"{name} {args}: exit {status}\n{err}")
    return out


def messages(text: str) -> list:
    """Every (rank, direction, micro-batch, peer) the output names, in no order."""
    found = []
    for line in text.splitlines():
        rank = int(line.split(":")[0].split()[1])
        found += [(rank, d, int(mb), int(peer))
                  for mb, d, peer in re.findall(r"mb (\d+) (->|<-) rank (\d+)", line)]
    return sorted(found)


def actions(text: str) -> list:
    """Each line's rank and actions (F0, B3, ...), in the order printed."""
    return [(line.split(":")[0], re.findall(r"\b[FBW]\d+(?:\.\d)?\b", line))
            for line in text.splitlines() if re.search(r"\b[FBW]\d", line)]


class ShowSchedule(unittest.TestCase):

    def test_chapter_04_prints_each_ranks_1f1b_calls_with_their_messages_and_exits(self):
        self.assertEqual(show("04_pipeline_parallel.py", "--micro-batches", "4"), LOOP_1F1B)

    def test_chapter_04b_prints_its_plan_with_the_same_messages_as_04s_loop(self):
        out = show("04b_zero_bubble.py", "--schedule", "1f1b", "--micro-batches", "4")
        self.assertEqual(out, PLAN_1F1B)
        self.assertEqual(messages(out), messages(LOOP_1F1B))
        self.assertEqual(actions(out), actions(LOOP_1F1B))  # the same order on every rank

    def test_chapter_04b_shows_a_v_shape_turn_and_weight_gradients_without_messages(self):
        out = show("04b_zero_bubble.py", "--schedule", "zbv", "--virtual-stages", "2",
                   "--micro-batches", "2")
        lines = out.splitlines()
        # rank 1 holds stages 1 and 2: its chunk 1's forward takes its input from its chunk 0
        self.assertIn("rank 1: F0.1 send_forward(mb 0 -> rank 0)", lines)
        self.assertIn("rank 0: recv_forward(mb 0 <- rank 1) F0.1", lines)
        self.assertIn("rank 0: W0", lines)
        self.assertEqual(len(lines), 2 * 2 * 2 * 3)  # p ranks x m x v chunks x (F, B, W)


if __name__ == "__main__":
    unittest.main()
