"""Grading chapter 04's exercises (examples/exercises/04_pipeline_parallel.py) on 2 gloo ranks.

Each job trains chapter 04's run (examples/configs/04_pipeline_parallel.yaml: pp 2, 1F1B, 8
micro-batches, ``STEPS`` steps) with the learner's function in place of
scaletorch/parallel/pipeline_schedules.py's, and measures on every rank: the actions of step 0
in order and the most activations held at once, each backward called without its gradient,
the losses, grad norms and final weights. The parent compares them with 1F1B's order
(``one_f_one_b_actions``) and with one device, and says what is wrong in the learner's terms.

A hang is a diagnosis. Each send and receive is waited for at most ``HANG_TIMEOUT``: on gloo
they wait for the group's creation timeout (startup_timeout, 120 s), not the one set after it,
so the grader passes its own to ``wait``. Each rank writes down the named operation it waits
in (torch's flight recorder keeps no point-to-point entries on gloo), and the grader names the
ranks, the operations and their peers.
"""

import datetime
import os
import sys
import time
from typing import Any, Dict, List, Optional

import torch

from scaletorch.dist import comm, destroy_pg_manager, get_ledger, init_pg_manager_from_config
from scaletorch.models import build_model
from scaletorch.parallel import pipeline_schedules
from scaletorch.parallel.pipeline_parallel import apply_pipeline_parallel
from scaletorch.parallel.pipeline_schedules import PipelineLoop, PipelineRank
from scaletorch.parallel.tensor_parallel import tensor_parallel_clip_grad_norm
from scaletorch.schedule.orders import message, one_f_one_b_actions
from scaletorch.trainer import Config, Trainer, parse_args
from scaletorch.trainer.parity import max_norm_diff, reference_trainer
from scaletorch.trainer.pipeline_state import gather_pipeline_state_dict
from scaletorch.trainer.precision import NORM_TOLERANCES, TOLERANCES
from scripts.grading.runner import (LEARNER_ERRORS, RANK_LIMITS, Source, Verdict, error_verdict,
                                    failure, is_hang, is_unwritten, load, patched, run_world,
                                    streamed)

CHAPTER = "04"
EXERCISES = ("one_f_one_b", "micro_batch_loss")
LIBRARY = "scaletorch.parallel.pipeline_schedules"
WORLD = 2
AGAINST = "one device"
STEPS = 3
# Seconds a rank waits in a send or receive before the grader calls it a hang: a message
# waits for one micro-batch of a 1-layer stage (milliseconds), so 10 s is slack for a loaded
# machine, and a deadlock costs the learner 10 s.
HANG_TIMEOUT = 10.0
RANK_LIMITS.append((__name__, "HANG_TIMEOUT"))  # the ranks wait the parent's (runner.py)
# A gradient off by a factor: within 1% of it (fp32 norms agree to 1e-4 when right).
FACTOR_TOL = 0.01


def config() -> Config:
    cfg = parse_args(
        ["--config", "examples/configs/04_pipeline_parallel.yaml", "--steps",
         str(STEPS)])
    cfg.logging.progress = False
    return cfg


def _instrumented(exercise: str, fn: Any, record: Dict[str, Any]) -> List[tuple]:
    """The patches that put ``fn`` in the library's place and record what the stage did."""
    forward, backward, batch = PipelineRank.forward, PipelineRank.backward, PipelineRank._batch
    recv_backward, wait = PipelineRank.recv_backward, comm.Work.wait

    def recorded_forward(self: PipelineRank, mb: int, x: Any) -> Any:
        out = forward(self, mb, x)
        if get_ledger().step == 0:
            record["actions"].append(f"F{mb}")
            record["peak"] = max(record["peak"], len(self.held))
        return out

    def recorded_backward(self: PipelineRank, mb: int, dy: Any) -> Any:
        if dy is None and not self.last:  # no gradient: receive it for the learner, go on
            record["no_grad"].append((get_ledger().step, mb))
            dy = recv_backward(self, mb)
        if get_ledger().step == 0:
            record["actions"].append(f"B{mb}")
        return backward(self, mb, dy)

    def recorded_batch(self: PipelineRank, name: str, sends: list, recvs: list) -> Any:
        caller = sys._getframe(2)  # the learner's line that called the named operation
        messages = [message(mb, peer, True) for mb, peer, y in sends if peer is not None]
        messages += [message(mb, peer, False) for mb, peer in recvs if peer is not None]
        record["waiting"] = {
            "step": get_ledger().step,
            "call": f"{name}({', '.join(messages)})",
            "sends": any(peer is not None for _, peer, _ in sends),
            "recvs": any(peer is not None for _, peer in recvs),
            "where": f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}",
            "since": time.perf_counter()
        }
        out = batch(self, name, sends, recvs)
        record["waiting"] = None
        return out

    def bounded_wait(self: comm.Work, *args: Any) -> Any:
        return wait(self, *args) if args else wait(self, datetime.timedelta(seconds=HANG_TIMEOUT))

    schedules = {**pipeline_schedules.SCHEDULES}
    if exercise == "one_f_one_b":
        schedules["1f1b"] = fn
    loss = fn if exercise == "micro_batch_loss" else pipeline_schedules.micro_batch_loss
    return [(pipeline_schedules, "SCHEDULES", schedules),
            (pipeline_schedules, "micro_batch_loss", loss),
            (PipelineRank, "forward", recorded_forward),
            (PipelineRank, "backward", recorded_backward), (PipelineRank, "_batch", recorded_batch),
            (comm.Work, "wait", bounded_wait)]


def _train(cfg: Config, pgm: Any) -> Dict[str, Any]:
    model = build_model(cfg.model, seed=cfg.training.model_seed)
    pipe = apply_pipeline_parallel(model, pgm, 1, cfg.parallel.layer_split)
    loop = PipelineLoop(pipe, pgm, "1f1b", cfg.data.num_micro_batches)
    clip = tensor_parallel_clip_grad_norm(pipe, pgm)  # the global norm over the stages
    result = Trainer(cfg, pipe, pgm, device=torch.device("cpu"), forward_backward=loop,
                     clip_grad_norm=clip, verbose=False).train()
    return {
        "losses": result.losses,
        "grad_norms": result.grad_norms,
        "state": gather_pipeline_state_dict(pipe, pgm)  # rank 0's, None elsewhere
    }


def rank_jobs(rank: int, world: int, jobs: List[Dict[str, Source]]) -> List[Dict[str, Any]]:
    """Inside a rank: each job trained and measured; a hang ends the jobs with what each rank
    waited in."""
    cfg = config()
    pgm = init_pg_manager_from_config(cfg.parallel, HANG_TIMEOUT)
    out = streamed()
    try:
        for job in jobs:
            (exercise, source), = job.items()
            record: Dict[str, Any] = {"actions": [], "peak": 0, "no_grad": [], "waiting": None}
            try:
                fn = load(source)
                if exercise == "micro_batch_loss":  # every rank, before anything is sent
                    fn(torch.ones(()), cfg.data.num_micro_batches)
                with patched(_instrumented(exercise, fn, record)):
                    measured = _train(cfg, pgm)
            except LEARNER_ERRORS as err:  # a diagnosis, sys.exit() too
                if is_hang(err) and record["waiting"] is not None:
                    waiting = record["waiting"]
                    waiting["waited"] = time.perf_counter() - waiting.pop("since")
                    out.append({"exercise": exercise, "stuck": waiting})
                    break  # the pair's messages are out of step: the world cannot go on
                out.append({"exercise": exercise, "error": failure(err)})
                if not is_unwritten(err):
                    break
                continue
            record.pop("waiting")
            out.append({"exercise": exercise, **measured, **record})
    finally:
        destroy_pg_manager()
    return out


def reference() -> Dict[str, Any]:
    """One device, the same run: losses, grad norms, weights."""
    trainer = reference_trainer(config())
    result = trainer.train()
    return {
        "losses": result.losses,
        "grad_norms": result.grad_norms,
        "state": trainer.model.state_dict()
    }


# ---- diagnoses: from what the jobs measured, in the learner's terms -----------------------


def hang_diagnosis(runs: List[Dict[str, Any]]) -> str:
    """The ranks, the operations they wait in and their peers; why, when the pattern says."""
    stuck = [run.get("stuck") for run in runs]
    step = next(s["step"] for s in stuck if s is not None)
    waits = [
        f"rank {rank} waits in {s['call']} at {s['where']}"
        if s is not None else f"rank {rank} is in no send or receive"
        for rank, s in enumerate(stuck)
    ]
    text = f"hang in step {step}: {', '.join(waits)}"
    if all(s is not None and s["sends"] and not s["recvs"] for s in stuck):
        text += (" (both send first): a send waits for its receive, so post each send with the "
                 "receive that answers it in one batch (send_forward_recv_backward, "
                 "send_backward_recv_forward)")
    elif all(s is not None and s["recvs"] and not s["sends"] for s in stuck):
        text += " (both receive first): one of them must send first"
    waited = max(s["waited"] for s in stuck if s is not None)
    return text + f"; they gave up after {waited:.0f} s (the grader's timeout for a message)"


def order_diagnosis(runs: List[Dict[str, Any]], m: int) -> Optional[str]:
    """What differs between each rank's actions of step 0 and 1F1B's, None if nothing."""
    for rank, run in enumerate(runs):
        want = [str(a) for a in one_f_one_b_actions(WORLD, m, rank)]
        got = run["actions"]
        if got == want:
            continue
        first_b = next((i for i, a in enumerate(got) if a.startswith("B")), len(got))
        if first_b != next(i for i, a in enumerate(want) if a.startswith("B")):
            ran, warmup = first_b - 1, WORLD - rank - 1  # one forward of the steady state
            head = (f"rank {rank}'s warm-up ran {ran} forwards before the steady state "
                    f"({' '.join(got[:first_b + 2])} ...): 1F1B warms up with p - r - 1 = "
                    f"{warmup}")
            if ran > warmup:
                return (f"{head}; one more holds {run['peak']} activations at once, not "
                        f"p - r = {WORLD - rank}")
            return (f"{head}; one fewer and the ranks take turns: rank {rank} waits for a "
                    f"gradient while the next rank has no micro-batch to work on")
        k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        return (f"rank {rank}'s actions of step 0 leave 1F1B's at action {k}: "
                f"{' '.join(got[max(k - 2, 0):k + 2])}, where 1F1B runs "
                f"{' '.join(want[max(k - 2, 0):k + 2])}")
    return None


def gradient_diagnosis(runs: List[Dict[str, Any]], ref: Dict[str, Any], m: int) -> Optional[str]:
    """Step 0's gradients off by a factor (the global grad norm's ratio), None if not."""
    ratio = runs[0]["grad_norms"][0] / ref["grad_norms"][0]
    near = lambda k: abs(ratio - k) < FACTOR_TOL * k  # noqa: E731
    head = f"gradients are {ratio:.3g}x the reference in step 0 (its grad norm)"
    if near(m):
        return (f"{head}: each micro-batch's loss is a mean over its tokens; divide it by "
                f"m = {m}, so that the m backwards add up to the whole batch's mean")
    if near(1 / m):
        return f"{head} = 1/m: divided by m = {m} twice? divide once"
    if near(m / WORLD):
        return (f"{head}: divided by p = {WORLD}, the pipeline ranks? divide by m = {m}, the "
                f"micro-batches")
    return None


def parity_diagnosis(runs: List[Dict[str, Any]], ref: Dict[str, Any]) -> Optional[str]:
    """The chapter's check: losses and grad norms on every rank, weights on rank 0."""
    for rank, run in enumerate(runs):
        loss = max(abs(a - b) for a, b in zip(run["losses"], ref["losses"]))
        norm = max_norm_diff(run["grad_norms"], ref["grad_norms"])
        state = run["state"] or {}
        weight = max((float((state[k] - v).abs().max())
                      for k, v in ref["state"].items() if k in state), default=0.0)
        if loss > TOLERANCES["fp32"] or weight > TOLERANCES["fp32"] or \
                norm > NORM_TOLERANCES["fp32"]:
            return (f"after {STEPS} steps rank {rank}'s loss is {loss:.1e}, its grad norm "
                    f"{norm:.1e} relative and the weights {weight:.1e} off the reference")
    return None


def diagnose(exercise: str, runs: List[Dict[str, Any]], ref: Dict[str, Any]) -> Verdict:
    """The verdict of one exercise from every rank's measurements of its job."""
    # a rank that died or raised is the cause; its peer's wait for it, the consequence
    if any("stuck" in run for run in runs) and not any("lost" in r or "error" in r for r in runs):
        return Verdict(exercise, False, hang_diagnosis(runs))
    failed = error_verdict(exercise, runs)
    if failed is not None:
        return failed
    m = config().data.num_micro_batches
    for rank, run in enumerate(runs):
        if run["no_grad"]:
            step, mb = run["no_grad"][0]
            return Verdict(
                exercise, False,
                f"rank {rank} ran the backward of micro-batch {mb} in step {step} without its "
                f"gradient: in the cool-down, recv_backward({mb}) from rank {rank + 1} first")
    text = order_diagnosis(runs, m) or gradient_diagnosis(runs, ref, m) or \
        parity_diagnosis(runs, ref)
    return Verdict(exercise, text is None, text or "passed")


def grade(jobs: List[Dict[str, Source]]) -> List[Verdict]:
    """Every job (one exercise each, in order) graded in one world of WORLD ranks."""
    ref = reference()
    results = run_world(rank_jobs, WORLD, jobs)
    return [diagnose(next(iter(job)), [r[i] for r in results], ref) for i, job in enumerate(jobs)]


def solution_jobs() -> List[Dict[str, Source]]:
    return [{name: (LIBRARY, name)} for name in EXERCISES]


def exercise_jobs(path: str) -> List[Dict[str, Source]]:
    return [{name: (path, name)} for name in EXERCISES]
