"""Grading chapter 08's exercises (examples/exercises/08_mixed_precision.py) on 2 gloo ranks.

Each job trains chapter 01's data-parallel run for ``STEPS`` steps with the dynamic loss scale
(init 2^10, growth interval 2) and the learner's function in place of
scaletorch/parallel/loss_scale.py's. The grader plants the overflows a scale must survive, in
the already averaged gradients of one rank: an inf on rank 1 in step 3, a NaN on rank 0 in step
5. It measures each rank's overflow flag, scale and clean-step count after every step, step 0's
unscaled gradients and the final weights, and compares them with the library's run in the same
world (job 0). fp32 compute: the scale's logic is the same as in fp16, and the run is exact.
"""

import math
from typing import Any, Dict, List, Optional

import torch

from scaletorch.dist import destroy_pg_manager, get_ledger, init_pg_manager_from_config
from scaletorch.models import build_model, loss_fn
from scaletorch.parallel import mixed_precision
from scaletorch.parallel.data_parallel import apply_data_parallel
from scaletorch.parallel.grad_norm import clip_replicated
from scaletorch.parallel.mixed_precision import DynamicLossScaler
from scaletorch.parallel.step import make_data_parallel_step
from scaletorch.trainer import Config, Trainer, parse_args
from scaletorch.trainer import run as run_module
from scaletorch.trainer import trainer as trainer_module
from scripts.grading.runner import (LEARNER_ERRORS, Source, Verdict, collective_timeout,
                                    error_verdict, failure, is_hang, is_unwritten, load, patched,
                                    run_world, streamed)

CHAPTER = "08"
EXERCISES = ("unscale_and_check", "update_scale")
LIBRARY = "scaletorch.parallel.loss_scale"
WORLD = 2
AGAINST = "the library's run"  # what the jobs are compared with
STEPS = 8
INIT_SCALE, GROWTH_INTERVAL = 2.0**10, 2
PLANTED = {3: (1, math.inf, "an inf on rank 1"), 5: (0, math.nan, "a NaN on rank 0")}
WEIGHT_TOL = 1e-6  # the same operations in the same order as the library's run: equal


def config() -> Config:
    cfg = parse_args(["--config", "examples/configs/01_ddp.yaml", "--steps", str(STEPS)])
    cfg.logging.progress = False
    return cfg


def _train(cfg: Config, pgm: Any, exercise: str, fn: Any) -> Dict[str, Any]:
    model = build_model(cfg.model, seed=cfg.training.model_seed)
    wrapped = apply_data_parallel(model, pgm, "ours", cfg.parallel.bucket_size_mb)
    scaler = DynamicLossScaler(INIT_SCALE, GROWTH_INTERVAL)  # over the world
    step = make_data_parallel_step(wrapped, cfg.data.num_micro_batches, pgm.data_parallel_rank,
                                   pgm.data_parallel_world_size, pgm.gradient_sync_group, loss_fn,
                                   scaler=scaler)
    found: List[bool] = []
    scales: List[tuple] = []
    grads: List[torch.Tensor] = []
    unscale, update = mixed_precision.unscale_and_check, mixed_precision.update_scale

    def planted_unscale(grads_: Any, scale: float, group: Any, agree: bool = True) -> bool:
        rank, value, _ = PLANTED.get(get_ledger().step, (-1, 0.0, ""))
        if rank == pgm.rank:
            grads_[0].view(-1)[0] = value
        result = (fn if exercise == "unscale_and_check" else unscale)(grads_, scale, group, agree)
        if not grads:
            grads.extend(g.detach().clone() for g in grads_)
        found.append(bool(result))
        return result

    def recorded_update(*args: Any) -> tuple:
        out = (fn if exercise == "update_scale" else update)(*args)
        scales.append(tuple(out))
        return out

    # A step the learner's scaler lets through with a NaN is measured, not stopped: the run's
    # own non-finite stop would end one rank and leave the other waiting in a collective.
    with patched([(mixed_precision, "unscale_and_check", planted_unscale),
                  (mixed_precision, "update_scale", recorded_update),
                  (trainer_module, "check_finite", lambda *args: None),
                  (run_module, "check_finite", lambda *args: None)]):
        Trainer(cfg, wrapped, pgm, device=torch.device("cpu"), forward_backward=step,
                clip_grad_norm=lambda max_norm: clip_replicated(list(model.parameters()), max_norm),
                scaler=scaler, verbose=False).train()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"found": found, "scales": scales, "grads": grads, "state": state}


def rank_jobs(rank: int, world: int, jobs: List[Dict[str, Source]]) -> List[Dict[str, Any]]:
    """Inside a rank: the library's run (the reference), then each job, measured."""
    cfg = config()
    pgm = init_pg_manager_from_config(cfg.parallel, collective_timeout())
    out = streamed()
    try:
        for job in [{EXERCISES[0]: (LIBRARY, EXERCISES[0])}] + jobs:
            (exercise, source), = job.items()
            try:
                out.append({"exercise": exercise, **_train(cfg, pgm, exercise, load(source))})
            except LEARNER_ERRORS as err:  # a diagnosis, sys.exit() too
                if is_hang(err):
                    raise
                out.append({"exercise": exercise, "error": failure(err)})
                if not is_unwritten(err):
                    break
    finally:
        destroy_pg_manager()
    return out


def unscale_diagnosis(runs: List[Dict[str, Any]], ref: Dict[str, Any]) -> Optional[str]:
    for step in range(STEPS):
        flags = [run["found"][step] for run in runs]
        if len(set(flags)) > 1:
            said, other = flags.index(True), flags.index(False)
            return (f"in step {step} rank {said} found an overflow and rank {other} did not, so "
                    f"rank {other} stepped alone: agree on the flag over the group (all-reduce "
                    f"MAX)")
        if flags[0] != ref["found"][step]:
            what = PLANTED[step][2] if step in PLANTED else "no overflow"
            return (f"step {step}'s gradients held {what}, and unscale_and_check returned "
                    f"{flags[0]}: look for inf and NaN alike (torch.isfinite)")
    norm = lambda gs: math.sqrt(sum(float(g.norm())**2 for g in gs))  # noqa: E731
    ratio = norm(runs[0]["grads"]) / norm(ref["grads"])
    if abs(ratio - 1) > 1e-4:
        return (f"gradients are {ratio:.4g}x the reference after unscale_and_check (the scale "
                f"was {INIT_SCALE:.0f}): divide them by the scale, once")
    return None


def update_diagnosis(runs: List[Dict[str, Any]], ref: Dict[str, Any]) -> Optional[str]:
    previous = (INIT_SCALE, 0)
    for step, ((scale, clean), (want,
                                want_clean)) in enumerate(zip(runs[0]["scales"], ref["scales"])):
        if ref["found"][step] and scale >= previous[0]:
            return (f"the scale stayed {scale:.0f} after the overflow in step {step}: halve it "
                    f"after an overflow")
        if want > previous[0] and scale <= previous[0]:
            return (f"the scale did not double after {GROWTH_INTERVAL} clean steps (step "
                    f"{step}): double it every growth_interval clean steps")
        if scale > previous[0] and want <= previous[0]:
            return (f"the scale doubled in step {step}, the reference's did not: count the "
                    f"clean steps from 0 again after halving or doubling")
        if scale == want and clean != want_clean == 0:
            event = f"the overflow in step {step}" if ref["found"][step] else f"step {step}"
            return (f"after {event} the clean-step count is {clean}, not 0: count the clean "
                    f"steps from 0 again after halving or doubling")
        if (scale, clean) != (want, want_clean):
            return (f"after step {step} the scale is {scale:.0f} with {clean} clean steps, the "
                    f"reference's {want:.0f} with {want_clean}")
        previous = (scale, clean)
    return None


def diagnose(exercise: str, runs: List[Dict[str, Any]], ref: Dict[str, Any]) -> Verdict:
    failed = error_verdict(exercise, runs)
    if failed is not None:
        return failed
    special = {"unscale_and_check": unscale_diagnosis, "update_scale": update_diagnosis}
    text = special[exercise](runs, ref)
    if text is None:
        weight = max(
            float((runs[r]["state"][k] - v).abs().max()) for r in range(WORLD)
            for k, v in ref["state"].items())
        if not weight <= WEIGHT_TOL:
            text = f"flags and scales match, but the weights end {weight:.1e} off the reference"
    return Verdict(exercise, text is None, text or "passed")


def grade(jobs: List[Dict[str, Source]]) -> List[Verdict]:
    """Every job graded in one world of WORLD ranks, against the library's run (job 0)."""
    ranks = run_world(rank_jobs, WORLD, jobs, lead=1)
    if any("state" not in r[0] for r in ranks):
        lost = next(r[0] for r in ranks if "state" not in r[0])
        text = f"the library's run failed: {lost.get('lost') or lost.get('error')}"
        return [Verdict(next(iter(job)), False, text) for job in jobs]
    refs = [r[0] for r in ranks]
    verdicts = []
    for i, job in enumerate(jobs, start=1):
        (exercise, _), = job.items()
        runs = [r[i] for r in ranks]
        verdicts.append(diagnose(exercise, runs, refs[0]))
    return verdicts


def solution_jobs() -> List[Dict[str, Source]]:
    return [{name: (LIBRARY, name)} for name in EXERCISES]


def exercise_jobs(path: str) -> List[Dict[str, Source]]:
    return [{name: (path, name)} for name in EXERCISES]
