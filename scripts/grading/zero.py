"""Grading chapter 02's exercises (examples/exercises/02_fsdp.py) on 4 gloo ranks, dp 2 x tp 2.

Each job trains chapter 02's run (examples/configs/02_fsdp.yaml, ``STEPS`` steps of
``MICRO_BATCHES`` micro-batches) on dp 2 x tp 2, so that the data-parallel group the functions
are given (2 ranks) is not the world (4), under ZeRO-1 (``reduce_scatter_mean``: ZeRO-1's step)
or ZeRO-3 with prefetch (``gather_unit``, ``release_unit``), with the learner's function in
place of scaletorch/parallel/flat_unit.py's, and measures: step 0's collectives (at the process
group, whatever API), what each unit held when it ran in step 0, what ``release_unit`` left of
a unit, the peak of gathered bytes, step 0's shard gradients against one device's cut as this
rank holds them (``ParamMap.scatter``), the losses, grad norms and final weights. Then
``probe`` calls the function on its own: a reduce-scatter into an fp32 and a bf16 ``out``, a
gather with and without ``async_op``, each checking the values and that an async call left its
collective in flight (a work returned). The parent says what is wrong in the learner's terms.
"""

import copy
import dataclasses
from typing import Any, Callable, Dict, List, Optional

import torch

from scaletorch.dist import comm, destroy_pg_manager, get_ledger, init_pg_manager_from_config
from scaletorch.models import build_model
from scaletorch.parallel import flat_unit
from scaletorch.parallel import zero as zero_module
from scaletorch.parallel.flat_unit import release_unit
from scaletorch.parallel.parallelize import parallelize
from scaletorch.rules.group_names import gradient_group_name
from scaletorch.trainer import Config, Trainer, parse_args
from scaletorch.trainer.param_map import ParamMap
from scripts.grading.ddp import GRAD_TOL, parity_diagnosis, reference
from scripts.grading.learner import InPlace, Source, caused_by, failure, load, patched
from scripts.grading.runner import collective_timeout, run_jobs, run_world
from scripts.grading.traffic import observed
from scripts.grading.verdicts import Verdict, error_verdict, per_job

CHAPTER = "02"
EXERCISES = ("reduce_scatter_mean", "gather_unit", "release_unit")
LIBRARY = "scaletorch.parallel.flat_unit"
DP, TP = 2, 2  # the data-parallel group (N) is not the world (DP x TP)
WORLD = DP * TP
AGAINST = "one device"  # what the jobs are compared with
STEPS = 3
MICRO_BATCHES = 2
PROBE_SHARD = 5  # elements of a shard in ``probe``'s calls
STAGE = {"reduce_scatter_mean": 1, "gather_unit": 3, "release_unit": 3}
PROBES = ("reduce_scatter_mean", "gather_unit")


class Diagnosed(Exception):
    """A mistake seen as it happened, on every rank before the same collective (so the world
    goes on with the next job), before it could crash a rank (a write into freed memory)."""


def config() -> Config:
    cfg = parse_args([
        "--config", "examples/configs/02_fsdp.yaml", "--steps",
        str(STEPS), "--parallel.tensor_model_parallel_size",
        str(TP), "--parallel.data_parallel_size",
        str(DP), "--data.num_micro_batches",
        str(MICRO_BATCHES)
    ])
    cfg.logging.progress = False
    return cfg


def _slices(flat: torch.Tensor, reference: torch.Tensor, world: int) -> List[int]:
    """For each of the ``world`` slices of ``flat``: the slice of ``reference`` it equals, or
    -1 (neither: values that were never sent)."""
    got, want = flat.float().view(world, -1), reference.float().view(world, -1)
    return [
        next((j for j in range(world) if torch.equal(got[k], want[j])), -1) for k in range(world)
    ]


def poisoned_release(flat: torch.Tensor) -> None:
    """The library's ``release_unit`` after filling ``flat`` with NaN: memory handed back by a
    later resize then never holds the right weights by chance."""
    if flat.untyped_storage().nbytes() == 0:
        flat.untyped_storage().resize_(flat.numel() * flat.element_size())
    flat.fill_(float("nan"))
    release_unit(flat)


def _train(cfg: Config, pgm: Any, exercise: str, fn: Callable, ref: Dict[str,
                                                                         Any]) -> Dict[str, Any]:
    get_ledger().clear()  # step 0 of this job only
    cfg = copy.deepcopy(cfg)
    cfg.parallel.zero_stage = STAGE[exercise]
    model = build_model(cfg.model, seed=cfg.training.model_seed)
    par = parallelize(model, cfg, pgm, torch.device("cpu"))
    zero = par.model
    params = ParamMap(par.layout)
    want = {u.name: params.scatter(ref["grads"])[u.shard] for u in zero.units}
    with get_ledger().paused():  # every unit's (P',) vector at step 0, by the library
        masters = [unit.all_gather_flat(unit.shard.detach()) for unit in zero.units]
    for unit in zero.units if zero.zero_stage == 3 else []:
        poisoned_release(unit.flat)
    ran: Dict[str, List[int]] = {}  # unit -> where each slice of what it held came from
    released: List[tuple] = []  # (shape, bytes left, all zero) after each release in step 0

    def snapshot(i: int, module: Any, args: Any) -> None:  # after ZeRO's own pre-hook
        unit = zero.units[i]
        if get_ledger().step == 0 and unit.name not in ran and unit.gathered_bytes:
            ran[unit.name] = _slices(unit.flat, masters[i], unit.world)
            wrong = misplaced(unit.name, pgm.rank, ran[unit.name], pgm.group_ranks("dp"))
            if wrong:  # stop before it computes with them (a NaN would hide the reason)
                raise Diagnosed(wrong)

    for i, unit in enumerate(zero.units):
        unit.modules[0].register_forward_pre_hook(lambda m, a, i=i: snapshot(i, m, a))

    def release(flat: torch.Tensor) -> None:
        shape = tuple(flat.shape)
        # the storage the parameters view: a release that rebinds flat (flat.data = ...)
        # leaves them holding it, so its bytes, not flat's new ones, are what stays allocated
        storage = flat.untyped_storage()
        held = storage.nbytes()
        fn(flat)
        left = storage.nbytes()
        if 0 < left < held:  # the parameters' views now reach past it: their next use fails
            raise Diagnosed(f"release_unit left {left:,} of flat's {held:,} bytes allocated: "
                            f"resize its storage to 0 bytes (all of it is gathered again "
                            f"before its next use)")
        if tuple(flat.shape) != shape:  # the next gather would fail on it
            rebound = flat.untyped_storage().data_ptr() != storage.data_ptr()
            raise Diagnosed(f"release_unit changed flat's shape from ({shape[0]:,},) to "
                            f"{tuple(flat.shape)} and left {left:,} bytes allocated" +
                            (f" in the storage the parameters view (flat now has a new one "
                             f"of {flat.untyped_storage().nbytes():,})" if rebound else "") +
                            ": keep the shape (the parameters live on flat), free its storage")
        if get_ledger().step == 0:
            released.append((shape, left, left > 0 and not bool(flat.detach().any())))

    gather_into = comm.all_gather_into_tensor

    def checked_gather(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        need = output.numel() * output.element_size()
        if output.untyped_storage().nbytes() < need:  # gloo would write into freed memory
            held = output.untyped_storage().nbytes()
            count = f", its element count: resize_ takes bytes, P' x {output.element_size()}" \
                if held == output.numel() and output.element_size() > 1 else ""
            raise Diagnosed(f"gather_unit all-gathered into a released flat ({held:,} of its "
                            f"{need:,} bytes{count}): give its storage the P' elements back first")
        return gather_into(output, input, *args, **kwargs)

    grads: Dict[str, torch.Tensor] = {}
    clip_grad_norm = par.clip_grad_norm

    def clip(max_norm: float) -> torch.Tensor:
        zero.finish_grad_sync()
        if not grads:  # step 0, after the reduce-scatters, before clipping: this rank's shards
            grads.update({u.name: u.shard.grad.detach().clone() for u in zero.units})
        return clip_grad_norm(max_norm)

    value = release if exercise == "release_unit" else fn
    # the library's home of the function and zero.py, whose hooks and step call it by name
    patches = [(owner, exercise, value) for owner in (flat_unit, zero_module)]
    patches.append((comm, "all_gather_into_tensor", checked_gather))
    if exercise == "gather_unit":  # a slice the learner never wrote is NaN, not old weights
        patches += [(owner, "release_unit", poisoned_release) for owner in (flat_unit, zero_module)]
    try:
        with patched(patches), observed(lambda: get_ledger().step) as traffic:
            result = Trainer.from_parallelized(cfg, dataclasses.replace(par,
                                                                        clip_grad_norm=clip), pgm,
                                               device=torch.device("cpu"), verbose=False).train()
    except Exception as err:  # noqa: B902 - the Trainer wraps what a step raised
        seen = caused_by(err, Diagnosed)
        if seen is None:
            raise
        return {"diagnosed": str(seen)}
    ops: Dict[str, List[int]] = {}  # what reached the dp group in step 0, whatever the API
    gradients = gradient_group_name(pgm.context_parallel_world_size)  # "dp": cp is 1 here
    for op in ("all_reduce", "reduce_scatter"):
        ops[op] = [c.elements for c in traffic.select(op, gradients, step=0)]
    elsewhere = sorted({c.group for c in traffic.select("reduce_scatter", step=0)} - {gradients})
    full_bytes = sum(u.padded_numel * u.flat.element_size() for u in zero.units)
    final = params.scatter(ref["state"])
    return {
        "losses": result.losses,
        "grad_norms": result.grad_norms,
        "weight": max(float((u.shard.detach() - final[u.shard]).abs().max()) for u in zero.units),
        "grads": grads,
        "want": want,
        "ops": ops,
        "elsewhere": elsewhere,
        "ran": ran,
        "released": released,
        "peak": zero.peak_gathered_bytes,
        "full_bytes": full_bytes,
        "units": [(u.name, u.padded_numel) for u in zero.units]
    }


def rank_jobs(rank: int, world: int, jobs: List[Dict[str, Source]]) -> List[Dict[str, Any]]:
    """Inside a rank: each job ({exercise: source}, one exercise each) trained and measured."""
    cfg = config()
    pgm = init_pg_manager_from_config(cfg.parallel, collective_timeout())  # the jobs' groups
    ref = reference(cfg)  # this rank cuts its own expected pieces from it

    def measure(exercise: str, source: Source) -> Dict[str, Any]:
        fn = load(source)
        measured = _train(cfg, pgm, exercise, fn, ref)
        if "diagnosed" not in measured and exercise in PROBES:
            measured["probe"] = probe(exercise, fn, pgm)
        return measured

    try:
        return run_jobs(jobs, measure)
    finally:
        destroy_pg_manager()


def _values(seed: int, n: int) -> torch.Tensor:
    """Rank-specific values, not all ones: any rank can make every rank's."""
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) + seed % 7


IN_FLIGHT = "while its reduce-scatter was in flight"  # the probe's words for a division too soon


def probe(exercise: str, fn: Callable, pgm: Any) -> Optional[str]:
    """``fn`` called on its own on every rank over the dp group: (reduce_scatter_mean) full
    (P',) fp32 into an fp32 and a bf16 out; (gather_unit) a released flat, async_op False and
    True. What this rank measured wrong, or None."""
    group, peers = pgm.gradient_sync_group, pgm.group_ranks("dp")
    me, n, s = peers.index(pgm.rank), len(peers), PROBE_SHARD
    try:
        if exercise == "reduce_scatter_mean":
            for dtype in (torch.float32, torch.bfloat16):
                out = torch.zeros(s, dtype=dtype)
                with InPlace(out) as seen:
                    work = fn(_values(pgm.rank, n * s), out, group)
                if work is not None:
                    work.wait()
                want = sum(_values(r, n * s)[me * s:(me + 1) * s] for r in peers) / n
                summed = torch.allclose(out.float(), n * want.float(), rtol=1e-2, atol=1e-2)
                if work is not None and seen.seen and summed:  # its division lost to the sum
                    return (f"reduce_scatter_mean called {seen.seen[0]} on out {IN_FLIGHT} (it "
                            f"returned the work unfinished), and out then held the sum over the "
                            f"{n} ranks: the reduce-scatter wrote its sum over the division; "
                            f"divide full before it starts")
                if not torch.allclose(out.float(), want.to(dtype).float(), rtol=1e-2, atol=1e-2):
                    got = ", ".join(f"{v:.2f}" for v in out.float().tolist())
                    return (f"reduce_scatter_mean of a (P',) fp32 full into a {dtype} out gave "
                            f"rank {pgm.rank} [{got}], not the mean of its shard over the "
                            f"{n} ranks of its group, "
                            f"[{', '.join(f'{v:.2f}' for v in want.tolist())}]")
                if work is None:
                    return (f"reduce_scatter_mean returned None on a group of {n} ranks: its "
                            f"reduce-scatter was not in flight during the next unit's backward; "
                            f"return the work of an async_op=True reduce-scatter")
            return None
        for async_op in (False, True):
            flat = torch.zeros(n * s)
            flat.untyped_storage().resize_(0)  # released, as ZeRO-3 hands it over
            work = fn(flat, _values(100 + pgm.rank, s), group, async_op)
            if async_op and work is None:
                return (f"gather_unit(async_op=True) returned None on a group of {n} ranks: the "
                        f"prefetch's all-gather was not in flight during the unit before; "
                        f"return the work of an async all-gather")
            held = flat.detach().clone() if flat.untyped_storage().nbytes() else None
            if work is not None:
                work.wait()
            want = torch.cat([_values(100 + r, s) for r in peers])
            if not async_op and (held is None or not torch.equal(held, want)):
                return ("gather_unit(async_op=False) returned before flat held every rank's "
                        "shard: ZeRO computes with it at once; wait for the all-gather")
        return None
    except Exception as err:  # noqa: B902 - the measurement: what it raised, where
        return f"{exercise} called on its own raised on rank {pgm.rank}: {failure(err)}"


# ---- diagnoses: from what the jobs measured, in the learner's terms -----------------------


def traffic_diagnosis(runs: List[Dict[str, Any]]) -> Optional[str]:
    """reduce_scatter_mean: one reduce-scatter of each unit's P' elements in step 0."""
    ops, units = runs[0]["ops"], runs[0]["units"]
    sizes = sorted(n for _, n in units)
    elsewhere = sorted({g for run in runs for g in run["elsewhere"]})
    if elsewhere:
        return (f"step 0's reduce-scatters ran over {', '.join(map(repr, elsewhere))} too, not "
                f"only over 'dp' ({WORLD // TP} of the world's {WORLD} ranks): reduce-scatter "
                f"over the group you are given")
    if sorted(ops.get("all_reduce", []))[-len(units):] == sizes:
        return (f"each unit's gradients crossed as an all-reduce of its P' elements ({sizes[0]:,} "
                f"to {sizes[-1]:,}): every rank received all {DP} shards, {DP}x what it "
                f"keeps; reduce-scatter, so that rank r receives shard r only")
    if sorted(ops.get("reduce_scatter", [])) != sizes:
        return (f"step 0 held {len(ops.get('reduce_scatter', []))} reduce-scatters over dp "
                f"for {len(units)} units: reduce-scatter each unit's gradients once")
    return None


def misplaced(name: str, rank: int, came_from: List[int], peers: List[int]) -> Optional[str]:
    """What is wrong with a unit about to run whose k-th slice came from group rank
    came_from[k] (global rank peers[came_from[k]])."""
    if came_from == list(range(len(came_from))):
        return None
    if -1 in came_from:
        return (f"unit {name!r} was about to run in step 0 on rank {rank} with shard "
                f"{came_from.index(-1)}'s place holding values no rank sent: all-gather every "
                f"rank's shard into flat")
    k = next(k for k, j in enumerate(came_from) if j != k)
    return (f"unit {name!r} was about to run in step 0 on rank {rank} with group rank "
            f"{came_from[k]}'s shard (rank {peers[came_from[k]]}'s) at offset {k} S: group rank "
            f"r's shard belongs at r S, as the all-gather puts it")


def gather_diagnosis(runs: List[Dict[str, Any]]) -> Optional[str]:
    """gather_unit: every unit ran in step 0 with its parameters gathered."""
    missing = [name for name, _ in runs[0]["units"] if name not in runs[0]["ran"]]
    if missing:
        return f"unit {missing[0]!r} ran in step 0 without its parameters gathered"
    return None


def release_diagnosis(runs: List[Dict[str, Any]]) -> Optional[str]:
    """release_unit: a released flat keeps 0 bytes; the peak is 2 units."""
    run = runs[0]
    if run["released"] and all(zeros for _, _, zeros in run["released"]):
        left = max(b for _, b, _ in run["released"])
        return (f"release_unit zeroed flat but left its {left:,} bytes allocated: setting values "
                f"keeps the memory; resize flat's storage to 0 bytes")
    if run["peak"] >= run["full_bytes"]:
        return (f"peak gathered {run['peak']:,} bytes on rank 0, the whole model "
                f"({run['full_bytes']:,}): release each unit after its forward and its backward, "
                f"so that at most 2 units are full")
    return None


def shard_gradient_diagnosis(runs: List[Dict[str, Any]], ref: Dict[str, Any]) -> Optional[str]:
    """Step 0's shard gradients of every rank against one device's, cut as the rank holds them."""
    top = max(float(g.abs().max()) for run in runs for g in run["want"].values())
    for rank, run in enumerate(runs):
        got, want = run["grads"], run["want"]
        off = [n for n in want if float((got[n] - want[n]).abs().max()) > GRAD_TOL * top]
        if not off:
            continue
        scales = [
            sum(float((r["grads"][n] * r["want"][n]).sum()) for n in r["want"]) /
            sum(float((r["want"][n] * r["want"][n]).sum()) for n in r["want"]) for r in runs
        ]
        early = next((r["probe"] for r in runs if IN_FLIGHT in (r.get("probe") or "")), None)
        if all(abs(x - DP) < 0.01 * DP for x in scales) and early:  # the probe saw why
            return (f"the shards' gradients are {scales[0]:.2f}x the reference on every rank, "
                    f"not divided by N = {DP}; called on its own, {early}")
        if all(abs(x - DP) < 0.01 * DP for x in scales):
            # undivided: no division, or one of out while the reduce-scatter was in flight
            # (its sum overwrites out) both leave it so
            return (f"the shards' gradients are {scales[0]:.2f}x the reference on every rank: "
                    f"the sum over the N = {DP} ranks, not divided by N; look at the division: "
                    f"missing, or of out before the reduce-scatter finished? divide full before "
                    f"it starts")
        if all(abs(x - 1 / DP) < 0.01 / DP for x in scales):
            return (f"the shards' gradients are {scales[0]:.2f}x the reference on every rank: "
                    f"divided by N = {DP} twice, or by the world's {len(runs)} ranks? divide "
                    f"once by the size of the group you are given")
        return (f"rank {rank}'s shard gradients are {scales[rank]:.3f}x the reference, "
                f"{len(off)} of {len(want)} units off in step 0, first {off[0]!r}")
    return None


def diagnose(exercise: str, runs: List[Dict[str, Any]], ref: Dict[str, Any]) -> Verdict:
    """The verdict of one exercise from every rank's measurements of its job."""
    seen = [run["diagnosed"] for run in runs if "diagnosed" in run]
    if seen:
        return Verdict(exercise, False, seen[0])
    failed = error_verdict(exercise, runs)
    if failed is not None:
        return failed
    special = {
        "reduce_scatter_mean": traffic_diagnosis,
        "gather_unit": gather_diagnosis,
        "release_unit": release_diagnosis
    }
    text = special[exercise](runs)
    text = text or shard_gradient_diagnosis(runs, ref) or parity_diagnosis(runs, ref)
    text = text or next((run["probe"] for run in runs if run.get("probe")), None)
    return Verdict(exercise, text is None, text or "passed")


def grade(jobs: List[Dict[str, Source]]) -> List[Verdict]:
    """Every job (one exercise each, in order) graded in one world of WORLD ranks."""
    ref = reference(config())
    return per_job(jobs, run_world(rank_jobs, WORLD, jobs),
                   lambda exercise, runs: diagnose(exercise, runs, ref))


def solution_jobs() -> List[Dict[str, Source]]:
    return [{name: (LIBRARY, name)} for name in EXERCISES]


def exercise_jobs(path: str) -> List[Dict[str, Source]]:
    return [{name: (path, name)} for name in EXERCISES]
