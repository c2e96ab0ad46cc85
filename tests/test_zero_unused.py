"""ZeRO on generated models whose parameters go unused, against one device.

A model nobody here wrote (``Drawn``): a root with trainable gains of its own, one read first
or before the head (drawn) and one last in the forward (and, drawn, a frozen offset), three
blocks of two linears in a ``ModuleList``, a head. Hypothesis draws, per step: blocks not
called on any rank, blocks called whose output no rank uses, per rank a block's second linear
left out (a parameter one rank uses and the other does not), blocks one rank does not call,
blocks one rank calls but does not use, a rank that calls no unit at all (its output a view of
a root parameter), and each root gain left out, units drawn nested (each block a unit with its
own gain around its linears' units), and a
second ``step()`` after the backward (the same gradients again, never reduced twice). It draws
``zero_grad``'s set_to_none (False: an unused parameter keeps its zeroed gradient, which AdamW
decays, as on one device) and the dtype: float64 weights come back float64, within 1e-12
(a cast to float32 is off by ~1e-8); bfloat16 ones come back bfloat16, bit for bit.
apply_zero_any's ZeRO-3 and flat ZeRO-2, ShardedOptimizer's ZeRO-2 on the bare model, or its
ZeRO-1 on our bucketed DDP with find_unused_parameters (drawn) step it 3 times with AdamW
(weight decay) or SGD (momentum, weight decay) at 2 ranks, each rank built from its own seed;
one device steps rank 0's model on the global batch, each rank's slice with that rank's plan
(mean of the losses). ZeRO-3 is drawn with and without prefetch: a block one rank skips must
still be gathered there at its turn, or the ranks' all-gathers no longer pair up (they hung).
Ranks that call a unit a different number of times, or units in another order, must stop on
every rank with one line (``DIVERGING``).

Tolerance (fp32, eps 6e-8). The gradients are the mean of 2 slices' sums in another order:
relative error about N eps = 1.2e-7. SGD is linear in them: 3 steps of lr 1e-2 with momentum
0.9 move a weight by at most 3 x 3 x 1e-2 x |g| (|g| < 1 here), so atol 1e-6 is 10x that error
bound. AdamW divides by the element's own gradient size, which amplifies rounding where it is
small: atol 1e-5 (measured worst below 1e-6). The mistakes are far larger: AdamW decaying an
unused weight moves it lr x wd x |w| (1e-2 x 0.5 x ~0.3 = 1.5e-3) and its old moments move it
up to lr = 1e-2 per step; SGD's momentum moves it 0.9 x lr x |buffer| (~1e-3).
"""

import os
import unittest
import warnings
from typing import Any, Dict, List

import torch
import torch.nn.functional as F
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from torch import nn

from scaletorch.parallel.data_parallel_any_module import apply_data_parallel_any
from scaletorch.parallel.sharded_optimizer import ShardedOptimizer
from scaletorch.parallel.zero_any_module import apply_zero_any
from tests.harness import run_distributed

WORLD, STEPS, BATCH = 2, 3, 8
LONG = os.environ.get("SCALETORCH_LONG_TESTS") == "1"
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.5)),
    "sgd": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=0.1)),
}
WEIGHT_TOL = {"adamw": 1e-5, "sgd": 1e-6}  # see the module docstring
DTYPES = ["float32", "float64"]  # drawn per case; bfloat16: one wrap, compared bit for bit
FP64_TOL = 1e-12  # float64 (eps 1.1e-16): a cast to float32 on the way is off by ~1e-8
# apply_zero_any's (3, 2); ShardedOptimizer's ZeRO-2 on the bare model (None), or its ZeRO-1 on
# our DDP (find_unused_parameters), which averages the gradients (-1)
STAGES = {"zero3": 3, "flat_zero2": 2, "zero2": None, "zero1": -1}


class Block(nn.Module):
    """Two linears and a gain of its own; the second linear is left out when ``use_b`` is False
    (with ``nested`` units the block is a unit holding the units of its linears)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.linspace(0.8, 1.2, 6))

    def forward(self, h: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = torch.tanh(self.a(h)) * self.scale
        return h + torch.tanh(self.b(h)) if use_b else h


class Drawn(nn.Module):
    """Root gains (trainable), a frozen root offset (drawn), blocks, a head; ``plan`` says
    what this step's forward leaves out."""

    def __init__(self, frozen_own: bool) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.out_gain = nn.Parameter(torch.linspace(1.5, 0.5, 3))  # its gradient comes first
        self.offset = nn.Parameter(torch.full((6, ), 0.1), requires_grad=False) if frozen_own \
            else None
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(6, 3)
        self.plan: Dict[str, Any] = dict(skip=[], drop=[], no_b=[], gain=True, out_gain=True,
                                         gain_at="input")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plan.get("root_only"):  # no unit called: the output views a root parameter
            return self.out_gain.expand(len(x), 3)
        first = self.plan["gain_at"] == "input"
        h = x * self.gain if self.plan["gain"] and first else x
        h = h + self.offset if self.offset is not None else h
        for i, block in enumerate(self.blocks):
            if i in self.plan["skip"]:
                continue  # not called on any rank
            out = block(h, use_b=i not in self.plan["no_b"])
            h = h if i in self.plan["drop"] else out  # dropped: called, unused by every rank
        h = h * self.gain if self.plan["gain"] and not first else h  # read after the blocks
        return self.head(h) * self.out_gain if self.plan["out_gain"] else self.head(h)


def cases() -> List[Dict[str, Any]]:
    """Drawn by hypothesis (derandomized: the same cases in every run and on every rank)."""
    blocks = st.lists(st.integers(0, 2), max_size=2, unique=True)

    def per_rank(each: Any) -> Any:  # one draw per rank
        return st.lists(each, min_size=WORLD, max_size=WORLD)

    step = st.fixed_dictionaries(
        dict(skip=blocks, drop=blocks, no_b=per_rank(blocks), one_drops=per_rank(blocks),
             one_skips=per_rank(blocks), gain=per_rank(st.booleans()),
             out_gain=per_rank(st.booleans()), twice=st.booleans(),
             root_only=per_rank(st.sampled_from([False, False, False, True]))))
    case = st.fixed_dictionaries({
        "frozen_own": st.booleans(),
        "opt": st.sampled_from(sorted(OPTIMIZERS)),
        "stage": st.sampled_from(list(STAGES)),
        "seed": st.integers(0, 2**16),
        "set_to_none": st.booleans(),
        "gain_at": st.sampled_from(["input", "head"]),
        "prefetch": st.booleans(),
        "nested": st.booleans(),
        "dtype": st.sampled_from(DTYPES),
        "steps": st.lists(step, min_size=STEPS, max_size=STEPS),
    })
    found: List[Dict[str, Any]] = []

    @settings(max_examples=60 if LONG else 10, database=None, derandomize=True, deadline=None,
              phases=[Phase.generate])
    @given(case)
    def collect(drawn: Dict[str, Any]) -> None:
        found.append(drawn)

    collect()
    # round 3's hang, always: ZeRO-3, both root gains read after block 0 on rank 0 alone, so the
    # root's unit completes there first (block 0's prefetch must not gather it on rank 0 only);
    # in float64 (round 4's #11: ZeRO-3's full_state_dict gave float32; bfloat16: bf16_model)
    root_first = dict(skip=[], drop=[], no_b=[[], []], one_drops=[[], []], one_skips=[[], []],
                      gain=[True, True], out_gain=[True, False], twice=False, root_only=[0, 0])
    found.append(
        dict(frozen_own=False, opt="adamw", stage="zero3", seed=3, set_to_none=True, gain_at="head",
             dtype="float64", prefetch=True, nested=False, steps=[root_first] * STEPS))
    # issue 52's probe, round 6, always: ZeRO-3 without prefetch, rank 0 calls block 1 and not
    # block 2, rank 1 calls block 2 and drops block 1's output (each hung in the first backward)
    per_rank = dict(skip=[], drop=[], no_b=[[], []], one_drops=[[], [1]], one_skips=[[2], []],
                    gain=[True, True], out_gain=[True, True], twice=False, root_only=[0, 0])
    # probe round 7: rank 1 calls no unit, its output a view of a root parameter (it segfaulted)
    root_only = dict(per_rank, one_drops=[[], []], one_skips=[[], []], root_only=[0, 1])
    found.append(
        dict(frozen_own=True, opt="adamw", stage="zero3", seed=5, set_to_none=True, gain_at="input",
             dtype="float32", prefetch=False, nested=False, steps=[per_rank] * STEPS))
    # and nested units (round 7: rank 0 skipping a block that holds units aborted)
    found.append(dict(found[-1], seed=6, nested=True, steps=[per_rank, root_only, root_only]))
    # ZeRO-1 with zero_grad(set_to_none=False), always: an unused parameter keeps its zeroed
    # gradient through DDP's find_unused_parameters and the sharded step (round 3's #5)
    # (a parameter used in step 1, left out of steps 2 and 3)
    every = dict(skip=[], drop=[], no_b=[[], []], one_drops=[[], []], one_skips=[[], []],
                 gain=[True, True], out_gain=[True, True], twice=False, root_only=[0, 0])
    fewer = dict(skip=[1], drop=[0], no_b=[[2], []], one_drops=[[], [2]], one_skips=[[], []],
                 gain=[False, True], out_gain=[False, False], twice=True, root_only=[0, 0])
    found.append(
        dict(frozen_own=True, opt="adamw", stage="zero1", seed=7, set_to_none=False,
             gain_at="input", dtype="float32", prefetch=True, nested=False,
             steps=[every, fewer, fewer]))
    return found


def plan_of(case: Dict[str, Any], k: int, rank: int) -> Dict[str, Any]:
    """Step k's plan on ``rank``: what every rank leaves out, and what this one does."""
    step = case["steps"][k]
    return dict(skip=step["skip"] + step["one_skips"][rank],
                drop=step["drop"] + step["one_drops"][rank], no_b=step["no_b"][rank],
                gain=step["gain"][rank], out_gain=step["out_gain"][rank], gain_at=case["gain_at"],
                root_only=step["root_only"][rank])


def data(case: Dict[str, Any], step: int) -> Any:
    g = torch.Generator().manual_seed(case["seed"] + step)
    x, y = torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)
    return x.to(getattr(torch, case["dtype"])), y.to(getattr(torch, case["dtype"]))


def build(case: Dict[str, Any], rank: int) -> Drawn:
    torch.manual_seed(case["seed"] + 100 * rank)  # each rank its own: ZeRO broadcasts rank 0's
    return Drawn(case["frozen_own"]).to(getattr(torch, case["dtype"]))


def state_of(model: nn.Module) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def one_device(case: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    """Rank 0's model on the global batch: each rank's slice with that rank's plan."""
    model = build(case, 0)
    cls, kwargs = OPTIMIZERS[case["opt"]]
    opt = cls([p for p in model.parameters() if p.requires_grad], **kwargs)
    for k in range(STEPS):
        x, y = data(case, k)
        opt.zero_grad(set_to_none=case["set_to_none"])
        loss = 0.0
        for rank, (xs, ys) in enumerate(zip(x.chunk(WORLD), y.chunk(WORLD))):
            model.plan = plan_of(case, k, rank)
            loss = loss + F.mse_loss(model(xs), ys)
        (loss / WORLD).backward()
        for _ in range(2 if case["steps"][k]["twice"] else 1):
            opt.step()
    return state_of(model)


def bf16_model(rank: int) -> Drawn:
    torch.manual_seed(100 * rank)  # each rank its own: ZeRO broadcasts rank 0's
    return Drawn(frozen_own=True).bfloat16()


class Diverging(nn.Module):
    """Three square linears; ``calls`` lists the ones this rank's forward calls, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.calls = "abc"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.calls:
            x = torch.tanh(getattr(self, name)(x))
        return x


# ZeRO-3 cannot pair up what ranks that call units a different number of times, or in another
# order, all-gather: each must stop on every rank with the check's one line, not a hang
ORDER_BATCH = torch.linspace(-1, 1, 4 * 6).view(4, 6)
DIVERGING = {
    "b twice on rank 0": ["abbc", "abc"],
    "b, a on rank 1": ["abc", "bac"],
    "c on rank 0 only, b twice on rank 1": ["abc", "abb"],
    "b before a on rank 0, b skipped on rank 1 (probe round 8)": ["bac", "ac"],
}


def diverging(rank: int) -> Dict[Any, str]:
    said = {}
    for how, calls in DIVERGING.items():
        for prefetch in (True, False):
            model = Diverging()
            model.calls = calls[rank]
            zero = apply_zero_any(model, prefetch=prefetch)
            try:
                zero(torch.randn(2, 6)).sum().backward()
                said[how, prefetch] = "ran"
            except RuntimeError as error:
                said[how, prefetch] = str(error)
    return said


def nested_units(model: Drawn) -> List[nn.Module]:
    """The root, each block (its own gain) holding its two linears' units, the head."""
    return [model, *[m for b in model.blocks for m in (b, b.a, b.b)], model.head]


def out_of_order(rank: int) -> Dict[str, Any]:
    """Every rank calls b, a, c, listed a, b, c: correct, but b's turn passes a (gathered once
    more), which one warning says. One SGD step on this rank's slice of ``ORDER_BATCH``."""
    torch.manual_seed(0)
    model = Diverging()
    model.calls = "bac"
    zero = apply_zero_any(model)
    opt = ShardedOptimizer(zero, torch.optim.SGD, lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zero(ORDER_BATCH.chunk(WORLD)[rank]).sum().backward()
    opt.step()
    return dict(warned=[str(w.message) for w in caught], state=zero.full_state_dict())


def _world(rank: int, world: int, drawn: List[Dict[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {"states": []}
    out["bf16"] = apply_zero_any(bf16_model(rank)).full_state_dict()  # a frozen unit too
    for case in drawn:
        model = build(case, rank)
        cls, kwargs = OPTIMIZERS[case["opt"]]
        bare = STAGES[case["stage"]] in (None, -1)
        if STAGES[case["stage"]] is None:  # the bare model; the optimizer reduces in step()
            zero: Any = model
            opt = ShardedOptimizer(model.parameters(), cls, zero_stage=2, **kwargs)
        elif STAGES[case["stage"]] == -1:  # DDP averages, the optimizer steps its shard
            zero = apply_data_parallel_any(model, None, "ours", 1e-4, find_unused_parameters=True)
            opt = ShardedOptimizer(model.parameters(), cls, zero_stage=1, **kwargs)
        else:
            zero = apply_zero_any(model, None, STAGES[case["stage"]], prefetch=case["prefetch"],
                                  units=nested_units(model) if case["nested"] else None)
            if not case["nested"]:
                out.setdefault("units", [(u.name, [n[0] for n in u.names]) for u in zero.units])
            opt = ShardedOptimizer(zero, cls, **kwargs)
        for k in range(STEPS):
            x, y = data(case, k)
            model.plan = plan_of(case, k, rank)
            opt.zero_grad(set_to_none=case["set_to_none"])
            F.mse_loss(zero(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
            for _ in range(2 if case["steps"][k]["twice"] else 1):
                opt.step()
        out["states"].append(state_of(model) if bare else zero.full_state_dict())
    out["out_of_order"] = out_of_order(rank)
    out["diverging"] = diverging(rank)  # last: a case that stops leaves nothing in flight
    return out


class UnusedParametersZero(unittest.TestCase):
    """One 2-rank world runs every drawn case."""

    @classmethod
    def setUpClass(cls) -> None:
        cls.cases = cases()
        cls.results = run_distributed(_world, WORLD, cls.cases, timeout=300)

    def test_the_root_parameters_are_a_unit_of_their_own(self) -> None:
        """child_units: the root's own trainable gains first, alone (the whole model in one unit
        would gather every block for the root's forward), then one unit per block, the head."""
        for r in self.results:
            self.assertEqual(r["units"][0], ("model", ["gain", "out_gain"]))
            self.assertEqual([n for n, _ in r["units"]],
                             ["model", "blocks.0", "blocks.1", "blocks.2", "head"])

    def test_zero3_full_state_dict_keeps_bfloat16_bit_for_bit(self) -> None:
        """Rank 0's bfloat16 weights, trainable and frozen, come back bfloat16 and bit for bit
        (a gather through float32 and back would be exact: only the dtype shows it)."""
        want = state_of(bf16_model(0))
        for r in self.results:
            self.assertEqual(sorted(r["bf16"]), sorted(want))
            for n, w in want.items():
                self.assertEqual(r["bf16"][n].dtype, torch.bfloat16, n)
                self.assertTrue(torch.equal(r["bf16"][n], w), n)

    def test_ranks_that_call_units_differently_stop_with_one_line_on_every_rank(self) -> None:
        for key in [(how, prefetch) for how in DIVERGING for prefetch in (True, False)]:
            for rank, r in enumerate(self.results):
                said = r["diverging"][key]
                self.assertIn("ZeRO-3: the ranks are about to run different collectives", said,
                              f"{key} rank {rank}")
                self.assertIn("rank 1: all-gather of unit", said, f"{key} rank {rank}")
                self.assertIn("listed in the order the forward calls them", said)

    def test_units_listed_out_of_call_order_train_as_one_device_and_warn(self) -> None:
        torch.manual_seed(0)
        model = Diverging()
        model.calls = "bac"
        (sum(model(x).sum() for x in ORDER_BATCH.chunk(WORLD)) / WORLD).backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        for r in self.results:
            got = r["out_of_order"]
            self.assertTrue(
                any("unit 'a' ran after the forward had passed it" in w for w in got["warned"]),
                got["warned"])
            for n, w in state_of(model).items():
                torch.testing.assert_close(got["state"][n], w, rtol=0, atol=1e-6)

    def test_weights_after_steps_with_unused_parameters_match_one_device(self) -> None:
        worst = {"adamw": 0.0, "sgd": 0.0, "float64": 0.0}
        for k, case in enumerate(self.cases):
            want = one_device(case)
            for rank, r in enumerate(self.results):
                got = r["states"][k]
                self.assertEqual(sorted(got), sorted(want))
                for n, w in want.items():
                    msg = f"case {k} {case} rank {rank} {n}"
                    if n == "offset":  # frozen: bit for bit
                        self.assertTrue(torch.equal(got[n], w), msg)
                    self.assertEqual(got[n].dtype, w.dtype, msg)  # float64 kept, never cast
                    tol = FP64_TOL if w.dtype == torch.float64 else WEIGHT_TOL[case["opt"]]
                    key = case["opt"] if w.dtype != torch.float64 else "float64"
                    worst[key] = max(worst[key], (got[n] - w).abs().max().item())
                    torch.testing.assert_close(got[n], w, rtol=0, atol=tol,
                                               msg=lambda m, msg=msg: f"{msg}: {m}")
        print(f"\nworst |weight - one device's|: {worst}")


if __name__ == "__main__":
    unittest.main()
