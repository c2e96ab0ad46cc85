"""Grading chapter 01's exercises (examples/exercises/01_ddp.py) on 2 gloo ranks.

Each job trains chapter 01's run (examples/configs/01_ddp.yaml, ``STEPS`` steps) with the
learner's functions in place of scaletorch/parallel/gradient_sync.py's, and measures: every
rank's gradients of step 0 after the sync (before clipping), the losses, grad norms and final
weights; for the bucketed wrapper, each bucket launch (how many of its gradients had arrived,
inside backward or not) and which of the works the learner waited for. The parent compares them
with one device (``reference``) and says what is wrong in the learner's terms.
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from scaletorch.dist import destroy_pg_manager, get_ledger, init_pg_manager_from_config
from scaletorch.models import build_model
from scaletorch.parallel import data_parallel
from scaletorch.parallel.data_parallel import BucketedDataParallel, apply_data_parallel
from scaletorch.parallel.grad_norm import clip_replicated
from scaletorch.trainer import Config, Trainer, parse_args
from scaletorch.trainer.parity import max_norm_diff, reference_trainer
from scaletorch.trainer.precision import NORM_TOLERANCES, TOLERANCES
from scripts.grading.runner import (LEARNER_ERRORS, Source, Verdict, collective_timeout,
                                    error_verdict, failure, is_hang, is_unwritten, load, patched,
                                    per_job, run_world, streamed)

CHAPTER = "01"
EXERCISES = ("average_gradients", "launch_full_buckets", "wait_for_buckets")
LIBRARY = "scaletorch.parallel.gradient_sync"
WORLD = 2
AGAINST = "one device"  # what the jobs are compared with
STEPS = 3
# Step 0's gradients, relative to the largest reference element: the same sums in another
# order differ by about 1e-7 (fp32); a gradient off by 0.1% is 1e-3 off.
GRAD_TOL = 1e-4
IMPL = {"average_gradients": "naive", "launch_full_buckets": "ours", "wait_for_buckets": "ours"}


def config() -> Config:
    cfg = parse_args(["--config", "examples/configs/01_ddp.yaml", "--steps", str(STEPS)])
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
                                                       list]) -> List[Tuple[object, str, object]]:
    """The patches that put ``fn`` in place of the library's ``exercise`` and record what it
    did: each bucket launch (step, bucket, gradients arrived, of how many, inside backward) and
    each step's waits."""
    launch = BucketedDataParallel._launch

    def recorded_launch(self: BucketedDataParallel, bucket: Any, in_backward: bool) -> None:
        record["launches"].append(
            (get_ledger().step, bucket.index, bucket.ready, len(bucket.param_ids), in_backward))
        launch(self, bucket, in_backward)

    def counted_wait(works: Sequence[Any]) -> None:
        counted = [_CountedWork(w) if w is not None else None for w in works]
        fn(counted)
        record["waits"].append([c.waits if c is not None else 1 for c in counted])

    value = counted_wait if exercise == "wait_for_buckets" else fn
    return [(data_parallel, exercise, value), (BucketedDataParallel, "_launch", recorded_launch)]


def _train(cfg: Config, pgm: Any, impl: str) -> Dict[str, Any]:
    model = build_model(cfg.model, seed=cfg.training.model_seed)
    wrapped = apply_data_parallel(model, pgm, impl, cfg.parallel.bucket_size_mb)
    named = list(model.named_parameters())
    grads: Dict[str, torch.Tensor] = {}

    def clip(max_norm: float) -> torch.Tensor:
        if not grads:  # step 0, after the sync, before clipping
            grads.update({n: p.grad.detach().clone() for n, p in named if p.grad is not None})
        return clip_replicated([p for _, p in named], max_norm)

    result = Trainer(cfg, wrapped, pgm, device=torch.device("cpu"), clip_grad_norm=clip,
                     verbose=False).train()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {
        "losses": result.losses,
        "grad_norms": result.grad_norms,
        "state": state,
        "grads": grads
    }


def rank_jobs(rank: int, world: int, jobs: List[Dict[str, Source]]) -> List[Dict[str, Any]]:
    """Inside a rank: each job ({exercise: source}, one exercise each) trained and measured."""
    cfg = config()
    pgm = init_pg_manager_from_config(cfg.parallel, collective_timeout())  # the jobs' groups
    out = streamed()
    try:
        for job in jobs:
            (exercise, source), = job.items()
            record: Dict[str, list] = {"launches": [], "waits": []}
            try:
                with patched(_instrumented(exercise, load(source), record)):
                    measured = _train(cfg, pgm, IMPL[exercise])
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


def _off(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor], scale: float) -> List[str]:
    """The parameters whose gradients differ by more than GRAD_TOL x ``scale``."""
    return [n for n in b if float((a[n] - b[n]).abs().max()) > GRAD_TOL * scale]


def apart_diagnosis(runs: List[Dict[str, Any]], ref: Dict[str, Any], top: float) -> str:
    """The ranks' gradients differ in every parameter after the sync: what was measured, and
    the cause only where the measurement determines it."""
    names = list(ref["grads"])
    mean = {n: sum(run["grads"][n] for run in runs) / len(runs) for n in names}
    if not _off(mean, ref["grads"], top):  # the local gradients' mean is the reference
        return (f"rank 0's and rank 1's gradients differ in all {len(names)} parameters after "
                f"the sync, and their mean is the reference: each rank kept its own; "
                f"all-reduce every gradient over the data-parallel group")
    scales = [_scale(run["grads"], ref["grads"]) for run in runs]
    scaled = [{n: s * g for n, g in ref["grads"].items()} for s in scales]
    if all(not _off(run["grads"], want, top * max(1.0, s))
           for run, want, s in zip(runs, scaled, scales)):
        told = ", ".join(f"rank {r}'s {s:.2f}x" for r, s in enumerate(scales))
        return (f"the ranks' gradients are multiples of the reference ({told}): every rank "
                f"summed the same gradients, but they scaled the sum differently; each rank "
                f"divides by N = {WORLD}")
    told = ", ".join(f"rank {r} {s:.2f}x" for r, s in enumerate(scales))
    return (f"the ranks' gradients differ in all {len(names)} parameters after the sync "
            f"(least-squares factors {told} of the reference), and neither their mean nor a "
            f"multiple of the reference matches: look at what each rank sends and divides")


def gradient_diagnosis(runs: List[Dict[str, Any]], ref: Dict[str, Any]) -> Optional[str]:
    """What is wrong with every rank's step-0 gradients, or None if they are right."""
    top = max(float(g.abs().max()) for g in ref["grads"].values())
    names = list(ref["grads"])
    apart = _off(runs[1]["grads"], runs[0]["grads"], top)
    if len(apart) == len(names):
        return apart_diagnosis(runs, ref, top)
    if apart:
        return (f"{len(apart)} of {len(names)} gradients differ between the ranks, first "
                f"{apart[0]}: every gradient must go through the all-reduce")
    scale = _scale(runs[0]["grads"], ref["grads"])
    if abs(scale - WORLD) < 0.01 * WORLD:
        return (f"gradients are {scale:.2f}x the reference on every rank: did you average over "
                f"the data-parallel ranks? divide the all-reduced sum by N = {WORLD}")
    if abs(scale - 1 / WORLD) < 0.01 / WORLD:
        return (f"gradients are {scale:.2f}x the reference on every rank: divided by N = "
                f"{WORLD} twice? the all-reduce sums, divide once")
    off = _off(runs[0]["grads"], ref["grads"], top)
    if off:
        return (f"gradients are {scale:.3f}x the reference, {len(off)} of {len(names)} "
                f"parameters off, first {off[0]}")
    return None


def parity_diagnosis(runs: List[Dict[str, Any]], ref: Dict[str, Any]) -> Optional[str]:
    """The chapter's check on every rank: losses, grad norms, weights; None if it passes."""
    for rank, run in enumerate(runs):
        loss = max(abs(a - b) for a, b in zip(run["losses"], ref["losses"]))
        norm = max_norm_diff(run["grad_norms"], ref["grad_norms"])
        weight = max(float((run["state"][k] - v).abs().max()) for k, v in ref["state"].items())
        if loss > TOLERANCES["fp32"] or weight > TOLERANCES["fp32"] or \
                norm > NORM_TOLERANCES["fp32"]:
            return (f"step 0's gradients match, but after {STEPS} steps rank {rank}'s loss is "
                    f"{loss:.1e}, its grad norm {norm:.1e} relative and its weights {weight:.1e} "
                    f"off the reference")
    return None


def launch_diagnosis(runs: List[Dict[str, Any]]) -> Optional[str]:
    for run in runs:
        seen: Dict[Tuple[int, int], int] = {}
        for step, bucket, ready, size, _ in run["launches"]:
            if ready < size:
                return (f"bucket {bucket}'s all-reduce started with {ready} of its {size} "
                        f"gradients: launch a bucket only when its last gradient has arrived")
            seen[(step, bucket)] = seen.get((step, bucket), 0) + 1
        if not seen:  # (a launch that never runs: its buckets are left to the wait)
            return ("no bucket's all-reduce started during backward: launch each bucket as "
                    "soon as its last gradient has arrived")
        (step, bucket), times = max(seen.items(), key=lambda kv: kv[1])
        if times > 1:
            return (f"bucket {bucket} was all-reduced {times} times in step {step}: return the "
                    f"index of the next bucket to launch, past the ones you launched")
        if not any(inside for *_, inside in run["launches"]):
            n = len({b for _, b, *_ in run["launches"]})
            return (f"none of the {n} buckets started its all-reduce during backward: launch "
                    f"each as soon as it is full, so that it overlaps the rest of backward")
    return None


def wait_diagnosis(runs: List[Dict[str, Any]]) -> Optional[str]:
    skipped = {
        rank: sorted({k
                      for waits in run["waits"]
                      for k, n in enumerate(waits) if n == 0})
        for rank, run in enumerate(runs)
    }
    buckets = len(runs[0]["waits"][0]) if runs[0]["waits"] else 0
    if all(len(s) == buckets for s in skipped.values()):
        return ("no rank waited for any bucket's all-reduce before the step: the optimizer "
                "read gradients still in flight; call wait() on every work")
    lazy = [rank for rank, s in skipped.items() if len(s) == buckets]
    if lazy:
        return (f"rank {lazy[0]} waited for no bucket, the others for all: every rank must "
                f"wait before its own step")
    for rank, s in skipped.items():
        if s:
            return (f"bucket {s[-1]} of 0-{buckets - 1} was never waited for (rank {rank}): "
                    f"wait for every bucket, the last one launched too")
    return None


def diagnose(exercise: str, runs: List[Dict[str, Any]], ref: Dict[str, Any]) -> Verdict:
    """The verdict of one exercise from every rank's measurements of its job."""
    failed = error_verdict(exercise, runs)
    if failed is not None:
        return failed
    special = {"launch_full_buckets": launch_diagnosis, "wait_for_buckets": wait_diagnosis}
    text = special[exercise](runs) if exercise in special else None
    text = text or gradient_diagnosis(runs, ref) or parity_diagnosis(runs, ref)
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
