"""Grading chapter 04's exercises (examples/exercises/04_pipeline_parallel.py) on 3 gloo ranks.

Each job trains chapter 04's run (examples/configs/04_pipeline_parallel.yaml, 1F1B) at pp 3, one
layer a stage, ``MICRO_BATCHES`` micro-batches, ``STEPS`` steps, with the learner's function in
place of scaletorch/parallel/pipeline_schedules.py's. Three stages, so that each warm-up length
of 1F1B (2, 1, 0 forwards) occurs and the middle rank sends and receives both ways. Every rank
measures: the actions of step 0 in order and the most activations held at once, each backward
called without its gradient, step 0's messages (which micro-batch each carried, the label it
was given, which forward or backward used it), step 0's gradients of its stage, the losses,
grad norms and final weights. The parent compares them with 1F1B's order
(``one_f_one_b_actions``) and with one device (scripts/grading/pipeline_diagnoses.py), and says
what is wrong in the learner's terms.

A hang is a diagnosis. Each send and receive is waited for at most ``HANG_TIMEOUT``: on gloo
they wait for the group's creation timeout (startup_timeout, 120 s), not the one set after it,
so the grader passes its own to ``wait``. Each rank writes down the named operation it waits
in (torch's flight recorder keeps no point-to-point entries on gloo), and the grader names the
ranks, the operations, their peers and the messages before it; a new world grades the next job.
"""

import datetime
import os
import re
import sys
import time
import traceback
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from scaletorch.dist import comm, destroy_pg_manager, get_ledger, init_pg_manager_from_config
from scaletorch.models import build_model
from scaletorch.parallel import pipeline_schedules
from scaletorch.parallel.pipeline_parallel import apply_pipeline_parallel
from scaletorch.parallel.pipeline_schedules import PipelineLoop, PipelineRank
from scaletorch.parallel.tensor_parallel import tensor_parallel_clip_grad_norm
from scaletorch.schedule.orders import message
from scaletorch.trainer import Config, Trainer, parse_args
from scaletorch.trainer.parity import reference_trainer
from scaletorch.trainer.pipeline_state import gather_pipeline_state_dict
from scripts.grading import pipeline_groups
from scripts.grading.learner import (LEARNER_ERRORS, Source, failure, is_hang, is_unwritten, load,
                                     patched)
from scripts.grading.pipeline_diagnoses import (MicroBatchNotHeld, detached_return,
                                                gradient_diagnosis, hang_diagnosis, link_facts,
                                                loss_scales, not_held, order_diagnosis,
                                                parity_diagnosis, stage_diagnosis, waited_for)
from scripts.grading.runner import RANK_LIMITS, run_world, streamed
from scripts.grading.stop_reports import where_stopped
from scripts.grading.verdicts import Verdict, error_verdict

CHAPTER = "04"
EXERCISES = ("one_f_one_b", "micro_batch_loss")
LIBRARY = "scaletorch.parallel.pipeline_schedules"
WORLD = 3  # pp 3: a first, a middle and a last stage
# what the headline adds: where a 1F1B that passes is graded again (pipeline_groups.py)
ALSO = (f"; a 1F1B that passes, again at {pipeline_groups.NAME} ({pipeline_groups.WORLD} ranks, "
        f"the pipeline a subgroup)")
# m >= p; 4, not the chapter's 8: every phase of 1F1B on every rank (rank 0: 2 warm-up forwards,
# 2 steady, 2 cool-down backwards) at half the job's cost, and m differs from p, p - 1, m / p
MICRO_BATCHES = 4
AGAINST = "one device"
STEPS = 3
# Seconds a rank waits in a send or receive before the grader calls it a hang: a message
# waits for one micro-batch of a 1-layer stage (milliseconds), so 10 s is slack for a loaded
# machine, and a deadlock costs the learner 10 s.
HANG_TIMEOUT = 10.0
RANK_LIMITS.append((__name__, "HANG_TIMEOUT"))  # the ranks wait the parent's (runner.py)
# On a loaded machine a rank may wait that long for a peer that computes (at a load of 54 on 2
# cores the library's own loop timed out at 10 s): the limit grows with the load per core, to
# at most LOAD_STRETCH x, below the parent's 30 s without progress (runner.STALL_LIMIT).
LOAD_STRETCH = 2.5


def message_limit() -> float:
    """Seconds a send or receive waits here and now: ``HANG_TIMEOUT``, stretched by the load."""
    load = os.getloadavg()[0] / (os.cpu_count() or 1)
    return HANG_TIMEOUT * min(max(load, 1.0), LOAD_STRETCH)


def config() -> Config:
    cfg = parse_args([
        "--config", "examples/configs/04_pipeline_parallel.yaml", "--steps",
        str(STEPS), "--pp",
        str(WORLD), "--model.num_layers",
        str(WORLD), "--micro-batches",
        str(MICRO_BATCHES)
    ])
    cfg.logging.progress = False
    return cfg


def _instrumented(exercise: str, fn: Any, record: Dict[str, Any]) -> List[tuple]:
    """The patches that put ``fn`` in the library's place and record what the stage did."""
    forward, backward, batch = PipelineRank.forward, PipelineRank.backward, PipelineRank._batch
    recv_backward, wait = PipelineRank.recv_backward, comm.Work.wait
    # step 0's tensors by id: (kind, micro-batch, the tensor, kept so that its id stays its own)
    made: Dict[int, Tuple[str, int, Any]] = {}
    arrived: Dict[int, Tuple[int, Any]] = {}  # id -> (its index in "received", the tensor)

    def ran(self: PipelineRank) -> List[str]:  # its actions ("F0", "B0", ...): one step's rank
        return self.__dict__.setdefault("_graded_actions", [])

    def used(t: Any, mb: int) -> None:  # a received tensor given to micro-batch mb's action
        hit = arrived.pop(id(t), None) if t is not None else None
        if hit is not None:
            record["received"][hit[0]][3] = mb

    def recorded_forward(self: PipelineRank, mb: int, x: Any) -> Any:
        step0 = get_ledger().step == 0
        if step0:
            used(x, mb)
        out = forward(self, mb, x)
        ran(self).append(f"F{mb}")
        if step0:
            record["actions"].append(f"F{mb}")
            record["peak"] = max(record["peak"], len(self.held))
            if out is not None:
                made[id(out)] = ("activation", mb, out)
        return out

    def recorded_backward(self: PipelineRank, mb: int, dy: Any) -> Any:
        if dy is None and not self.last:  # no gradient: receive it for the learner, go on
            record["no_grad"].append((get_ledger().step, mb))
            dy = recv_backward(self, mb)
        step0 = get_ledger().step == 0
        if mb not in self.held:  # the library would raise KeyError: say what was asked
            raise MicroBatchNotHeld(not_held(self.rank, mb, get_ledger().step, ran(self)))
        if step0:
            used(dy, mb)
            record["actions"].append(f"B{mb}")
        ran(self).append(f"B{mb}")
        dx = backward(self, mb, dy)
        if step0 and dx is not None:
            made[id(dx)] = ("gradient", mb, dx)
        return dx

    def recorded_batch(self: PipelineRank, name: str, sends: list, recvs: list) -> Any:
        caller = sys._getframe(2)  # the learner's line that called the named operation
        step = get_ledger().step
        messages = [message(mb, peer, True) for mb, peer, y in sends if peer is not None]
        messages += [message(mb, peer, False) for mb, peer in recvs if peer is not None]
        kind = lambda peer: "activation" if peer == self.next else "gradient"  # noqa: E731
        pp = lambda peer: self.rank + (1 if peer == self.next else -1)  # noqa: E731
        if step == 0:  # what each send carries: the output of which forward or backward
            for mb, peer, y in sends:
                if peer is not None and y is not None:
                    k, of, _ = made.get(id(y), (None, -1, None))
                    record["sent"].append([kind(peer), mb, pp(peer), of if k == kind(peer) else -1])
        # what each receive waits for: a gradient from the next rank, an activation the previous
        wants = [["gradient" if peer == self.next else "activation", mb,
                  pp(peer)] for mb, peer in recvs if peer is not None]
        record["waiting"] = {
            "step": step,
            "call": f"{name}({', '.join(messages)})",
            "sends": any(peer is not None for _, peer, _ in sends),
            "recvs": bool(wants),
            "wants": wants,
            "where": f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}",
            "since": time.perf_counter()
        }
        out = batch(self, name, sends, recvs)
        record["waiting"] = None
        for mb, peer in recvs:  # activations come from the previous rank, gradients the next
            if step == 0 and peer is not None and out is not None:
                arrived[id(out)] = (len(record["received"]), out)
                of = "activation" if peer == self.prev else "gradient"
                record["received"].append(
                    [of, mb, self.rank + (-1 if of == "activation" else 1), -1])
        return out

    def own(op: str, call: Any) -> Any:  # torch.distributed's blocking send or recv, waited in

        def waited_in(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            peer = args[1] if len(args) > 1 else kwargs.get("dst" if op == "send" else "src")
            tag = args[3] if len(args) > 3 else kwargs.get("tag", 0)
            before = record["waiting"]
            record["waiting"] = {
                "step": get_ledger().step,
                "call": f"torch.distributed.{op}({'to' if op == 'send' else 'from'} rank {peer}"
                f"{f', tag {tag}' if tag else ''})",
                "sends": op == "send",
                "recvs": op == "recv",
                "own": peer,
                "where": f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}",
                "since": time.perf_counter()
            }
            out = call(*args, **kwargs)
            record["waiting"] = before
            return out

        return waited_in

    def bounded_wait(self: comm.Work, *args: Any) -> Any:
        if args:
            return wait(self, *args)
        record["limit"] = message_limit()
        return wait(self, datetime.timedelta(seconds=record["limit"]))

    schedules = {**pipeline_schedules.SCHEDULES}
    if exercise == "one_f_one_b":
        schedules["1f1b"] = fn
    loss = fn if exercise == "micro_batch_loss" else pipeline_schedules.micro_batch_loss
    return [(pipeline_schedules, "SCHEDULES", schedules),
            (pipeline_schedules, "micro_batch_loss", loss),
            (PipelineRank, "forward", recorded_forward),
            (PipelineRank, "backward", recorded_backward), (PipelineRank, "_batch", recorded_batch),
            (comm.Work, "wait", bounded_wait), (dist, "send", own("send", dist.send)),
            (dist, "recv", own("recv", dist.recv))]


def _grads_of(module: torch.nn.Module) -> Dict[str, float]:
    """Each tensor's squared gradient norm, by its full model name."""
    return {
        k: float(t.grad.float().square().sum()) if t.grad is not None else 0.0
        for k, t in module.state_dict(keep_vars=True).items()
    }


def _recording(clip: Any, module: torch.nn.Module, grads: Dict[str, float]) -> Any:
    """``clip`` that first writes step 0's gradients of ``module`` into ``grads``."""

    def recorded(max_norm: float) -> Any:
        if get_ledger().step == 0 and not grads:
            grads.update(_grads_of(module))
        return clip(max_norm)

    return recorded


def _train(cfg: Config, pgm: Any, record: Dict[str, Any]) -> Dict[str, Any]:
    model = build_model(cfg.model, seed=cfg.training.model_seed)
    pipe = apply_pipeline_parallel(model, pgm, 1, cfg.parallel.layer_split)
    loop = PipelineLoop(pipe, pgm, "1f1b", cfg.data.num_micro_batches)
    clip = tensor_parallel_clip_grad_norm(pipe, pgm)  # the global norm over the stages
    clip = _recording(clip, pipe.chunks[0], record["stage_grads"])
    result = Trainer(cfg, pipe, pgm, device=torch.device("cpu"), forward_backward=loop,
                     clip_grad_norm=clip, verbose=False).train()
    return {
        "losses": result.losses,
        "grad_norms": result.grad_norms,
        "state": gather_pipeline_state_dict(pipe, pgm)  # rank 0's, None elsewhere
    }


def rank_jobs(rank: int, world: int, jobs: List[Dict[str, Source]]) -> List[Dict[str, Any]]:
    """Inside a rank: each job trained and measured; a hang ends the jobs with what each rank
    waited in (marked as an error: a new world grades the next job)."""
    cfg = config()
    pgm = init_pg_manager_from_config(cfg.parallel, HANG_TIMEOUT)
    out = streamed()
    try:
        for job in jobs:
            (exercise, source), = job.items()
            record, detached = pipeline_groups.empty_record(), None
            try:
                fn = load(source)
                if exercise == "micro_batch_loss":  # every rank, before anything is sent
                    detached = detached_return(fn, cfg.data.num_micro_batches)
                if detached is not None:  # every rank alike: the world goes on to the next job
                    out.append({"exercise": exercise, **detached})
                    continue
                if exercise == "micro_batch_loss":  # its divisor, at several m (p = m - 1 here)
                    record["scales"] = loss_scales(fn, cfg.data.num_micro_batches)
                with patched(_instrumented(exercise, fn, record)):
                    measured = _train(cfg, pgm, record)
            except LEARNER_ERRORS as err:  # a diagnosis, sys.exit() too
                if is_hang(err) and record["waiting"] is not None:
                    waiting = record["waiting"]
                    waiting["waited"] = time.perf_counter() - waiting.pop("since")
                    waiting["limit"] = record.get("limit", HANG_TIMEOUT)
                    waiting["messages"] = {"sent": record["sent"], "received": record["received"]}
                    waiting["actions"] = record["actions"]
                    # the ranks' messages are out of step: the world cannot go on
                    out.append({"exercise": exercise, "stuck": waiting, "error": "stuck"})
                    break
                hung = {}
                if is_hang(err):  # waits outside a send or receive: where, and what it ran
                    # the Trainer names the collective it waited in; else the innermost frame
                    said = re.search(r"the last collective issued was ([^:]+)", str(err))
                    hung = {
                        "step":
                        get_ledger().step,
                        "actions":
                        record["actions"],
                        "messages": {
                            "sent": record["sent"],
                            "received": record["received"]
                        },
                        "in":
                        said.group(1)
                        if said else where_stopped(traceback.format_exc(), [], "", False)
                    }
                out.append({
                    "exercise": exercise,
                    "error": failure(err),
                    "hung": is_hang(err),
                    **hung
                })
                if not is_unwritten(err):
                    break
                continue
            record.pop("waiting")
            record.pop("limit", None)
            out.append({"exercise": exercise, **measured, **record})
    finally:
        destroy_pg_manager()
    return out


def reference() -> Dict[str, Any]:
    """One device, the same run: losses, grad norms, weights, step 0's gradients by name."""
    threads = torch.get_num_threads()
    # one thread, as the ranks run: on 2 busy cores torch's second thread spins (9 s of CPU for
    # this run under load, 0.25 s on one thread)
    torch.set_num_threads(1)
    try:
        trainer = reference_trainer(config())
        grads: Dict[str, float] = {}
        trainer.clip_grad_norm = _recording(trainer.clip_grad_norm, trainer.model, grads)
        result = trainer.train()
    finally:
        torch.set_num_threads(threads)
    return {
        "losses": result.losses,
        "grad_norms": result.grad_norms,
        "state": trainer.model.state_dict(),
        "grads": grads
    }


def diagnose(exercise: str, runs: List[Dict[str, Any]], ref: Dict[str, Any]) -> Verdict:
    """The verdict of one exercise from every rank's measurements of its job."""
    m = config().data.num_micro_batches
    runs = waited_for(runs)
    # a rank that died or raised is the cause; the others' waits for it, the consequence
    # ranks that only wait (in a send or receive, or a collective): a hang, not a raw timeout
    if any("stuck" in r or r.get("hung") for r in runs) and not any(
            "lost" in r or ("error" in r and "stuck" not in r and not r.get("hung")) for r in runs):
        return Verdict(exercise, False, hang_diagnosis(runs, m))
    # a rank stuck because a peer raised: the peer's error is the verdict, named by its rank;
    # a rank that raised its own error is the cause, the others' broken connections (a hang's
    # error: they waited for it) the consequence
    own = any("error" in r and "stuck" not in r and not r.get("hung") for r in runs)
    failed = error_verdict(exercise, [{
        k: v
        for k, v in r.items() if k != "error"
    } if "stuck" in r or (own and r.get("hung")) else r for r in runs])
    if failed is not None:
        return failed
    checked = [r["before_run"] for r in runs if "before_run" in r]
    if checked:  # micro_batch_loss's return, checked on each rank before the run (not run)
        return Verdict(exercise, False, f"{exercise}, checked before the run: {checked[0]}")
    for rank, run in enumerate(runs):
        if run["no_grad"]:
            step, mb = run["no_grad"][0]
            return Verdict(
                exercise, False,
                f"rank {rank} ran the backward of micro-batch {mb} in step {step} without its "
                f"gradient: in the cool-down, recv_backward({mb}) from rank {rank + 1} first")
    facts = link_facts(runs, m, True)
    text = order_diagnosis(runs, m) or (facts[0] if facts else None) or \
        gradient_diagnosis(runs, ref, m) or stage_diagnosis(runs, ref) or \
        parity_diagnosis(runs, ref, STEPS)
    return Verdict(exercise, text is None, text or "passed")


def subgroup_rank_jobs(rank: int, world: int, jobs: List[Dict[str, Source]]) -> List[Any]:
    """Inside a rank of pipeline_groups.py's pp 2 x dp 2 world: its measurements of each job."""
    return pipeline_groups.rank_jobs(jobs, _instrumented, _train, HANG_TIMEOUT)


def grade(jobs: List[Dict[str, Source]]) -> List[Verdict]:
    """Every job (one exercise each, in order) graded in one world of WORLD ranks; each
    one_f_one_b that passed, again where the pipeline is a subgroup (pipeline_groups.py)."""
    ref = reference()
    results = run_world(rank_jobs, WORLD, jobs)
    verdicts = [
        diagnose(next(iter(job)), [r[i] for r in results], ref) for i, job in enumerate(jobs)
    ]
    return pipeline_groups.regrade(jobs, verdicts, subgroup_rank_jobs)


def solution_jobs() -> List[Dict[str, Source]]:
    return [{name: (LIBRARY, name)} for name in EXERCISES]


def exercise_jobs(path: str) -> List[Dict[str, Source]]:
    return [{name: (path, name)} for name in EXERCISES]
