"""The grader (scripts/grade.py) says what is wrong, in the learner's terms, and passes the library.

One world per chapter grades, in one go: the library's own functions (the reference solutions,
each must pass), correct solutions written another way (each must pass), mistakes nobody planted
and a rank stopped in one job (each gets what was measured) and the unwritten stubs of
examples/exercises/ (each says "write <function> next"). Every planted variant of
scripts/grading/variants.py (each must get its own diagnosis, the words its catalogue entry
names, not a generic failure) is graded in the same worlds in CI's long phase
(``SCALETORCH_LONG_TESTS=1``), beside the mutation runs: the planted catalogue is a regression
set of 67 jobs, and the 10-minute suite keeps what is new to each job. A learner's file that does
not import, and the stubs' signatures, are tests/test_grade_files.py's (no world).
"""

import inspect
import os
import re
import time
import unittest

from scripts import grade
from scripts.grading import ring_waits, runner, tensor
from scripts.grading.variants import CATALOGUE, HANGS, STOPPING, source
from tests import harness  # noqa: F401 - sets the forkserver's preload list
from tests import (grading_mistakes_03_05, grading_other_ways, grading_probe_mistakes,
                   grading_probe_r3, grading_probe_r4, grading_probe_r5, grading_solutions)
from tests.grading_other_ways import CRASHES
from tests.grading_solutions import ALTERNATIVES, MISTAKES
from tests.test_planted_bugs import patched  # a limit in runner.RANK_LIMITS, sent to the ranks

# The graded worlds fork from the test run's forkserver, which imported torch and the library
# once, instead of starting Pythons that import them again (the grader's way for a learner)
runner.START_METHOD = "forkserver"

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The hang tests' limits, passed to the graded worlds (runner.RANK_LIMITS) in place of the
# grader's 25 s a collective and 10 s a message: a hang waits out its limit, so a shorter one
# ends it sooner (17 s and 6 s less), and the diagnosis names the limit it was given. A healthy
# collective waits only for its peer to reach it (milliseconds: tiny models, 3 steps); a whole
# world of chapter 01's three library jobs, its start and its reference run took 18.5 s of
# wall at load average 13, and a chapter 04 message waits one micro-batch of a 1-layer stage.
SHORT_COLLECTIVE_TIMEOUT = 8.0
SHORT_HANG_TIMEOUT = 4.0
# CI's long phase (.ci/run): the planted variants in each chapter's world, and the worlds that
# wait out a limit
LONG = os.environ.get("SCALETORCH_LONG_TESTS") == "1"
SOLUTIONS = "tests.grading_solutions"
OTHER_WAYS = "tests.grading_other_ways"
MISTAKES_03_05 = "tests.grading_mistakes_03_05"
PROBED = "tests.grading_probe_mistakes"
PROBED_R3 = "tests.grading_probe_r3"
PROBED_R4 = "tests.grading_probe_r4"
PROBED_R5 = "tests.grading_probe_r5"
# the words a verdict must not say, of every module of mistakes
MUST_NOT = {
    **grading_probe_mistakes.MUST_NOT,
    **grading_probe_r3.MUST_NOT,
    **grading_probe_r4.MUST_NOT,
    **grading_probe_r5.MUST_NOT
}


class _GradeChapter:
    """One chapter's world: its solutions, a rank stopped in one job (grading_other_ways.CRASHES:
    a new world grades the jobs after it), correct solutions written another way, mistakes
    nobody planted, every planted variant, its stubs, in one go."""
    chapter = ""
    world = 0  # ranks, if not the grader's (module.WORLD)

    @classmethod
    def setUpClass(cls):
        module, path = grade.CHAPTERS[cls.chapter]
        cls.exercises = module.EXERCISES
        cls.planted = [(exercise, variant) for (chapter, exercise, variant) in CATALOGUE
                       if chapter == cls.chapter and LONG]
        cls.others = [(e, SOLUTIONS, f) for c, e, f in ALTERNATIVES if c == cls.chapter] + \
            [(e, where, f) for where, module_ in ((OTHER_WAYS, grading_other_ways),
                                                  (PROBED, grading_probe_mistakes))
             for c, e, f in module_.ALTERNATIVES if c == cls.chapter]
        cls.mistakes = [(e, (SOLUTIONS, f), words) for c, e, f, words in MISTAKES
                        if c == cls.chapter] + \
            [(e, (OTHER_WAYS, f), words) for c, e, f, words in grading_other_ways.MISTAKES
             if c == cls.chapter] + \
            [(e, (MISTAKES_03_05, f), words)
             for c, e, f, words in grading_mistakes_03_05.MISTAKES if c == cls.chapter] + \
            [(e, (PROBED, f), words)
             for c, e, f, words in grading_probe_mistakes.MISTAKES if c == cls.chapter] + \
            [(e, (where, f), words)
             for where, module_ in ((PROBED_R3, grading_probe_r3), (PROBED_R4, grading_probe_r4),
                                    (PROBED_R5, grading_probe_r5))
             for c, e, f, words in module_.MISTAKES if c == cls.chapter]
        crash, function, _, _ = CRASHES[cls.chapter]
        # the mistakes last: one that ends its rank (01's SIGSEGV) then needs no new world for
        # the jobs after it (a new world after a stopped rank is CRASHES' test)
        jobs = module.solution_jobs() + [{crash: (OTHER_WAYS, function)}] + \
            [{e: (where, f)} for e, where, f in cls.others] + \
            module.exercise_jobs(os.path.join(ROOT, path)) + \
            [{e: source} for e, source, _ in cls.mistakes] + \
            [{e: source(v)} for e, v in cls.planted]
        # a receive never answered (05) waits out the collective timeout: the short one
        with patched(runner, "COLLECTIVE_TIMEOUT", SHORT_COLLECTIVE_TIMEOUT), \
                patched(module, "WORLD", cls.world or module.WORLD):
            verdicts = module.grade(jobs)
        n, k, m = len(module.EXERCISES), len(cls.others), len(cls.mistakes)
        cls.solutions, cls.crashed = verdicts[:n], verdicts[n]
        cls.written_otherwise = dict(zip(cls.others, verdicts[n + 1:n + 1 + k]))
        cls.stubs = verdicts[n + 1 + k:2 * n + 1 + k]
        cls.unplanted = list(zip(cls.mistakes, verdicts[2 * n + 1 + k:2 * n + 1 + k + m]))
        cls.variants = dict(zip(cls.planted, verdicts[2 * n + 1 + k + m:]))
        assert len(verdicts) == len(jobs) == 2 * n + 1 + k + m + len(cls.planted)

    def test_the_library_passes_every_exercise(self):
        for verdict in self.solutions:
            self.assertEqual((verdict.passed, verdict.text), (True, "passed"), verdict.exercise)

    def test_correct_solutions_written_another_way_pass(self):
        # torch.distributed directly, in place, another order, another API, batched p2p
        for exercise in self.exercises:
            self.assertIn(exercise, [e for e, _, _ in self.written_otherwise])
        for (exercise, _, function), verdict in self.written_otherwise.items():
            self.assertEqual((verdict.exercise, verdict.passed, verdict.text),
                             (exercise, True, "passed"), function)

    def test_a_stopped_rank_is_named_with_its_function_and_line(self):
        # the jobs before it and after it (a new world) keep their verdicts: the tests above
        exercise, function, words, statement = CRASHES[self.chapter]
        verdict = self.crashed
        self.assertEqual((verdict.exercise, verdict.passed), (exercise, False), verdict.text)
        for phrase in words:
            self.assertIn(phrase, verdict.text)
        if statement is not None:
            line = _line(getattr(grading_other_ways, function), statement)
            self.assertIn(f"grading_other_ways.py:{line}", verdict.text)
        self.assertNotIn("gloo", verdict.text)  # the learner's terms, not the backend's

    def test_a_mistake_nobody_planted_gets_what_was_measured(self):
        for (exercise, (_, function), words), verdict in self.unplanted:
            self.assertEqual(verdict.exercise, exercise)
            self.assertFalse(verdict.passed, function)
            self.assertIn(words, verdict.text, function)
            for wrong in MUST_NOT.get(function, []):  # a guessed cause
                self.assertNotIn(wrong, verdict.text, function)

    @unittest.skipUnless(LONG, "long phase: the planted catalogue, a regression set")
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
    """Data parallel, 4 ranks (dp 2 x tp 2: the group is not the world), 3 steps of 2
    micro-batches a job: 3 solutions, rank 1's os._exit (a second world grades the rest), 3
    written another way, 2 mistakes (one a SIGSEGV: a third world), 10 variants, 3 stubs."""
    chapter = "01"


class GradeChapter02(_GradeChapter, unittest.TestCase):
    """ZeRO, 4 ranks (dp 2 x tp 2: the group is not the world), 3 steps of 2 micro-batches a
    job (ZeRO-1 for reduce_scatter_mean, ZeRO-3 with prefetch for gather_unit and release_unit,
    then each called on its own): 3 solutions, rank 1's sys.exit (a second world grades the
    rest), 4 written another way, 2 mistakes, 10 variants, 3 stubs."""
    chapter = "02"


class GradeChapter03(_GradeChapter, unittest.TestCase):
    """Tensor parallel, 2 ranks (tp 2; the grader's 4, tp 2 x dp 2, in GradeOverTheTpGroup and
    the mutation run), 2 steps without and 2 with sequence parallel a job (stopped at the first
    wrong call), every call's forward and backward checked on its rank: 3 solutions, rank 1
    killed (SIGKILL; a second world grades the rest), 4 written another way, 1 mistake, 12
    variants, 3 stubs."""
    chapter = "03"
    # at 4 ranks the class took 42 s of CPU, at 2 ranks 22 s; only a wrong group needs the 4
    world = 2


class GradeOverTheTpGroup(unittest.TestCase):
    """Chapter 03 at the grader's 4 ranks (tp 2 x dp 2), one world: an f-bar that sums over the
    world, not its tp group, is named so, and a vocabulary offset from the world rank by the
    ranks it puts off (the suite's GradeChapter03 grades at tp 2 = world)."""

    def test_a_sum_over_the_world_is_named(self):
        wide = [(MISTAKES_03_05, *w) for w in grading_mistakes_03_05.WIDE] + \
            [(PROBED, *w) for w in grading_probe_mistakes.WIDE] + \
            [(PROBED_R3, *w) for w in grading_probe_r3.WIDE]
        verdicts = tensor.grade([{
            exercise: (where, function)
        } for where, exercise, function, _ in wide])
        for (_, exercise, function, words), verdict in zip(wide, verdicts):
            self.assertEqual((verdict.exercise, verdict.passed), (exercise, False))
            self.assertIn(words, verdict.text)
            for wrong in MUST_NOT.get(function, []):
                self.assertNotIn(wrong, verdict.text, function)


class GradeChapter04(_GradeChapter, unittest.TestCase):
    """Pipeline parallel, pp 3 (a middle stage sends and receives both ways), 4 micro-batches,
    3 steps a job: 2 solutions, rank 1's abort (a second world grades the rest), 4 written
    another way (torch.distributed.batch_isend_irecv over pp, and over the default group), 4
    mistakes: a warm-up on rank 0 only (pp 2 cannot see it); the world's size as p and
    neighbours at the global rank +- 1 (only a pipeline that is a subgroup sees them: each
    one_f_one_b that passes pp 3 is graded again at pp 2 x dp 2, 1 step); a loss returned
    without grad_fn (told before the run, on every rank), 6 variants, 2 stubs."""
    chapter = "04"


class GradeChapter05(_GradeChapter, unittest.TestCase):
    """Context parallel, 3 ranks (a ring of 3; probes on a ring of 2 whose group is not the
    world), 2 steps a job, every call checked on its rank: 3 solutions, rank 1's receive never
    answered (8 s; a second world grades the rest), 6 written another way, 3 mistakes, 10
    variants, 3 stubs."""
    chapter = "05"


class GradeChapter06(_GradeChapter, unittest.TestCase):
    """Expert parallel, 4 ranks (ep 2 x edp 2), 3 steps a job (stopped at the first wrong
    call), then one call on uneven tables: the library's run, 2 solutions, rank 1's
    KeyboardInterrupt (a second world grades the rest), 2 written another way, 4 mistakes (one
    of split sizes the ranks disagree on, told before gloo sees them), 8 variants, 2 stubs."""
    chapter = "06"


class GradeChapter06b(_GradeChapter, unittest.TestCase):
    """The routing bias of chapter 06b, 2 ranks (ep 2), 4 steps a job after a probe: 2
    solutions, 7 variants, 2 stubs."""
    chapter = "06b"


class GradeChapter08(_GradeChapter, unittest.TestCase):
    """The loss scale, 2 ranks, 8 steps a job, then direct calls (a group of each rank alone,
    agree=False): the library's run, 2 solutions, rank 1's segfault (a second world, its own
    library run, grades the rest), 2 written another way, 3 mistakes only the direct calls
    see, 6 variants, 2 stubs."""
    chapter = "08"


class GradeAStoppedWorld(unittest.TestCase):
    """A variant whose ranks issue different collectives: gloo aborts one; the grader names
    where the other stopped, from its flight recorder (one job, chapter 01's 4 ranks)."""

    def test_a_mismatched_collective_is_named_with_its_group_and_line(self):
        for (chapter, exercise, variant), words in STOPPING.items():
            module, _ = grade.CHAPTERS[chapter]
            verdict, = module.grade([{exercise: source(variant)}])
            self.assertFalse(verdict.passed)
            self.assertIn("in a collective", verdict.text)
            self.assertRegex(verdict.text, words)
            self.assertIn(variant, verdict.text)  # the function that issued it


class GradeAHang(unittest.TestCase):
    """A variant that deadlocks (all pipeline ranks send first), and a rank that never reaches
    its first receive (pp 3; a ring of 3 whose rank 0 never sends): the grader's short timeout
    ends each, and the diagnosis names each rank's operation, its peer and why (one job each)."""

    def test_a_deadlock_is_named_with_the_operations_and_peers(self):
        for (chapter, exercise, variant), phrases in HANGS.items():
            module, _ = grade.CHAPTERS[chapter]
            with patched(module, "HANG_TIMEOUT", SHORT_HANG_TIMEOUT):
                verdict, = module.grade([{exercise: source(variant)}])
            self.assertFalse(verdict.passed)
            for phrase in phrases:
                self.assertIn(phrase, verdict.text)
            # the ranks gave up after the grader's timeout for one message (stretched by the
            # machine's load, at most module.LOAD_STRETCH x), not the world's
            waited = float(re.search(r"gave up after (\d+) s", verdict.text).group(1))
            limit = float(re.search(r"for a message: (\d+) s", verdict.text).group(1))
            self.assertGreaterEqual(limit, SHORT_HANG_TIMEOUT - 1, verdict.text)
            self.assertLessEqual(limit, SHORT_HANG_TIMEOUT * module.LOAD_STRETCH + 1, verdict.text)
            self.assertGreaterEqual(waited, limit - 1, verdict.text)
            self.assertLessEqual(waited, limit + 2, verdict.text)

    # a world that waits out the grader's hang limit (about 40 s of wall, little CPU): in the
    # long phase of .ci/run (SCALETORCH_LONG_TESTS=1), as the suite keeps to 10 minutes
    @unittest.skipUnless(LONG, "long phase")
    def test_a_rank_the_others_waited_for_is_the_cause(self):
        # rank 2 sleeps before its first receive: not "stopped after another rank had left"
        exercise, function, phrases = grading_probe_mistakes.NEVER_CAME
        module, _ = grade.CHAPTERS["04"]
        with patched(module, "HANG_TIMEOUT", SHORT_HANG_TIMEOUT):
            verdict, = module.grade([{exercise: (PROBED, function)}])
        self.assertFalse(verdict.passed)
        for phrase in phrases:
            self.assertIn(phrase, verdict.text)
        for wrong in grading_probe_mistakes.MUST_NOT[function]:
            self.assertNotIn(wrong, verdict.text)

    # a world whose ranks compute until the grader's CPU limit for one job (3 s here, not 20:
    # 2 ranks x 3 s of CPU), then a new world for the job after it: in the long phase
    @unittest.skipUnless(LONG, "long phase")
    def test_a_function_that_never_returns_is_stopped_by_its_cpu_and_the_next_job_passes(self):
        chapter, exercise, function, words = grading_probe_r3.NEVER_RETURNS
        module, _ = grade.CHAPTERS[chapter]
        with patched(runner, "JOB_CPU_LIMIT", 3.0):
            loop, after = module.grade([{
                exercise: (PROBED_R3, function)
            }, {
                exercise: (module.LIBRARY, exercise)
            }])
        self.assertFalse(loop.passed)
        self.assertIn(words, loop.text)
        self.assertIn("s of CPU in this job (the grader's limit: 3 s on any rank)", loop.text)
        self.assertEqual((after.passed, after.text), (True, "passed"))

    # as above: the others wait out the limit of a ring message (chapter 05, 3 ranks)
    @unittest.skipUnless(LONG, "long phase")
    def test_a_rank_that_never_sent_its_ring_message_is_the_cause(self):
        exercise, function, phrases = grading_probe_mistakes.NEVER_SENT
        module, _ = grade.CHAPTERS["05"]
        with patched(ring_waits, "WAIT_LIMIT", SHORT_HANG_TIMEOUT):
            verdict, = module.grade([{exercise: (PROBED, function)}])
        self.assertFalse(verdict.passed)
        for phrase in phrases:
            self.assertIn(phrase, verdict.text)
        for wrong in grading_probe_mistakes.MUST_NOT[function]:
            self.assertNotIn(wrong, verdict.text)


class GradeARaiseInTheLearnersTerms(unittest.TestCase):
    """A raise where no frame of the learner's is left (autograd checks a backward's result
    after it returned) or inside the library's bookkeeping (a backward of a micro-batch not
    held): torch's words at the learner's line, or what was asked (one world each)."""

    @unittest.skipUnless(LONG, "long phase")
    def test_a_raise_is_told_at_the_learners_line(self):
        for chapter, exercise, function, words in grading_probe_mistakes.RAISING:
            module, _ = grade.CHAPTERS[chapter]
            verdict, = module.grade([{exercise: (PROBED, function)}])
            self.assertFalse(verdict.passed, function)
            self.assertIn(words, verdict.text, function)
            for wrong in grading_probe_mistakes.MUST_NOT[function]:
                self.assertNotIn(wrong, verdict.text, function)


def _line(function, text):
    """The line of ``function``'s file where ``text`` first appears in ``function``."""
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


def _text(line):
    return inspect.getsource(grading_solutions).splitlines()[line - 1].strip()


# In CI's long phase: its four worlds wait out a segfault and a hang (39 s of wall, 24 s of CPU
# in the suite). The suite's chapter worlds each stop a rank in one job (CRASHES: its rank, its
# function and line, the jobs after it graded by a new world) and GradeAHang names a hang's ranks.
@unittest.skipUnless(LONG, "long phase")
class GradeEachExerciseOnItsOwn(unittest.TestCase):
    """Chapter 01's jobs: a segfault on rank 1, the library, an error raised on rank 1, a hang
    (rank 1 receives a message never sent), the library: each failure is its job's alone, with
    its rank and the learner's line, and the library's jobs after it pass (4 worlds of 4)."""

    @classmethod
    def setUpClass(cls):
        module, _ = grade.CHAPTERS["01"]
        library = (module.LIBRARY, "average_gradients")
        jobs = [{"average_gradients": (SOLUTIONS, f)} for f in ("segfault_on_rank_1", )]
        jobs += [{"average_gradients": library}]
        jobs += [{
            "average_gradients": (SOLUTIONS, f)
        } for f in ("raise_on_rank_1", "hang_on_rank_1")]
        jobs += [{"wait_for_buckets": (module.LIBRARY, "wait_for_buckets")}]
        start = time.perf_counter()
        with patched(runner, "COLLECTIVE_TIMEOUT", SHORT_COLLECTIVE_TIMEOUT):
            cls.verdicts = module.grade(jobs)
        cls.seconds = time.perf_counter() - start

    def test_a_segfault_names_its_rank_and_function(self):
        verdict = self.verdicts[0]
        self.assertFalse(verdict.passed)
        self.assertIn("rank 1 died of SIGSEGV in segfault_on_rank_1 (grading_solutions.py:",
                      verdict.text)

    def test_a_learners_error_shows_the_learners_line(self):
        line = _line(grading_solutions.raise_on_rank_1, "raise ValueError")
        self.assertEqual(
            self.verdicts[2].text, "average_gradients raised on rank 1: ValueError: the learner's "
            f"own error (at grading_solutions.py:{line}: {_text(line)})")

    def test_a_hang_names_where_each_rank_waited(self):
        text = self.verdicts[3].text
        self.assertFalse(self.verdicts[3].passed)
        recv = _line(grading_solutions.hang_on_rank_1, "dist.recv")
        reduce = _line(grading_solutions.hang_on_rank_1, "comm.all_reduce")
        self.assertIn(f"rank 1 stopped in hang_on_rank_1 (grading_solutions.py:{recv})", text)
        # the grader's timeout as the test set it, not gloo's 120 s nor the default 25 s
        self.assertIn(f"no peer answered its recv within {SHORT_COLLECTIVE_TIMEOUT:.0f} s", text)
        # rank 1's data-parallel peer (dp 2 x tp 2: ranks 1 and 3) waits for it in the sum
        self.assertIn(f"rank 3 stopped in hang_on_rank_1 (grading_solutions.py:{reduce})", text)
        self.assertNotIn("gloo", text)  # the learner's terms, not the backend's

    def test_the_other_exercises_keep_their_verdicts(self):
        self.assertEqual([(v.exercise, v.text) for v in (self.verdicts[1], self.verdicts[4])],
                         [("average_gradients", "passed"), ("wait_for_buckets", "passed")])


if __name__ == "__main__":
    unittest.main()
