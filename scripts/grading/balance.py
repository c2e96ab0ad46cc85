"""Grading chapter 06b's exercises (examples/exercises/06b_load_balance.py) on 2 gloo ranks.

Each job trains chapter 06b's run (examples/configs/06b_load_balance.yaml: 4 experts, top-2,
ep 2, the router collapsed onto experts 0 and 1) with the routing bias on, for ``STEPS`` steps,
with the learner's function called in place of scaletorch/parallel/moe_balance.py's. First one
probe on chosen inputs, where each mistake gives another answer; then every call of the run is
compared on its rank with the library's on the same inputs, and the run goes on with the
library's answer (every rank stays in step whatever the learner returned). The first call
that differs is the diagnosis. ``RATE`` is larger than the chapter's, so that the bias turns
the choice of some tokens within the run's few steps.
"""

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from scaletorch.dist import destroy_pg_manager, get_ledger, init_pg_manager_from_config
from scaletorch.models import build_model
from scaletorch.parallel import moe_balance
from scaletorch.parallel.expert_parallel import (ExpertParallel, expert_parallel_clip_grad_norm,
                                                 shard_experts)
from scaletorch.parallel.moe_balance import BiasBalancer, skew_router
from scaletorch.parallel.moe_load import measured_step
from scaletorch.parallel.step import make_data_parallel_step
from scaletorch.trainer import Config, Trainer, parse_args
from scripts.grading.learner import Source, load, patched
from scripts.grading.runner import collective_timeout, run_jobs
from scripts.grading.verdicts import Verdict, grade_found

CHAPTER = "06b"
EXERCISES = ("biased_top_k", "update_bias")
LIBRARY = "scaletorch.parallel.moe_balance"
WORLD = 2
AGAINST = "the library's calls"  # what the jobs are compared with
STEPS = 4
RATE = 0.2  # after 2 steps the cold experts' bias is 0.8 over the hot ones': some tokens turn
HOT = {0: 3.0, 1: 3.0}  # chapter 06b's collapse (its --hot-offset)
# The probe: 4 tokens, 4 experts, k 2, in sixteenths (exact sums). Token 0's k largest of
# probs + bias, {2, 3}, are none of the choices a mistaken rule of RULES makes there, and the
# rules' choices on tokens 0-2 differ pairwise (so at most one rule matches every token).
# Token 3's probs + bias tie at the k-th place (experts 0 and 1): either is right.
PROBE_PROBS = [[1 / 16, 4 / 16, 2 / 16, 9 / 16], [10 / 16, 1 / 16, 2 / 16, 3 / 16],
               [3 / 16, 7 / 16, 4 / 16, 2 / 16], [7 / 16, 5 / 16, 1 / 16, 3 / 16]]
PROBE_BIAS = [-6 / 16, -4 / 16, 4 / 16, -6 / 16]
# mean 3: expert 1 at the mean keeps its bias; the median (2, torch's lower middle) is not it
PROBE_LOAD = [7.0, 3.0, 0.0, 2.0]
# then a mean that is not whole (2.5): a mean floored or rounded to 2 leaves experts 1 and 2 be
PROBE_LOAD_HALF = [3.0, 2.0, 2.0, 3.0]
PROBE_RATE = 0.1
# Other rules of choice a learner may write: (scores whose k largest it takes, what it chose
# by, what to do). A diagnosis names one only when it chose as that rule does on every token.
RULES: List[Tuple[Callable, str, str]] = [
    (lambda p, b: p, "the k largest of probs alone",
     "add the bias to the probabilities before top-k (it is what moves the choice)"),
    (lambda p, b: p - b, "the k largest of probs - bias",
     "add the bias (an underloaded expert's is positive, to win more tokens)"),
    (lambda p, b: b.expand_as(p), "the k largest of the bias alone",
     "add the bias to the probabilities, which keep each token's own preference"),
    (lambda p, b: p * (1 + b), "the k largest of probs x (1 + bias)",
     "add the bias to the probabilities: scaled by it, a rare expert's score hardly moves"),
    (lambda p, b: p * b, "the k largest of probs x bias",
     "add the bias to the probabilities, do not multiply by it"),
    (lambda p, b: -(p + b), "the k smallest of probs + bias",
     "take the k largest (topk's largest=True, the default)"),
]


def _experts(chosen: torch.Tensor) -> List[List[int]]:
    return [sorted(row) for row in chosen.tolist()]


def _consistent(scores: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """(T,) True where row t's chosen experts (k distinct) hold the k largest scores, which
    any tie-break may pick from."""
    k = chosen.size(1)
    distinct = chosen.sort(-1).values.diff(dim=-1).ne(0).all(-1) if k > 1 else \
        torch.ones(len(chosen), dtype=torch.bool)
    mine = scores.gather(-1, chosen).sort(-1, descending=True).values
    return distinct & mine.eq(scores.topk(k, dim=-1).values).all(-1)


def _kind(value: Any) -> str:
    """What a function returned, in a few words: None, a tensor (2, 4), a tuple of 3."""
    if isinstance(value, torch.Tensor):
        return f"one tensor {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        kinds = ", ".join(type(v).__name__ for v in value)
        return f"a {type(value).__name__} of {len(value)}: {kinds}"
    return repr(value) if value is None else type(value).__name__


def _largest(scores: torch.Tensor, k: int) -> str:
    """The k largest of one token's scores (E,), ties said: "experts [1, 3]", or "expert 2 and
    1 of the tied [0, 1]"."""
    kth = scores.topk(k).values[-1]
    above = (scores > kth).nonzero().flatten().tolist()
    tied = (scores == kth).nonzero().flatten().tolist()
    if len(above) + len(tied) == k:
        return f"experts {sorted(above + tied)}"
    return (f"{'experts ' + str(above) + ' and ' if above else ''}{k - len(above)} of the tied "
            f"{tied}")


def _numbers(row: torch.Tensor) -> List[float]:
    return [round(v, 4) for v in row.tolist()]


def top_k_diagnosis(args: Tuple, got: Any, want: Tuple[torch.Tensor, torch.Tensor],
                    when: str) -> Optional[str]:
    """What is wrong with one biased_top_k call's answer (``when``: "the probe" or "step S's
    call"), None if right. A cause is named only when the choices determine it (one rule of
    RULES makes them on every token); otherwise what was chosen, on which token, from what."""
    probs, bias, k = args
    if not (isinstance(got, (tuple, list)) and len(got) == 2
            and all(isinstance(g, torch.Tensor) for g in got)):
        return (f"biased_top_k returned {_kind(got)} in {when}: return (weights, chosen), two "
                f"tensors")
    weights, chosen = got
    if tuple(weights.shape) != tuple(want[0].shape) or tuple(chosen.shape) != tuple(want[1].shape):
        over_tokens = ("; (k, E) is what a top-k over dim 0 (the tokens) returns"
                       if tuple(chosen.shape) == (k, probs.size(-1)) else "")
        return (f"biased_top_k returned weights {tuple(weights.shape)} and chosen "
                f"{tuple(chosen.shape)} in {when}, for probs {tuple(probs.shape)} and k {k}: "
                f"(T, k) each{over_tokens}")
    if chosen.is_floating_point() or chosen.is_complex() or chosen.dtype == torch.bool:
        return (f"biased_top_k returned chosen of dtype {chosen.dtype} in {when}: it returns "
                f"(weights, chosen), chosen the experts' indices (integers)")
    outside = chosen[(chosen < 0) | (chosen >= probs.size(-1))]
    if len(outside):
        return (f"biased_top_k chose expert {int(outside[0])} in {when}, of {probs.size(-1)} "
                f"experts (0 to {probs.size(-1) - 1})")
    p, scores = probs.detach(), (probs + bias).detach()
    right = _consistent(scores, chosen)
    if not bool(right.all()):
        matched = [(what, fix) for rule, what, fix in RULES
                   if bool(_consistent(rule(p, bias), chosen).all())]
        if len(matched) == 1:
            (what, fix), = matched
            # the observation, not a claim on the code: another rule may choose alike here
            return (f"biased_top_k's choices on all {len(p)} tokens of {when} are those of {what}, "
                    f"not of the k largest of probs + bias: {fix}")
        t = int((~right).nonzero()[0])  # the first token it chose wrongly for: what it saw
        return (f"biased_top_k chose experts {_experts(chosen[t:t + 1])[0]} for token {t} in "
                f"{when}: probs {_numbers(p[t])} + bias {_numbers(bias)} = "
                f"{_numbers(scores[t])}, whose k largest are {_largest(scores[t], k)}")
    theirs = p.gather(-1, chosen)  # the chosen experts' probabilities, in the learner's order
    mine = weights.detach()
    # a rounding apart (3e-8: the same probabilities written another way) is the same weights
    if torch.allclose(mine, theirs, rtol=1e-6, atol=1e-7):
        if probs.requires_grad and weights.grad_fn is None:
            return (f"biased_top_k's weights carry no gradient back to the router in {when}: "
                    f"gather them from probs, without detaching")
        return None
    if torch.equal(mine, scores.gather(-1, chosen)):
        return (f"biased_top_k chose the right experts in {when}, but its weights are probs + "
                f"bias: take them from probs (the bias moves the choice, never the output's "
                f"scale)")
    return (f"biased_top_k chose the right experts in {when}, but its weights are not their "
            f"probabilities: largest difference {float((mine - theirs).abs().max()):.3g}")


def update_diagnosis(args: Tuple, got: torch.Tensor, want: torch.Tensor,
                     when: str) -> Optional[str]:
    """What is wrong with one update_bias call (``got``: the bias it left, ``want``: the
    library's), None if right."""
    bias, load, rate = args
    if torch.equal(got, want):
        return None
    if torch.equal(got, bias) and getattr(got, "touched", False):
        return (f"update_bias wrote the bias in place in {when}, but it holds what it held "
                f"before, {[round(v, 3) for v in got.tolist()]}; the rule moves it by "
                f"{[round(v, 3) for v in (want - bias).tolist()]} (a clamp or a reset after "
                f"the step undoes it)")
    if torch.equal(got, bias):
        return (f"update_bias left the bias unchanged in {when}: change it in place "
                f"(bias.add_), the layer keeps that tensor")
    moved, step = got - bias, want - bias
    if torch.allclose(moved, -step):
        return (f"update_bias moved each bias toward the load in {when} (an overloaded "
                f"expert's rose): rate x sign(mean load - load_e)")
    if torch.allclose(moved, rate * (load.mean() - load)):
        return (f"update_bias moved the bias by rate x (mean load - load) in {when}, "
                f"{[round(v, 3) for v in moved.tolist()]}: by rate x its sign, "
                f"{[round(v, 3) for v in step.tolist()]}")
    return (f"update_bias moved the bias by {[round(v, 3) for v in moved.tolist()]} in {when}, "
            f"the rule by {[round(v, 3) for v in step.tolist()]}")


def _call(exercise: str, fn: Callable, args: Tuple) -> Tuple[Any, Any]:
    """(the learner's answer, the library's) on the same inputs, each on copies of them: for
    update_bias, the biases each left."""
    library = LIBRARY_FUNCTIONS[exercise]
    if exercise == "update_bias":
        bias, load, rate = args
        mine, theirs = bias.clone(), bias.clone()
        version = mine._version
        fn(mine, load.clone(), rate)
        mine.touched = mine._version != version  # written in place, whatever it holds now
        library(theirs, load.clone(), rate)
        return mine, theirs
    probs, bias, k = args
    mine = probs.detach().clone().requires_grad_(probs.requires_grad)
    with torch.enable_grad():
        got = fn(mine, bias.clone(), k)
    return got, library(probs.detach(), bias, k)


LIBRARY_FUNCTIONS = {name: getattr(moe_balance, name) for name in EXERCISES}
DIAGNOSES = {"biased_top_k": top_k_diagnosis, "update_bias": update_diagnosis}


def probe(exercise: str, fn: Callable) -> Optional[str]:
    """The learner's function on the chosen inputs, where each mistake answers differently."""
    if exercise == "biased_top_k":
        args: Tuple = (torch.tensor(PROBE_PROBS, requires_grad=True), torch.tensor(PROBE_BIAS), 2)
        got, want = _call(exercise, fn, args)
        return top_k_diagnosis(args, got, want, "the probe")
    for rows, when in ((PROBE_LOAD, "the probe"),
                       (PROBE_LOAD_HALF, f"the probe with load {PROBE_LOAD_HALF} (mean 2.5)")):
        args = (torch.zeros(4), torch.tensor(rows), PROBE_RATE)
        got, want = _call(exercise, fn, args)
        text = update_diagnosis(args, got, want, when)
        if text is not None:
            return text
    return None


def _checked(exercise: str, fn: Callable, found: List[str]) -> Callable:
    """``fn`` beside the library's on each call's inputs; the library's answer goes on."""
    library = LIBRARY_FUNCTIONS[exercise]

    def call(*args: Any) -> Any:
        if not found:
            got, want = _call(exercise, fn, args)
            text = DIAGNOSES[exercise](args, got, want, f"step {get_ledger().step}'s call")
            found.extend([text] if text is not None else [])
        return library(*args)

    return call


def config() -> Config:
    cfg = parse_args(["--config", "examples/configs/06b_load_balance.yaml", "--steps", str(STEPS)])
    cfg.logging.progress = False
    return cfg


def _train(cfg: Config, pgm: Any) -> None:
    """Chapter 06b's run with the bias (its ``build``), on ep 2."""
    model = skew_router(build_model(cfg.model, seed=cfg.training.model_seed), HOT)
    balancer = BiasBalancer(model, RATE)
    model = ExpertParallel(shard_experts(model, pgm), pgm)
    step = make_data_parallel_step(model, cfg.data.num_micro_batches, pgm.data_parallel_rank,
                                   pgm.data_parallel_world_size, pgm.gradient_sync_group)
    Trainer(cfg, model, pgm, device=torch.device("cpu"),
            forward_backward=measured_step(step, balancer.update),
            clip_grad_norm=expert_parallel_clip_grad_norm(model, pgm), verbose=False).train()


def rank_jobs(rank: int, world: int, jobs: List[Dict[str, Source]]) -> List[Dict[str, Any]]:
    """Inside a rank: each job, its probe, then its calls checked one by one."""
    cfg = config()
    pgm = init_pg_manager_from_config(cfg.parallel, collective_timeout())

    def measure(exercise: str, source: Source) -> Dict[str, Any]:
        fn = load(source)
        probed = probe(exercise, fn)
        if probed is not None:
            return {"found": [probed]}
        found: List[str] = []
        with patched([(moe_balance, exercise, _checked(exercise, fn, found))]):
            _train(cfg, pgm)
        return {"found": found}

    try:
        return run_jobs(jobs, measure)
    finally:
        destroy_pg_manager()


def grade(jobs: List[Dict[str, Source]]) -> List[Verdict]:
    """Every job graded in one world of WORLD ranks, each call against the library's."""
    return grade_found(rank_jobs, WORLD, jobs)


def solution_jobs() -> List[Dict[str, Source]]:
    return [{name: (LIBRARY, name)} for name in EXERCISES]


def exercise_jobs(path: str) -> List[Dict[str, Source]]:
    return [{name: (path, name)} for name in EXERCISES]
