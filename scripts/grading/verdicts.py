"""An exercise's verdict from every rank's results of its job (``runner.run_world``'s).

A job's results are one dict per rank: {"error": ...} when the learner's function raised there,
{"lost": ...} when a hang or a crash stopped the rank, else what the chapter measured.
``error_verdict`` tells the first two; ``per_job`` leaves the rest to the chapter's verdict;
chapters whose ranks return {"found": diagnoses} (03, 05, 06b) use ``grade_found``.
"""

import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from scripts.grading.learner import UNWRITTEN, Source
from scripts.grading.runner import run_world
from scripts.grading.stop_reports import plain

# a backend's error that follows another rank's: its connection closed or reset, a wait that
# timed out (gloo's words, torch's DistError)
_FOLLOWED = re.compile(r"Connection (?:closed|reset) by peer|peer rank had left|imed out|"
                       r"timeout caused pair closure|DistBackendError|DistNetworkError|Broken pipe")


def followed(run: Dict[str, Any]) -> bool:
    """Whether a rank's error followed another rank's (the backend's words, or the chapter
    marked it a hang): the other rank's own error is the job's verdict."""
    return bool(run.get("hung")) or _FOLLOWED.search(str(run.get("error", ""))) is not None


@dataclass
class Verdict:
    """One exercise's grade: ``passed``, and the line the learner reads."""
    exercise: str
    passed: bool
    text: str

    def line(self) -> str:
        return f"{self.exercise:22s} {self.text}"


def error_verdict(exercise: str, runs: List[dict]) -> Optional[Verdict]:
    """The verdict of a job that raised on some rank: "write <function> next" for a stub, else
    the error and where (a rank's own error before the ones that followed it on its peers: their
    connection closed, their wait timed out); None if every rank finished it."""
    errors = [(r, run["error"]) for r, run in enumerate(runs) if "error" in run]
    if any(e == UNWRITTEN for _, e in errors):
        return Verdict(exercise, False, f"write {exercise} next")
    lost = [run["lost"] for run in runs if "lost" in run]
    if errors and not (lost and all(followed(runs[r]) for r, _ in errors)):
        rank, error = min(errors, key=lambda e: (followed(runs[e[0]]), e[0]))
        error = plain(error) if followed(runs[rank]) else error  # without gloo's internals
        return Verdict(exercise, False, f"{exercise} raised on rank {rank}: {error}")
    changed = [(r, run["settings_left"]) for r, run in enumerate(runs) if "settings_left" in run]
    if changed:  # job_state.py: a setting the job left changed
        rank, state = changed[0]
        return Verdict(exercise, False, f"on rank {rank}, {state}")
    if lost:  # a rank stopped (runner.py's words), the others' errors followed it
        return Verdict(exercise, False, f"{exercise}: {lost[0]}")
    return None


def per_job(jobs: Sequence[Dict[str, Source]], results: List[List[Any]],
            verdict: Callable[[str, List[Dict[str, Any]]], Verdict]) -> List[Verdict]:
    """Each job's verdict from every rank's result of it (``run_world``'s): its error or what
    stopped it, else ``verdict(exercise, runs)``."""
    verdicts = []
    for i, job in enumerate(jobs):
        (exercise, _), = job.items()
        runs = [r[i] for r in results]
        verdicts.append(error_verdict(exercise, runs) or verdict(exercise, runs))
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
    return per_job(jobs, run_world(rank_jobs, world, jobs), found_verdict)
