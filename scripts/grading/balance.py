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
from scripts.grading.runner import (Source, Verdict, collective_timeout, grade_found, load, patched,
                                    run_jobs)

CHAPTER = "06b"
EXERCISES = ("biased_top_k", "update_bias")
LIBRARY = "scaletorch.parallel.moe_balance"
WORLD = 2
AGAINST = "the library's calls"  # what the jobs are compared with
STEPS = 4
RATE = 0.2  # after 2 steps the cold experts' bias is 0.8 over the hot ones': some tokens turn
HOT = {0: 3.0, 1: 3.0}  # chapter 06b's collapse (its --hot-offset)
# The probe: top-2 of probs + bias is {1, 3}, of probs alone {0, 1}, of probs - bias {0, 2}
PROBE_PROBS = [[0.4, 0.3, 0.2, 0.1]]
PROBE_BIAS = [-0.3, 0.15, 0.0, 0.25]
PROBE_LOAD = [5.0, 3.0, 0.0, 4.0]  # mean 3: expert 1 at the mean keeps its bias
PROBE_RATE = 0.1


def _experts(chosen: torch.Tensor) -> List[List[int]]:
    return [sorted(row) for row in chosen.tolist()]


def _by_expert(weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """weights (T, k) in the order of each row's experts: any order of the k is right."""
    return weights.gather(-1, chosen.argsort(-1))


def top_k_diagnosis(args: Tuple, got: Any, want: Tuple[torch.Tensor, torch.Tensor],
                    when: str) -> Optional[str]:
    """What is wrong with one biased_top_k call's answer (``when``: "the probe" or "step S's
    call"), None if right."""
    probs, bias, k = args
    weights, chosen = got
    if tuple(weights.shape) != tuple(want[0].shape) or tuple(chosen.shape) != tuple(want[1].shape):
        return (f"biased_top_k returned weights {tuple(weights.shape)} and chosen "
                f"{tuple(chosen.shape)} in {when}, for probs {tuple(probs.shape)} and k {k}: "
                f"(T, k) each")
    if _experts(chosen) != _experts(want[1]):
        if _experts(chosen) == _experts(probs.topk(k, dim=-1).indices):
            return (f"biased_top_k chose by probs alone in {when}: add the bias to the "
                    f"probabilities before top-k (it is what moves the choice)")
        if _experts(chosen) == _experts((probs - bias).topk(k, dim=-1).indices):
            return (f"biased_top_k chose by probs - bias in {when}: add the bias (an "
                    f"underloaded expert's is positive, to win more tokens)")
        return (f"biased_top_k chose experts {_experts(chosen)[0]} for token 0 in {when}, the "
                f"k largest of probs + bias are {_experts(want[1])[0]}")
    mine, theirs = _by_expert(weights, chosen).detach(), _by_expert(want[0], want[1]).detach()
    if torch.equal(mine, theirs):
        if probs.requires_grad and weights.grad_fn is None:
            return (f"biased_top_k's weights carry no gradient back to the router in {when}: "
                    f"gather them from probs, without detaching")
        return None
    if torch.equal(mine, _by_expert((probs + bias).gather(-1, want[1]), want[1])):
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
        fn(mine, load.clone(), rate)
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
    else:
        args = (torch.zeros(4), torch.tensor(PROBE_LOAD), PROBE_RATE)
    got, want = _call(exercise, fn, args)
    return DIAGNOSES[exercise](args, got, want, "the probe")


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
