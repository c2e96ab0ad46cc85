"""Grade a chapter's exercises: run the chapter with the learner's functions, say what is wrong.

    python scripts/grade.py 01               # examples/exercises/01_ddp.py
    python scripts/grade.py 01 --solution    # the library's own functions (they pass)
    python scripts/grade.py all --solution
    python scripts/grade.py 01 --variant average_sum_not_mean   # a planted mistake's diagnosis
    python scripts/grade.py --mutants 01     # mutants of the library's solutions, each graded

Each exercise is a core function of the chapter with its body removed. The grader runs the
chapter on gloo ranks of this CPU with the learner's function in place of the library's,
compares with one device and prints, per exercise, "passed" or the diagnosis measured: the
gradients' ratio to the reference, the ranks that disagree, a bucket launched early, a work
never waited for, and for a hang the flight recorder's account of which rank waits on which.
``--variant NAME`` grades one of scripts/grading/variants.py's planted mistakes instead (the
grader's own test suite), to see what a diagnosis looks like. ``--mutants NN`` grades every
mutant of chapter NN's library functions (scripts/grading/mutants.py) and reports, per exercise,
the mutants made, killed and surviving (exit status 1 if one survives that
scripts/grading/equivalent_mutants.txt does not list as equivalent, makes the grader raise or
is not graded within ``--time-limit`` s).
A file that does not compile or import is named, with its line, the exception and its message,
before any rank starts: any exception (SystemExit, KeyboardInterrupt too), a process that ends
(os._exit) or an import that does not finish within a limit. Exit status 0 when every exercise
passed, 1 otherwise (an unwritten one: "write <function> next"; a file that does not import),
2 for a chapter without exercises.
"""

import os
import signal
import sys
import time
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from scaletorch.rules.errors import OneLineParser, RunStopped  # noqa: E402
from scripts.grading import (balance, context, ddp, expert, file_check, loss_scale, pipeline,
                             tensor, variants, zero)
from scripts.grading.job_state import adopt_orphans, children  # noqa: E402

CHAPTERS = {
    ddp.CHAPTER: (ddp, "examples/exercises/01_ddp.py"),
    zero.CHAPTER: (zero, "examples/exercises/02_fsdp.py"),
    tensor.CHAPTER: (tensor, "examples/exercises/03_tensor_parallel.py"),
    pipeline.CHAPTER: (pipeline, "examples/exercises/04_pipeline_parallel.py"),
    context.CHAPTER: (context, "examples/exercises/05_context_parallel.py"),
    expert.CHAPTER: (expert, "examples/exercises/06_expert_parallel.py"),
    balance.CHAPTER: (balance, "examples/exercises/06b_load_balance.py"),
    loss_scale.CHAPTER: (loss_scale, "examples/exercises/08_mixed_precision.py"),
}


def grade_chapter(chapter: str, solution: bool, variant: Optional[str] = None) -> bool:
    module, path = CHAPTERS[chapter]
    jobs = module.solution_jobs() if solution else module.exercise_jobs(os.path.join(ROOT, path))
    what = "the library" if solution else path
    if variant is not None:
        exercise = next(e for c, e, v in variants.PLANTED if (c, v) == (chapter, variant))
        jobs, what = [{exercise: variants.source(variant)}], f"variant {variant}"
    start = time.perf_counter()
    print(
        f"chapter {chapter}: {what}, {module.WORLD} ranks (CPU, gloo), {module.STEPS} steps "
        f"against {module.AGAINST}{getattr(module, 'ALSO', '')}", flush=True)
    broken = None if solution or variant is not None else file_check.import_error(
        os.path.join(ROOT, path), path)
    if broken is not None:  # each rank would stop on it, in whichever exercise it was
        print(f"  your file does not compile or import: {broken}")
        print(f"chapter {chapter}: not yet (fix the file first)")
        return False
    passed, graded = True, 0
    for verdict in module.grade(jobs):
        print(f"  {verdict.line()}")
        passed, graded = passed and verdict.passed, graded + 1
        if not verdict.passed and verdict.text.startswith("write "):
            break  # the next function to write: the later ones wait for it
    if not graded:  # "passed" needs a verdict: never exit 0 with none
        print("  no exercise was graded")
        passed = False
    print(f"chapter {chapter}: {'passed' if passed else 'not yet'} "
          f"({time.perf_counter() - start:.0f} s)")
    return passed


def grade_mutants(chapter: str, time_limit: float) -> int:
    """Every mutant of ``chapter``'s solutions graded: 0 if each is killed or listed as
    equivalent, 1 otherwise."""
    from scripts.grading import mutants
    from scripts.plan import progress
    start = time.perf_counter()
    mutants.preload(CHAPTERS[chapter][0])
    graded = mutants.grade_mutants(chapter, CHAPTERS[chapter][0], time_limit, progress)
    print("\n".join(mutants.report(chapter, graded, time.perf_counter() - start)))
    left = [g for g in graded if g.crash or g.passed is None or (g.passed and not g.equivalent)]
    return 1 if left else 0


def main(argv: Optional[List[str]] = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("chapter", nargs="?", help=f"{', '.join(CHAPTERS)} or all")
    parser.add_argument("--solution", action="store_true",
                        help="grade the library's own functions (the reference solutions)")
    parser.add_argument("--variant", help="grade one planted mistake (scripts/grading/variants.py)")
    parser.add_argument("--mutants", metavar="NN", choices=list(CHAPTERS),
                        help="grade every mutant of chapter NN's library functions")
    parser.add_argument("--time-limit", type=float, default=900.0, metavar="S",
                        help="--mutants: start no world after S seconds (default 900)")
    args = parser.parse_args(argv)
    if args.mutants is not None:
        return grade_mutants(args.mutants, args.time_limit)
    if args.chapter is None:
        parser.error("a chapter, or --mutants NN, is needed")
    if args.chapter != "all" and args.chapter not in CHAPTERS:
        print(
            f"error: chapter {args.chapter!r} has no exercises; chapters with exercises: "
            f"{', '.join(CHAPTERS)} (or all)", file=sys.stderr)
        return 2
    names = [v for c, _, v in variants.PLANTED if c == args.chapter]
    if args.variant is not None and args.variant not in names:
        print(
            f"error: chapter {args.chapter} has no variant {args.variant!r}; its variants: "
            f"{', '.join(names) or 'none'}", file=sys.stderr)
        return 2
    chapters = list(CHAPTERS) if args.chapter == "all" else [args.chapter]
    results = [grade_chapter(chapter, args.solution, args.variant) for chapter in chapters]
    return 0 if all(results) else 1


if __name__ == "__main__":
    adopt_orphans()  # a process a learner's rank forked ends with its world (job_state.py)
    try:
        sys.exit(main())
    except (KeyboardInterrupt, RunStopped):  # the reference run's Trainer says RunStopped;
        # the ranks ignore Ctrl-C and end with the grader
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second one would break the exit
        for pid in children():  # the ranks, at once: a SIGTERM at exit would stop their runs
            os.kill(pid, signal.SIGKILL)
        print("\ngrade: stopped by Ctrl-C; the exercises not graded yet have no verdict",
              file=sys.stderr)
        sys.exit(130)
