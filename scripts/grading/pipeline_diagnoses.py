"""Chapter 04's diagnoses (scripts/grading/pipeline.py): from what each rank measured in step 0
and over the run, in the learner's terms, for a pipeline of ``p`` ranks and ``m`` micro-batches.

Each rank's run holds: "actions" (step 0's F<mb> and B<mb> in order), "peak" (activations held
at once), "sent" and "received" (step 0's messages: [kind, label, pipeline rank of the peer,
mb], kind "activation" or "gradient", label the micro-batch the named operation was given, mb
the micro-batch whose forward or backward produced the tensor sent, or whose forward or
backward used the tensor received; -1 where the tensor was none of those), "stage_grads" (step
0's squared gradient norm of each of the stage's tensors), "losses", "grad_norms", "state".
"""

import linecache
import os
import re
import sys
from typing import Any, Callable, Dict, List, Optional

import torch

from scaletorch.schedule.orders import one_f_one_b_actions
from scaletorch.trainer.parity import max_norm_diff
from scaletorch.trainer.precision import NORM_TOLERANCES, TOLERANCES

# A gradient off by a factor: within 1% of it (fp32 norms agree to 1e-4 when right).
FACTOR_TOL = 0.01
OPERATION = {
    ("activation", True): "send_forward",
    ("activation", False): "recv_forward",
    ("gradient", True): "send_backward",
    ("gradient", False): "recv_backward"
}


def _mbs(mbs: List[int]) -> str:
    return ", ".join(str(k) for k in mbs)


def link_facts(runs: List[Dict[str, Any]], m: int, finished: bool) -> List[str]:
    """What each link's messages of step 0 show: a micro-batch sent twice or never (``finished``:
    the step ended; otherwise only one skipped below a later one), a label that is not the
    micro-batch carried, a forward or backward run on another micro-batch's message. Messages
    of one link arrive in the order sent, so the k-th receive holds the k-th send."""
    facts: List[str] = []
    p = len(runs)
    for rank, run in enumerate(runs):
        for kind, peer in (("activation", rank + 1), ("gradient", rank - 1)):
            # a link neither end used a named operation on (torch.distributed's own calls) is
            # not seen: nothing to say of it
            seen = [
                m for r in (run, runs[peer] if 0 <= peer < p else {})
                for m in r.get("sent", []) + r.get("received", [])
            ]
            if not 0 <= peer < p or not seen:
                continue
            sent = [s for s in run.get("sent", []) if s[0] == kind]
            carried = [s[3] for s in sent if s[3] >= 0]
            twice = sorted({k for k in carried if carried.count(k) > 1})
            if twice:
                facts.append(f"rank {rank} sent the {kind} of micro-batch {_mbs(twice)} to rank "
                             f"{peer} {carried.count(twice[0])} times in step 0")
            top = max(carried, default=-1)
            never = [k for k in range(m if finished else top) if k not in carried]
            if never and len(carried) == len(sent):
                facts.append(f"rank {rank} sent no {kind} of micro-batch {_mbs(never)} to rank "
                             f"{peer} in step 0 (it sent {_mbs(carried) or 'none'})")
            for _, label, _, mb in sent:
                if mb >= 0 and label != mb:
                    facts.append(f"rank {rank} sent the {kind} of micro-batch {mb} to rank {peer} "
                                 f"labelled micro-batch {label} ({OPERATION[kind, True]}({label}"
                                 f", ...)): the label names the message in traces and hangs")
            got = [g for g in runs[peer].get("received", []) if g[0] == kind]
            action = "forward" if kind == "activation" else "backward"
            for (_, _, _, mb), (_, label, _, used) in zip(sent, got):
                if mb >= 0 and used >= 0 and used != mb:
                    facts.append(f"rank {peer} ran the {action} of micro-batch {used} on rank "
                                 f"{rank}'s {kind} of micro-batch {mb}")
                elif used >= 0 and label != used:
                    facts.append(f"rank {peer} received the {kind} of micro-batch {used} "
                                 f"labelled micro-batch {label} ({OPERATION[kind, False]}"
                                 f"({label})): the label names the message in traces and hangs")
    return facts


# the parent's words for a rank it stopped, still running, once the others had left or while
# no rank progressed (runner.py)
STOPPED = re.compile(r"rank \d+ (?:was stopped in (.+?), after another rank had left|"
                     r"made no progress \([^)]*\), stopped in (.+))")


def waited_for(runs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """``runs`` with each rank the parent stopped after the others left as {"never": where it
    was}, when the others left because they gave up waiting in a send or receive ("stuck"):
    the ranks waited for it, it is no victim of their leaving."""
    if not any("stuck" in r for r in runs):
        return runs
    out = []
    for run in runs:
        lost = run.get("lost", "")
        parts = [STOPPED.fullmatch(t) for t in lost.split("; ")] if lost else []
        out.append({
            "exercise": run["exercise"],
            "never": parts[0].group(1) or parts[0].group(2)
        } if parts and all(parts) and len(parts) == 1 else run)
    return out


def hang_diagnosis(runs: List[Dict[str, Any]], m: int) -> str:
    """The ranks, the operations they wait in and their peers; why, when the pattern says; what
    the messages sent before it show."""
    stuck = [run.get("stuck") for run in runs]
    step = next((s["step"] for s in stuck if s is not None), None)
    step = next((r["step"] for r in runs if "step" in r), 0) if step is None else step
    waits = [
        f"rank {rank} waits in {s['call']} at {s['where']}" if s is not None else _outside(
            rank, runs[rank], len(runs), m, step) for rank, s in enumerate(stuck)
    ]
    # a rank the others waited for, still outside any send or receive, first: the cause; the
    # others' operations only say what they waited in (all sends wait for a rank that never came)
    never = [w for w in waits if "never reached" in w]
    text = f"hang in step {step}: " + "; ".join(never +
                                                [", ".join(w for w in waits if w not in never)])
    unsent = _unsent(runs, stuck) if step == 0 else []
    for rank, s in enumerate(stuck):  # torch.distributed's own send, no receive posted for it
        peer = (s or {}).get("own")
        if s is not None and s["sends"] and isinstance(peer, int) and 0 <= peer < len(runs) \
                and stuck[peer] is not None and stuck[peer].get("own") != rank:
            unsent.insert(
                0, f"rank {peer} posts no receive for rank {rank}'s {s['call']} at "
                f"{s['where']}: it waits in {stuck[peer]['call']}")
    text += "".join(f"; {fact}" for fact in unsent)
    waiting = [s for s in stuck if s is not None] if not never else []
    if len(waiting) > 1 and all(s["sends"] and not s["recvs"] for s in waiting):
        text += (" (all send first): a send waits for its receive, so post each send with the "
                 "receive that answers it in one batch (send_forward_recv_backward, "
                 "send_backward_recv_forward)")
    # every rank in a receive, none left the loop: a cycle of receives, none of them answered
    elif len(waiting) == len(runs) > 1 and not unsent and \
            all(s["recvs"] and not s["sends"] for s in waiting):
        text += " (all receive first): one of them must send first"
    facts = link_facts([s.get("messages", {}) if s else {} for s in stuck], m, False) \
        if step == 0 else []
    if facts:
        text += f"; before it {'; '.join(facts[:2])}"
    waiting = [s for s in stuck if s is not None]
    if not waiting:
        return text
    waited, limit = max(s["waited"] for s in waiting), max(s["limit"] for s in waiting)
    return text + (f"; they gave up after {waited:.0f} s (the grader's timeout for a message: "
                   f"{limit:.0f} s at this machine's load)")


def _unsent(runs: List[Dict[str, Any]], stuck: List[Optional[Dict[str, Any]]]) -> List[str]:
    """Each message of step 0 a rank waits to receive whose sender ran the forward or backward
    that makes it but sent it to no one (its messages and actions as measured up to the hang)."""
    facts = []
    for rank, s in enumerate(stuck):
        for kind, mb, peer in (s or {}).get("wants", []):
            if not 0 <= peer < len(runs):
                continue
            theirs = stuck[peer] or runs[peer]
            messages, actions = theirs.get("messages"), theirs.get("actions") or []
            action = ("F" if kind == "activation" else "B") + str(mb)
            if messages is None or action not in actions:
                continue  # not measured, or it never got that far: waiting itself
            sent = [x for x in messages["sent"] if x[0] == kind and x[2] == rank]
            if any(mb in (x[1], x[3]) for x in sent):
                continue
            name = "forward" if kind == "activation" else "backward"
            facts.append(f"rank {peer} ran the {name} of micro-batch {mb} but never sent its "
                         f"{kind} to rank {rank} ({OPERATION[kind, True]}({mb}, ...); it sent "
                         f"{'micro-batch ' + _mbs([x[1] for x in sent]) if sent else 'none'})")
    return facts


def _outside(rank: int, run: Dict[str, Any], p: int, m: int, step: int) -> str:
    """A rank waiting outside a send or receive: where, and the actions of step 0 it left the
    loop without (the message its peer waits to give it or take from it)."""
    if run.get("never"):
        return (f"rank {rank} never reached a send or receive: it was still in {run['never']} "
                f"when the others gave up waiting for it")
    text = f"rank {rank} is in no send or receive"
    text += f" (it waits in {run['in']})" if run.get("in") else ""
    want = [str(a) for a in one_f_one_b_actions(p, m, rank)]
    got = run.get("actions") or []
    never = [a for a in want if a not in got]
    if step == 0 and got and never:
        text += (f": it left step 0's loop without {' '.join(never)} ({' '.join(got)}; 1F1B "
                 f"runs {' '.join(want)})")
    return text


def order_diagnosis(runs: List[Dict[str, Any]], m: int) -> Optional[str]:
    """What differs between each rank's actions of step 0 and 1F1B's, None if nothing."""
    p = len(runs)
    for rank, run in enumerate(runs):
        want = [str(a) for a in one_f_one_b_actions(p, m, rank)]
        got = run["actions"]
        if got == want:
            continue
        for kind, name in (("F", "forward"), ("B", "backward")):
            ran = [int(a[1:]) for a in got if a[0] == kind]
            twice = sorted({k for k in ran if ran.count(k) > 1})
            never = [k for k in range(m) if k not in ran]
            if twice or never:
                said = [f"ran the {name} of micro-batch {_mbs(twice)} twice"] if twice else []
                said += [f"never ran the {name} of micro-batch {_mbs(never)}"] if never else []
                return (f"rank {rank} {' and '.join(said)} in step 0 ({' '.join(got)}; 1F1B "
                        f"runs {' '.join(want)})")
        first_b = next((i for i, a in enumerate(got) if a.startswith("B")), len(got))
        if first_b != next(i for i, a in enumerate(want) if a.startswith("B")):
            ran_f, warmup = first_b - 1, p - rank - 1  # one forward of the steady state
            head = (f"rank {rank}'s warm-up ran {ran_f} forwards before the steady state "
                    f"({' '.join(got[:first_b + 2])} ...): 1F1B warms up with p - r - 1 = "
                    f"{warmup}")
            if ran_f > warmup:
                return (f"{head}; one more holds {run['peak']} activations at once, not "
                        f"p - r = {p - rank}")
            return (f"{head}; one fewer and the ranks take turns: rank {rank} waits for a "
                    f"gradient while the next rank has no micro-batch to work on")
        k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        return (f"rank {rank}'s actions of step 0 leave 1F1B's at action {k}: "
                f"{' '.join(got[max(k - 2, 0):k + 2])}, where 1F1B runs "
                f"{' '.join(want[max(k - 2, 0):k + 2])}")
    return None


def gradient_diagnosis(runs: List[Dict[str, Any]], ref: Dict[str, Any], m: int) -> Optional[str]:
    """Step 0's gradients off by one factor on every stage (the global grad norm's ratio), None
    if not. A micro_batch_loss's runs hold "scales" (``loss_scales``): its divisor as measured
    at several m, which tells m - 1 from p where they are equal."""
    p = len(runs)
    ratios = stage_ratios(runs, ref)
    ratio = runs[0]["grad_norms"][0] / ref["grad_norms"][0]
    if ratios and max(ratios) - min(ratios) > FACTOR_TOL * max(ratios):
        return None  # the stages differ: not one factor (stage_diagnosis)
    near = lambda k: abs(ratio - k) < FACTOR_TOL * k  # noqa: E731
    head = f"gradients are {ratio:.3g}x the reference in step 0 (its grad norm)"
    scales = runs[0].get("scales") or {}
    if near(m):
        return (f"{head}: each micro-batch's loss is a mean over its tokens; divide it by "
                f"m = {m}, so that the m backwards add up to the whole batch's mean")
    if near(1 / m):
        return f"{head} = 1/m: divided by m = {m} twice? divide once"
    # the same divisor at every m measured: p (a count of ranks); else what it was at each m
    if near(m / p) and len({round(1 / v, 3) for v in scales.values() if v}) <= 1:
        return (f"{head}: divided by p = {p}, the pipeline ranks? divide by m = {m}, the "
                f"micro-batches")
    if near(m * m):
        return f"{head} = m x m: multiplied by m = {m}? divide by it"
    return divisor_diagnosis(head, scales, m) if not near(1.0) else None


# the m micro_batch_loss is measured at, besides the run's, before the run (``loss_scales``)
SCALE_MS = (2, 3, 5, 8)
# what a divisor measured at every m reads as, in the learner's terms
DIVISORS = (("m", lambda k: k), ("m - 1", lambda k: k - 1), ("m + 1", lambda k: k + 1),
            ("m x m", lambda k: k * k), ("nothing", lambda k: 1))


def loss_scales(fn: Callable, m: int) -> Dict[int, float]:
    """The gradient ``fn`` (a micro_batch_loss) gives the loss it is passed, at m and at each
    of ``SCALE_MS`` (1/m for the library's); {} if a call raised or returned no tensor."""
    scales = {}
    for k in sorted({m, *SCALE_MS}):
        given = torch.ones((), requires_grad=True)
        try:
            out = fn(given, k)
            if not isinstance(out, torch.Tensor):
                return {}
            out.sum().backward()
        except Exception:  # noqa: B902 - the run's own call says what it raised
            return {}
        scales[k] = float(given.grad) if given.grad is not None else 0.0
    return scales


def divisor_diagnosis(head: str, scales: Dict[int, float], m: int) -> Optional[str]:
    """What micro_batch_loss was measured to divide the loss by, at several m; None if by m."""
    if not scales or any(v == 0 for v in scales.values()):
        return None
    divisor = {k: 1 / v for k, v in scales.items()}
    if all(abs(d - k) < FACTOR_TOL * k for k, d in divisor.items()):
        return None
    others = ", ".join(f"{d:.3g} at m = {k}" for k, d in divisor.items() if k != m)
    fits = [
        name for name, f in DIVISORS if all(
            abs(d - f(k)) < FACTOR_TOL * f(k) for k, d in divisor.items())
    ]
    same = len({round(d, 3) for d in divisor.values()}) == 1
    reads = (f": it divides by {fits[0]}"
             if fits else f": it divides by {divisor[m]:.3g} whatever m is" if same else "")
    return (f"{head}: micro_batch_loss(loss, m), called before the run with a loss of 1, "
            f"divides it by {divisor[m]:.3g} at m = {m} ({others}){reads}; divide by m, so "
            f"that the m backwards add up to the whole batch's mean")


def stage_ratios(runs: List[Dict[str, Any]], ref: Dict[str, Any]) -> List[float]:
    """Each stage's gradient norm of step 0 over the reference's on the same tensors."""
    out = []
    for run in runs:
        mine = run.get("stage_grads") or {}
        want = sum(ref["grads"][k] for k in mine)
        out.append((sum(mine.values()) / want)**0.5 if want else 1.0)
    return out


def stage_diagnosis(runs: List[Dict[str, Any]], ref: Dict[str, Any]) -> Optional[str]:
    """The stages whose gradients of step 0 differ from the reference's, by their factors."""
    ratios = stage_ratios(runs, ref)
    off = [r for r, x in enumerate(ratios) if abs(x - 1) > FACTOR_TOL]
    if not off:
        return None
    each = ", ".join(f"stage {r}'s {x:.3g}x" for r, x in enumerate(ratios))
    if max(ratios) - min(ratios) <= FACTOR_TOL * max(ratios):  # one factor: the loss's scale
        return (f"step 0's gradients are {ratios[0]:.3g}x the reference's on every stage "
                f"({each}): the loss each backward starts from is scaled by that factor")
    first = off[-1]  # the backward runs from the last stage: the first one off on its way
    return (f"step 0's gradients differ from the reference's on stage {_mbs(off)} ({each}): "
            f"the backward runs from the last stage, so look first at what stage {first} "
            f"computes or receives" + (f" from stage {first + 1}" if first + 1 < len(runs) else ""))


def parity_diagnosis(runs: List[Dict[str, Any]], ref: Dict[str, Any], steps: int) -> Optional[str]:
    """The chapter's check: losses and grad norms on every rank, weights on rank 0."""
    for rank, run in enumerate(runs):
        loss = max(abs(a - b) for a, b in zip(run["losses"], ref["losses"]))
        norm = max_norm_diff(run["grad_norms"], ref["grad_norms"])
        state = run["state"] or {}
        weight = max((float((state[k] - v).abs().max())
                      for k, v in ref["state"].items() if k in state), default=0.0)
        if loss > TOLERANCES["fp32"] or weight > TOLERANCES["fp32"] or \
                norm > NORM_TOLERANCES["fp32"]:
            return (f"after {steps} steps rank {rank}'s loss is {loss:.1e}, its grad norm "
                    f"{norm:.1e} relative and the weights {weight:.1e} off the reference")
    return None


class MicroBatchNotHeld(LookupError):
    """A backward asked of a micro-batch whose forward this rank does not hold."""


def not_held(rank: int, mb: int, step: int, ran: List[str]) -> str:
    """What a backward of micro-batch ``mb`` asked, in the learner's terms: its forward not run
    yet, or its backward run already (``ran``: this rank's actions of the step so far)."""
    why = ("its backward had already run (each micro-batch's backward runs once)"
           if f"B{mb}" in ran else "this rank had not run its forward yet")
    return (f"rank {rank} asked for the backward of micro-batch {mb} in step {step}, but {why}; "
            f"its actions of the step so far: {' '.join(ran) or 'none'}")


def detached_return(fn: Callable, m: int) -> Optional[Dict[str, str]]:
    """``fn`` (a micro_batch_loss) given a loss that requires grad, and the backward of what it
    returns, on this rank alone: None if that backward reaches the loss given, else what stops
    it ({"error": ...} if the backward raised, else {"before_run": ...}), at the learner's line
    that returned the loss (no frame of the learner's is on a backward's stack): torch's error
    for a loss without a grad_fn or one whose backward torch has not (``loss // m``), or a loss
    whose backward ends before the given one (a new tensor made of ``loss.item()``: the last
    stage's gradient would reach no model and send nothing back)."""
    code, line = getattr(fn, "__code__", None), [0]

    def seen(frame: Any, event: str, arg: Any) -> None:
        if event == "return" and frame.f_code is code:
            line[0] = frame.f_lineno

    given = torch.ones((), requires_grad=True)
    sys.setprofile(seen)
    try:
        out = fn(given, m)
    finally:
        sys.setprofile(None)
    if not isinstance(out, torch.Tensor) or code is None:
        return None
    try:
        out.sum().backward()
        if given.grad is not None:
            return None
        key, said, why = (
            "before_run", "its backward does not reach the loss it was given", "what it returned "
            "does not depend on it (a new tensor made of loss.item() or a copy starts "
            "a graph of its own), so no gradient reaches the model")
    except RuntimeError as err:
        key, said = "error", f"RuntimeError: {str(err).splitlines()[0]}"
        why = ("it returned one without a grad_fn, so no gradient reaches the model"
               if out.grad_fn is None else "torch cannot run the backward of what it returned")
    returned = linecache.getline(code.co_filename, line[0]).strip()
    return {
        key: (f"{said} (in the backward of the loss micro_batch_loss returned at "
              f"{os.path.basename(code.co_filename)}:{line[0]}: {returned}): given a loss that "
              f"requires grad, {why}")
    }
