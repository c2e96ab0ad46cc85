"""Grading chapter 06's exercises (examples/exercises/06_expert_parallel.py) on 4 gloo ranks.

Each job trains chapter 06's run (examples/configs/06_expert_parallel.yaml: 4 experts, top-2,
ep 2, so 2 local experts per rank) on ``WORLD`` = 4 ranks, dp 4 = ep 2 x edp 2: the ep group
the functions are given is not the world (a function that uses the world, or None, fails), for
``STEPS`` steps with the learner's function in place of
scaletorch/parallel/expert_parallel.py's. Every call of it is checked at once against the
library's function on the same inputs (ledger paused): the rows it returns (how many, which,
in which order) and whether they carry a gradient. The ranks agree on the verdict by one
all-reduce over the world, so all stop the job together and the next job starts in step. A job
whose every call matched is then compared with the library's run in the same world (job 0):
losses, grad norms and final weights. Then the function is called on tables of the grader's
own (``COUNTS``: uneven, some zero, a rank that sends nothing to one expert) and its rows and the
gradient it sends back for a random output gradient (not all ones) are compared with the
library's, forward first. Split sizes the ranks disagree on are told before gloo sees them
(expert_splits.py).
"""

import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from scaletorch.dist import comm, destroy_pg_manager, get_ledger, init_pg_manager_from_config
from scaletorch.dist.all_to_all import all_to_all
from scaletorch.models import build_model, loss_fn
from scaletorch.parallel import expert_parallel
from scaletorch.parallel.expert_parallel import (ExpertParallel, by_local_expert,
                                                 expert_parallel_clip_grad_norm, shard_experts)
from scaletorch.parallel.step import make_data_parallel_step
from scaletorch.trainer import Config, Trainer, parse_args
from scripts.grading.expert_splits import SplitSizes, agreed_splits
from scripts.grading.learner import Source, caused_by, innermost, load, patched
from scripts.grading.runner import collective_timeout, run_jobs, run_world, streamed
from scripts.grading.verdicts import Verdict, error_verdict

CHAPTER = "06"
EXERCISES = ("dispatch_tokens", "combine_tokens")
LIBRARY = "scaletorch.parallel.expert_parallel"
WORLD = 4  # dp 4 = ep 2 x edp 2: the ep group is half the world
AGAINST = "the library's run"  # what the jobs are compared with
STEPS = 3
# A learner's dispatch and combine only move rows: the same numbers as the library's, so the
# runs are equal; 1e-6 leaves room for another summation order in a learner's regrouping.
TOL = 1e-6
# The probe's tables, COUNTS[i][j][l]: rows ep rank i sends to local expert l of ep rank j
# (ep 2, 2 local experts): uneven, and none to ep rank 0's expert 1 from rank 0, to its expert
# 0 from rank 1, to ep rank 1's expert 0 from rank 1 (a code that assumes rows for every pair
# of rank and expert, or equal counts, fails).
COUNTS = [[[3, 0], [2, 5]], [[0, 4], [0, 1]]]
PROBE_WIDTH = 6  # h of the probe's rows
PROBE = "with the grader's tables (uneven counts, some zero)"
RIGHT, ROWS, NO_GRAD, ORDER, FOREIGN = range(5)  # what a call returned, in order of priority
UNDONE, TWICE = 1, 2  # combine_tokens's rows went back as given, or regrouped a second time
UNDO_SEEN = {  # what combine_tokens's wrong rows were, by _undo_seen
    0: ": neither the rows as given nor in by_local_expert's order again; each rank's rows go "
    "back in source-rank order",
    UNDONE: ": undo the regrouping by local expert before the all-to-all back, so each rank's "
    "rows go home",
    TWICE: ": the rows went back in by_local_expert's order, the regrouping applied a second "
    "time; undo it with its inverse (torch.argsort of that order)",
}

ARRIVED, INVERSE = 1, 2  # dispatch_tokens's rows: as they arrived, by the inverse of the order
ARRIVAL_SEEN = {  # which order dispatch_tokens's rows were in, by _arrival_seen (bits)
    0: ": neither in the order they arrived (by source rank) nor in the inverse of "
    "by_local_expert's; expert 0's rows first, each expert's in source-rank order",
    ARRIVED: ": they are in the order they arrived, by source rank; regroup them, expert 0's "
    "rows first",
    INVERSE: ": they were regrouped by the inverse of by_local_expert's order "
    "(received[torch.argsort(order)]); index the received rows with the order itself",
    ARRIVED | INVERSE: ": here the order they arrived in (by source rank) and the inverse of "
    "by_local_expert's order are the same; regroup them, expert 0's rows first",
}


class WrongRows(Exception):
    """Raised on every rank when a call's rows differ from the library's on some rank."""


def _compare(got: torch.Tensor, want: torch.Tensor, needs_grad: bool) -> int:
    """RIGHT, or what differs: the row count, the gradient, the order only, the rows."""
    if got.shape != want.shape:
        return ROWS
    rows, want = got.detach().float(), want.float()
    if not torch.equal(rows, want):
        # the same rows, each as often (a token routed to two local experts comes twice)?
        mine, theirs = (torch.unique(t, dim=0, return_counts=True) for t in (rows, want))
        same = all(torch.equal(a, b) for a, b in zip(mine, theirs))
        return ORDER if same else FOREIGN
    return NO_GRAD if needs_grad and got.grad_fn is None else RIGHT


def _text(exercise: str, code: int, rank: int, got: int, want: int, given: int, when: str,
          undo: int = 0) -> str:
    """The diagnosis of a call that returned ``code`` on ``rank`` (in the learner's terms):
    ``got`` rows for ``want``, from ``given`` rows in. A wrong row count names a cause only
    when the rows returned are the rows given (none crossed), a wrong undo only when
    ``undo`` (_undo_seen) says which order the rows went back in."""
    kept = got == given != want
    texts = {
        ("dispatch_tokens", ROWS):
        f"rank {rank}'s experts got {got} rows {when}, the ranks routed {want} to them" +
        (f": the {given} rows it was given, so none crossed; exchange the tokens with one "
         f"all-to-all over ep, sending send_table's row sums and receiving recv_table's"
         if kept else ""),
        ("dispatch_tokens", NO_GRAD):
        "the dispatched tokens carry no gradient back to the router and attention: "
        "torch.distributed's all-to-all is invisible to autograd; use all_to_all.all_to_all "
        "(its backward is the reverse all-to-all)",
        ("dispatch_tokens", ORDER):
        f"rank {rank}'s experts got the right {want} tokens {when}, but not grouped by "
        f"local expert" + ARRIVAL_SEEN[undo],
        ("dispatch_tokens", FOREIGN):
        f"rank {rank}'s experts got tokens {when} that no rank routed to them",
        ("combine_tokens", ROWS):
        f"combine_tokens returned {got} rows on rank {rank} {when}, for its {want} routed "
        f"rows" +
        (f": send each output back to its token's rank (the all-to-all with the "
         f"dispatch's splits swapped; it returned the {given} rows it was given)" if kept else ""),
        ("combine_tokens", NO_GRAD):
        "the combined outputs carry no gradient back to the experts: torch.distributed's "
        "all-to-all is invisible to autograd; use all_to_all.all_to_all",
        ("combine_tokens", ORDER):
        f"rank {rank} got its tokens' outputs back {when}, in the wrong order: row n "
        f"must be routed row n's output",
        ("combine_tokens", FOREIGN):
        f"rank {rank} got back outputs of other tokens {when}" + UNDO_SEEN[undo],
    }
    return texts[(exercise, code)]


def _undo_seen(x: torch.Tensor, got: torch.Tensor, send_table: List[List[int]],
               recv_table: List[List[int]], group: Any) -> int:
    """combine_tokens returned other tokens' rows: UNDONE if on every rank they are the
    all-to-all back of ``x`` as given (M, h), TWICE if of ``x`` in by_local_expert's order
    again, else 0 (the ranks agree: one all-reduce over the world each)."""
    order = by_local_expert(recv_table, x.device)
    send = [sum(row) for row in send_table]
    recv = [sum(row) for row in recv_table]
    seen = torch.zeros(2)
    for i, rows in enumerate((x, x[order])):
        back = all_to_all(rows.detach(), send, recv, group, "ep")
        seen[i] = float(back.shape == got.shape and torch.equal(back, got.detach().to(back)))
    comm.all_reduce(seen, None)
    world = comm.group_size(None)
    return UNDONE if seen[0] == world else TWICE if seen[1] == world else 0


def _arrival_seen(x: torch.Tensor, got: torch.Tensor, send_table: List[List[int]],
                  recv_table: List[List[int]], group: Any, rank: int) -> int:
    """dispatch_tokens returned the right rows in another order on ``rank``: ARRIVED if they
    are the all-to-all of ``x`` (N, h) as it arrives (source-rank order), INVERSE if that
    indexed by the inverse of by_local_expert's order, both bits, or 0 (one all-to-all over
    ``group`` on every rank, one all-reduce over the world)."""
    send = [sum(row) for row in send_table]
    recv = [sum(row) for row in recv_table]
    arrived = all_to_all(x.detach(), recv, send, group, "ep")
    inverse = arrived[torch.argsort(by_local_expert(recv_table, x.device))]
    seen = torch.zeros(comm.group_size(None), 2)
    for i, rows in enumerate((arrived, inverse)):
        seen[comm.group_rank(None), i] = float(torch.equal(rows, got.detach().to(rows)))
    comm.all_reduce(seen, None)
    return ARRIVED * int(seen[rank, 0]) | INVERSE * int(seen[rank, 1])


def _backward_splits(err: BaseException) -> Optional[str]:
    """The diagnosis of an all-to-all whose split sizes do not fit, raised in a backward (on
    every rank: each rank's rows received and sent differ in number), else None."""
    first = innermost(err)
    frames = traceback.extract_tb(first.__traceback__)
    if "Split sizes" not in str(first) or not any(f.name == "backward" for f in frames):
        return None
    return (f"the backward's all-to-all raised \"{str(first).splitlines()[0]}\" in step "
            f"{get_ledger().step}: the gradients of the rows received from rank i go back to "
            f"rank i, so swap the split sizes in the backward")


def _checked(exercise: str, fn: Callable, library: Callable) -> Callable:
    """``fn`` in the library's place, each call compared with ``library`` on the same inputs;
    the ranks agree on the worst (one all-reduce over the world) and all raise WrongRows."""

    def call(x: torch.Tensor, send_table: List[List[int]], recv_table: List[List[int]],
             group: Any) -> torch.Tensor:
        with agreed_splits(exercise, send_table, recv_table, f"in step {get_ledger().step}"):
            got = fn(x.clone(), send_table, recv_table, group)  # its own input: may work in place
        with torch.no_grad(), get_ledger().paused():  # a check, not training traffic
            want = library(x.detach(), send_table, recv_table, group)
            # (rank, [code, rows returned, rows expected, rows given])
            mine = torch.zeros(comm.group_size(None), 4)
            rank = comm.group_rank(None)
            mine[rank] = torch.tensor(
                [_compare(got, want, x.requires_grad), got.shape[0], want.shape[0], x.shape[0]],
                dtype=torch.float)
            comm.all_reduce(mine, None)
            undo = _undo(exercise, mine, x, got, send_table, recv_table, group)
        codes = [int(c) for c in mine[:, 0].tolist()]
        if any(codes):
            raise WrongRows(_worst(exercise, mine, f"in step {get_ledger().step}", undo))
        return got

    return call


def _worst_rank(mine: torch.Tensor) -> int:
    """The first rank of the worst code of ``mine`` (rank, [code, ...]), -1 if all RIGHT."""
    codes = [int(c) for c in mine[:, 0].tolist()]
    return codes.index(min(c for c in codes if c)) if any(codes) else -1


def _undo(exercise: str, mine: torch.Tensor, x: torch.Tensor, got: torch.Tensor,
          send_table: List[List[int]], recv_table: List[List[int]], group: Any) -> int:
    """_undo_seen when the worst of ``mine`` is combine_tokens's FOREIGN, _arrival_seen when
    it is dispatch_tokens's ORDER (every rank sees the same ``mine``, so all call it or
    none), else 0."""
    r = _worst_rank(mine)
    if exercise == "dispatch_tokens" and r >= 0 and int(mine[r, 0]) == ORDER:
        return _arrival_seen(x, got, send_table, recv_table, group, r)
    if exercise != "combine_tokens" or r < 0 or int(mine[r, 0]) != FOREIGN:
        return 0
    return _undo_seen(x, got, send_table, recv_table, group)


def _worst(exercise: str, mine: torch.Tensor, when: str, undo: int = 0) -> str:
    """The diagnosis of the worst code of ``mine`` (rank, [code, rows returned, expected])."""
    r = _worst_rank(mine)
    return _text(exercise, int(mine[r, 0]), r, int(mine[r, 1]), int(mine[r, 2]), int(mine[r, 3]),
                 when, undo)


def _probe(exercise: str, fn: Callable, library: Callable, pgm: Any) -> Optional[str]:
    """``fn`` and ``library`` called on the same rows with ``COUNTS``'s tables over the ep
    group, and their backward with the same random output gradient: the diagnosis of the first
    difference (the ranks agree on it: one all-reduce over the world each), None if none."""
    me, ep = pgm.expert_model_parallel_rank, pgm.expert_model_parallel_world_size
    send = COUNTS[me]
    recv = [COUNTS[i][me] for i in range(ep)]
    rows_in = sum(map(sum, send if exercise == "dispatch_tokens" else recv))
    gen = torch.Generator().manual_seed(60 + pgm.rank)
    x = torch.randn(rows_in, PROBE_WIDTH, generator=gen)
    mine_x, lib_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    with agreed_splits(exercise, send, recv, PROBE):
        got = fn(mine_x.clone(), send, recv, pgm.expert_model_parallel_group)
    with get_ledger().paused():
        want = library(lib_x, send, recv, pgm.expert_model_parallel_group)
    world, rank = comm.group_size(None), comm.group_rank(None)
    mine = torch.zeros(world, 4)
    mine[rank] = torch.tensor([_compare(got, want, True), got.shape[0], want.shape[0], rows_in],
                              dtype=torch.float)
    comm.all_reduce(mine, None)
    if mine[:, 0].any():
        with get_ledger().paused():
            undo = _undo(exercise, mine, x, got, send, recv, pgm.expert_model_parallel_group)
        return _worst(exercise, mine, PROBE, undo)
    grad = torch.randn(want.shape, generator=gen)
    got.backward(grad)
    with get_ledger().paused():
        want.backward(grad)
    assert mine_x.grad is not None and lib_x.grad is not None
    off_rows = ((mine_x.grad - lib_x.grad).abs().amax(1) > TOL * lib_x.grad.abs().max())
    norms = torch.zeros(world, 4)  # (rank, [rows off, first row off, norm ratio, rows])
    ratio = float(mine_x.grad.norm() / lib_x.grad.norm()) if lib_x.grad.norm() else 1.0
    first = int(off_rows.nonzero()[0, 0]) if off_rows.any() else -1
    norms[rank] = torch.tensor([float(off_rows.sum()), first, ratio, rows_in])
    comm.all_reduce(norms, None)
    bad = [r for r in range(world) if norms[r, 0] > 0]
    if not bad:
        return None
    r = bad[0]
    return (f"{exercise} returns the library's rows {PROBE}, but the gradient it sends back "
            f"for a random output gradient differs on rank {r} in {int(norms[r, 0])} of "
            f"{int(norms[r, 3])} rows (from row {int(norms[r, 1])}; its norm "
            f"{float(norms[r, 2]):.4g}x the library's): its backward must be the reverse "
            f"all-to-all and nothing more")


def config() -> Config:
    cfg = parse_args(
        ["--config", "examples/configs/06_expert_parallel.yaml", "--steps",
         str(STEPS)])
    cfg.logging.progress = False
    return cfg


def _train(cfg: Config, pgm: Any) -> Dict[str, Any]:
    model = ExpertParallel(shard_experts(build_model(cfg.model, seed=cfg.training.model_seed), pgm),
                           pgm)
    step = make_data_parallel_step(model, cfg.data.num_micro_batches, pgm.data_parallel_rank,
                                   pgm.data_parallel_world_size, pgm.gradient_sync_group, loss_fn)
    result = Trainer(cfg, model, pgm, device=torch.device("cpu"), forward_backward=step,
                     clip_grad_norm=expert_parallel_clip_grad_norm(model,
                                                                   pgm), verbose=False).train()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": result.losses, "grad_norms": result.grad_norms, "state": state}


def rank_jobs(rank: int, world: int, jobs: List[Dict[str, Source]]) -> List[Dict[str, Any]]:
    """Inside a rank: the library's run (the reference), then each job, checked call by call."""
    cfg = config()
    pgm = init_pg_manager_from_config(cfg.parallel, collective_timeout())

    def measure(exercise: str, source: Source) -> Dict[str, Any]:
        checked = _checked(exercise, load(source), getattr(expert_parallel, exercise))
        try:
            with patched([(expert_parallel, exercise, checked)]):
                run = _train(cfg, pgm)
            library = getattr(expert_parallel, exercise)
            return {**run, "probe": _probe(exercise, load(source), library, pgm)}
        except Exception as err:  # noqa: B902 - run_jobs reports what this cannot name
            wrong = caused_by(err, WrongRows) or caused_by(err, SplitSizes)
            text = str(wrong) if wrong is not None else _backward_splits(err)
            if text is None:
                raise
            return {"wrong": text}  # every rank raised it at the same call

    try:
        out = streamed()
        out.append({"exercise": "the library", **_train(cfg, pgm)})
        run_jobs(jobs, measure)  # appends to the same stream
        return out
    finally:
        destroy_pg_manager()


def parity_diagnosis(exercise: str, runs: List[Dict[str, Any]],
                     refs: List[Dict[str, Any]]) -> Optional[str]:
    """Every call matched the library's: the run must too. Each step's grad norm (before
    clipping) first, where a wrong backward shows before the weights move, then losses and
    weights; None if all match."""
    for rank, (run, ref) in enumerate(zip(runs, refs)):
        for step, (norm, want) in enumerate(zip(run["grad_norms"], ref["grad_norms"])):
            if not abs(norm - want) <= TOL * want:
                return (f"{exercise} returns the library's rows, but step {step}'s gradient "
                        f"norm is {norm / want:.4g}x the reference's on rank {rank}: its "
                        f"backward must be the reverse all-to-all and nothing more")
        pairs: List[Tuple[str, float]] = [
            ("loss", max(abs(a - b) for a, b in zip(run["losses"], ref["losses"]))),
            ("weights",
             max(float((run["state"][k] - v).abs().max()) for k, v in ref["state"].items())),
        ]
        for what, off in pairs:
            if not off <= TOL:
                return (f"{exercise} returns the library's rows, but rank {rank}'s {what} ends "
                        f"{off:.1e} off the reference after {STEPS} steps")
    return None


def grade(jobs: List[Dict[str, Source]]) -> List[Verdict]:
    """Every job graded in one world of WORLD ranks, against the library's run (job 0)."""
    ranks = run_world(rank_jobs, WORLD, jobs, lead=1)
    if any("losses" not in r[0] for r in ranks):
        lost = next(r[0] for r in ranks if "losses" not in r[0])
        text = f"the library's run failed: {lost.get('lost') or lost.get('error')}"
        return [Verdict(next(iter(job)), False, text) for job in jobs]
    refs = [r[0] for r in ranks]
    verdicts = []
    for i, job in enumerate(jobs, start=1):
        (exercise, _), = job.items()
        runs = [r[i] for r in ranks]
        failed = error_verdict(exercise, runs)
        if failed is not None:
            verdicts.append(failed)
            continue
        text = runs[0]["wrong"] if "wrong" in runs[0] else \
            parity_diagnosis(exercise, runs, refs) or runs[0]["probe"]
        verdicts.append(Verdict(exercise, text is None, text or "passed"))
    return verdicts


def solution_jobs() -> List[Dict[str, Source]]:
    return [{name: (LIBRARY, name)} for name in EXERCISES]


def exercise_jobs(path: str) -> List[Dict[str, Source]]:
    return [{name: (path, name)} for name in EXERCISES]
