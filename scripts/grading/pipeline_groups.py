"""Grading chapter 04's 1F1B where the pipeline is a subgroup: pp 2 x dp 2 on 4 gloo ranks.

pipeline.py's world is pp 3 = the whole world: there a stage's rank is its global rank and
``dist.get_world_size()`` is p, so a loop that sends to ``dist.get_rank() + 1`` over the default
group, or warms up with the world's size, trains exactly like 1F1B. Here the pipelines are the
"pp" groups of chapter 04's order (tp-cp-dp-pp: [0, 2] and [1, 3]), so global ranks differ from
stage ranks and the world (4) from p (2). A ``one_f_one_b`` that passed pp 3 trains one step
here, ``MICRO_BATCHES`` micro-batches; every rank measures step 0's actions, the most activations
held at once, each point-to-point message it sent or received at the process group whatever API
issued it (scripts/grading/traffic.py: the peer as a global rank), its losses, and on an error
or a hang what it had done until then. The verdict says what was measured: which rank sent to or
received from which rank outside its pipeline, a warm-up length per stage, losses off one
device's; it names the world size or global ranks as the cause only when the counts and peers
measured are those they give.
"""

import re
from typing import Any, Callable, Dict, List, Optional

from scaletorch.dist import destroy_pg_manager, get_ledger, init_pg_manager_from_config
from scaletorch.trainer import Config, parse_args
from scaletorch.trainer.parity import reference_trainer
from scaletorch.trainer.precision import TOLERANCES
from scripts.grading.learner import (LEARNER_ERRORS, Source, failure, is_hang, is_unwritten, load,
                                     patched)
from scripts.grading.pipeline_diagnoses import order_diagnosis
from scripts.grading.runner import run_world, streamed
from scripts.grading.traffic import observed
from scripts.grading.verdicts import Verdict

PP, DP = 2, 2
WORLD = PP * DP
# 4 (the chapter's global batch of 16 over dp 2 takes 4 or 8): a warm-up of the world's
# 4 - r - 1 forwards (3, 2) differs from 1F1B's p - r - 1 (1, 0) and from m
MICRO_BATCHES = 4
STEPS = 1
NAME = f"pp {PP} x dp {DP}"


def config() -> Config:
    cfg = parse_args([
        "--config", "examples/configs/04_pipeline_parallel.yaml", "--steps",
        str(STEPS), "--pp",
        str(PP), "--dp",
        str(DP), "--model.num_layers",
        str(PP), "--micro-batches",
        str(MICRO_BATCHES)
    ])
    cfg.logging.progress = False
    return cfg


def _messages(traffic: List[Any], pipeline: List[int]) -> List[List[Any]]:
    """Step 0's sends and receives as [op, the peer's global rank, the group]: a "pp" peer is a
    rank of this rank's pipeline, any other group's the world's (the default group)."""
    return [[
        c.op, pipeline[c.peer] if c.group == "pp" and c.peer < len(pipeline) else c.peer, c.group
    ] for c in traffic if c.op in ("send", "recv") and c.step == 0 and c.peer is not None]


def empty_record() -> Dict[str, Any]:
    """What a rank measures of one job (both worlds of chapter 04 fill it)."""
    return {
        "actions": [],
        "peak": 0,
        "no_grad": [],
        "waiting": None,
        "sent": [],
        "received": [],
        "stage_grads": {}
    }


def rank_jobs(jobs: List[Dict[str, Source]], instrumented: Callable, train: Callable,
              timeout: float) -> List[Any]:
    """Inside a rank: each job (``one_f_one_b``) trained with pipeline.py's ``instrumented``
    patches and ``train``, its groups' timeout ``timeout`` s; the measurements, also of a job
    that raised or hung."""
    cfg = config()
    pgm = init_pg_manager_from_config(cfg.parallel, timeout)
    pipeline = pgm.group_ranks("pp")
    out = streamed()
    try:
        for job in jobs:
            (exercise, source), = job.items()
            record = empty_record()
            facts = {"pipeline": pipeline, "stage": pgm.pipeline_model_parallel_rank}
            with observed(lambda: get_ledger().step) as traffic:
                try:
                    with patched(instrumented(exercise, load(source), record)):
                        measured = train(cfg, pgm, record)
                except LEARNER_ERRORS as err:  # the world cannot go on: what it did till then
                    out.append({
                        "exercise": exercise,
                        **facts, "error": failure(err),
                        "hung": is_hang(err),
                        "actions": record["actions"],
                        "messages": _messages(traffic, pipeline)
                    })
                    if not is_unwritten(err):
                        break
                    continue
            out.append({
                "exercise": exercise,
                **facts, "actions": record["actions"],
                "peak": record["peak"],
                "messages": _messages(traffic, pipeline),
                "losses": measured["losses"]
            })
    finally:
        destroy_pg_manager()
    return out


def _where(rank: int, run: Dict[str, Any]) -> str:
    return f"rank {rank} (stage {run['stage']} of the pipeline of ranks {run['pipeline']})"


def _peer_diagnosis(runs: List[Dict[str, Any]]) -> Optional[str]:
    """The first message sent to or received from a rank that is not a neighbour stage of the
    sender's pipeline; global rank +- 1 named when that is the peer measured."""
    for rank, run in enumerate(runs):
        pipe, stage = run.get("pipeline"), run.get("stage")
        if pipe is None:
            continue
        neighbours = [pipe[s] for s in (stage - 1, stage + 1) if 0 <= s < len(pipe)]
        for op, peer, group in run.get("messages", []):
            if peer in neighbours:
                continue
            verb = "sent a message to" if op == "send" else "received a message from"
            whose = next((f"stage {r['stage']} of the pipeline {r['pipeline']}"
                          for k, r in enumerate(runs) if k == peer and "pipeline" in r), "")
            text = (f"in the {NAME} world {_where(rank, run)} {verb} rank {peer}"
                    f"{f' ({whose})' if whose else ''} over the group '{group}' in step 0; its "
                    f"neighbour stages are rank {' and '.join(map(str, neighbours))}")
            if peer in (rank - 1, rank + 1):
                text += (f": rank {peer} is its global rank {'+' if peer > rank else '-'} 1; a "
                         f"stage's neighbours are this_rank.next and this_rank.prev (global "
                         f"ranks of its 'pp' group), or the named operations")
            return text
    return None


def _warmups(runs: List[Dict[str, Any]]) -> Dict[int, int]:
    """{rank: forwards before its first backward in step 0}."""
    return {
        r: next((i for i, a in enumerate(run["actions"]) if a.startswith("B")), len(run["actions"]))
        for r, run in enumerate(runs)
    }


def _order(runs: List[Dict[str, Any]]) -> Optional[str]:
    """pipeline_diagnoses' order diagnosis of each pipeline (its ranks by stage), the ranks
    named globally; the world size named when every stage warmed up with W - s - 1."""
    for pipe in sorted({tuple(r["pipeline"]) for r in runs}):
        mine = [runs[g] for g in pipe]
        said = order_diagnosis(mine, MICRO_BATCHES)
        if said is None:
            continue
        said = re.sub(r"\brank (\d+)", r"stage \1", said)  # its ranks are the pipeline's
        text = f"in the {NAME} world, pipeline of ranks {list(pipe)} (its stage s is rank " \
            f"{', '.join(f'{g} for s = {s}' for s, g in enumerate(pipe))}): {said}"
        ran = {run["stage"]: w - 1 for run, w in zip(mine, _warmups(mine).values())}
        world = {s: min(WORLD - s - 1, MICRO_BATCHES) for s in ran}
        if ran == world and any(ran[s] != PP - s - 1 for s in ran):
            text += (f"; each stage s warmed up with {WORLD} - s - 1 forwards, the world's size "
                     f"(dist.get_world_size()) in place of p = {PP}, the pipeline's "
                     f"(this_rank.p)")
        return text
    return None


def diagnose(exercise: str, runs: List[Dict[str, Any]], ref: List[float]) -> Verdict:
    """The verdict of one job of the pp 2 x dp 2 world."""
    peers = _peer_diagnosis(runs)
    if peers is not None:
        return Verdict(exercise, False, peers)
    lost = next((r["lost"] for r in runs if "lost" in r), None)
    errors = [(k, r) for k, r in enumerate(runs) if "error" in r]
    if lost is not None or errors:
        said = lost or "; ".join(f"rank {k} {'hung' if r.get('hung') else 'raised'}: "
                                 f"{r['error']}" for k, r in errors[:2])
        return Verdict(
            exercise, False, f"{exercise} passed at pp 3 but not in the {NAME} world "
            f"(pipelines [0, 2] and [1, 3]): {said}")
    text = _order(runs)
    if text is not None:
        return Verdict(exercise, False, text)
    tol = TOLERANCES["fp32"]
    off = [(k, r["losses"][0]) for k, r in enumerate(runs) if abs(r["losses"][0] - ref[0]) > tol]
    if off:
        rank, loss = off[0]
        return Verdict(
            exercise, False, f"in the {NAME} world rank {rank}'s loss of step 0 is "
            f"{loss:.6f}, one device's {ref[0]:.6f} (ranks off: "
            f"{', '.join(str(k) for k, _ in off)})")
    return Verdict(exercise, True, "passed")


def regrade(jobs: List[Dict[str, Source]], verdicts: List[Verdict],
            rank_fn: Callable) -> List[Verdict]:
    """``verdicts`` with each ``one_f_one_b`` job that passed at pp 3 graded again in the pp 2
    x dp 2 world by ``rank_fn`` (pipeline.py's, which runs ``rank_jobs``): its verdict if it
    fails there."""
    again = [
        i for i, (job, v) in enumerate(zip(jobs, verdicts))
        if v.passed and next(iter(job)) == "one_f_one_b"
    ]
    if not again:
        return verdicts
    trainer = reference_trainer(config())
    ref = trainer.train().losses
    results = run_world(rank_fn, WORLD, [jobs[i] for i in again])
    out = list(verdicts)
    for k, i in enumerate(again):
        verdict = diagnose("one_f_one_b", [r[k] for r in results], ref)
        if not verdict.passed:
            out[i] = verdict
    return out
