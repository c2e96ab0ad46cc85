"""Grading chapter 03's exercises (examples/exercises/03_tensor_parallel.py) on 4 gloo ranks.

Each job trains chapter 03's run (examples/configs/03_tensor_parallel.yaml) at tp 2 x dp 2 for
``STEPS`` steps, without and then with sequence parallel, with the learner's function called
beside the library's: ``enter_region`` (f, or g under sequence parallel) and ``exit_region``
(f-bar, or g-bar) get the same input in forward and the same output gradient in backward, so
the forward and the backward are each compared; ``vocab_parallel_cross_entropy`` gets the same
logits, and its loss and gradient are compared. The tp group is not the world: a function that
communicates over the world (``dist.get_world_size()``, no group) sums or gathers the other dp
replica's data too, and each call is also compared with the library's over the world, to say
so. The run goes on with the library's answer, so the ranks stay in step whatever the learner
returned; the first difference is the diagnosis. The ranks agree by one all-reduce over the
world whether to go on to sequence parallel. The cross-entropy is first given probes: fp32 and
bf16 logits (its loss is fp32 whatever they are), logits near 100 (exp overflows fp32), targets
in one rank's shard at a time, shards whose largest logits differ, and an output gradient of
``GRAD_OUTPUT``, not 1 (a backward must scale by it) (tensor_probes.py gives the first two).
A region that passed is then given the dp groups, whose ranks are not blocks of the world
(tensor_groups.py: a chunk taken by the world rank modulo the group's size fails there).
"""

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from scaletorch.dist import comm, destroy_pg_manager, init_pg_manager_from_config
from scaletorch.dist.split_regions import split_along_dim
from scaletorch.models import build_model
from scaletorch.parallel import tensor_parallel, tensor_parallel_layers
from scaletorch.parallel.data_parallel import apply_data_parallel
from scaletorch.parallel.tensor_parallel import (apply_tensor_parallel,
                                                 tensor_parallel_clip_grad_norm,
                                                 tensor_parallel_loss_fn)
from scaletorch.trainer import Config, Trainer, parse_args
from scripts.grading.learner import Source, load, patched
from scripts.grading.runner import collective_timeout, run_jobs
from scripts.grading.tensor_groups import probe_strided
from scripts.grading.tensor_probes import close, dtype_off, probe, ranks_off
from scripts.grading.verdicts import Verdict, grade_found

CHAPTER = "03"
EXERCISES = ("enter_region", "exit_region", "vocab_parallel_cross_entropy")
LIBRARY = "scaletorch.parallel.tensor_parallel_layers"
WORLD = 4  # tp 2 x dp 2: the tp group the functions are given is not the world
AGAINST = "the library's calls"  # what the jobs are compared with
STEPS = 2
# the probe's output gradient: a backward that ignores it returns 1 / GRAD_OUTPUT times the
# gradient, a factor no other mistake of the probe gives (the token count is 8)
GRAD_OUTPUT = 0.375
LIBRARY_FNS = {e: getattr(tensor_parallel_layers, e) for e in EXERCISES}  # before any patch
NAMES = {
    ("enter_region", False): "f",
    ("enter_region", True): "g",
    ("exit_region", False): "f-bar",
    ("exit_region", True): "g-bar"
}


def _ratio(got: torch.Tensor, want: torch.Tensor) -> Optional[float]:
    """r if got = r x want (a factor the learner's mistake multiplied by), else None."""
    if got.shape != want.shape or float(want.abs().max()) == 0.0:
        return None
    r = float((got * want).sum() / (want * want).sum())
    return r if close(got, r * want) else None


def _over_world(op: str, what: str, group: Any) -> str:
    return (f"{op}'s {what} equals the same operation over the whole world "
            f"({dist.get_world_size()} ranks), not over the tp group it is given "
            f"({comm.group_size(group)} ranks): communicate over ``group``, and take sizes "
            f"and ranks from it")


def forward_text(exercise: str, sp: bool, x: torch.Tensor, got: torch.Tensor, want: torch.Tensor,
                 group: Any, world: Optional[torch.Tensor] = None) -> Optional[str]:
    """What is wrong with one call's forward, None if right. ``world``: the library's answer
    over the whole world (a group that is not the tp group)."""
    op = NAMES[(exercise, sp)]
    if close(got, want):
        return None
    if world is not None and not close(world, want) and close(got, world):
        return _over_world(op, "forward", group)
    if got.shape != want.shape:
        what = "all-gather" if exercise == "enter_region" else "reduce-scatter"
        return (f"{op} returned {tuple(got.shape)} for an input {tuple(x.shape)}, the library "
                f"{tuple(want.shape)}: {what} the sequence, dim 1 of (b, s, h)")
    if exercise == "exit_region" and close(got, split_along_dim(x, 1, group) if sp else x):
        return (f"{op} returned this rank's own partial output: sum the row-parallel shards' "
                f"outputs over tp ({'reduce-scatter' if sp else 'all-reduce'})")
    r = _ratio(got, want)
    if r is not None and exercise == "enter_region":
        return (f"{op}'s forward returned {r:.2f}x its input: f is the identity in forward; "
                f"its all-reduce belongs to the backward")
    if r is not None:
        return (f"{op}'s forward is {r:.2f}x the library's: sum the partial outputs over tp, "
                f"do not average them")
    return f"{op}'s forward is {float((got - want).abs().max()):.1e} off the library's"


def backward_text(exercise: str, sp: bool, dy: torch.Tensor, got: Optional[torch.Tensor],
                  want: torch.Tensor, group: Any,
                  world: Optional[torch.Tensor] = None) -> Optional[str]:
    """What is wrong with one call's backward (its forward was right), None if right."""
    op = NAMES[(exercise, sp)]
    if got is None:
        return (f"{op}'s output carries no gradient back: torch.distributed's collectives are "
                f"invisible to autograd, so write a torch.autograd.Function")
    if close(got, want):
        return None
    if world is not None and not close(world, want) and close(got, world):
        return _over_world(op, "backward", group)
    if exercise == "enter_region" and close(got, split_along_dim(dy, 1, group) if sp else dy):
        if sp:
            return ("g's backward kept this rank's chunk of the gradient without summing it: "
                    "reduce-scatter it over tp (sum the ranks' partial gradients, then split)")
        return ("loss matches, gradients do not: f's backward must all-reduce, not copy (every "
                "rank's shard used x, so dx is the sum of their partial gradients)")
    r = _ratio(got, want)
    if r is not None and exercise == "exit_region":
        return (f"{op}'s forward matches, its backward returned {r:.2f}x the gradient: every "
                f"rank already holds the whole output gradient, so {op}'s backward "
                f"{'all-gathers it' if sp else 'is the identity'}")
    if r is not None:
        return (f"{op}'s backward gradient is {r:.2f}x the library's: sum the ranks' partial "
                f"gradients over tp, do not average them")
    return f"{op}'s backward is {float((got - want).abs().max()):.1e} off the library's"


class _Compared(torch.autograd.Function):
    """The library's region operator in the run, the learner's beside it on the same input
    and, in backward, on the same output gradient; the first difference goes to ``found``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fn: Callable, exercise: str, group: Any, sp: bool,
                found: List[str]) -> torch.Tensor:
        library = LIBRARY_FNS[exercise]
        with torch.enable_grad():
            # each its own copy: an in-place f-bar (Megatron's all_reduce(x); return x) is right
            mine, theirs = x.detach().clone().requires_grad_(), x.detach().requires_grad_()
            got, want = fn(mine, group, sp), library(theirs, group, sp)
            # the library over the world, on every rank alike: what a wrong group gives
            other = x.detach().clone().requires_grad_()
            world = library(other, dist.group.WORLD, sp)
        if not found:
            found += [
                t
                for t in [forward_text(exercise, sp, x, got.detach(), want, group, world.detach())]
                if t
            ]
        ctx.graphs, ctx.how = (mine, got, theirs, want, other, world), (exercise, group, sp, found)
        return want.detach().clone()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        (mine, got, theirs, want, other, world), (exercise, group, sp, found) = ctx.graphs, ctx.how
        dx_want, = torch.autograd.grad(want, theirs, dy)
        dx_world = None  # shapes are alike on every rank: each decides the same
        if world.shape == want.shape:
            dx_world, = torch.autograd.grad(world, other, dy.clone())
        dx_got = None  # the same decision on every rank: the learner's backward may communicate
        if got.shape == want.shape and got.requires_grad:
            dx_got, = torch.autograd.grad(got, mine, dy.clone(), allow_unused=True)
        if not found:
            found += [
                t for t in [backward_text(exercise, sp, dy, dx_got, dx_want, group, dx_world)] if t
            ]
        return dx_want, None, None, None, None, None


def probe_cross_entropy(fn: Callable, group: Any, vocab: int) -> Optional[str]:
    """The diagnosis of the first probe the learner's cross-entropy fails, None if none."""
    seen = dtype_off(fn, group, vocab) or ranks_off(fn, group, vocab)
    if seen is not None:
        return seen
    n, gen = comm.group_size(group), torch.Generator().manual_seed(0)
    shard = vocab // n
    logits = torch.randn(2, 4, vocab, generator=gen)
    for r in range(n):  # every shard's largest logit 10: this rank's max is the global max
        logits[..., r * shard] = 10.0
    zeros = torch.zeros(2, 4, dtype=torch.long)
    got, _, want, _ = probe(fn, 100.0 + logits, zeros, group)
    # the library's loss over the world, on every rank alike: what a wrong group gives
    world = LIBRARY_FNS["vocab_parallel_cross_entropy"](
        (100.0 + logits).chunk(n, dim=-1)[comm.group_rank(group)], zeros, dist.group.WORLD)
    if not close(got, want) and close(got, world.detach()):
        return (f"the loss is {float(got):.4f}, not {float(want):.4f}, and equals the library's "
                f"over the whole world ({dist.get_world_size()} ranks), not over the tp group it "
                f"is given ({n} ranks): communicate over ``group``, and take sizes and ranks "
                f"from it")
    # an overflow only if the same logits 100 lower give the right loss; else the later probes
    # say what else is wrong (called on every rank: the ranks call the same collectives)
    low, _, low_want, _ = probe(fn, logits, zeros, group)
    if not bool(torch.isfinite(got)):
        if close(low, low_want):
            return (f"the loss of logits near 100 is {float(got):.4g}, not {float(want):.4f}, "
                    f"and right for the same logits 100 lower: exp(100) overflows fp32; "
                    f"subtract the max over all tp ranks first")
    wrong, ratios = [], []
    for r in range(n):  # every target in rank r's shard
        targets = torch.randint(r * shard, (r + 1) * shard, (2, 4), generator=gen)
        got, _, want, _ = probe(fn, logits, targets, group)
        ratios.append(float(got / want))
        if not close(got, want):
            wrong.append(f"rank {r}'s (ids {r * shard}-{(r + 1) * shard - 1})")
    tokens = zeros.numel()
    if len(wrong) == n and max(ratios) - min(ratios) < 1e-4 * abs(ratios[0]):  # one factor
        k = tokens / ratios[0]
        return (f"the loss is {ratios[0]:.4g}x the library's whatever shard the targets are in" +
                (f": divided by {k:.0f}, not by the {tokens} tokens (b x s)"
                 if abs(k - round(k)) < 1e-3 else ""))
    if wrong:
        return (f"the loss is wrong when the targets are in {' and '.join(wrong)} shard: rank r "
                f"holds the logits of ids [r V/tp, (r+1) V/tp); subtract r V/tp from a target "
                f"id, and add 0 on the ranks that do not hold it")
    targets = torch.randint(0, vocab, (2, 4), generator=gen)
    skewed = logits + 4.0 * torch.arange(vocab).div(shard, rounding_mode="floor")  # max 10 + 4r
    got, _, want, _ = probe(fn, skewed, targets, group)
    if not close(got, want):
        return (f"the loss is right when every rank's largest logit is the same, and "
                f"{float(got):.4f}, not {float(want):.4f}, when they differ: shift by the max "
                f"over all tp ranks (all-reduce MAX), not by this rank's")
    got, _, want, _ = probe(fn, 100.0 + logits, zeros, group)
    if not close(got, want):  # finite, right in the probes above, wrong near 100
        return f"the loss of logits near 100 is {float(got):.6g}, not {float(want):.6f}"
    got, grad, want, want_grad = probe(fn, logits, targets, group, GRAD_OUTPUT)
    if grad is None:
        return "the loss carries no gradient back to the logits: write a torch.autograd.Function"
    r, tokens = _ratio(grad, want_grad), targets.numel()
    head = f"the loss matches; given an output gradient of {GRAD_OUTPUT}, its gradient is"
    if r is not None and abs(r * GRAD_OUTPUT - 1.0) < 1e-3:
        return (f"{head} {r:.2f}x = 1 / {GRAD_OUTPUT} the library's: the backward ignores its "
                f"output gradient; multiply (softmax - one_hot) / {tokens} by it")
    if r is not None and abs(r / tokens - 1.0) < 1e-3:
        return (f"{head} {r:.2f}x the library's: the loss is the mean over the {tokens} tokens, "
                f"so its gradient is (softmax - one_hot) / {tokens}")
    if r is not None and abs(r - 1.0) > 1e-3:
        return f"{head} {r:.2f}x the library's"
    if not close(grad, want_grad):
        return f"{head} {float((grad - want_grad).abs().max()):.1e} off the library's"
    return None


def _cross_entropy_checked(fn: Callable, found: List[str]) -> Callable:
    """The learner's cross-entropy beside the library's on the run's logits; the library's is
    returned, so the ranks stay in step."""
    library = LIBRARY_FNS["vocab_parallel_cross_entropy"]

    def call(logits: torch.Tensor, targets: torch.Tensor, group: Any) -> torch.Tensor:
        mine = logits.detach().clone().requires_grad_()  # its own: it may work in place
        got = fn(mine, targets.clone(), group)
        grad = torch.autograd.grad(got, mine)[0] if got.requires_grad else None
        theirs = logits.detach().requires_grad_()
        want = library(theirs, targets, group)
        want_grad, = torch.autograd.grad(want, theirs)
        if not found and not (close(got, want) and grad is not None and close(grad, want_grad)):
            found.append(f"the loss {float(got):.6f} (the library {float(want):.6f}) or its "
                         f"gradient differs in the run")
        return library(logits, targets, group)

    return call


def config(sp: bool) -> Config:
    args = ["--config", "examples/configs/03_tensor_parallel.yaml", "--steps", str(STEPS)]
    cfg = parse_args(args + (["--sequence-parallel"] if sp else []))
    cfg.logging.progress = False
    return cfg


def _train(cfg: Config, pgm: Any) -> None:
    model = apply_tensor_parallel(build_model(cfg.model, seed=cfg.training.model_seed), pgm,
                                  cfg.parallel.sequence_parallel)
    # dp > 1: chapter 01 around it, as the chapter's script does
    wrapped = apply_data_parallel(model, pgm, cfg.parallel.impl, cfg.parallel.bucket_size_mb) \
        if pgm.data_parallel_world_size > 1 else model
    Trainer(cfg, wrapped, pgm, device=torch.device("cpu"), loss_fn=tensor_parallel_loss_fn(pgm),
            clip_grad_norm=tensor_parallel_clip_grad_norm(model, pgm), verbose=False).train()


def rank_jobs(rank: int, world: int, jobs: List[Dict[str, Source]]) -> List[Dict[str, Any]]:
    """Inside a rank: each job, its calls checked one by one, without then with sp."""
    pgm = init_pg_manager_from_config(config(False).parallel, collective_timeout())
    group = pgm.tensor_model_parallel_group

    def measure(exercise: str, source: Source) -> Dict[str, Any]:
        found: List[str] = []
        fn = load(source)
        if exercise == "vocab_parallel_cross_entropy":
            probed = probe_cross_entropy(fn, group, config(False).model.vocab_size)
            found += [probed] if probed is not None else []
            with patched([(tensor_parallel, exercise, _cross_entropy_checked(fn, found))]):
                _train(config(False), pgm)
            return {"found": found}
        checked = lambda x, g, sp: _Compared.apply(x, fn, exercise, g, sp, found)  # noqa: E731
        for sp in (False, True):
            agreed = torch.tensor(float(bool(found)))
            comm.all_reduce(agreed, op=dist.ReduceOp.MAX)  # every rank goes on, or none
            if agreed.item():
                break
            with patched([(tensor_parallel_layers, exercise, checked)]):
                _train(config(sp), pgm)
        agreed = torch.tensor(float(bool(found)))
        comm.all_reduce(agreed, op=dist.ReduceOp.MAX)
        if not agreed.item():  # the run's tp groups are blocks of ranks: a group that is not
            text = probe_strided(fn, LIBRARY_FNS[exercise], exercise, pgm.data_parallel_group)
            found += [text] if text is not None else []
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
