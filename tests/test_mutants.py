"""The mutator of ``scripts/grade.py --mutants`` (scripts/grading/mutate.py, mutants.py), in one
process and without a world: each operator makes the intended AST, and a grader that cannot see
a mistake has it reported as a survivor (a planted weak grader), unless the equivalents file
lists it. The run on a chapter's real grader is CI's long phase (.ci/run).
"""

import ast
import inspect
import os
import sys
import tempfile
import unittest
from typing import Any, Callable, Dict, List, Sequence

from scripts.grading import mutants
from scripts.grading.learner import Source, load
from scripts.grading.mutate import WORLD_GROUP, function_def
from scripts.grading.mutate import mutants as make
from scripts.grading.verdicts import Verdict


def sample(x, y, group, other_group, comm):  # noqa: ANN001, ANN201 - the mutator's input
    """A docstring is never mutated: 1 - 2."""
    n = x - y
    comm.all_reduce(x, group)
    if n[y] < 3:
        x.div_(n)
    while n > 0:
        n -= 1
    comm.barrier(other_group)
    return 1 - n


def full_buckets(ready: Sequence[int], sizes: Sequence[int], start: int) -> int:
    """The planted chapter's library function: the first bucket from ``start`` not full."""
    while start < len(sizes) and ready[start] == sizes[start]:
        start += 1
    return start


# The planted grader's inputs: never two full buckets in a row, so that an ``if`` for the
# ``while`` returns the same (the survivor it must report); an index past the end raises
CASES = [([2, 0], [2, 1], 0), ([0, 0], [1, 1], 0), ([1, 3], [2, 3], 1)]


def bounded(fn: Callable, *args: Any) -> Any:
    """``fn(*args)``, stopped by an error after 1000 lines (a mutant's endless loop): the
    planted grader's limit of a job."""
    lines = [0]

    def trace(frame: Any, event: str, arg: Any) -> Any:
        lines[0] += event == "line"
        if lines[0] > 1000:
            raise TimeoutError("more than 1000 lines")
        return trace

    sys.settrace(trace)
    try:
        return fn(*args)
    finally:
        sys.settrace(None)


class PlantedChapter:
    """A chapter with one exercise and a grader that cannot tell ``if`` from ``while``; a job
    that raises leaves the next two without a verdict (a world whose ranks stopped: the run
    must not take the job after the library's for the mutant's own)."""
    EXERCISES = ("full_buckets", )

    def __init__(self) -> None:
        self.calls = 0

    @staticmethod
    def solution_jobs() -> List[Dict[str, Source]]:
        return [{"full_buckets": (__name__, "full_buckets")}]

    def grade(self, jobs: List[Dict[str, Source]]) -> List[Verdict]:
        self.calls += 1
        out, lost = [], 0
        for job in jobs:
            (exercise, source), = job.items()
            if lost:
                out.append(Verdict(exercise, False, "rank 1 ended without a result"))
                lost -= 1
                continue
            try:
                got = [bounded(load(source), *case) for case in CASES]
            except Exception as err:  # noqa: B902 - a mutant's error is its verdict
                out.append(Verdict(exercise, False, f"{exercise} raised {err!r}"))
                lost = 2
                continue
            want = [full_buckets(*case) for case in CASES]
            out.append(
                Verdict(exercise, got == want,
                        "passed" if got == want else f"{exercise} returned {got}, not {want}"))
        return out


def _mutated(source: str) -> Dict[str, str]:
    """{mutation: the mutated function's body as one line}, of ``sample``."""
    tree = function_def(source, "sample")
    return {m.description: ast.unparse(ast.parse(m.source).body[0]) for m in make(tree)}


class OperatorsMakeTheIntendedMutants(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        with open(__file__) as f:
            cls.source = f.read()
        cls.made = _mutated(cls.source)

    def has(self, description: str, line: str) -> None:
        self.assertIn(description, self.made)
        self.assertIn(line, self.made[description])

    def test_each_operator(self):
        self.has("swap: x - y -> y - x", "n = y - x")
        self.has("operator: x - y -> x + y", "n = x + y")
        self.has("operator: n -= 1 -> n += 1", "n += 1")
        self.has("constant: 3 -> 4", "if n[y] < 4:")
        self.has("constant: 0 -> 1", "while n > 1:")
        self.has("constant: 0 -> -1", "while n > -1:")
        self.has("index: n[y] -> n[y + 1]", "if n[y + 1] < 3:")
        self.has("index: n[y] -> n[y - 1]", "if n[y - 1] < 3:")
        self.has("drop: comm.all_reduce(x, group) -> (dropped)", "n = x - y\n    pass\n")
        self.has("group: group -> other_group", "comm.all_reduce(x, other_group)")
        self.has(f"group: group -> {WORLD_GROUP}", f"comm.all_reduce(x, {WORLD_GROUP})")
        self.has("group: other_group -> None", "comm.barrier(None)")
        self.has("compare: n[y] < 3 -> n[y] >= 3", "if n[y] >= 3:")
        self.has("compare: n[y] < 3 -> n[y] <= 3", "if n[y] <= 3:")
        self.has("constant: 1 -> 2", "n -= 2")
        self.has("constant: 1 -> 2 (#2)", "return 2 - n")  # a second site of the same text
        self.has("method: x.div_(n) -> x.mul_(n)", "x.mul_(n)")
        self.assertTrue(any(d.startswith("if/while: if n[y] < 3:") for d in self.made))
        self.assertTrue(any(d.startswith("if/while: while n > 0:") for d in self.made))
        self.has("swap: 1 - n -> n - 1", "return n - 1")
        self.has("return: return 1 - n -> return n", "return n")
        self.has("drop: return 1 - n -> (dropped)", "comm.barrier(other_group)\n    pass")

    def test_the_docstring_and_duplicates_are_left(self):
        self.assertFalse(any("1 - 2" in d for d in self.made))
        self.assertEqual(len(set(self.made.values())), len(self.made))

    def test_every_mutant_differs_from_the_function_in_one_place(self):
        tree = function_def(self.source, "sample")
        original = ast.unparse(tree)
        for description, source in self.made.items():
            self.assertNotEqual(source, original, description)


class APlantedSurvivorIsReported(unittest.TestCase):
    """The whole run on PlantedChapter: mutant files, rounds, the report."""

    def run_planted(self, listed: str = "") -> List[mutants.Graded]:
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "equivalent.txt")
            with open(path, "w") as f:
                f.write(listed)
            old, mutants.EQUIVALENT = mutants.EQUIVALENT, path
            try:
                return mutants.grade_mutants("99", PlantedChapter(), 60.0, lambda line: None)
            finally:
                mutants.EQUIVALENT = old

    def test_the_survivor_and_the_score(self):
        graded = self.run_planted()
        lines = mutants.report("99", graded, 1.0)
        survivors = [line for line in lines if "survived:" in line]
        self.assertEqual(len(survivors), 1, lines)
        line = inspect.getsourcelines(full_buckets)[1] + 2
        self.assertIn(f"tests/test_mutants.py:{line} if/while: while start < len(sizes)",
                      survivors[0])
        score = mutants.scores(graded)["full_buckets"]
        self.assertEqual((score.killed + 1, score.not_graded), (score.made, 0))
        self.assertEqual(score.named, score.killed)  # no verdict above blames another function
        self.assertFalse(graded[0].names_function(["full_buckets", "returned"]))

    def test_a_verdict_after_a_lost_job_is_graded_again(self):
        # an error leaves the next job "ended without a result": a mutant there is regraded,
        # so no mutant is killed by its predecessor's error (each verdict is its own)
        for g in self.run_planted():
            names = dict(globals())
            exec(g.mutant.source, names)  # noqa: S102 - the mutant, alone
            try:
                alone = [bounded(names["full_buckets"], *case) for case in CASES]
            except Exception:  # noqa: B902 - it raised alone too
                alone = None
            want = [full_buckets(*case) for case in CASES]
            self.assertEqual(g.passed, alone == want, g.where())
            self.assertNotIn("without a result", g.text)

    def test_an_equivalent_listed_is_not_a_survivor(self):
        graded = self.run_planted("99 | full_buckets | " +
                                  next(g.mutant.description
                                       for g in self.run_planted() if g.passed) +
                                  " | no test sees it\n")
        self.assertFalse(mutants.scores(graded)["full_buckets"].survivors)
        self.assertEqual(mutants.scores(graded)["full_buckets"].equivalent, 1)


class AMutantThatDropsTheLaunchIsDiagnosed(unittest.TestCase):
    """The mutation run of chapter 01 found it: a launch_full_buckets that never launches left
    the diagnosis with no launches to look at (ValueError from max() in the grader itself)."""

    def test_no_launch_at_all_is_named(self):
        from scripts.grading import ddp
        verdict = ddp.launch_diagnosis([{"launches": []}, {"launches": []}])
        self.assertIn("no bucket's all-reduce started during backward", verdict or "")


class ASliceIdsThatTakesAnyOrderIsDiagnosed(unittest.TestCase):
    """Chapter 05's mutant that drops slice_ids' ValueError is not equivalent: zigzag_positions
    and Ulysses refuse a misspelt order through it. The grader's probe asks for one."""

    def test_an_unknown_order_must_raise_value_error(self):
        from scaletorch.parallel.ring_attention import slice_ids
        from scripts.grading.context import probe_slice_ids

        def any_order(cp_rank, cp_size, order="zigzag"):  # noqa: ANN001, ANN202 - a mutant
            if order == "zigzag":
                return cp_rank, 2 * cp_size - 1 - cp_rank
            return 2 * cp_rank, 2 * cp_rank + 1

        def key_error(cp_rank, cp_size, order="zigzag"):  # noqa: ANN001, ANN202
            return {"zigzag": any_order, "contiguous": any_order}[order](cp_rank, cp_size, order)

        self.assertIsNone(probe_slice_ids(slice_ids))
        self.assertIn(
            "returned (0, 1): an order other than zigzag or contiguous raises "
            "ValueError",
            probe_slice_ids(any_order) or "")
        self.assertIn("slice_ids(0, 2, 'striped') raised KeyError",
                      probe_slice_ids(key_error) or "")
