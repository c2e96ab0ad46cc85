"""Chapter 01's ``launch_full_buckets`` called on its own (scripts/grading/ddp.py grades it).

In chapter 01's run gradients arrive in bucket order, one bucket filling per hook, so an ``if``
for the ``while`` launches the same buckets there. A hook may see several full buckets at once
(gradients out of bucket order, a bucket of unused parameters): ``CASES`` are such states, each
called with a launch that records, and compared with what the docstring asks. Here too the
diagnoses of the bucketed run's launches and waits (``launch_diagnosis``, ``wait_diagnosis``).
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

# (ready, sizes, next_bucket) a hook may see: several buckets full at once (gradients arrive
# out of bucket order), a full bucket after one that is not, none full
CASES = [([2, 1, 0], [2, 1, 3], 0), ([2, 1, 3], [2, 1, 3], 1), ([2, 0, 3], [2, 1, 3], 1),
         ([1, 1], [2, 1], 0)]


def calls(fn: Any) -> List[Tuple[List[int], int]]:
    """``fn`` (a launch_full_buckets) on each of ``CASES``: (buckets it launched, returned)."""
    out = []
    for ready, sizes, next_bucket in CASES:
        launched: List[int] = []
        returned = fn(list(ready), list(sizes), next_bucket, launched.append)
        out.append((launched, returned))
    return out


def expected_calls() -> List[Tuple[List[int], int]]:
    out = []
    for ready, sizes, k in CASES:
        launched = []
        while k < len(sizes) and ready[k] == sizes[k]:
            launched.append(k)
            k += 1
        out.append((launched, k))
    return out


def call_diagnosis(runs: List[Dict[str, Any]]) -> Optional[str]:
    """launch_full_buckets: no hook left a full bucket unlaunched, and on ``CASES`` (several
    buckets full at once) it launched the full ones from next_bucket in order."""
    for rank, run in enumerate(runs):
        if run["left"]:
            step, k = run["left"][0]
            return (f"in step {step} on rank {rank} a hook's launch_full_buckets returned {k} with "
                    f"bucket {k} full: its all-reduce started at a later hook or after backward, "
                    f"so it overlapped less of backward; launch every full bucket in order")
    for (ready, sizes, start), got, want in zip(CASES, runs[0]["calls"], expected_calls()):
        if tuple(got) == tuple(want):
            continue
        said = (f"launch_full_buckets(ready={ready}, sizes={sizes}, next_bucket={start}) launched "
                f"{got[0]} and returned {got[1]}; the full buckets from {start} on, in order, "
                f"are {want[0]}")
        if list(got[0]) == list(want[0])[:len(got[0])] and len(got[0]) < len(want[0]):
            return (said + ": the ones left wait for a later hook or the end of backward, no "
                    "longer overlapping it; launch while the next bucket is full")
        return said + f": launch those, stop at the first bucket not full, return {want[1]}"
    return None


def apart_cause(runs: List[Dict[str, Any]], peers: List[int], name: str) -> str:
    """What each rank of the data-parallel group ``peers`` holds in gradient ``name`` after the
    sync, against what the ranks handed to average_gradients (step 0): its own, its own / N, the
    group's sum or mean; a cause only when every rank kept its own (no all-reduce)."""
    if any("inputs" not in runs[r] for r in peers):
        return "look at what each rank sends and divides"
    i = runs[peers[0]]["names"].index(name)
    given = [runs[r]["inputs"][i].double() for r in peers]
    total, n = sum(given), len(peers)
    said, kept = [], True
    for r, own in zip(peers, given):
        got = runs[r]["grads"][name].double()
        atol = 1e-5 * float(total.abs().max())
        label = next(
            (label for label, want in (("its own", own), ("its own / N", own / n),
                                       ("the group's sum", total), ("the group's mean", total / n))
             if torch.allclose(got, want, rtol=1e-4, atol=atol)), None)
        kept = kept and label is not None and label.startswith("its own")
        said.append(f"rank {r}'s is {label or 'none of its own, the group sum or mean'}")
    return ", ".join(said) + ("; no rank all-reduced it: every gradient goes through the "
                              "all-reduce" if kept else "")


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


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
        busy = [rank for rank in skipped if rank not in lazy]
        return (f"rank{'s' if len(lazy) > 1 else ''} {_ranks(lazy)} waited for no bucket, rank"
                f"{'s' if len(busy) > 1 else ''} {_ranks(busy)} for all: every rank must wait "
                f"before its own step")
    for rank, s in skipped.items():
        if s:
            return (f"bucket {s[-1]} of 0-{buckets - 1} was never waited for (rank {rank}): "
                    f"wait for every bucket, the last one launched too")
    return None
