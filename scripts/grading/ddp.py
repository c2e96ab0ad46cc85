"""Grading chapter 01's exercises (examples/exercises/01_ddp.py) on 4 gloo ranks, dp 2 x tp 2.

Each job trains chapter 01's run (examples/configs/01_ddp.yaml, ``STEPS`` steps of
``MICRO_BATCHES`` micro-batches) on 4 ranks: data parallel 2 x tensor parallel 2, so that the
data-parallel group the functions are given (2 ranks) is not the world (4), and the world
group or ``dist.get_world_size()`` gives wrong gradients. The learner's functions replace
scaletorch/parallel/gradient_sync.py's. Each rank measures its own parameters (tp shards):
step 0's gradients after the sync (before clipping) against one device's, cut as this rank
holds them (``ParamMap.scatter``); the gradients each rank handed ``average_gradients``; the
losses, grad norms and final weights; for the bucketed wrapper each bucket launch (how many of
its gradients had arrived, inside backward or not), each hook's call (a full bucket left
unlaunched) and which works the learner waited for. ``launch_full_buckets`` is also called on
states where several buckets are full at once (ddp_calls.py), ``average_gradients`` on known
values, watched for a tensor touched while its all-reduce is in flight (ddp_race.py); the parent
says what is wrong.
"""

import copy
import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from scaletorch.dist import destroy_pg_manager, get_ledger, init_pg_manager_from_config
from scaletorch.models import build_model
from scaletorch.parallel import data_parallel
from scaletorch.parallel.data_parallel import BucketedDataParallel
from scaletorch.parallel.parallelize import parallelize
from scaletorch.trainer import Config, Trainer, parse_args
from scaletorch.trainer.param_map import ParamMap
from scaletorch.trainer.parity import max_norm_diff, reference_trainer
from scaletorch.trainer.precision import NORM_TOLERANCES, TOLERANCES
from scripts.grading.ddp_calls import (apart_cause, call_diagnosis, calls, launch_diagnosis,
                                       wait_diagnosis)
from scripts.grading.ddp_race import race_probe, race_text
from scripts.grading.learner import (LEARNER_ERRORS, Source, failure, is_hang, is_unwritten, load,
                                     patched)
from scripts.grading.runner import collective_timeout, run_world, streamed
from scripts.grading.verdicts import Verdict, error_verdict, per_job

CHAPTER = "01"
EXERCISES = ("average_gradients", "launch_full_buckets", "wait_for_buckets")
LIBRARY = "scaletorch.parallel.gradient_sync"
DP, TP = 2, 2  # the data-parallel group (N) is not the world (DP x TP)
WORLD = DP * TP
AGAINST = "one device"  # what the jobs are compared with
STEPS = 3
MICRO_BATCHES = 2  # the sync happens once, after the last one's backward
# Step 0's gradients, relative to the largest reference element: the same sums in another
# order differ by about 1e-7 (fp32); a gradient off by 0.1% is 1e-3 off.
GRAD_TOL = 1e-4
IMPL = {"average_gradients": "naive", "launch_full_buckets": "ours", "wait_for_buckets": "ours"}


def config() -> Config:
    cfg = parse_args([
        "--config", "examples/configs/01_ddp.yaml", "--steps",
        str(STEPS), "--parallel.tensor_model_parallel_size",
        str(TP), "--parallel.data_parallel_size",
        str(DP), "--data.num_micro_batches",
        str(MICRO_BATCHES)
    ])
    cfg.logging.progress = False
    return cfg


class _CountedWork:
    """A bucket's work handle that counts the learner's ``wait()`` calls."""

    def __init__(self, work: Any) -> None:
        self.work, self.waits = work, 0

    def wait(self, *args: Any) -> Any:
        self.waits += 1
        return self.work.wait(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def _instrumented(exercise: str, fn: Any, record: Dict[str,
                                                       Any]) -> List[Tuple[object, str, object]]:
    """The patches that put ``fn`` in place of the library's ``exercise`` and record what it
    did: the gradients handed to the first average (cloned), each bucket launch (step, bucket,
    gradients arrived, of how many, inside backward), each hook's full bucket left unlaunched
    (step, bucket) and each step's waits."""
    launch = BucketedDataParallel._launch

    def recorded_launch(self: BucketedDataParallel, bucket: Any, in_backward: bool) -> None:
        record["launches"].append(
            (get_ledger().step, bucket.index, bucket.ready, len(bucket.param_ids), in_backward))
        launch(self, bucket, in_backward)

    def counted_wait(works: Sequence[Any]) -> None:
        counted = [_CountedWork(w) if w is not None else None for w in works]
        fn(counted)
        record["waits"].append([c.waits if c is not None else 1 for c in counted])

    def recorded_average(grads: Sequence[torch.Tensor], group: Any) -> None:
        if "inputs" not in record:  # step 0's sync: what this rank brought
            record["inputs"] = [g.detach().clone() for g in grads]
        fn(grads, group)

    def checked_launch(ready: Sequence[int], sizes: Sequence[int], next_bucket: int,
                       launch: Any) -> int:
        returned = fn(ready, sizes, next_bucket, launch)
        k = returned if isinstance(returned, int) else -1
        if 0 <= k < len(sizes) and ready[k] == sizes[k]:  # a full bucket waits for a later hook
            record["left"].append((get_ledger().step, k))
        return returned

    value = {
        "wait_for_buckets": counted_wait,
        "average_gradients": recorded_average,
        "launch_full_buckets": checked_launch
    }[exercise]
    return [(data_parallel, exercise, value), (BucketedDataParallel, "_launch", recorded_launch)]


def _train(cfg: Config, pgm: Any, impl: str, ref: Dict[str, Any]) -> Dict[str, Any]:
    cfg = copy.deepcopy(cfg)
    cfg.parallel.impl = impl
    model = build_model(cfg.model, seed=cfg.training.model_seed)
    par = parallelize(model, cfg, pgm, torch.device("cpu"))
    params = ParamMap(par.layout)
    names = {id(p): pieces[0][0][0] for p, pieces, _ in par.layout.entries}
    want = {names[id(p)]: t for p, t in params.scatter(ref["grads"]).items()}
    grads: Dict[str, torch.Tensor] = {}
    clip_grad_norm = par.clip_grad_norm

    def clip(max_norm: float) -> torch.Tensor:
        if not grads:  # step 0, after the sync, before clipping
            grads.update({
                names[id(p)]: p.grad.detach().clone()
                for p in params.params() if p.grad is not None
            })
        return clip_grad_norm(max_norm)

    par = dataclasses.replace(par, clip_grad_norm=clip)
    result = Trainer.from_parallelized(cfg, par, pgm, device=torch.device("cpu"),
                                       verbose=False).train()
    final = params.scatter(ref["state"])
    weight = max(float((p.detach() - t).abs().max()) for p, t in final.items())
    wrapped = par.model
    return {
        "losses": result.losses,
        "grad_norms": result.grad_norms,
        "weight": weight,
        "grads": grads,
        "want": want,
        "names": list(getattr(wrapped, "names", [])),
        "dp_ranks": pgm.group_ranks("dp")
    }


def rank_jobs(rank: int, world: int, jobs: List[Dict[str, Source]]) -> List[Dict[str, Any]]:
    """Inside a rank: each job ({exercise: source}, one exercise each) trained and measured."""
    cfg = config()
    pgm = init_pg_manager_from_config(cfg.parallel, collective_timeout())  # the jobs' groups
    ref = reference(cfg)  # this rank cuts its own expected pieces from it
    out = streamed()
    try:
        for job in jobs:
            (exercise, source), = job.items()
            record: Dict[str, Any] = {"launches": [], "waits": [], "left": []}
            try:
                fn = load(source)
                if exercise == "launch_full_buckets":
                    record["calls"] = calls(fn)
                with patched(_instrumented(exercise, fn, record)):
                    measured = _train(cfg, pgm, IMPL[exercise], ref)
                if exercise == "average_gradients":  # a race the run's values cannot name
                    record["race"] = race_probe(fn, pgm.gradient_sync_group)
            except LEARNER_ERRORS as err:  # a diagnosis, sys.exit() too
                if is_hang(err):
                    raise  # a collective timed out: the world cannot go on (runner.py)
                out.append({"exercise": exercise, "error": failure(err)})
                if not is_unwritten(err):
                    break  # the ranks may now disagree on the collectives to come
                continue
            out.append({"exercise": exercise, **measured, **record})
    finally:
        destroy_pg_manager()
    return out


def reference(cfg: Optional[Config] = None) -> Dict[str, Any]:
    """One device, the same run (or ``cfg``'s): losses, grad norms, weights, step 0's
    gradients."""
    trainer = reference_trainer(cfg or config())
    named = list(trainer.model.named_parameters())
    grads: Dict[str, torch.Tensor] = {}
    clip = trainer.clip_grad_norm

    def capture(max_norm: float) -> torch.Tensor:
        if not grads:
            grads.update({n: p.grad.detach().clone() for n, p in named if p.grad is not None})
        return clip(max_norm)

    trainer.clip_grad_norm = capture
    result = trainer.train()
    return {
        "losses": result.losses,
        "grad_norms": result.grad_norms,
        "state": trainer.model.state_dict(),
        "grads": grads
    }


# ---- diagnoses: from what the jobs measured, in the learner's terms -----------------------


def _scale(got: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor]) -> float:
    """The least-squares factor of ``got`` over ``ref`` (1.00 when right, 2.00 for a sum)."""
    dot = sum(float((got[n] * ref[n]).sum()) for n in ref)
    return dot / sum(float((ref[n] * ref[n]).sum()) for n in ref)


def _off(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], tol: float) -> List[str]:
    """The parameters whose gradients differ by more than ``tol``."""
    return [n for n in b if float((a[n] - b[n]).abs().max()) > tol]


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def mixing_diagnosis(runs: List[Dict[str, Any]]) -> Optional[str]:
    """average_gradients: each rank's gradients after the sync as a weighted sum of the
    gradients every rank handed it (least squares); a weight on a rank outside the rank's
    data-parallel group says which group was reduced over. None if none is outside."""
    if any("inputs" not in run for run in runs):
        return None
    columns = torch.stack(
        [torch.cat([g.double().flatten() for g in run["inputs"]]) for run in runs], dim=1)
    for r, run in enumerate(runs):
        got = torch.cat([run["grads"][n].double().flatten() for n in run["names"]])
        fit = torch.linalg.lstsq(columns, got.unsqueeze(1)).solution  # exact for a wrong group
        weights = fit.flatten().tolist()
        outside = [s for s, w in enumerate(weights) if s not in run["dp_ranks"] and abs(w) > 0.01]
        if outside and float((columns @ fit).flatten().sub(got).norm()) < 1e-3 * float(got.norm()):
            told = ", ".join(f"{w:.2f} x rank {s}'s" for s, w in enumerate(weights) if abs(w) > .01)
            return (f"rank {r}'s gradients after the sync are {told} own gradients: ranks "
                    f"{_ranks(outside)} are outside its data-parallel group (ranks "
                    f"{_ranks(run['dp_ranks'])}; the world has {len(runs)}), so the sum ran over "
                    f"another group: all-reduce over the group you are given, divide by its size")
    return None


def apart_diagnosis(runs: List[Dict[str, Any]], peers: Sequence[int], tol: float) -> str:
    """The data-parallel ranks ``peers`` hold different gradients in every parameter after the
    sync: what was measured, and the cause only where the measurement determines it."""
    want = runs[peers[0]]["want"]
    names = list(want)
    told = " and ".join(f"rank {r}'s" for r in peers)
    mean = {n: sum(runs[r]["grads"][n] for r in peers) / len(peers) for n in names}
    if not _off(mean, want, tol):  # the local gradients' mean is the reference
        return (f"{told} gradients (one data-parallel group) differ in all {len(names)} parameters "
                f"after the sync, and their mean is the reference: each rank kept its own; "
                f"all-reduce every gradient over the data-parallel group")
    scales = [_scale(run["grads"], run["want"]) for run in runs]
    if all(not _off(run["grads"], {
            n: s * g
            for n, g in run["want"].items()
    }, tol * max(1.0, s)) for run, s in zip(runs, scales)):
        told = ", ".join(f"rank {r}'s {s:.2f}x" for r, s in enumerate(scales))
        return (f"the ranks' gradients are multiples of the reference ({told}): every rank "
                f"summed the same gradients, but they scaled the sum differently; each rank "
                f"divides by N = {DP}")
    told = ", ".join(f"rank {r} {s:.2f}x" for r, s in enumerate(scales))
    return (f"{' and '.join(f'rank {r}' for r in peers)} (one data-parallel group) hold different "
            f"gradients in all {len(names)} parameters after the sync (least-squares factors "
            f"{told} of the reference), and neither their mean nor a multiple of the reference "
            f"matches: look at what each rank sends and divides")


def gradient_diagnosis(runs: List[Dict[str, Any]], ref: Dict[str, Any]) -> Optional[str]:
    """What is wrong with every rank's step-0 gradients (its own pieces, against one device's
    cut the same way), or None if they are right."""
    top = max(float(g.abs().max()) for run in runs for g in run["want"].values())
    tol = GRAD_TOL * top
    if not any(_off(run["grads"], run["want"], tol) for run in runs):
        return None
    if race_text(runs):  # measured in the call on its own: the cause, whatever the factors
        told = ", ".join(f"rank {r}'s {_scale(run['grads'], run['want']):.3f}x"
                         for r, run in enumerate(runs))
        return f"the gradients are off the reference ({told}); called on its own, {race_text(runs)}"
    text = mixing_diagnosis(runs)
    if text:
        return text
    peers = runs[0]["dp_ranks"]
    names = list(runs[0]["want"])
    apart = _off(runs[peers[1]]["grads"], runs[peers[0]]["grads"], tol)
    if len(apart) == len(names):
        return apart_diagnosis(runs, peers, tol)
    if apart:
        return (f"{len(apart)} of {len(names)} gradients differ between the ranks of a "
                f"data-parallel group (ranks {_ranks(peers)}) after the sync, first {apart[0]}: "
                f"{apart_cause(runs, peers, apart[0])}")
    scales = [_scale(run["grads"], run["want"]) for run in runs]
    if all(abs(s - DP) < 0.01 * DP for s in scales):
        # the sum, undivided: no division, one on a copy (g = g / N rebinds g) and one while
        # an async all-reduce was in flight (overwritten by its sum) all leave it so
        return (f"gradients are {scales[0]:.2f}x the reference on every rank: the sum over the "
                f"{DP} data-parallel ranks, not divided by N = {DP}; look at the division: "
                f"missing, on a copy (g = g / N rebinds g), or before the all-reduce finished? "
                f"divide each gradient in place once its sum has arrived")
    if all(abs(s - 1 / DP) < 0.01 / DP for s in scales):
        return (f"gradients are {scales[0]:.2f}x the reference on every rank: divided by N = "
                f"{DP} twice, or by the world's {len(runs)} ranks? the all-reduce sums over "
                f"the group, divide once by its size")
    told = ", ".join(f"rank {r}'s {s:.3f}x" for r, s in enumerate(scales))
    for r, run in enumerate(runs):
        off = _off(run["grads"], run["want"], tol)
        if off:
            return (f"rank {r}'s gradients are {scales[r]:.3f}x the reference, {len(off)} of "
                    f"{len(names)} parameters off, first {off[0]} (all ranks: {told}): look at "
                    f"what each gradient is summed and divided by, and in which order: a "
                    f"division while its all-reduce is in flight gives factors like these")
    return None


def parity_diagnosis(runs: List[Dict[str, Any]], ref: Dict[str, Any]) -> Optional[str]:
    """The chapter's check on every rank: losses, grad norms, weights; None if it passes.
    A run's "weight" is its largest weight difference (measured on the rank), else its
    "state" is compared with the reference's."""
    for rank, run in enumerate(runs):
        loss = max(abs(a - b) for a, b in zip(run["losses"], ref["losses"]))
        norm = max_norm_diff(run["grad_norms"], ref["grad_norms"])
        weight = run["weight"] if "weight" in run else max(
            float((run["state"][k] - v).abs().max()) for k, v in ref["state"].items())
        if loss > TOLERANCES["fp32"] or weight > TOLERANCES["fp32"] or \
                norm > NORM_TOLERANCES["fp32"]:
            return (f"step 0's gradients match, but after {len(ref['losses'])} steps rank {rank}'s "
                    f"loss is {loss:.1e}, its grad norm {norm:.1e} relative and its weights "
                    f"{weight:.1e} off the reference")
    return None


def diagnose(exercise: str, runs: List[Dict[str, Any]], ref: Dict[str, Any]) -> Verdict:
    """The verdict of one exercise from every rank's measurements of its job."""
    failed = error_verdict(exercise, runs)
    if failed is not None:
        return failed
    special = {
        "launch_full_buckets": lambda runs: launch_diagnosis(runs) or call_diagnosis(runs),
        "wait_for_buckets": wait_diagnosis
    }
    text = special[exercise](runs) if exercise in special else None
    text = text or gradient_diagnosis(runs, ref)
    if text is None and race_text(runs):  # the race went well in step 0, or in every step
        text = f"{parity_diagnosis(runs, ref) or 'the run matches'}; called on its own, " \
            f"{race_text(runs)}"
    text = text or parity_diagnosis(runs, ref)
    return Verdict(exercise, text is None, text or "passed")


def grade(jobs: List[Dict[str, Source]]) -> List[Verdict]:
    """Every job (one exercise each, in order) graded in one world of WORLD ranks."""
    ref = reference()
    return per_job(jobs, run_world(rank_jobs, WORLD, jobs),
                   lambda exercise, runs: diagnose(exercise, runs, ref))


def solution_jobs() -> List[Dict[str, Source]]:
    return [{name: (LIBRARY, name)} for name in EXERCISES]


def exercise_jobs(path: str) -> List[Dict[str, Source]]:
    return [{name: (path, name)} for name in EXERCISES]
