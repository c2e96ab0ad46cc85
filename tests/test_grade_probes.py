"""The grader's diagnoses of mistakes nobody planted, where a probe decides them in one process
(no world: the probes of scripts/grading/context.py call ``merge`` directly, and
scripts/grading/loss_scale.py's diagnoses read the flags and scales a world measured, here
given by hand). Each names a cause only where the measurement determines it: a merge that is
not finite is an overflow only if the same tiles 100 lower merge right; an overflow lost by
every rank is the agreement's fault only if the rank holding it finds it when it decides alone.
"""

import unittest

import torch

from scaletorch.dist import flight_recorder
from scaletorch.parallel import loss_scale as library
from scripts.grading import context, context_variants, loss_scale, pipeline
from tests.test_file_kinds import DUMP_ENTRY


def merge_max_for_lse(out, lse, tile_out, tile_lse):
    """The larger lse for the merged one: the weights no longer sum to 1."""
    new_lse = torch.maximum(lse, tile_lse)
    return (torch.exp(lse - new_lse).unsqueeze(-1) * out +
            torch.exp(tile_lse - new_lse).unsqueeze(-1) * tile_out), new_lse


def merge_lse_updated_first(out, lse, tile_out, tile_lse):
    """lse updated in place first, then used as the old one: out's weight is 1."""
    lse.copy_(torch.logaddexp(lse, tile_lse))
    return out + torch.exp(tile_lse - lse).unsqueeze(-1) * tile_out, lse


def merge_divides_by_zero(out, lse, tile_out, tile_lse):
    """Not finite for any lse (0 / 0): no overflow to name."""
    return out * 0 / 0, torch.logaddexp(lse, tile_lse)


def merge_max_shift(out, lse, tile_out, tile_lse):
    """Correct: shifted by the larger lse, normalised by the weights' sum."""
    top = torch.maximum(lse, tile_lse)
    a, b = torch.exp(lse - top), torch.exp(tile_lse - top)
    out = (a.unsqueeze(-1) * out + b.unsqueeze(-1) * tile_out) / (a + b).unsqueeze(-1)
    return out, top + torch.log(a + b)


def update_grows_early(scale, clean_steps, found_inf, growth_interval):
    """Compares with growth_interval - 1: doubles one clean step early."""
    if found_inf:
        return scale / 2.0, 0
    clean_steps += 1
    if clean_steps >= growth_interval - 1:
        return scale * 2.0, 0
    return scale, clean_steps


class MergeProbes(unittest.TestCase):

    def test_each_merge_gets_what_was_measured(self):
        cases = [
            (merge_max_for_lse, "merge's lse is the larger of the two tiles'"),
            (merge_lse_updated_first, "merge's lse matches, its output is"),
            (merge_divides_by_zero, "its output is nan off the library's"),
            (context_variants.merge_without_max_shift,
             "and 0.999955 with lse 100 lower: e^100 overflows"),
        ]
        for fn, words in cases:
            text = context.probe_merge(fn)
            self.assertIn(words, text or "passed", fn.__name__)
            if fn is not context_variants.merge_without_max_shift:
                self.assertNotIn("overflows", text, fn.__name__)  # wrong at lse 0 and -10 too
        self.assertIsNone(context.probe_merge(merge_max_shift))


def _runs(found, probe_flags):
    return [{"found": found, "probes": [{"flag": f} for f in flags]} for flags in probe_flags]


class LossScaleDiagnoses(unittest.TestCase):

    def test_an_overflow_lost_by_the_agreement_is_named_so(self):
        # every rank returned False in every step; alone (probes 3, 4) rank 1 finds its own
        runs = _runs([False] * loss_scale.STEPS, [[False] * 5, [False, False, False, True, True]])
        ref = {"found": [s in loss_scale.PLANTED for s in range(loss_scale.STEPS)]}
        text = loss_scale.unscale_diagnosis(runs, ref)
        self.assertIn("step 3's gradients held an inf on rank 1", text)
        self.assertIn("the agreement lost it", text)
        self.assertNotIn("inf and NaN alike", text)

    def test_a_scale_doubled_early_is_told_when_not_why(self):

        def scales(fn):
            out, scale, clean = [], loss_scale.INIT_SCALE, 0
            for step in range(loss_scale.STEPS):
                scale, clean = fn(scale, clean, step in loss_scale.PLANTED,
                                  loss_scale.GROWTH_INTERVAL)
                out.append((scale, clean))
            return out

        ref = {
            "found": [s in loss_scale.PLANTED for s in range(loss_scale.STEPS)],
            "scales": scales(library.update_scale)
        }
        text = loss_scale.update_diagnosis([{"scales": scales(update_grows_early)}], ref)
        self.assertIn("the scale doubled in step 0, 1 step(s) after its last change", text)
        self.assertIn("look at where the clean steps are counted and compared", text)


def _dp_tp_dump(rank, dp_name, last_op):
    """Rank ``rank``'s dump in a world of 4 ranks as dp 2 x tp 2: one all_gather of its dp group
    (torch's name ``dp_name``), then two collectives of the world, the second ``last_op``."""
    dp = [rank % 2, rank % 2 + 2]
    entry = lambda group, seq, op: {  # noqa: E731
        **DUMP_ENTRY, "process_group": [group, "x"],
        "collective_seq_id": seq,
        "profiling_name": f"gloo:{op}"
    }
    return {
        "entries":
        [entry(dp_name, 1, "all_gather"),
         entry("0", 1, "all_reduce"),
         entry("0", 2, last_op)],
        "pg_config": {
            "0": {
                "name": "0",
                "desc": "world",
                "ranks": "[0, 1, 2, 3]"
            },
            dp_name: {
                "name": dp_name,
                "desc": "dp",
                "ranks": str(dp)
            },
        },
        "rank":
        rank
    }


class FlightRecorderGroups(unittest.TestCase):
    """Groups are told apart by their ranks: two dp groups of a dp x tp world are never compared
    with each other, even under one torch name; what rank 0 alone did differently is named."""

    def test_only_the_collective_that_differs_is_a_disagreement(self):
        for same_name in (False, True):
            traces = {
                r:
                _dp_tp_dump(r, "1" if same_name or r % 2 == 0 else "2",
                            "barrier" if r == 0 else "all_reduce")
                for r in range(4)
            }
            lines = flight_recorder.analyze(traces)
            self.assertIn(
                "first disagreement: collective #2 of group 'world' (ranks "
                "[0, 1, 2, 3])", lines[0], same_name)
            self.assertNotIn(
                "'dp'",
                "\n".join(lines[:lines.index("where each rank stopped (its last collective):")]),
                same_name)

    def test_a_dump_names_the_ranks_of_every_group_of_its_rank(self):
        # the grader's ranks dump without naming their groups (runner.py): each group's ranks
        # must be in the table, else the analysis takes it for the world's
        import json
        import tempfile

        import torch.distributed as dist

        from scaletorch.dist.spawn import free_port
        if dist.is_initialized():
            self.skipTest("a process group exists already")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)
        try:
            dist.new_group([0], group_desc="dp")
            with tempfile.TemporaryDirectory() as d, open(flight_recorder.dump(d, 0)) as f:
                table = json.load(f)["pg_config"]
        finally:
            dist.destroy_process_group()
        self.assertIn(("dp", "[0]"), [(g["desc"], g["ranks"]) for g in table.values()])


class PipelineHangOutsideTheLoop(unittest.TestCase):
    """A 1F1B whose cool-down skips the last backward (``range(rem, m - 1)``): rank 2 waits in
    send_backward(3) while ranks 0 and 1 left the loop and wait in a collective. The verdict
    names the backward each left without, from the actions it ran (pipeline.rank_jobs records
    them), and is the hang's, never a bare timeout, even with no rank in a send or receive."""

    def test_the_skipped_backward_is_named(self):
        from scaletorch.schedule.orders import one_f_one_b_actions
        m, p = pipeline.MICRO_BATCHES, pipeline.WORLD
        timeout = "RuntimeError: Timed out waiting 10000ms for recv (at distributed_c10d.py:1)"
        runs = [{
            "exercise": "one_f_one_b",
            "error": timeout,
            "hung": True,
            "step": 0,
            "in": "all_reduce (comm.py:1)",
            "actions": [str(a) for a in one_f_one_b_actions(p, m, r) if str(a) != f"B{m - 1}"]
        } for r in range(p)]
        text = pipeline.diagnose("one_f_one_b", runs, {}).text
        self.assertNotIn("Timed out", text)
        for r in range(p):
            self.assertIn(
                f"rank {r} is in no send or receive (it waits in all_reduce (comm.py:1))"
                f": it left step 0's loop without B{m - 1}", text)
        runs[-1] = {
            "exercise": "one_f_one_b",
            "error": "stuck",
            "stuck": {
                "step": 0,
                "call": f"send_backward(mb {m - 1} -> rank {p - 2})",
                "sends": True,
                "recvs": False,
                "where": "04_pipeline_parallel.py:34",
                "waited": 4.0,
                "limit": 4.0,
                "messages": {
                    "sent": [],
                    "received": []
                }
            }
        }
        text = pipeline.diagnose("one_f_one_b", runs, {}).text
        self.assertIn(f"rank {p - 1} waits in send_backward(mb {m - 1} -> rank {p - 2})", text)
        self.assertIn(f"rank {p - 2} is in no send or receive", text)
        self.assertIn(f"without B{m - 1}", text)


class AHangIsHeadedByTheCollectiveNeverMet(unittest.TestCase):
    """A 06 world of two ep groups ([0, 1], [2, 3]) where rank 3's combine_tokens skips its
    all-to-all: rank 2 waits in it, the others go on to a world all_reduce. The headline names
    the rank waiting, the op, the group by its ranks, the learner's line and the rank missing."""

    def test_the_waiting_and_the_missing_rank_are_named(self):
        import os

        from scripts.grading import stop_reports
        mine = os.path.abspath("examples/exercises/06_expert_parallel.py")

        def entry(group, seq, op, frames):
            return {
                **DUMP_ENTRY, "process_group": [group, "x"],
                "collective_seq_id": seq,
                "profiling_name": f"gloo:{op}",
                "frames": frames
            }

        ours = [{
            "filename": os.path.abspath("scaletorch/dist/all_to_all.py"),
            "line": 28,
            "name": "forward"
        }, {
            "filename": mine,
            "line": 9,
            "name": "combine_tokens"
        }]
        traces = {}
        for r in range(4):
            ep = "1" if r < 2 else "2"
            # an all-to-all's sizes differ between ranks when right (uneven splits)
            entries = [{**entry(ep, 1, "all_to_all", ours), "input_sizes": [[r + 1, 4]]}]
            entries += [entry(ep, 2, "all_to_all", ours)] if r != 3 else []
            entries += [entry("0", 1, "all_reduce", [])] if r != 2 else []
            traces[r] = {
                "entries": entries,
                "rank": r,
                "pg_config": {
                    "0": {
                        "name": "0",
                        "desc": "world",
                        "ranks": "[0, 1, 2, 3]"
                    },
                    ep: {
                        "name": ep,
                        "desc": "ep",
                        "ranks": "[0, 1]" if r < 2 else "[2, 3]"
                    }
                }
            }
        head = stop_reports.hang_head(traces, [mine])
        self.assertIn(
            "hang: rank 2 wait(s) in all_to_all #2 of group 'ep' (ranks [2, 3]), "
            "issued at combine_tokens (06_expert_parallel.py:9); rank 3 of that group "
            "never issued it (rank 3's last is all_reduce #1 of group 'world'", head)


if __name__ == "__main__":
    unittest.main()
