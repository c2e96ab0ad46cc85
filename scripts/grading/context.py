"""Grading chapter 05's exercises (examples/exercises/05_context_parallel.py) on 2 gloo ranks.

Each job trains chapter 05's run (examples/configs/05_context_parallel.yaml: ring attention,
cp 2, zigzag) for ``STEPS`` steps with the learner's function called in place of
scaletorch/parallel/ring_attention.py's. Each call is compared on its rank with the library's
on the same inputs, and the run goes on with the library's answer: every rank stays in step
whatever the learner returned, and the first call that differs is the diagnosis.
``ring_forward`` communicates: every rank runs the learner's call, then the library's, and the
K/V messages the learner's sent are counted (the ledger). ``merge`` is also given one probe
before the run: two tiles whose log-sum-exps (100 and 90) overflow fp32 once exponentiated.
"""

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from scaletorch.dist import comm, destroy_pg_manager, get_ledger, init_pg_manager_from_config
from scaletorch.models import build_model, loss_fn
from scaletorch.parallel import context_parallel, ring_attention
from scaletorch.parallel.context_parallel import apply_context_parallel, make_sequence_sharder
from scaletorch.parallel.data_parallel import apply_data_parallel
from scaletorch.parallel.step import make_data_parallel_step
from scaletorch.trainer import Config, Trainer, parse_args
from scripts.grading.runner import (Source, Verdict, cloned, collective_timeout, grade_found, load,
                                    patched, run_jobs)
from scripts.grading.traffic import observed

CHAPTER = "05"
EXERCISES = ("slice_ids", "merge", "ring_forward")
LIBRARY = "scaletorch.parallel.ring_attention"
WORLD = 2
AGAINST = "the library's calls"  # what the jobs are compared with
STEPS = 2
# merge in fp32: the library's logaddexp and a learner's max-shifted exps differ by a few
# roundings of values of order 1 (eps 1.2e-7 each); a wrong weight is off by far more.
RTOL, ATOL = 1e-5, 1e-6
PROBE_LSE = (100.0, 90.0)  # e^100 > 3.4e38, fp32's largest: only a shifted merge survives


def slice_ids_diagnosis(args: Tuple, got: Any, want: Tuple[int, int]) -> Optional[str]:
    """What is wrong with one slice_ids call's answer, None if right."""
    rank, size = args[0], args[1]
    if tuple(got) == want:
        return None
    call = f"slice_ids({rank}, {size})"
    if any(not 0 <= c < 2 * size for c in got):
        return (f"{call} returned {tuple(got)}: there are 2 x {size} = {2 * size} slices, "
                f"numbered 0 to {2 * size - 1}")
    if sorted(got) == list(want):
        return (f"{call} returned {tuple(got)}: give the two slices in sequence order, {want} "
                f"(the rank's tokens are concatenated in that order)")
    if tuple(got) == (2 * rank, 2 * rank + 1):
        return (f"{call} returned {tuple(got)}, the contiguous split: zigzag pairs slice r with "
                f"slice 2P-1-r, {want}, so every rank does the same causal work")
    return f"{call} returned {tuple(got)}, the library {want}"


def merge_diagnosis(args: Tuple, got: Any, want: Tuple[torch.Tensor, torch.Tensor],
                    step: int) -> Optional[str]:
    """What is wrong with one merge call's answer, None if right."""
    out, lse = got
    close = lambda a, b: torch.allclose(a.float(), b, rtol=RTOL, atol=ATOL)  # noqa: E731
    if close(out, want[0]) and close(lse, want[1]):
        return None
    if close(out, want[0]):
        return ("merge's output matches, its lse does not: return the merged log-sum-exp, "
                "log(e^lse + e^tile_lse) (torch.logaddexp), which the next tile merges with")
    if close(out, (args[0] + args[2]) / 2):
        return ("merge averaged the two tiles' outputs: weight each by its share of the "
                "softmax mass, exp(its lse - the merged lse)")
    off = float((out.float() - want[0]).abs().max())
    return f"merge's output is {off:.1e} off the library's in step {step}"


def ring_forward_diagnosis(args: Tuple, got: Any, want: Tuple[torch.Tensor, torch.Tensor],
                           sent: int, needed: int, step: int) -> Optional[str]:
    """What is wrong with one ring_forward call, None if right. ``sent``: the elements it sent
    over cp (any API, any message order or split), ``needed``: the library's."""
    group = args[2]
    cp, rank = comm.group_size(group), comm.group_rank(group)
    where = f"on rank {rank} in step {step}"
    if sent == 0:
        return (f"ring_forward sent no K/V message {where}: at each of the first N - 1 = {cp - 1} "
                f"steps post the send to rank r + 1 and the receive from r - 1 (_exchange)")
    if sent != needed:
        return (f"ring_forward sent {sent / (needed / (cp - 1)):.2g} blocks of K/V {where} "
                f"({sent:,} elements), the ring needs N - 1 = {cp - 1} ({needed:,})")
    out, lse = got
    close = lambda a, b: torch.allclose(a.float(), b, rtol=RTOL, atol=ATOL)  # noqa: E731
    if close(out, want[0]) and close(lse, want[1]):
        return None
    gap = lse.float() - want[1]  # more keys, a larger log-sum-exp
    if float(gap.max()) <= ATOL:
        return (f"ring_forward's log-sum-exp is below the library's {where}, by up to "
                f"{-float(gap.min()):.2f}: its queries saw fewer keys than their causal past; "
                f"merge every tile into the running (out, lse)")
    if float(gap.min()) >= -ATOL:
        return (f"ring_forward's log-sum-exp is above the library's {where}, by up to "
                f"{float(gap.max()):.2f}: its queries saw keys after them; skip the tiles "
                f'ring_schedule marks "skipped"')
    off = float((out.float() - want[0]).abs().max())
    return f"ring_forward's output is {off:.1e} off the library's {where}"


def probe_merge(fn: Callable) -> Optional[str]:
    """Two tiles of one query whose lse overflow fp32 when exponentiated: the diagnosis if
    the merge is not finite (a wrong finite answer is left to the run's calls)."""
    lse, tile_lse = (torch.full((1, 1, 1), v) for v in PROBE_LSE)
    out, tile_out = torch.ones(1, 1, 1, 2), torch.zeros(1, 1, 1, 2)
    got, new_lse = fn(out, lse, tile_out, tile_lse)
    if bool(torch.isfinite(got).all()) and bool(torch.isfinite(new_lse).all()):
        return None
    want = 1 / (1 + math.exp(PROBE_LSE[1] - PROBE_LSE[0]))
    return (f"merging tiles with lse {PROBE_LSE[0]:.0f} and {PROBE_LSE[1]:.0f} gave "
            f"{float(got[0, 0, 0, 0])}, not {want:.6f}: e^100 overflows fp32; weight by "
            f"exp(lse - the merged lse), every exponent <= 0")


def _checked(exercise: str, fn: Callable, library: Callable, found: List[str]) -> Callable:
    """``fn`` called in the library's place; its first wrong answer's diagnosis goes to
    ``found``; the library's answer is returned, so the ranks stay in step."""

    def call(*args: Any) -> Any:
        ledger = get_ledger()
        # every rank: the learner's call on inputs of its own, then the library's; the K/V
        # messages sent are counted where they reach a process group, whatever API sent them
        with observed() as traffic:
            got = fn(*cloned(args))
        with observed() as reference:
            want = library(*args)
        sent, needed = (sum(c.elements for c in t.select("send")) for t in (traffic, reference))
        if not found:
            if exercise == "slice_ids":
                text = slice_ids_diagnosis(args, got, want)
            elif exercise == "merge":
                text = merge_diagnosis(args, got, want, ledger.step)
            else:
                text = ring_forward_diagnosis(args, got, want, sent, needed, ledger.step)
            if text is not None:
                found.append(text)
        return want

    return call


def config() -> Config:
    cfg = parse_args(
        ["--config", "examples/configs/05_context_parallel.yaml", "--steps",
         str(STEPS)])
    cfg.logging.progress = False
    return cfg


def _train(cfg: Config, pgm: Any) -> None:
    p = cfg.parallel
    model = build_model(cfg.model, seed=cfg.training.model_seed)
    apply_context_parallel(model, pgm, p.cp_variant, kernel=p.cp_attention)
    wrapped = apply_data_parallel(model, pgm, p.impl, p.bucket_size_mb)
    step = make_data_parallel_step(wrapped, cfg.data.num_micro_batches, pgm.data_parallel_rank,
                                   pgm.data_parallel_world_size, pgm.gradient_sync_group, loss_fn,
                                   shard_sequence=make_sequence_sharder(pgm, cfg.data.seq_len))
    Trainer(cfg, wrapped, pgm, device=torch.device("cpu"), forward_backward=step,
            verbose=False).train()


def rank_jobs(rank: int, world: int, jobs: List[Dict[str, Source]]) -> List[Dict[str, Any]]:
    """Inside a rank: each job, its calls checked one by one."""
    cfg = config()
    pgm = init_pg_manager_from_config(cfg.parallel, collective_timeout())

    def measure(exercise: str, source: Source) -> Dict[str, Any]:
        found: List[str] = []
        fn = load(source)
        if exercise == "merge":
            probed = probe_merge(fn)
            found.extend([probed] if probed is not None else [])
        checked = _checked(exercise, fn, getattr(ring_attention, exercise), found)
        owners = [ring_attention] + ([context_parallel] if exercise == "slice_ids" else [])
        with patched([(owner, exercise, checked) for owner in owners]):
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
