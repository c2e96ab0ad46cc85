"""Grading chapter 02's exercises (examples/exercises/02_fsdp.py) on 2 gloo ranks.

Each job trains chapter 02's run (examples/configs/02_fsdp.yaml, ``STEPS`` steps) under ZeRO-1
(``reduce_scatter_mean``: ZeRO-1's step) or ZeRO-3 (``gather_unit``, ``release_unit``) with the
learner's function in place of scaletorch/parallel/flat_unit.py's, and measures: step 0's
collectives (the ledger), what each unit held when it ran in step 0, what ``release_unit`` left
of a unit, the peak of gathered bytes, step 0's shard gradients (all-gathered under the
reference's names), the losses, grad norms and final weights. The parent compares them with one
device (``reference``) and says what is wrong in the learner's terms.
"""

from typing import Any, Callable, Dict, List, Optional

import torch

from scaletorch.dist import comm, destroy_pg_manager, get_ledger, init_pg_manager_from_config
from scaletorch.models import build_model
from scaletorch.parallel import flat_unit
from scaletorch.parallel import zero as zero_module
from scaletorch.parallel.flat_unit import release_unit
from scaletorch.parallel.zero import ZeroAdamW, apply_zero
from scaletorch.rules.group_names import gradient_group_name
from scaletorch.trainer import Config, Trainer, parse_args
from scripts.grading.ddp import GRAD_TOL, parity_diagnosis, reference
from scripts.grading.runner import (Source, Verdict, caused_by, collective_timeout, error_verdict,
                                    load, patched, per_job, run_jobs, run_world)
from scripts.grading.traffic import observed

CHAPTER = "02"
EXERCISES = ("reduce_scatter_mean", "gather_unit", "release_unit")
LIBRARY = "scaletorch.parallel.flat_unit"
WORLD = 2
AGAINST = "one device"  # what the jobs are compared with
STEPS = 3
STAGE = {"reduce_scatter_mean": 1, "gather_unit": 3, "release_unit": 3}


class Diagnosed(Exception):
    """A mistake seen as it happened, on every rank before the same collective (so the world
    goes on with the next job), before it could crash a rank (a write into freed memory)."""


def config() -> Config:
    cfg = parse_args(["--config", "examples/configs/02_fsdp.yaml", "--steps", str(STEPS)])
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


def _train(cfg: Config, pgm: Any, exercise: str, fn: Callable) -> Dict[str, Any]:
    get_ledger().clear()  # step 0 of this job only
    model = build_model(cfg.model, seed=cfg.training.model_seed)
    zero = apply_zero(model, pgm, STAGE[exercise])
    t = cfg.training
    optimizer = ZeroAdamW(zero, t.lr, (t.beta1, t.beta2), t.weight_decay)
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
            wrong = misplaced(unit.name, pgm.rank, ran[unit.name])
            if wrong:  # stop before it computes with them (a NaN would hide the reason)
                raise Diagnosed(wrong)

    for i, unit in enumerate(zero.units):
        unit.modules[0].register_forward_pre_hook(lambda m, a, i=i: snapshot(i, m, a))

    def release(flat: torch.Tensor) -> None:
        shape = tuple(flat.shape)
        fn(flat)
        left = flat.untyped_storage().nbytes()
        if tuple(flat.shape) != shape:  # the next gather would fail on it
            raise Diagnosed(f"release_unit changed flat's shape from ({shape[0]:,},) to "
                            f"{tuple(flat.shape)} and left {left:,} bytes allocated: keep the "
                            f"shape (the parameters live on flat), free its storage")
        if get_ledger().step == 0:
            released.append((shape, left, left > 0 and not bool(flat.detach().any())))

    gather_into = comm.all_gather_into_tensor

    def checked_gather(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        need = output.numel() * output.element_size()
        if output.untyped_storage().nbytes() < need:  # gloo would write into freed memory
            raise Diagnosed(f"gather_unit all-gathered into a released flat ("
                            f"{output.untyped_storage().nbytes()} of its {need:,} bytes): give "
                            f"its storage the P' elements back first")
        return gather_into(output, input, *args, **kwargs)

    grads: Dict[str, torch.Tensor] = {}

    def clip(max_norm: float) -> torch.Tensor:
        zero.finish_grad_sync()
        if not grads:  # step 0, after the reduce-scatters, before clipping
            grads.update(zero.full_state_dict(lambda s: s.grad))
        return zero.clip_grad_norm(max_norm)

    value = release if exercise == "release_unit" else fn
    # the library's home of the function and zero.py, whose hooks and step call it by name
    patches = [(owner, exercise, value) for owner in (flat_unit, zero_module)]
    patches.append((comm, "all_gather_into_tensor", checked_gather))
    if exercise == "gather_unit":  # a slice the learner never wrote is NaN, not old weights
        patches += [(owner, "release_unit", poisoned_release) for owner in (flat_unit, zero_module)]
    try:
        with patched(patches), observed(lambda: get_ledger().step) as traffic:
            result = Trainer(cfg, zero, pgm, device=torch.device("cpu"), optimizer=optimizer,
                             clip_grad_norm=clip, verbose=False).train()
            state = zero.full_state_dict()
    except Exception as err:  # noqa: B902 - the Trainer wraps what a step raised
        seen = caused_by(err, Diagnosed)
        if seen is None:
            raise
        return {"diagnosed": str(seen)}
    ops: Dict[str, List[int]] = {}  # what reached the dp group in step 0, whatever the API
    gradients = gradient_group_name(pgm.context_parallel_world_size)  # "dp": cp is 1 here
    for op in ("all_reduce", "reduce_scatter"):
        ops[op] = [c.elements for c in traffic.select(op, gradients, step=0)]
    full_bytes = sum(u.padded_numel * u.flat.element_size() for u in zero.units)
    return {
        "losses": result.losses,
        "grad_norms": result.grad_norms,
        "state": state,
        "grads": grads,
        "ops": ops,
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
    try:
        return run_jobs(jobs, lambda exercise, source: _train(cfg, pgm, exercise, load(source)))
    finally:
        destroy_pg_manager()


# ---- diagnoses: from what the jobs measured, in the learner's terms -----------------------


def traffic_diagnosis(runs: List[Dict[str, Any]]) -> Optional[str]:
    """reduce_scatter_mean: one reduce-scatter of each unit's P' elements in step 0."""
    ops, units = runs[0]["ops"], runs[0]["units"]
    sizes = sorted(n for _, n in units)
    if sorted(ops.get("all_reduce", []))[-len(units):] == sizes:
        return (f"each unit's gradients crossed as an all-reduce of its P' elements ({sizes[0]:,} "
                f"to {sizes[-1]:,}): every rank received all {WORLD} shards, {WORLD}x what it "
                f"keeps; reduce-scatter, so that rank r receives shard r only")
    if sorted(ops.get("reduce_scatter", [])) != sizes:
        return (f"step 0 held {len(ops.get('reduce_scatter', []))} reduce-scatters over dp "
                f"for {len(units)} units: reduce-scatter each unit's gradients once")
    return None


def misplaced(name: str, rank: int, came_from: List[int]) -> Optional[str]:
    """What is wrong with a unit about to run whose k-th slice came from rank came_from[k]."""
    if came_from == list(range(len(came_from))):
        return None
    if -1 in came_from:
        return (f"unit {name!r} was about to run in step 0 on rank {rank} with shard "
                f"{came_from.index(-1)}'s place holding values no rank sent: all-gather every "
                f"rank's shard into flat")
    k = next(k for k, j in enumerate(came_from) if j != k)
    return (f"unit {name!r} was about to run in step 0 on rank {rank} with rank "
            f"{came_from[k]}'s shard at offset {k} S: rank r's shard belongs at r S, as the "
            f"all-gather puts it")


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
    """Step 0's shard gradients (all-gathered under chapter 00's names) against one device."""
    got, want = runs[0]["grads"], ref["grads"]
    scale = sum(float((got[n] * want[n]).sum()) for n in want) / \
        sum(float((want[n] * want[n]).sum()) for n in want)
    if abs(scale - WORLD) < 0.01 * WORLD:
        return (f"the shards' gradients are {scale:.2f}x the reference: the reduce-scatter "
                f"sums over the N = {WORLD} ranks; divide by N for the mean")
    if abs(scale - 1 / WORLD) < 0.01 / WORLD:
        return (f"the shards' gradients are {scale:.2f}x the reference: divided by N = {WORLD} "
                f"twice? divide once, before or after the sum")
    top = max(float(g.abs().max()) for g in want.values())
    off = [n for n in want if float((got[n] - want[n]).abs().max()) > GRAD_TOL * top]
    if off:
        return (f"the shards' gradients are {scale:.3f}x the reference, {len(off)} of "
                f"{len(want)} parameters off in step 0, first {off[0]}")
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
