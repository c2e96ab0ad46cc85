"""Grading chapter 05's exercises (examples/exercises/05_context_parallel.py) on 3 gloo ranks.

Each job trains chapter 05's run (examples/configs/05_context_parallel.yaml: ring attention,
zigzag) at cp 3 (a ring of 3 ranks, where sending to r - 1 instead of r + 1 is wrong; sequences
of ``SEQ_LEN`` tokens, 2 x 3 slices) for ``STEPS`` steps with the learner's function called in
place of scaletorch/parallel/ring_attention.py's. Each call is compared on its rank with the
library's on the same inputs, and the run goes on with the library's answer: every rank stays
in step whatever the learner returned, and the first call that differs is the diagnosis.
``ring_forward`` communicates: every rank runs the learner's call, then the library's, and the
K/V messages the learner's sent are counted and their peers noted (at the process group). Probes
before or after the run see what it cannot: ``slice_ids`` every rank of 1 to 4 ranks in both
orders, and an unknown order (ValueError); ``merge`` two tiles whose log-sum-exps (100 and 90)
overflow fp32 once exponentiated, and tiles whose outputs and log-sum-exps all differ, so that
any wrong combination shows; ``ring_forward`` the contiguous order on the ring of 3, and both
orders on a ring of ranks 1 and 2 only (its group is not the world, and its ranks are not the
world's: the world's size, rank or group is wrong). A ``ring_forward`` calls the library's
``slice_ids`` and ``merge`` in place of its file's, so each exercise is judged on its own.
Its waits are bounded (ring_waits.py): a rank that never sent is named, then what each waited in.
"""

import datetime
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from scaletorch.dist import comm, destroy_pg_manager, get_ledger, init_pg_manager_from_config
from scaletorch.models import build_model, loss_fn
from scaletorch.parallel import context_parallel, ring_attention
from scaletorch.parallel.context_parallel import apply_context_parallel, make_sequence_sharder
from scaletorch.parallel.data_parallel import apply_data_parallel
from scaletorch.parallel.step import make_data_parallel_step
from scaletorch.trainer import Config, Trainer, parse_args
from scripts.grading.learner import Source, cloned, load, patched
from scripts.grading.ring_waits import bounded, hang_text
from scripts.grading.runner import collective_timeout, run_jobs, run_world
from scripts.grading.traffic import observed
from scripts.grading.verdicts import Verdict, found_verdict

CHAPTER = "05"
EXERCISES = ("slice_ids", "merge", "ring_forward")
LIBRARY = "scaletorch.parallel.ring_attention"
WORLD = 3  # cp 3: a ring of 3 ranks, in which the ring's direction matters
AGAINST = "the library's calls"  # what the jobs are compared with
STEPS = 2
SEQ_LEN = 24  # divisible by 2 x cp = 6 (zigzag's slices)
ORDERS = ("zigzag", "contiguous")
BAD_ORDER = "striped"  # neither: slice_ids raises ValueError
PAIR = [1, 2]  # the probe's ring: its group is not the world, its ranks not the world's
# merge in fp32: the library's logaddexp and a learner's max-shifted exps differ by a few
# roundings of values of order 1 (eps 1.2e-7 each); a wrong weight is off by far more.
RTOL, ATOL = 1e-5, 1e-6
PROBE_LSE = (100.0, 90.0)  # e^100 > 3.4e38, fp32's largest: only a shifted merge survives
LIBRARY_FNS = {e: getattr(ring_attention, e) for e in EXERCISES}  # before any patch


def _zigzag(rank: int, size: int) -> Tuple[int, int]:
    return rank, 2 * size - 1 - rank


def _contiguous(rank: int, size: int) -> Tuple[int, int]:
    return 2 * rank, 2 * rank + 1


def slice_ids_diagnosis(args: Tuple, got: Any, want: Tuple[int, int],
                        seen: Optional[Dict[Tuple, Tuple]] = None) -> Optional[str]:
    """What is wrong with one slice_ids call's answer, None if right. ``seen``: every answer
    the probe saw, {(rank, size, order): answer}; the other order's rule is named only when it
    gives every answer seen for this order (without ``seen``, this call's)."""
    rank, size = args[0], args[1]
    order = args[2] if len(args) > 2 else "zigzag"
    if tuple(got) == want:
        return None
    call = f"slice_ids({rank}, {size}, {order!r})"
    seen = {(rank, size, order): tuple(got)} if seen is None else seen
    mine = {k[:2]: tuple(v) for k, v in seen.items() if k[2] == order}
    # the other order's answer here, if its rule gives every answer seen (else None)
    zigzag, contiguous = ((rule(rank, size) if all(v == rule(*k)
                                                   for k, v in mine.items()) else None)
                          for rule in (_zigzag, _contiguous))
    if any(not 0 <= c < 2 * size for c in got):
        return (f"{call} returned {tuple(got)}: there are 2 x {size} = {2 * size} slices, "
                f"numbered 0 to {2 * size - 1}")
    if sorted(got) == list(want):
        return (f"{call} returned {tuple(got)}: give the two slices in sequence order, {want} "
                f"(the rank's tokens are concatenated in that order)")
    if order == "zigzag" and tuple(got) == contiguous:
        return (f"{call} returned {tuple(got)}, the contiguous split: zigzag pairs slice r with "
                f"slice 2P-1-r, {want}, so every rank does the same causal work")
    if order == "contiguous" and tuple(got) == zigzag:
        return (f"{call} returned {tuple(got)}, zigzag's pair: the order it is given is "
                f"contiguous, two neighbours {want}")
    wrong = sum(v != LIBRARY_FNS["slice_ids"](*k, order) for k, v in mine.items())
    return f"{call} returned {tuple(got)}, the library {want}" + (
        f" (wrong in {wrong} of the {len(mine)} {order!r} calls, 1 to 4 ranks)"
        if len(mine) > 1 else "")


def probe_slice_ids(fn: Callable) -> Optional[str]:
    """Every rank of 1 to 4 ranks in both orders (the run sees only zigzag at cp 3), then an
    unknown order: the first wrong answer's diagnosis, None if none."""
    calls = [(rank, size, order) for size in range(1, 5) for rank in range(size)
             for order in ORDERS]
    seen = {args: tuple(fn(*args)) for args in calls}
    for args in calls:
        text = slice_ids_diagnosis(args, seen[args], ring_attention.slice_ids(*args), seen)
        if text is not None:
            return text
    # the library's callers (zigzag_positions, Ulysses) refuse a misspelt order through it
    call = f"slice_ids(0, 2, {BAD_ORDER!r})"
    try:
        got = fn(0, 2, BAD_ORDER)
    except ValueError:
        return None
    except Exception as err:  # noqa: B902 - any other error is the learner's answer
        return (f"{call} raised {type(err).__name__}: an order other than zigzag or contiguous "
                f"raises ValueError, which the callers expect")
    return (f"{call} returned {got!r}: an order other than zigzag or contiguous raises "
            f"ValueError, or a misspelt order trains with the wrong slices")


def merge_diagnosis(args: Tuple, got: Any, want: Tuple[torch.Tensor, torch.Tensor],
                    when: str) -> Optional[str]:
    """What is wrong with one merge call's answer, None if right; ``when``: "in step 0", or
    the probe's inputs."""
    out, lse = got
    close = lambda a, b: torch.allclose(a.float(), b, rtol=RTOL, atol=ATOL)  # noqa: E731
    if close(out, want[0]) and close(lse, want[1]):
        return None
    if close(out, want[0]):
        return (f"merge's output matches, its lse does not: return the merged log-sum-exp, "
                f"log(e^lse + e^tile_lse) (torch.logaddexp), which the next tile merges with "
                f"({when})")
    a, a_lse, b, b_lse = (t.float() for t in args)
    if close(out, (a + b) / 2):
        return ("merge averaged the two tiles' outputs: weight each by its share of the "
                "softmax mass, exp(its lse - the merged lse)")
    share = torch.exp(a_lse - want[1]).unsqueeze(-1)  # the first tile's share of the mass
    if close(out, (1 - share) * a + share * b):
        return (f"merge weighted each tile's output by the other tile's share ({when}): out "
                f"by exp(lse - the merged lse), tile_out by exp(tile_lse - the merged lse)")
    off = float((out.float() - want[0]).abs().max())
    if close(lse, torch.maximum(a_lse, b_lse)):
        return (f"merge's lse is the larger of the two tiles' ({when}), not their "
                f"log(e^lse + e^tile_lse) (torch.logaddexp); its output is {off:.1e} off")
    if close(lse, want[1]):  # the weights: what, and where to look first
        return (f"merge's lse matches, its output is {off:.1e} off the library's {when}: look "
                f"at the weights, exp(lse - the merged lse) on out and exp(tile_lse - the "
                f"merged lse) on tile_out, each from the lse it was given")
    return f"merge's output is {off:.1e} off the library's {when}"


def ring_forward_diagnosis(args: Tuple, got: Any, want: Tuple[torch.Tensor, torch.Tensor],
                           sent: Tuple[int, List[int]], needed: Tuple[int, List[int]],
                           when: str) -> Optional[str]:
    """What is wrong with one ring_forward call, None if right. ``sent``: the elements it sent
    over cp (any API, any message order or split) and the peers (group ranks) it sent to,
    ``needed``: the library's; ``when``: "in step 0", or the probe's ring."""
    group = args[2]
    cp, rank = comm.group_size(group), comm.group_rank(group)
    where = f"on rank {rank} {when}"
    if sent[0] == 0:
        return (f"ring_forward sent no K/V message {where}: at each of the first N - 1 = {cp - 1} "
                f"steps post the send to rank r + 1 and the receive from r - 1 (_exchange)")
    if sent[0] != needed[0]:
        return (f"ring_forward sent {sent[0] / (needed[0] / (cp - 1)):.2g} blocks of K/V {where} "
                f"({sent[0]:,} elements), the ring needs N - 1 = {cp - 1} ({needed[0]:,})")
    if set(sent[1]) != set(needed[1]):
        return (f"ring_forward sent its K/V to rank {sorted(set(sent[1]))} of the group {where}, "
                f"the library to {sorted(set(needed[1]))}: the ring sends to the next rank, "
                f"r + 1 mod N, and receives from r - 1, so that at step t rank r holds rank "
                f"r - t's K/V")
    out, lse = got
    close = lambda a, b: torch.allclose(a.float(), b, rtol=RTOL, atol=ATOL)  # noqa: E731
    if close(out, want[0]) and close(lse, want[1]):
        return None
    gap = lse.float() - want[1]  # more keys, a larger log-sum-exp
    if float(gap.max()) <= ATOL:
        return (f"ring_forward's log-sum-exp is below the library's {where}, by up to "
                f"{-float(gap.min()):.2f}: its queries saw fewer keys than their causal past; "
                f"fold every tile into the running (out, lse)")
    if float(gap.min()) >= -ATOL:
        return (f"ring_forward's log-sum-exp is above the library's {where}, by up to "
                f"{float(gap.max()):.2f}: its queries saw keys after them; skip the tiles "
                f'ring_schedule marks "skipped"')
    off = float((out.float() - want[0]).abs().max())
    return (f"ring_forward's output is {off:.1e} off the library's {where}, its log-sum-exp "
            f"above in some places and below in others: its queries met other keys than their "
            f"causal past (the K/V held at step t is rank r - t's)")


def probe_merge(fn: Callable) -> Optional[str]:
    """Two probes: tiles of one query whose lse overflow fp32 when exponentiated (the
    diagnosis if the merge is not finite), then tiles whose outputs and lse all differ (any
    wrong combination shows)."""
    lse, tile_lse = (torch.full((1, 1, 1), v) for v in PROBE_LSE)
    out, tile_out = torch.ones(1, 1, 1, 2), torch.zeros(1, 1, 1, 2)
    got, new_lse = fn(out, lse, tile_out, tile_lse)
    finite = lambda *ts: all(bool(torch.isfinite(t).all()) for t in ts)  # noqa: E731
    seen = None if finite(got, new_lse) else (f"merging tiles with lse {PROBE_LSE[0]:.0f} and "
                                              f"{PROBE_LSE[1]:.0f} gave {float(got[0, 0, 0, 0])}")
    if seen is not None:
        want = 1 / (1 + math.exp(PROBE_LSE[1] - PROBE_LSE[0]))
        # an overflow only if the same tiles with lse 100 lower merge right; else the probe
        # below says what else is wrong
        low = fn(torch.ones(1, 1, 1, 2), torch.full((1, 1, 1), 0.0), torch.zeros(1, 1, 1, 2),
                 torch.full((1, 1, 1), PROBE_LSE[1] - PROBE_LSE[0]))
        if finite(*low) and abs(float(low[0][0, 0, 0, 0]) - want) < 1e-5:
            return (f"{seen}, not {want:.6f}, and {want:.6f} with lse 100 "
                    f"lower: e^100 overflows fp32; weight by exp(lse - the merged lse), every "
                    f"exponent <= 0")
    gen = torch.Generator().manual_seed(5)
    args = (torch.randn(1, 2, 3, 4, generator=gen), torch.randn(1, 2, 3, generator=gen),
            torch.randn(1, 2, 3, 4, generator=gen), 1.0 + torch.randn(1, 2, 3, generator=gen))
    want = LIBRARY_FNS["merge"](*args)
    return merge_diagnosis(args, fn(*cloned(args)), want,
                           "for tiles (1, 2, 3, 4) whose outputs and lse all differ") or seen


def _tile(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
          causal: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    return ring_attention._math_forward(q, k, v, causal, 1.0 / math.sqrt(q.size(-1)))


def probe_ring(fn: Callable, group: Any, order: str, found: List[str]) -> None:
    """The learner's ring_forward and the library's on this rank's random q (1, 4, 8, 8) and
    kv (2, 1, 2, 8, 8) over ``group`` in ``order``; the diagnosis, if any, goes to ``found``.
    Every rank of ``group`` calls it (each decides alike: nothing depends on the answers)."""
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())
    q, kv = torch.randn(1, 4, 8, 8, generator=gen), torch.randn(2, 1, 2, 8, 8, generator=gen)
    args = (q, kv, group, order, _tile)
    with observed() as traffic, bounded("ring_forward", "a probe"):
        got = fn(*cloned(args))
    with observed() as reference:
        want = LIBRARY_FNS["ring_forward"](*args)
    ranks = dist.get_process_group_ranks(group)
    text = ring_forward_diagnosis(
        args, got, want, _sent(traffic), _sent(reference),
        f"in a probe: the ring of ranks {ranks} of the world's {dist.get_world_size()}, "
        f"order {order!r}")
    if text is not None and not found:
        found.append(text)


def with_library_helpers(fn: Callable) -> Callable:
    """``fn`` (a ring_forward) calling the library's slice_ids and merge where its file defines
    its own (the exercise file's, by name): the ring is judged alone, and a wrong slice_ids or
    merge fails that exercise, not this one."""
    names = [
        n for n in ("slice_ids", "merge") if callable(fn.__globals__.get(n))
        and getattr(fn.__globals__[n], "__module__", None) == fn.__module__
    ]

    def call(*args: Any) -> Any:
        with patched([(_Globals(fn.__globals__), n, LIBRARY_FNS[n]) for n in names]):
            return fn(*args)

    return call


class _Globals:
    """A module's globals dict as attributes, for ``patched``."""

    def __init__(self, names: Dict[str, Any]) -> None:
        object.__setattr__(self, "names", names)

    def __getattr__(self, name: str) -> Any:
        return self.names[name]

    def __setattr__(self, name: str, value: Any) -> None:
        self.names[name] = value


def _sent(traffic: Any) -> Tuple[int, List[int]]:
    sends = traffic.select("send")
    return sum(c.elements for c in sends), [c.peer for c in sends if c.peer is not None]


def _checked(exercise: str, fn: Callable, library: Callable, found: List[str]) -> Callable:
    """``fn`` called in the library's place; its first wrong answer's diagnosis goes to
    ``found``; the library's answer is returned, so the ranks stay in step."""

    def call(*args: Any) -> Any:
        ledger = get_ledger()
        # every rank: the learner's call on inputs of its own, then the library's; the K/V
        # messages sent are counted where they reach a process group, whatever API sent them
        with observed() as traffic, bounded(exercise, f"step {ledger.step}"):
            got = fn(*cloned(args))
        with observed() as reference:
            want = library(*args)
        if not found:
            if exercise == "slice_ids":
                text = slice_ids_diagnosis(args, got, want)
            elif exercise == "merge":
                text = merge_diagnosis(args, got, want, f"in step {ledger.step}")
            else:
                text = ring_forward_diagnosis(args, got, want, _sent(traffic), _sent(reference),
                                              f"in step {ledger.step}")
            if text is not None:
                found.append(text)
        return want

    return call


def config() -> Config:
    cfg = parse_args([
        "--config", "examples/configs/05_context_parallel.yaml", "--steps",
        str(STEPS), "--cp",
        str(WORLD), "--data.seq_len",
        str(SEQ_LEN)
    ])
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
    # a ring whose group is not the world (every rank creates it; ranks 1 and 2 use it)
    pair = dist.new_group(PAIR, timeout=datetime.timedelta(seconds=collective_timeout()))

    def measure(exercise: str, source: Source) -> Dict[str, Any]:
        found: List[str] = []
        fn = load(source)
        if exercise == "ring_forward":  # each exercise on its own
            fn = with_library_helpers(fn)
        probed = {"slice_ids": probe_slice_ids, "merge": probe_merge}.get(exercise)
        text = probed(fn) if probed is not None else None
        found.extend([text] if text is not None else [])
        checked = _checked(exercise, fn, LIBRARY_FNS[exercise], found)
        owners = [ring_attention] + ([context_parallel] if exercise == "slice_ids" else [])
        with patched([(owner, exercise, checked) for owner in owners]):
            _train(cfg, pgm)
        if exercise == "ring_forward":  # after the run: its diagnosis, if any, comes first
            probe_ring(fn, pgm.context_parallel_group, "contiguous", found)
            for order in ORDERS if dist.get_rank() in PAIR else ():
                probe_ring(fn, pair, order, found)
        return {"found": found}

    try:
        return run_jobs(jobs, measure)
    finally:
        destroy_pg_manager()


def grade(jobs: List[Dict[str, Source]]) -> List[Verdict]:
    """Every job graded in one world of WORLD ranks, each call against the library's; a job
    whose ranks gave up waiting for a ring message, by what they waited for (ring_waits.py)."""

    results, verdicts = run_world(rank_jobs, WORLD, jobs), []
    for i, job in enumerate(jobs):
        (exercise, _), = job.items()
        runs = [r[i] for r in results]
        hang = hang_text(runs)
        verdicts.append(
            Verdict(exercise, False, f"{exercise}: {hang}"
                    ) if hang else found_verdict(exercise, runs))
    return verdicts


def solution_jobs() -> List[Dict[str, Source]]:
    return [{name: (LIBRARY, name)} for name in EXERCISES]


def exercise_jobs(path: str) -> List[Dict[str, Source]]:
    return [{name: (path, name)} for name in EXERCISES]
