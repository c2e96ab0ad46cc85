"""The grader (scripts/grade.py) says what is wrong, in the learner's terms, and passes the library.

One world per chapter grades, in one go: the library's own functions (the reference solutions,
each must pass), every planted variant of scripts/grading/variants.py (each must get its own
diagnosis, the words its catalogue entry names, not a generic failure) and the unwritten stubs
of examples/exercises/ (each says "write <function> next"). Without a world: each stub has the
signature and the docstring of the library function it stands for, so they cannot drift.
"""

import contextlib
import inspect
import io
import os
import re
import unittest

from scripts import grade
from scripts.grading import runner
from scripts.grading.runner import load
from scripts.grading.variants import CATALOGUE, HANGS, STOPPING
from tests import harness  # noqa: F401 - sets the forkserver's preload list

# The graded worlds fork from the test run's forkserver, which imported torch and the library
# once, instead of starting Pythons that import them again (the grader's way for a learner)
runner.START_METHOD = "forkserver"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = "scripts.grading.variants"


class _GradeChapter:
    """One chapter's world: its solutions, every planted variant, its stubs, in one go."""
    chapter = ""

    @classmethod
    def setUpClass(cls):
        module, path = grade.CHAPTERS[cls.chapter]
        cls.exercises = module.EXERCISES
        cls.planted = [(exercise, variant) for (chapter, exercise, variant) in CATALOGUE
                       if chapter == cls.chapter]
        jobs = module.solution_jobs() + [{e: (VARIANTS, v)} for e, v in cls.planted] + \
            module.exercise_jobs(os.path.join(ROOT, path))
        cls.verdicts = module.grade(jobs)
        n = len(module.EXERCISES)
        cls.solutions, cls.stubs = cls.verdicts[:n], cls.verdicts[-n:]
        cls.variants = dict(zip(cls.planted, cls.verdicts[n:-n]))

    def test_the_library_passes_every_exercise(self):
        for verdict in self.solutions:
            self.assertEqual((verdict.passed, verdict.text), (True, "passed"), verdict.exercise)

    def test_every_planted_variant_gets_its_own_diagnosis(self):
        texts = set()
        for (exercise, variant), verdict in self.variants.items():
            self.assertEqual(verdict.exercise, exercise)
            self.assertFalse(verdict.passed, f"{variant}: {verdict.text}")
            self.assertIn(CATALOGUE[(self.chapter, exercise, variant)], verdict.text, variant)
            texts.add(verdict.text)
        self.assertEqual(len(texts), len(self.variants))  # no two share a diagnosis
        for exercise in self.exercises:  # at least three mistakes per exercise
            self.assertGreaterEqual(sum(e == exercise for e, _ in self.planted), 3, exercise)

    def test_an_unwritten_stub_says_which_function_to_write_next(self):
        for exercise, verdict in zip(self.exercises, self.stubs):
            self.assertEqual((verdict.passed, verdict.text), (False, f"write {exercise} next"))


class GradeChapter01(_GradeChapter, unittest.TestCase):
    """Data parallel, 2 ranks, 3 steps a job: 3 solutions, 10 variants, 3 stubs."""
    chapter = "01"


class GradeChapter02(_GradeChapter, unittest.TestCase):
    """ZeRO, 2 ranks, 3 steps a job (ZeRO-1 for reduce_scatter_mean, ZeRO-3 for gather_unit and
    release_unit): 3 solutions, 10 variants, 3 stubs."""
    chapter = "02"


class GradeChapter03(_GradeChapter, unittest.TestCase):
    """Tensor parallel, 2 ranks, 2 steps without and 2 with sequence parallel a job (stopped at
    the first wrong call), every call's forward and backward checked on its rank: 3 solutions,
    12 variants, 3 stubs."""
    chapter = "03"


class GradeChapter04(_GradeChapter, unittest.TestCase):
    """Pipeline parallel, pp 2, 3 steps a job: 2 solutions, 6 variants, 2 stubs."""
    chapter = "04"


class GradeChapter05(_GradeChapter, unittest.TestCase):
    """Context parallel, 2 ranks, 2 steps a job, every call checked on its rank: 3 solutions,
    10 variants, 3 stubs."""
    chapter = "05"


class GradeChapter06(_GradeChapter, unittest.TestCase):
    """Expert parallel, 2 ranks, 3 steps a job (stopped at the first wrong call): the library's
    run, 2 solutions, 8 variants, 2 stubs."""
    chapter = "06"


class GradeChapter08(_GradeChapter, unittest.TestCase):
    """The loss scale, 2 ranks, 8 steps a job: the library's run, 2 solutions, 6 variants,
    2 stubs."""
    chapter = "08"


class GradeAStoppedWorld(unittest.TestCase):
    """A variant whose ranks issue different collectives: gloo aborts one; the grader names
    where the other stopped, from its flight recorder (2 ranks, one job)."""

    def test_a_mismatched_collective_is_named_with_its_group_and_line(self):
        for (chapter, exercise, variant), words in STOPPING.items():
            module, _ = grade.CHAPTERS[chapter]
            verdict, = module.grade([{exercise: (VARIANTS, variant)}])
            self.assertFalse(verdict.passed)
            self.assertIn("in a collective", verdict.text)
            self.assertIn(words, verdict.text)
            self.assertIn(variant, verdict.text)  # the function that issued it


class GradeAHang(unittest.TestCase):
    """A variant that deadlocks (both pipeline ranks send first): the grader's short timeout
    ends it, and the diagnosis names each rank's operation, its peer and why (2 ranks, one job)."""

    def test_a_deadlock_is_named_with_the_operations_and_peers(self):
        for (chapter, exercise, variant), phrases in HANGS.items():
            module, _ = grade.CHAPTERS[chapter]
            verdict, = module.grade([{exercise: (VARIANTS, variant)}])
            self.assertFalse(verdict.passed)
            for phrase in phrases:
                self.assertIn(phrase, verdict.text)
            # the ranks gave up after the grader's timeout for one message, not the world's
            waited = float(re.search(r"gave up after (\d+) s", verdict.text).group(1))
            self.assertGreaterEqual(waited, module.HANG_TIMEOUT - 1, verdict.text)
            self.assertLessEqual(waited, module.HANG_TIMEOUT + 2, verdict.text)


class StubsMatchTheLibrary(unittest.TestCase):

    def test_each_stub_has_its_library_function_signature_and_docstring(self):
        for chapter, (module, path) in grade.CHAPTERS.items():
            for exercise in module.EXERCISES:
                stub = load((os.path.join(ROOT, path), exercise))
                library = load((module.LIBRARY, exercise))
                self.assertEqual(inspect.signature(stub), inspect.signature(library), exercise)
                self.assertEqual(stub.__doc__, library.__doc__, exercise)
                with self.assertRaises(NotImplementedError):
                    stub(*[None] * len(inspect.signature(stub).parameters))

    def test_a_chapter_without_exercises_is_a_user_error(self):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.assertEqual(grade.main(["99"]), 2)
        self.assertEqual(
            err.getvalue(), "error: chapter '99' has no exercises; chapters with "
            "exercises: 01, 02, 03, 04, 05, 06, 08 (or all)\n")


if __name__ == "__main__":
    unittest.main()
