"""``python scripts/grade.py --mutants NN``: grade every mutant of chapter NN's solutions.

Each exercise's library function (the chapter's ``solution_jobs``) is mutated by
scripts/grading/mutate.py; each mutant is written to a file of its own that sees the library
module's names, and graded by the chapter's own ``grade(jobs)`` in the exercise's place, as a
learner's function would be. A mutant is killed when its grade fails; a survivor is listed
(the library's file:line and the mutation), unless scripts/grading/equivalent_mutants.txt
lists it as equivalent, with the reason no test could see it. A killed mutant's verdict is its
exercise's (each job grades one function); the report lists those whose diagnosis blames
another of the chapter's functions.

Mutants share worlds (a world costs more than a job), each followed by the library's own
function: a mutant's verdict counts only if it is the first job of its world or the library's
job before it passed. Otherwise the mutant before it may have left the world disagreeing (an
error ends the ranks' jobs, a failed one may leave the next job nothing to compare), and the
mutant is graded again in the next round. A run stops starting rounds after ``--time-limit`` s.
``PARALLEL`` rounds run at once, each in its own worlds: most of a round's time is waiting (a
world's ranks meeting, a hung mutant's stall limit), which the other round's ranks fill.
"""

import ast
import importlib.util
import os
import re
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch.multiprocessing as mp

from scripts.grading import learner, runner
from scripts.grading.mutate import Mutant, function_def, mutants

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EQUIVALENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "equivalent_mutants.txt")
BATCH = 12  # mutants per ``grade`` call: a world's start costs several jobs
PARALLEL = 2  # rounds at once (threads of this process, each waiting on its worlds' ranks)
# The grader's settings, for mutants: ranks forked from a server that imported torch and the
# library once (``PRELOAD``: a new Python per rank and world costs 3 s of a core) and shorter
# limits, since a dropped collective leaves its peer waiting and a while for an if may never
# end; 15 s, not the suite's 8 s for its hang tests: a rank's connect waits as long, and under
# a load of 50 on 2 cores it took more than 8 s.
SETTINGS = {
    "START_METHOD": "forkserver",
    "COLLECTIVE_TIMEOUT": 15.0,
    "STALL_LIMIT": 20.0,
    "JOB_LIMIT": 60.0
}
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "scaletorch.trainer"]

HEADER = """# a mutant of {module}.{name} (scripts/grading/mutants.py): the library's names, then it
import importlib as _importlib
import torch.distributed as _dist
globals().update({{k: v for k, v in vars(_importlib.import_module({module!r})).items()
                  if not k.startswith('__')}})
"""


@dataclass
class Graded:
    """One mutant of one exercise and what its grade said (None: not graded yet)."""
    exercise: str
    file: str  # the library's file, relative to the repository
    mutant: Mutant
    path: str = ""  # the mutant's own file
    passed: Optional[bool] = None
    text: str = ""
    equivalent: str = ""  # the reason, from EQUIVALENT, if listed there
    crash: str = ""  # the grader's own error on this mutant (no verdict)

    def where(self) -> str:
        return f"{self.file}:{self.mutant.line} {self.mutant.description}"

    def names_function(self, exercises: Sequence[str]) -> bool:
        """The verdict names this exercise (its line starts with it) and no other of
        ``exercises`` (a diagnosis that blames another function), as a whole word and outside
        the learner's own line that raised (05's ``merged[a] = merge(...)`` is ring_forward's)."""
        text = re.sub(r"\(at [\w.-]+\.py:\d+(: .*)?\)", "", self.text)
        return not any(
            re.search(rf"\b{re.escape(e)}\b", text) for e in exercises if e != self.exercise)


def equivalents(path: Optional[str] = None) -> Dict[Tuple[str, str, str], str]:
    """{(chapter, function, mutation): why it is equivalent} from ``path``'s lines
    ``chapter | function | mutation | reason`` (``#`` starts a comment)."""
    out: Dict[Tuple[str, str, str], str] = {}
    path = path or EQUIVALENT
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            chapter, function, mutation, reason = (p.strip() for p in line.split(" | ", 3))
            out[(chapter, function, mutation)] = reason
    return out


def library_sources(module: Any) -> List[Tuple[str, str, str]]:
    """(exercise, library module, function) of each of a chapter's exercises."""
    return [(e, where, name) for job in module.solution_jobs() for e, (where, name) in job.items()]


def make_mutants(chapter: str, module: Any, directory: str) -> List[Graded]:
    """Every mutant of the chapter's solutions, each written to its file in ``directory``."""
    listed = equivalents()
    out: List[Graded] = []
    for exercise, where, name in library_sources(module):
        spec = importlib.util.find_spec(where)
        assert spec is not None and spec.origin is not None, where
        with open(spec.origin) as f:
            tree = function_def(f.read(), name)
        file = os.path.relpath(spec.origin, ROOT)
        for k, mutant in enumerate(mutants(tree)):
            path = os.path.join(directory, f"{chapter}_{name}_{k}.py")
            with open(path, "w") as f:
                f.write(HEADER.format(module=where, name=name) + "\n\n" + mutant.source + "\n")
            ast.parse(mutant.source)  # a mutant compiles, or the mutator is wrong
            reason = listed.get((chapter, exercise, mutant.description), "")
            out.append(Graded(exercise, file, mutant, path, equivalent=reason))
    return out


def _round(module: Any, batch: List[Graded], library: Dict[str, learner.Source]) -> List[Graded]:
    """Grade ``batch`` in one ``grade`` call, each mutant followed by the library's job; the
    mutants whose verdict does not count (see the module's docstring), to grade again."""
    jobs: List[Dict[str, learner.Source]] = []
    for g in batch:
        jobs += [{g.exercise: (g.path, g.exercise)}, {g.exercise: library[g.exercise]}]
    try:
        verdicts = module.grade(jobs)
    except Exception as err:  # noqa: B902 - the grader's own error, on one of these mutants
        if len(batch) > 1:  # which one: each half graded on its own
            half = len(batch) // 2
            return _round(module, batch[:half], library) + _round(module, batch[half:], library)
        batch[0].crash = f"{type(err).__name__}: {err}"
        return []
    again, counts = [], True
    for i, g in enumerate(batch):
        if counts and 2 * i < len(verdicts):
            g.passed, g.text = verdicts[2 * i].passed, verdicts[2 * i].text
        else:
            again.append(g)
        counts = 2 * i + 1 < len(verdicts) and verdicts[2 * i + 1].passed
    return again


def preload(module: Any) -> None:
    """The forkserver's imports for ``module``'s worlds (a process's first world starts it)."""
    libraries = sorted({where for _, where, _ in library_sources(module)})
    mp.get_context("forkserver").set_forkserver_preload(PRELOAD + [module.__name__] + libraries)


def grade_mutants(chapter: str, module: Any, time_limit: float,
                  progress: Callable[[str], None]) -> List[Graded]:
    """Every mutant of chapter ``chapter`` graded (those not reached within ``time_limit`` s
    keep ``passed`` None)."""
    library = {e: (where, name) for e, where, name in library_sources(module)}
    start = time.monotonic()
    saved = {k: getattr(runner, k) for k in SETTINGS if hasattr(runner, k)}
    for k in saved:  # once for the run: the rounds' threads share the module
        setattr(runner, k, SETTINGS[k])
    try:
        with tempfile.TemporaryDirectory(prefix=f"mutants_{chapter}_") as directory, \
                ThreadPoolExecutor(PARALLEL) as pool:
            made = make_mutants(chapter, module, directory)
            todo, running = list(made), {}  # running: a round's future -> its mutants
            while todo or running:
                while todo and len(running) < PARALLEL and time.monotonic() - start < time_limit:
                    batch, todo = todo[:BATCH], todo[BATCH:]
                    running[pool.submit(_round, module, batch, library)] = len(batch)
                if not running:
                    break  # the time limit: the rest stay not graded
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    del running[future]
                    todo = future.result() + todo
                done = len(made) - len(todo) - sum(running.values())
                progress(f"mutants of {chapter}: {_bar(done, len(made))} {done}/{len(made)} "
                         f"graded, {time.monotonic() - start:.0f} s")
    finally:
        for k, v in saved.items():
            setattr(runner, k, v)
    return made


def _bar(done: int, total: int, width: int = 20) -> str:
    full = width * done // max(total, 1)
    return "[" + "#" * full + "." * (width - full) + "]"


@dataclass
class Score:
    """One exercise's mutants: made, killed (and of them, diagnosed without blaming another),
    survivors (equivalent or not), not graded (the time limit), the grader's own errors."""
    made: int = 0
    killed: int = 0
    named: int = 0
    equivalent: int = 0
    not_graded: int = 0
    crashed: List["Graded"] = field(default_factory=list)
    survivors: List[Graded] = field(default_factory=list)

    def score(self) -> float:
        mortal = self.made - self.equivalent - self.not_graded - len(self.crashed)
        return self.killed / mortal if mortal else 1.0


def scores(graded: List[Graded]) -> Dict[str, Score]:
    exercises = sorted({g.exercise for g in graded})
    out: Dict[str, Score] = {}
    for g in graded:
        s = out.setdefault(g.exercise, Score())
        s.made += 1
        if g.crash:
            s.crashed.append(g)
        elif g.passed is None:
            s.not_graded += 1
        elif not g.passed:
            s.killed += 1
            s.named += g.names_function(exercises)
        elif g.equivalent:
            s.equivalent += 1
        else:
            s.survivors.append(g)
    return out


def report(chapter: str, graded: List[Graded], seconds: float) -> List[str]:
    """The lines of the run's report: per exercise its score, then each survivor."""
    lines = [f"chapter {chapter}: {len(graded)} mutants in {seconds:.0f} s"]
    for exercise, s in scores(graded).items():
        line = (f"  {exercise:22s} {s.made} made, {s.killed} killed ({s.killed - s.named} "
                f"blamed on another function), {len(s.survivors)} survived, {s.equivalent} "
                f"equivalent: score {s.score():.0%}")
        lines.append(line + (f", {s.not_graded} not graded (time limit)" if s.not_graded else "") +
                     (f", {len(s.crashed)} crashed the grader" if s.crashed else ""))
        lines += [f"    survived: {g.where()}" for g in s.survivors]
        lines += [f"    the grader raised on: {g.where()}: {g.crash}" for g in s.crashed]
    exercises = sorted({g.exercise for g in graded})
    blamed = [g for g in graded if g.passed is False and not g.names_function(exercises)]
    lines += [f"  killed, another function blamed: {g.where()}: {g.text[:160]}" for g in blamed]
    return lines
