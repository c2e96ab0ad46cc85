"""Who caused a hang or a crash, in one process (no world): scripts/grading/stop_reports.py's
``account`` of the ranks that did not finish a job, from what the parent measured (each rank's
kind of stop, its learner's frame, faulthandler's dump, the flight recorder's dumps of the ranks
whose collectives timed out), and verdicts.py's ``error_verdict`` of a job that raised. The
cause leads: a rank still computing, or one outside any collective that the others timed out
waiting for (asleep, in a call every rank of the world must make, stopped without a stack); a
rank's own error before the backend's "connection closed" of its peers. One world, in CI's long
phase: a rank asleep in chapter 08 (tests/grading_probe_r5.py)."""

import unittest

from scripts import grade
from scripts.grading import runner
from scripts.grading.learner import is_hang
from scripts.grading.stop_reports import Stop, account
from scripts.grading.verdicts import error_verdict
from tests import grading_probe_r5
from tests.test_file_kinds import DUMP_ENTRY
from tests.test_grade import LONG, SHORT_COLLECTIVE_TIMEOUT
from tests.test_planted_bugs import patched

MINE = "/learner/02_fsdp.py"
TORCH = "/site-packages/torch/distributed"


def _stack(*frames):
    """faulthandler's dump of ``frames`` ((file, line, name), innermost first)."""
    return "Stack (most recent call first):\n" + "".join(f'  File "{f}", line {n} in {name}\n'
                                                         for f, n, name in frames)


IN_NEW_GROUP = _stack((f"{TORCH}/distributed_c10d.py", 2169, "_new_process_group_helper"),
                      (f"{TORCH}/distributed_c10d.py", 5863, "new_group"),
                      (f"{TORCH}/c10d_logger.py", 97, "wrapper"), (MINE, 23, "gather_unit"))
IN_ALL_REDUCE = _stack((f"{TORCH}/distributed_c10d.py", 3252, "all_reduce"),
                       (f"{TORCH}/c10d_logger.py", 83, "wrapper"),
                       ("/repo/scaletorch/dist/comm.py", 69, "_issue"), (MINE, 25, "gather_unit"))
ASLEEP = _stack((MINE, 17, "gather_unit"), ("/repo/scripts/grading/zero.py", 140, "measure"))


def _dump(rank, group, ranks, seq, op):
    """Rank ``rank``'s flight-recorder dump: its last collective, ``op`` #``seq`` of ``group``."""
    name = "1" if group != "world" else "0"
    return {
        "entries": [{
            **DUMP_ENTRY, "process_group": [name, group],
            "collective_seq_id":
            seq,
            "profiling_name":
            f"gloo:{op}",
            "frames": [{
                "filename": "/repo/scripts/grading/traffic.py",
                "line": 92,
                "name": "call"
            }]
        }],
        "pg_config": {
            name: {
                "name": name,
                "desc": group,
                "ranks": str(ranks)
            }
        },
        "rank":
        rank
    }


def _timed_out(r, where="__exit__ (run.py:234)"):
    return Stop(
        f"rank {r} stopped in {where}, in a collective: no peer answered its recv "
        f"within 25 s", "timed out", where)


def _killed(r, where, stack):
    return Stop(f"rank {r} was stopped in {where}, after another rank had left", "stopped", where,
                stack)


def _verdict(stops, traces):
    texts = account(stops, traces, [MINE], "gather_unit")
    return "; ".join(texts[r] for r in sorted(texts))


class TheCauseLeads(unittest.TestCase):

    def test_a_rank_still_computing_leads_and_the_others_waits_follow(self):
        waiting = "_issue (comm.py:69)"
        stops = {
            r:
            Stop(
                f"rank {r} made no progress (the grader's limit: 30 s waiting, 300 s a job), "
                f"stopped in {waiting}", "no progress", waiting, IN_ALL_REDUCE)
            for r in (0, 2)
        }
        stops[1] = Stop(
            "rank 1 was still computing in gather_unit (02_fsdp.py:21) after 20 s of "
            "CPU in this job", "computing", "gather_unit (02_fsdp.py:21)")
        stops[3] = Stop(f"rank 3 stopped in {waiting}, in a collective: a peer rank had left",
                        "hang", waiting)
        texts = account(stops, {3: _dump(3, "dp", [1, 3], 69, "all_gather")}, [MINE], "x")
        self.assertEqual(list(texts), [1])  # one sentence: the cause, the others' waits after
        self.assertTrue(texts[1].startswith("rank 1 was still computing in gather_unit"))
        self.assertIn(
            f"; the others waited for it: rank 0 in {waiting}, rank 2 in {waiting}, "
            f"rank 3 in {waiting}", texts[1])
        self.assertNotIn("flight recorder", texts[1])

    def test_a_rank_asleep_in_the_learners_code_is_the_cause_not_a_victim(self):
        stops = {0: _timed_out(0), 1: _killed(1, "gather_unit (02_fsdp.py:17)", ASLEEP)}
        text = _verdict(stops, {0: _dump(0, "dp", [0, 1], 93, "all_reduce")})
        self.assertTrue(
            text.startswith("rank 1 was stopped in gather_unit (02_fsdp.py:17), outside any "
                            "collective, while the others waited for it"), text)
        self.assertIn("rank 0 timed out in all_reduce #93 of group 'dp' (ranks [0, 1])", text)
        self.assertNotIn("after another rank had left", text)
        # a loop on a loaded machine, stopped before the CPU limit: its CPU told
        stops[1].cpu = 12.4
        self.assertIn("outside any collective after 12 s of CPU in this job, while",
                      _verdict(stops, {0: _dump(0, "dp", [0, 1], 93, "all_reduce")}))

    def test_a_rank_in_a_call_of_the_whole_world_is_named_at_its_line(self):
        # rank 0 alone makes a group: the others wait in the grader's collectives for it
        stops = {
            0:
            _killed(0, "gather_unit (02_fsdp.py:23)", IN_NEW_GROUP),
            1:
            _killed(1, "gather_unit (02_fsdp.py:25)", IN_ALL_REDUCE),
            2:
            _timed_out(2, "gather_unit (02_fsdp.py:25)"),
            3:
            Stop(
                "rank 3 stopped in checked (zero.py:140), in a collective: a peer rank had "
                "left", "hang", "checked (zero.py:140)")
        }
        traces = {
            2: _dump(2, "dp", [0, 2], 7, "all_gather"),
            3: _dump(3, "tp", [2, 3], 1, "all_reduce")
        }
        text = _verdict(stops, traces)
        self.assertTrue(
            text.startswith("rank 0 was stopped in gather_unit (02_fsdp.py:23), in "
                            "torch.distributed's new_group (every rank of the world must call "
                            "it"), text)
        self.assertIn("rank 2 timed out in all_gather #7 of group 'dp' (ranks [0, 2])", text)
        # rank 1, waiting in a collective, is no cause; no grader file is the place to look
        self.assertNotIn("rank 1 was stopped", text)
        self.assertNotIn("traffic.py", text)

    def test_a_rank_that_wrote_no_stack_is_the_one_that_stopped(self):
        nothing = "vocab_parallel_cross_entropy (03_tensor_parallel.py, no Python stack)"
        stops = {
            0: _timed_out(0),
            1: _timed_out(1),
            2: _killed(2, nothing, ""),
            3: _timed_out(3, "vocab_parallel_cross_entropy (03_tensor_parallel.py:21)")
        }
        traces = {r: _dump(r, "world", [0, 1, 2, 3], 61, "all_reduce") for r in (0, 1)}
        traces[3] = _dump(3, "tp", [2, 3], 217, "all_reduce")
        text = _verdict(stops, traces)
        self.assertTrue(
            text.startswith(f"rank 2 stopped in {nothing}: it did not even write its "
                            f"stack when the grader asked"), text)
        self.assertIn("rank 3 timed out in all_reduce #217 of group 'tp' (ranks [2, 3])", text)
        self.assertNotIn("_ranks_off", text)

    def test_a_rank_stopped_while_it_waited_in_a_collective_is_no_cause(self):
        # it came late to a collective of the group: the flight recorder tells the disagreement
        stops = {0: _timed_out(0), 1: _killed(1, "gather_unit (02_fsdp.py:25)", IN_ALL_REDUCE)}
        text = _verdict(stops, {0: _dump(0, "dp", [0, 1], 93, "all_reduce")})
        self.assertTrue(text.startswith("rank 0 stopped in __exit__ (run.py:234)"), text)
        self.assertIn("the flight recorder says", text)
        self.assertIn("after another rank had left", text)


class ARanksOwnErrorLeads(unittest.TestCase):

    def test_the_error_a_rank_raised_comes_before_its_peers_closed_connections(self):
        closed = ("RuntimeError: [/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
                  "Connection closed by peer [127.0.0.1]:20141. (at distributed_c10d.py:5356: "
                  "work.wait())")
        runs = [{
            "error": closed,
            "hung": True
        }, {
            "error": closed
        }, {
            "error":
            "KeyboardInterrupt (at 04_pipeline_parallel.py:17: raise KeyboardInterrupt)"
        }]
        verdict = error_verdict("micro_batch_loss", runs)
        self.assertEqual(
            verdict.text, "micro_batch_loss raised on rank 2: KeyboardInterrupt (at "
            "04_pipeline_parallel.py:17: raise KeyboardInterrupt)")

    def test_a_rank_stopped_comes_before_its_peers_closed_connections(self):
        runs = [{
            "error": "RuntimeError: Connection reset by peer"
        }, {
            "lost": "rank 1 died of SIGKILL"
        }]
        self.assertEqual(error_verdict("f", runs).text, "f: rank 1 died of SIGKILL")
        # alone, the peer's error is told without gloo's internals
        alone = error_verdict(
            "f",
            [{
                "error": "RuntimeError: [/x/gloo/pair.cc:1] Connection "
                "closed by peer [127.0.0.1]:1"
            }, {}])
        self.assertNotIn("gloo", alone.text)

    def test_gloos_timeout_that_closed_the_pair_is_a_hang_not_the_learners_error(self):
        # as gloo tells a wait that ran out on a loaded machine: the world cannot go on
        self.assertTrue(is_hang(RuntimeError("Application timeout caused pair closure")))


# a world that waits out the collective timeout (8 s here) and the grader's grace: long phase
@unittest.skipUnless(LONG, "long phase")
class GradeARankAsleep(unittest.TestCase):
    """Chapter 08, 2 ranks: rank 1 sleeps outside any collective, rank 0 times out waiting for
    it in the next step's; rank 1 leads the verdict at the learner's line, not as a victim."""

    def test_a_rank_asleep_outside_any_collective_is_the_cause(self):
        chapter, exercise, function, words = grading_probe_r5.ASLEEP
        module, _ = grade.CHAPTERS[chapter]
        with patched(runner, "COLLECTIVE_TIMEOUT", SHORT_COLLECTIVE_TIMEOUT):
            verdict, = module.grade([{exercise: ("tests.grading_probe_r5", function)}])
        self.assertFalse(verdict.passed)
        self.assertTrue(verdict.text.startswith(words), verdict.text)
        self.assertIn("outside any collective, while the others waited for it", verdict.text)
        for wrong in grading_probe_r5.MUST_NOT[function]:
            self.assertNotIn(wrong, verdict.text)


if __name__ == "__main__":
    unittest.main()
