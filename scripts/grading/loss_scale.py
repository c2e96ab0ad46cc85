"""Grading chapter 08's exercises (examples/exercises/08_mixed_precision.py) on 2 gloo ranks.

Each job trains chapter 01's data-parallel run for ``STEPS`` steps with the dynamic loss scale
(init 2^10, growth interval 2) and the learner's function in place of
scaletorch/parallel/loss_scale.py's. The grader plants the overflows a scale must survive, in
the already averaged gradients of one rank: an inf on rank 1 in step 3, a NaN on rank 0 in step
5. It measures each rank's overflow flag, scale and clean-step count after every step, step 0's
unscaled gradients and the final weights, and compares them with the library's run in the same
world (job 0). fp32 compute: the scale's logic is the same as in fp16, and the run is exact.

Then the function is called directly (``PROBES``): unscale_and_check on random gradients with a
non-finite element on one rank only, over the world, over a group of each rank alone (a group
that is not the world: the flag must not cross it) and with ``agree`` False (no collective);
update_scale along flag sequences with growth intervals 1 and 3 (``UPDATE_PROBES``), then from
a scale of 1 (``LOW_PROBE``), each call compared with the library's.
"""

import datetime
import math
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from scaletorch.dist import destroy_pg_manager, get_ledger, init_pg_manager_from_config
from scaletorch.models import build_model, loss_fn, moe_aux_loss
from scaletorch.parallel import loss_scale, mixed_precision
from scaletorch.parallel.data_parallel import apply_data_parallel
from scaletorch.parallel.grad_norm import clip_replicated
from scaletorch.parallel.mixed_precision import DynamicLossScaler, scale_backward
from scaletorch.parallel.step import make_data_parallel_step
from scaletorch.trainer import Config, Trainer, parse_args
from scaletorch.trainer import run as run_module
from scaletorch.trainer import trainer as trainer_module
from scripts.grading.learner import (LEARNER_ERRORS, Source, failure, is_hang, is_unwritten, load,
                                     patched)
from scripts.grading.runner import collective_timeout, run_world, streamed
from scripts.grading.verdicts import Verdict, error_verdict

CHAPTER = "08"
EXERCISES = ("unscale_and_check", "update_scale")
LIBRARY = "scaletorch.parallel.loss_scale"
WORLD = 2
AGAINST = "the library's run"  # what the jobs are compared with
STEPS = 8
INIT_SCALE, GROWTH_INTERVAL = 2.0**10, 2
PLANTED = {3: (1, math.inf, "an inf on rank 1"), 5: (0, math.nan, "a NaN on rank 0")}
WEIGHT_TOL = 1e-6  # the same operations in the same order as the library's run: equal
# The direct calls of unscale_and_check: (what the ranks hold, the group: "world", "alone" (each
# rank in a group of its own) or None (agree False), the rank with the non-finite element or
# -1, its value). The element is the second gradient's fifth, not the first: a check of only
# the first tensor or element misses it.
PROBES: List[Tuple[str, Optional[str], int, float]] = [
    ("finite gradients, group the world", "world", -1, 0.0),
    ("an inf on rank 1 only, group the world", "world", 1, math.inf),
    ("a NaN on rank 0 only, group the world", "world", 0, math.nan),
    ("a -inf on rank 1 only, each rank in a group of its own", "alone", 1, -math.inf),
    ("a NaN on rank 1 only, agree=False", None, 1, math.nan),
]
PROBE_SCALE = 512.0  # a power of 2: g * (1 / s) and g / s are equal, so the check is exact
PROBE_TOL = 1e-6  # relative: room for another way to divide
# update_scale along each sequence of overflow flags, from (PROBE_SCALE, 0): (interval, flags)
UPDATE_PROBES = [(1, [False, False, True, False, True, True, False]),
                 (3, [False, False, False, False, True, False, False, False, False])]
# then from a scale of 1 (FP16 runs can fall below 2): halving by floor division gives 0
LOW_PROBE = (1.0, 2, [True, True, False, False])


def config() -> Config:
    cfg = parse_args(["--config", "examples/configs/01_ddp.yaml", "--steps", str(STEPS)])
    cfg.logging.progress = False
    return cfg


def _train(cfg: Config, pgm: Any, exercise: str, fn: Any, alone: Any) -> Dict[str, Any]:
    model = build_model(cfg.model, seed=cfg.training.model_seed)
    wrapped = apply_data_parallel(model, pgm, "ours", cfg.parallel.bucket_size_mb)
    scaler = DynamicLossScaler(INIT_SCALE, GROWTH_INTERVAL)  # over the world
    step = make_data_parallel_step(wrapped, cfg.data.num_micro_batches, pgm.data_parallel_rank,
                                   pgm.data_parallel_world_size, pgm.gradient_sync_group,
                                   loss_fn=scale_backward(loss_fn, scaler),
                                   aux_loss=scale_backward(moe_aux_loss, scaler))
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
    probes = _probe_unscale(fn, pgm.rank, alone) if exercise == "unscale_and_check" else \
        _probe_update(fn)
    return {"found": found, "scales": scales, "grads": grads, "state": state, "probes": probes}


def _probe_grads(rank: int) -> List[torch.Tensor]:
    """This rank's gradients for the probes: random, scaled, two tensors of other shapes."""
    gen = torch.Generator().manual_seed(80 + rank)
    return [
        PROBE_SCALE * torch.randn(3, 4, generator=gen), PROBE_SCALE * torch.randn(9, generator=gen)
    ]


@torch.no_grad()
def _probe_unscale(fn: Any, rank: int, alone: Any) -> List[Dict[str, Any]]:
    """Each of ``PROBES`` on this rank: the flag returned and the gradients after the call,
    measured against the gradients divided by the scale (the non-finite element left out)."""
    out = []
    for _, where, bad_rank, value in PROBES:
        grads = _probe_grads(rank)
        if rank == bad_rank:
            grads[1][4] = value
        want = [g / PROBE_SCALE for g in grads]
        group = {"world": dist.group.WORLD, "alone": alone, None: None}[where]
        flag = bool(fn(grads, PROBE_SCALE, group, where is not None))
        finite = [torch.isfinite(w) for w in want]
        got_norm = math.sqrt(sum(float(g[f].norm())**2 for g, f in zip(grads, finite)))
        want_norm = math.sqrt(sum(float(w[f].norm())**2 for w, f in zip(want, finite)))
        off = max(
            float(((g - w)[f]).abs().max() / w[f].abs().max())
            for g, w, f in zip(grads, want, finite))
        unchanged = all(
            torch.equal(g[f], (w * PROBE_SCALE)[f]) for g, w, f in zip(grads, want, finite))
        out.append({
            "flag": flag,
            "ratio": got_norm / want_norm,
            "off": off,
            "unchanged": unchanged
        })
    return out


def _probe_update(fn: Any) -> Optional[str]:
    """The first call of ``UPDATE_PROBES`` whose result differs from the library's, said as
    the call and both results; None if none does."""
    for start, interval, flags in [(PROBE_SCALE, *p) for p in UPDATE_PROBES] + [LOW_PROBE]:
        scale, clean = start, 0
        for flag in flags:
            got = fn(scale, clean, flag, interval)
            want = loss_scale.update_scale(scale, clean, flag, interval)
            if (float(got[0]), int(got[1])) != want:
                return (f"update_scale(scale={scale:g}, clean_steps={clean}, found_inf={flag}, "
                        f"growth_interval={interval}) returned ({float(got[0]):g}, "
                        f"{int(got[1])}), the library's ({want[0]:g}, {want[1]})")
            scale, clean = want
    return None


def rank_jobs(rank: int, world: int, jobs: List[Dict[str, Source]]) -> List[Dict[str, Any]]:
    """Inside a rank: the library's run (the reference), then each job, measured."""
    cfg = config()
    pgm = init_pg_manager_from_config(cfg.parallel, collective_timeout())
    timeout = datetime.timedelta(seconds=collective_timeout())
    # every rank makes every group (new_group is collective); each probes with its own
    alone = [dist.new_group([r], timeout=timeout) for r in range(world)][rank]
    out = streamed()
    try:
        for job in [{EXERCISES[0]: (LIBRARY, EXERCISES[0])}] + jobs:
            (exercise, source), = job.items()
            try:
                out.append({
                    "exercise": exercise,
                    **_train(cfg, pgm, exercise, load(source), alone)
                })
            except LEARNER_ERRORS as err:  # a diagnosis, sys.exit() too
                if is_hang(err):
                    raise
                out.append({"exercise": exercise, "error": failure(err)})
                if not is_unwritten(err):
                    break
    finally:
        destroy_pg_manager()
    return out


# (a direct call over the world, one alone) with the same kind of value on one rank (an
# infinity, a NaN; the same element): the holder finds it alone but not over the world only if
# the agreement lost it, not the check
SAME_VALUE = ((1, 3), (2, 4))


def agreement_lost(runs: List[Dict[str, Any]]) -> Optional[str]:
    """What the direct calls show if a rank finds its own non-finite value when it decides
    alone but not when the ranks agree over the world; None otherwise."""
    for world, alone in SAME_VALUE:
        held = lambda k: runs[PROBES[k][2]]["probes"][k]["flag"]  # noqa: E731
        if not held(world) and held(alone):
            return (f"given {PROBES[alone][0]}, rank {PROBES[alone][2]} found it, but given "
                    f"{PROBES[world][0]}, rank {PROBES[world][2]} returned False: the "
                    f"agreement lost it; agree on the flag over group with an all-reduce MAX "
                    f"(any rank's overflow)")
    return None


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
            head = f"step {step}'s gradients held {what}, and unscale_and_check returned {flags[0]}"
            lost = agreement_lost(runs) if ref["found"][step] else None
            if lost:
                return f"{head}; {lost}"
            if not ref["found"][step]:  # an overflow seen where none was: what, not why
                return f"{head} on every rank"
            return f"{head}: look for inf and NaN alike (torch.isfinite)"
    norm = lambda gs: math.sqrt(sum(float(g.norm())**2 for g in gs))  # noqa: E731
    ratio = norm(runs[0]["grads"]) / norm(ref["grads"])
    if abs(ratio - 1) > 1e-4:
        return (f"gradients are {ratio:.4g}x the reference after unscale_and_check (the scale "
                f"was {INIT_SCALE:.0f}): divide them by the scale, once")
    return None


def update_diagnosis(runs: List[Dict[str, Any]], ref: Dict[str, Any]) -> Optional[str]:
    previous, changed = (INIT_SCALE, 0), -1  # the step after which the scale last changed
    for step, ((scale, clean), (want,
                                want_clean)) in enumerate(zip(runs[0]["scales"], ref["scales"])):
        if ref["found"][step] and scale >= previous[0]:
            return (f"the scale stayed {scale:.0f} after the overflow in step {step}: halve it "
                    f"after an overflow")
        if want > previous[0] and scale <= previous[0]:
            return (f"the scale did not double after {GROWTH_INTERVAL} clean steps (step "
                    f"{step}): double it every growth_interval clean steps")
        if scale > previous[0] and want <= previous[0]:
            # too early: a count not reset, or counted or compared off by one; what, then where
            return (f"the scale doubled in step {step}, {step - changed} step(s) after its last "
                    f"change, the reference's did not (it doubles after growth_interval = "
                    f"{GROWTH_INTERVAL} clean steps): look at where the clean steps are counted "
                    f"and compared with growth_interval, and at their reset to 0 after halving "
                    f"or doubling")
        if scale == want and clean != want_clean == 0:
            event = f"the overflow in step {step}" if ref["found"][step] else f"step {step}"
            return (f"after {event} the clean-step count is {clean}, not 0: count the clean "
                    f"steps from 0 again after halving or doubling")
        if (scale, clean) != (want, want_clean):
            return (f"after step {step} the scale is {scale:.0f} with {clean} clean steps, the "
                    f"reference's {want:.0f} with {want_clean}")
        changed = step if scale != previous[0] else changed
        previous = (scale, clean)
    return None


def _ranks(flags: List[bool]) -> str:
    return ", ".join(f"rank {r} {f}" for r, f in enumerate(flags))


def agree_false_missed(runs: List[Dict[str, Any]], k: int) -> str:
    """The holder missed probe ``k``'s value with agree=False, though every probe before it (an
    inf, a NaN, a -inf, with agree=True) was found: the agree=False path skips the check."""
    bad = PROBES[k][2]
    found = [what for what, where, held, _ in PROBES[:k] if held >= 0 and where is not None]
    scaled = [r for r, run in enumerate(runs) if run["probes"][k]["unchanged"]]
    unscaled = (f", and rank{'s' if len(scaled) > 1 else ''} {', '.join(map(str, scaled))} "
                f"got {'their' if len(scaled) > 1 else 'its'} gradients back not divided by "
                f"the scale") if scaled else ""
    return (f": rank {bad}, which holds it, did not find it with agree=False, yet with "
            f"agree=True the check found every one ({'; '.join(found)}){unscaled}: look at "
            f"what unscale_and_check does when agree is False; it unscales and checks every "
            f"gradient whatever agree is, and only the all-reduce of the flag is skipped")


def probe_diagnosis(runs: List[Dict[str, Any]]) -> Optional[str]:
    """What the direct calls of unscale_and_check (``PROBES``) measured: each rank's flag
    against the flag its group should agree on, then its gradients against grads / scale. A
    cause is named only where the flags decide it; None if every call matched."""
    for k, (what, where, bad, _) in enumerate(PROBES):
        flags = [run["probes"][k]["flag"] for run in runs]
        want = [bad >= 0 and (where == "world" or r == bad) for r in range(len(runs))]
        if flags == want:
            continue
        place = " (the second gradient's element 4)" if bad >= 0 else ""
        text = (f"given {what}{place}, unscale_and_check returned {_ranks(flags)}, not "
                f"{_ranks(want)}")
        crossed = [r for r, f in enumerate(flags) if f and not want[r] and bad >= 0]
        if bad < 0:
            return text + ": no gradient held an inf or a NaN"
        if not flags[bad] and agreement_lost(runs):  # it finds it alone: the agreement
            return f"{text}; {agreement_lost(runs)}"
        if not flags[bad] and where is None and k > 0:  # the probes before it all matched
            return text + agree_false_missed(runs, k)
        if not flags[bad]:  # the rank that holds it did not see it
            return text + f": rank {bad}, which holds it, did not find it; look at every " \
                "element of every gradient (torch.isfinite finds inf and NaN alike)"
        if crossed and where == "alone":  # its own gradients were finite: told by another rank
            return (text + f": rank {crossed[0]} learned of rank {bad}'s value beyond the group "
                    f"it was given; agree over group, not the world")
        if crossed:
            return text + ": with agree=False each rank decides alone, no collective"
        if flags[bad] and where == "world":
            return text + f": only rank {bad}, which holds it, found it; agree on the flag " \
                "over group (all-reduce MAX)"
        return text
    for k, (what, _, _, _) in enumerate(PROBES):
        for r, run in enumerate(runs):
            probe = run["probes"][k]
            if probe["off"] > PROBE_TOL:
                if probe["unchanged"]:
                    return (f"given {what}, rank {r}'s gradients came back unchanged: divide "
                            f"them by the scale ({PROBE_SCALE:g}) in place")
                return (f"given {what}, rank {r}'s gradients are {probe['ratio']:.4g}x grads / "
                        f"scale (scale {PROBE_SCALE:g}) after unscale_and_check")
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
    if text is None:
        text = probe_diagnosis(runs) if exercise == "unscale_and_check" else runs[0]["probes"]
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
