"""What every chapter's grading shares: the learner's functions, the patch, the world, a hang.

A function to grade is named by its ``Source``, (file or module, attribute), so that each spawned
rank loads it itself: ``examples/exercises/01_ddp.py`` is a file (its name starts with a digit,
no import reaches it), a planted variant is a module of the tests. ``run_world`` starts the
ranks with a short collective timeout and torch's flight recorder; a rank whose collective
times out dumps its recorder, and the grader names the ranks, the collectives and the peers
(scaletorch/dist/flight_recorder.py) instead of waiting for a timeout to say nothing.
"""

import importlib
import importlib.util
import os
import re
import tempfile
import traceback
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch.distributed as dist

from scaletorch.dist import flight_recorder, spawn

Source = Tuple[str, str]  # (a .py file or a module name, the function's name in it)
COLLECTIVE_TIMEOUT = 30.0  # seconds: a world of 2 tiny ranks never waits this long unless hung
WORLD_TIMEOUT = 600.0  # seconds for every job of a world (the jobs' groups: COLLECTIVE_TIMEOUT)
# How the ranks start: new Pythons (spawn); the test suite forks them from its forkserver, which
# imported torch and the library once (tests/harness.py)
START_METHOD = "spawn"
UNWRITTEN = "NotImplementedError"


@dataclass
class Verdict:
    """One exercise's grade: ``passed``, and the line the learner reads."""
    exercise: str
    passed: bool
    text: str

    def line(self) -> str:
        return f"{self.exercise:22s} {self.text}"


def load(source: Source) -> Callable:
    """The function ``source`` names: from a file by its path, or from an importable module."""
    where, name = source
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"exercise_{abs(hash(where))}", where)
        if spec is None or spec.loader is None:
            raise ValueError(f"cannot load {where!r}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


@contextmanager
def patched(patches: Sequence[Tuple[object, str, object]]) -> Iterator[None]:
    """Set each (owner, attribute, value) for the block, then put the old values back."""
    with ExitStack() as stack:
        for owner, attr, value in patches:
            old = getattr(owner, attr)
            setattr(owner, attr, value)
            stack.callback(setattr, owner, attr, old)
        yield


def _chain(err: BaseException) -> List[BaseException]:
    """``err`` and what caused it (the Trainer re-raises a step's error as a RuntimeError)."""
    out: List[BaseException] = []
    while err is not None and err not in out:
        out.append(err)
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    return out


def innermost(err: BaseException) -> BaseException:
    """The first error of ``err``'s chain: the one raised where it went wrong."""
    return _chain(err)[-1]


def caused_by(err: BaseException, kind: type) -> Optional[BaseException]:
    """The first error of type ``kind`` in ``err``'s chain, or None."""
    return next((e for e in _chain(err) if isinstance(e, kind)), None)


def is_unwritten(err: BaseException) -> bool:
    return any(isinstance(e, NotImplementedError) for e in _chain(err))


def is_hang(err: BaseException) -> bool:
    """A collective that timed out, or whose peer left: the world cannot go on."""
    return not is_unwritten(err) and any(
        isinstance(e, dist.DistError) or re.search(r"imed out|peer|gloo", str(e)) is not None
        for e in _chain(err))


def failure(err: BaseException) -> str:
    """What a job's error was, for the parent: "NotImplementedError" for an unwritten stub,
    else the first exception's type, message and the line of the exercise that raised it."""
    if is_unwritten(err):
        return UNWRITTEN
    first = _chain(err)[-1]
    frames = traceback.extract_tb(first.__traceback__)
    where = next((f for f in reversed(frames) if "exercise" in f.filename), frames[-1])
    return f"{type(first).__name__}: {first} (at {os.path.basename(where.filename)}:" \
        f"{where.lineno})"


def _rank(rank: int, world: int, fn: Callable, directory: str, *args: Any) -> Any:
    """One rank: ``fn(rank, world, *args)``; a collective that times out dumps this rank's
    flight recorder to ``directory`` and returns {"hang": message}."""
    try:
        return fn(rank, world, *args)
    except Exception as err:  # noqa: B902 - fn lets only a hang through (is_hang)
        if not is_hang(err):
            raise
        flight_recorder.dump(directory, rank)
        return {"hang": str(err).splitlines()[0] if str(err) else type(err).__name__}


def run_world(fn: Callable, world: int, *args: Any) -> Tuple[List[Any], List[str]]:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks with the flight recorder on: (each
    rank's result, the recorder's analysis when a rank hung, else [])."""
    recorder = {flight_recorder.BUFFER_ENV: os.environ.get(flight_recorder.BUFFER_ENV, "2000")}
    with tempfile.TemporaryDirectory() as directory:
        try:
            results = spawn.run_distributed(_rank, world, fn, directory, *args,
                                            start_method=START_METHOD, env=recorder,
                                            timeout=WORLD_TIMEOUT)
        except RuntimeError as err:  # a rank died: gloo aborts on collectives that mismatch
            results = [{
                "hang":
                f"{str(err).splitlines()[0]}; gloo aborts a rank whose "
                f"collective's size differs from its peer's"
            }]
        hung = [r["hang"] for r in results if isinstance(r, dict) and "hang" in r]
        if not hung:
            return results, []
        dumps = os.listdir(directory)
        lines = flight_recorder.analyze(flight_recorder.load(directory)) if dumps else []
        return results, lines + [f"({hung[0]})"]


def run_jobs(jobs: Sequence[Dict[str, Source]],
             measure: Callable[[str, Source], Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Inside a rank: ``measure(exercise, source)`` of each job in turn, as {"exercise": ...,
    **measured}; a learner's error becomes {"exercise", "error": failure(err)}, and any error
    but an unwritten stub ends the jobs (the ranks may now disagree on the collectives to
    come). A hang is raised: the world cannot go on (``run_world`` reports it)."""
    out: List[Dict[str, Any]] = []
    for job in jobs:
        (exercise, source), = job.items()
        try:
            out.append({"exercise": exercise, **measure(exercise, source)})
        except Exception as err:  # noqa: B902 - the learner's error is a diagnosis
            if is_hang(err):
                raise
            out.append({"exercise": exercise, "error": failure(err)})
            if not is_unwritten(err):
                break
    return out


def hang_text(exercise: str, lines: List[str]) -> str:
    """A hang as a diagnosis: the ranks, the collectives and the peers, from the recorder."""
    return f"{exercise}: the ranks stopped in a collective; the flight recorder says\n    " + \
        "\n    ".join(lines)


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a)


def error_verdict(exercise: str, runs: List[dict]) -> Optional[Verdict]:
    """The verdict of a job that raised on some rank: "write <function> next" for a stub, else
    the error and where; None if every rank finished it."""
    errors = [run["error"] for run in runs if "error" in run]
    if UNWRITTEN in errors:
        return Verdict(exercise, False, f"write {exercise} next")
    if errors:
        return Verdict(exercise, False, f"{exercise} raised {errors[0]}")
    return None


def per_job(jobs: Sequence[Dict[str, Source]], results: List[Any], hang: List[str],
            verdict: Callable[[str, List[Dict[str, Any]]], Verdict]) -> List[Verdict]:
    """Each job's verdict from every rank's result of it (``run_world``'s ``results`` of
    ``run_jobs``): ``verdict(exercise, runs)``, or the hang (or a missing result) for a job that
    some rank did not finish."""
    ranks = [r for r in results if isinstance(r, list)]
    verdicts = []
    for i, job in enumerate(jobs):
        (exercise, _), = job.items()
        runs = [r[i] for r in ranks if i < len(r)]
        if len(runs) < len(results):
            text = hang_text(exercise, hang) if hang else "no result from every rank"
            verdicts.append(Verdict(exercise, False, text))
        else:
            verdicts.append(verdict(exercise, runs))
    return verdicts


def found_verdict(exercise: str, runs: List[Dict[str, Any]]) -> Verdict:
    """"passed" if no rank found a call that differed from the library's, else the first."""
    failed = error_verdict(exercise, runs)
    if failed is not None:
        return failed
    texts = [t for run in runs for t in run["found"]]
    return Verdict(exercise, not texts, texts[0] if texts else "passed")


def grade_found(rank_jobs: Callable, world: int, jobs: List[Dict[str, Source]]) -> List[Verdict]:
    """Every job graded in one world of ``world`` ranks, by ``rank_jobs`` whose measure returns
    {"found": the diagnoses of the calls that differed from the library's} (05 and 03 grade so)."""
    results, hang = run_world(rank_jobs, world, jobs)
    return per_job(jobs, results, hang, found_verdict)
