"""The zero-bubble schedules (Qi et al., 2023) as per-rank action lists like ``orders.py``'s
(chapter 04b; its page draws and explains them): F = forward, B = input gradient, W = weight
gradient, chunk 1 = the rank's second stage, on the way back up a V."""

from typing import List, Tuple

from scaletorch.schedule.orders import Action


def zb_h1_actions(pp: int, micro_batches: int, rank: int) -> List[Action]:
    """ZB-H1: 1F1B with each backward split in B then W, and W's held back on later stages.

    Warm-up: p - rank - 1 forwards (as 1F1B). Then every B is followed by the oldest waiting
    W, except that rank r lets its first r B's go without one: r W's stay pending and fill the
    cool-down, where the rank would otherwise wait for gradients. Live activations (F done,
    W not) peak at (p - r) + r = p on every rank: 1F1B's peak on rank 0.
    """
    p, m = pp, micro_batches
    warmup = min(p - rank - 1, m)
    actions = [Action("F", i) for i in range(warmup)]
    for b in range(m):
        if warmup + b < m:
            actions.append(Action("F", warmup + b))
        actions.append(Action("B", b))
        if b >= rank:  # the oldest pending W; the first ``rank`` wait for the cool-down
            actions.append(Action("W", b - rank))
    return actions + [Action("W", i) for i in range(max(m - rank, 0), m)]


def zbv_actions(pp: int, micro_batches: int, rank: int) -> List[Action]:
    """ZB-V (Qi et al.), in the order of torch's ScheduleZBVZeroBubble: chunk 0 is stage
    ``rank`` (going down), chunk 1 stage 2p-1-rank (coming back up).

    1. warm-up: 2 (p - rank) - 1 forwards of chunk 0, then ``rank`` pairs F(chunk 1), F(chunk 0)
    2. p - rank times F B W on chunk 1 (its input came from the turn of the V)
    3. steady state: F B W on chunk 0, F B W on chunk 1, until every forward ran
    4. cool-down: ``rank`` pairs B(chunk 0) B(chunk 1), then p - rank times B W on chunk 0,
       then the W's still owed (chunk 1's, then chunk 0's)

    With m < 2p - 1 the order is built for 2p - 1 and the missing micro-batches' actions are
    left out, as torch does (every dependency is within one micro-batch).
    """
    if micro_batches < 2 * pp - 1:
        full = zbv_actions(pp, 2 * pp - 1, rank)
        return [a for a in full if a.micro_batch < micro_batches]
    p, m = pp, micro_batches
    count = {(kind, c): 0 for kind in "FBW" for c in (0, 1)}
    actions: List[Action] = []

    def do(*steps: str) -> None:  # "F0": the next forward through chunk 0
        for kind, chunk in ((step[0], int(step[1])) for step in steps):
            actions.append(Action(kind, count[(kind, chunk)], chunk))
            count[(kind, chunk)] += 1

    do(*["F0"] * (2 * (p - rank) - 1), *["F1", "F0"] * rank)  # 1
    do(*["F1", "B1", "W1"] * (p - rank))  # 2
    while count[("F", 1)] < count[("F", 0)] or count[("F", 0)] < m:  # 3
        do(*(["F0"] if count[("F", 0)] < m else []), "B0", "W0", "F1", "B1", "W1")
    do(*["B0", "B1"] * rank, *["B0", "W0"] * (p - rank))  # 4
    for chunk in (1, 0):
        do(*[f"W{chunk}"] * (count[("B", chunk)] - count[("W", chunk)]))
    return actions


def dualpipev_bundles(pp: int, micro_batches: int, rank: int) -> List[List[Action]]:
    """DualPipeV (DeepSeek-V3's DualPipe in a V), in the order of torch's ScheduleDualPipeV.

    A bundle [F of one chunk, B of the other] is DualPipe's overlapped pair: its messages go
    out together and, on a GPU, each computation hides the other's communication. A B with no
    W later is a full backward; the last phases' B's are split, their W's fill the end.
    """
    p, m = pp, micro_batches
    count = {(kind, c): 0 for kind in "FBW" for c in (0, 1)}
    owed: List[Tuple[int, int]] = []  # (chunk, micro-batch) whose W is owed, oldest first
    bundles: List[List[Action]] = []

    def add(*steps: str, split: bool = False) -> None:
        """One bundle of "F0", "B1", ... (the next F of chunk 0, ...), or "W": the oldest owed."""
        bundle = []
        for kind, chunk in ((step[0], int(step[1:] or 0)) for step in steps):
            if kind == "W":  # none owed: no bundle
                bundle += [Action("W", mb, c) for c, mb in owed[:1]]
                del owed[:1]
                continue
            bundle.append(Action(kind, count[(kind, chunk)], chunk))
            count[(kind, chunk)] += 1
            if kind == "B" and split:
                owed.append((chunk, bundle[-1].micro_batch))
        bundles.extend([bundle] if bundle else [])

    for step in ["F0"] * (2 * (p - rank - 1)) + ["F0", "F1"] * (rank + 1):  # 1, 2: forwards
        add(step)
    for _ in range(p - rank - 1):  # 3: B1 W F1 (zero bubble)
        add("B1", split=True)
        add("W")
        add("F1")
    for i in range(m - 2 * p + rank + 1):  # 4: main: (F0, B1) and (F1, B0), overlapped
        if i == 0 and rank == p - 1:  # not overlapped: the turn of the V is on this rank
            add("F0")
            add("B1")
        else:
            add("F0", "B1")
        add("F1", "B0")
    for _ in range(p - rank - 1):  # 5: B1, (F1, B0)
        add("B1")
        add("F1", "B0")
    split = False
    for i in range(rank + 1):  # 6: B1 B0; the second half split (zero bubble)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        add("B1", split=split)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        add("B0", split=split)
    for _ in range(p - rank - 1):  # 7: W B0
        add("W")
        add("B0", split=split)
    while owed:  # 8: the W's still owed
        add("W")
    return bundles
