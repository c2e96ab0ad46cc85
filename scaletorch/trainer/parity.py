"""The proof: run the single-device reference on the same seed and data, and compare.

Every numbered script's ``--check`` ends with ``check_against_reference``, which prints
``parity: max |loss - reference| = 3.1e-07 over 10 steps (tolerance 1e-05): OK`` and the same
for the weights, when the strategy can gather them, and each step's global gradient norm
before clipping, relative to the reference's (``max |grad norm / reference - 1|``, tolerance
1e-4 in fp32, precision.py says why). The norm catches what the weights hide: AdamW divides
each update by its own running scale, so with every pipeline gradient message from rank 1
scaled by 1.001 (chapter 04, 2 ranks, 5 steps) the weights end 2.8e-6 from the reference and
pass, while the norm is 5.0e-4 off, 5 times its tolerance (tests/test_check_catches_bugs.py).
The reference computes in the run's
precision (precision.py decides it for both) and the tolerance is that precision's: 1e-5 in
fp32, 2^-5 under bf16 autocast (``(tolerance 3.1e-02, bf16)`` on the line).

The floor. A correct layout changes only the order of the sums, and AdamW turns a
rounding-level difference of a gradient near 0 into an update difference of up to lr: at a high
lr or after many steps two correct runs drift further apart than 1e-5. How far is measured, not
guessed: ``measure_floor`` trains the reference a second time with the global batch split into
another number of micro-batches (the same mathematics, another summation order) and takes the
largest loss and weight difference of the two single-device runs. In fp32, when a difference
exceeds 1e-5, the check measures the floor (one more reference run, only then) and that
comparison's tolerance becomes the larger of 1e-5 and ``SAFETY_FACTOR`` x its floor, printed
with its origin: ``(tolerance 6.1e-05 = 32 x floor 1.9e-06, measured this run)``. A run that
passes at 1e-5 never pays for the floor and its line is unchanged; one that passes only thanks
to the floor says so.

Why 32. Measured on chapter 00's run at lr 1e-2 (CPU, fp32): the floor of its 10 steps
(micro-batches 1 vs 2) is 6.3e-7 in the weights. On the synthetic data of chapters 00-07
correct layouts end at most 11 times their floor (tensor parallel in the tour: 7.1e-6; context
parallel 5.1e-6; pp 2 x tp 2 on 4 layers after 50 steps: 1.2e-5 against a floor of 3.0e-6, 4x;
ZeRO-1 at N = 4 after 200 steps: 1.3e-5 against 1.9e-6, 7 times).
The smallest planted bug, one rank's gradient x 1.001 (tests/test_check_catches_bugs.py),
moves the weights 1.1e-3: 1750 times the floor. 32 sits
between them, 2.8 times above the worst correct layout and 55 times below that bug. The floor
is a lower bound, not a bound on every layout: on chapter 10's English text, tp 2 x pp 2 drifted
300 times further than the micro-batchings in 20 steps (doc/10_real_model.md), so there
``--check`` stays short. The floor is skipped (the fixed tolerance stays) under bf16 or fp16,
whose tolerance is derived in precision.py; with mixture-of-experts, whose load-balancing
statistics depend on the micro-batch split; when the global batch splits no other way; and
when the caller passes its own tolerance.
"""

import copy
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from scaletorch.config import Config
from scaletorch.dist import comm, get_ledger
from scaletorch.models import build_model
from scaletorch.trainer.precision import (NORM_TOLERANCES, TOLERANCES, parity_tolerance,
                                          resolve_precision)

if TYPE_CHECKING:
    from scaletorch.trainer.trainer import Trainer

TOLERANCE = TOLERANCES["fp32"]  # K >= 5 steps in fp32; bf16's is derived in precision.py
SAFETY_FACTOR = 32  # x the measured floor; the measurements behind 32 in the docstring

State = Dict[str, torch.Tensor]


def reference_trainer(cfg: Config, device: torch.device = torch.device("cpu"),
                      micro_batches: Optional[int] = None) -> "Trainer":
    """The single-device Trainer of ``cfg`` (its model from the run's seed), with the global
    batch split into ``micro_batches`` (default: the config's). Touches no process group,
    writes no file, loads no checkpoint."""
    from scaletorch.trainer.trainer import Trainer  # the trainer imports this module's users

    cfg = copy.deepcopy(cfg)
    cfg.checkpoint.every, cfg.checkpoint.resume = 0, None
    if micro_batches is not None:
        cfg.data.num_micro_batches = micro_batches
    model = build_model(cfg.model, seed=cfg.training.model_seed).to(device)
    return Trainer(cfg, model, pgm=None, device=device, verbose=False)


def run_reference(
    cfg: Config,
    device: torch.device = torch.device("cpu"),
    micro_batches: Optional[int] = None,
) -> Tuple[List[float], List[float], nn.Module]:
    """Train the unsharded model on one device for ``cfg.training.steps`` steps.

    Touches no process group, writes no file, loads no checkpoint. Returns (losses, grad norms
    before clipping, model), as plain_loop.plain_training does.
    """
    trainer = reference_trainer(cfg, device, micro_batches)
    result = trainer.train()
    return result.losses, result.grad_norms, trainer.model


def other_split(cfg: Config) -> Optional[int]:
    """The floor run's micro-batches: twice the config's m where the global batch allows it,
    else half (the same global batch, summed in another order); None if neither fits."""
    m, batch = cfg.data.num_micro_batches, cfg.data.global_batch_size
    if batch % (2 * m) == 0:
        return 2 * m
    return m // 2 if m % 2 == 0 else None


def floor_applies(cfg: Config, device_type: str) -> bool:
    """Whether ``--check`` may widen the fp32 tolerance to its measured floor: fp32 only (bf16's
    and fp16's tolerance is derived in precision.py), no mixture-of-experts (its load-balancing
    statistics are per micro-batch: another split is other mathematics), and a global batch
    that splits another way."""
    return (resolve_precision(cfg, device_type) == "fp32" and cfg.model.num_experts == 0
            and other_split(cfg) is not None)


def measure_floor(cfg: Config, device: torch.device, losses: Sequence[float],
                  norms: Sequence[float], state: State) -> Tuple[float, float, float, int]:
    """The noise floor of a parity check: (loss, weight, relative grad norm, micro-batches).

    Trains the reference again with ``other_split(cfg)`` micro-batches and returns its largest
    loss, weight and relative grad-norm differences from the reference run's ``losses``,
    ``state`` and ``norms``."""
    m = other_split(cfg)
    if m is None:
        raise ValueError(
            f"the parity floor needs another split of the global batch of "
            f"{cfg.data.global_batch_size} sequences than {cfg.data.num_micro_batches} "
            f"micro-batches: neither twice nor half of it fits")
    floor_losses, floor_norms, floor_model = run_reference(cfg, device, m)
    weight = max_weight_diff(floor_model.state_dict(), state)
    return max_loss_diff(floor_losses, losses), weight, max_norm_diff(floor_norms, norms), m


def max_loss_diff(losses: Sequence[float], reference: Sequence[float]) -> float:
    if len(losses) != len(reference):
        raise ValueError(f"{len(losses)} losses vs {len(reference)} reference losses")
    return max(abs(a - b) for a, b in zip(losses, reference))


def max_norm_diff(norms: Sequence[float], reference: Sequence[float]) -> float:
    """Largest |norm / reference - 1| over the steps: each step's grad norm, relative."""
    if len(norms) != len(reference):
        raise ValueError(f"{len(norms)} grad norms vs {len(reference)} reference grad norms")
    return max(abs(a - b) / b if b > 0 else abs(a) for a, b in zip(norms, reference))


def weight_diffs(state: State, reference: State) -> Dict[str, float]:
    """{name: largest absolute difference} of two full state dicts with the same keys."""
    if set(state) != set(reference):
        raise ValueError(f"state dict keys differ: {sorted(set(state) ^ set(reference))}")
    diffs = {}
    for k in state:
        diff = state[k].detach().cpu().float() - reference[k].detach().cpu().float()
        diffs[k] = diff.abs().max().item()
    return diffs


def max_weight_diff(state: Dict[str, torch.Tensor], reference: Dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two full state dicts with the same keys."""
    return max(weight_diffs(state, reference).values())


def tolerance_text(tolerance: float, precision: str = "fp32", floor: Optional[float] = None) -> str:
    """"tolerance 1e-05" in fp32; "tolerance 3.1e-02, bf16" under a lower precision; with a
    measured ``floor``, where the tolerance came from: "tolerance 9.6e-05 = 32 x floor 3.0e-06,
    measured this run", or "tolerance 1e-05 > 32 x floor 2.4e-07, ..." when 1e-5 is larger."""
    if floor is not None:
        derived, origin = widened(0.0, floor), f"{SAFETY_FACTOR} x floor {floor:.1e}"
        if derived >= tolerance:
            return f"tolerance {derived:.1e} = {origin}, measured this run"
        return f"tolerance {tolerance:.0e} > {origin}, measured this run"
    if precision == "fp32":
        return f"tolerance {tolerance:.0e}"
    return f"tolerance {tolerance:.1e}, {precision}"


def widened(tolerance: float, floor: Optional[float]) -> float:
    """The tolerance a comparison is held to: ``tolerance``, or SAFETY_FACTOR x its measured
    floor where that is larger (the floor as printed, to 2 digits, so the line's product holds)."""
    return tolerance if floor is None else max(tolerance, SAFETY_FACTOR * float(f"{floor:.1e}"))


def report_parity(losses: Sequence[float], reference: Sequence[float], tolerance: float = TOLERANCE,
                  precision: str = "fp32", floor: Optional[float] = None) -> bool:
    """Print the parity line and return whether it passed."""
    diff = max_loss_diff(losses, reference)
    ok = diff <= widened(tolerance, floor)
    print(
        f"parity: max |loss - reference| = {diff:.1e} over {len(losses)} steps "
        f"({tolerance_text(tolerance, precision, floor)}): {'OK' if ok else 'FAIL'}", flush=True)
    return ok


def report_weight_parity(state: State, reference: State, steps: int, tolerance: float = TOLERANCE,
                         precision: str = "fp32", floor: Optional[float] = None,
                         kind: str = "weight") -> bool:
    """Print the weights' parity line (the worst parameter named) and return whether it passed.
    ``kind``: what the line calls the tensors (chapter 12 prints its running buffers too)."""
    diffs = weight_diffs(state, reference)
    worst = max(diffs, key=lambda name: diffs[name])
    diff, limit = diffs[worst], tolerance_text(tolerance, precision, floor)
    ok = diff <= widened(tolerance, floor)
    print(
        f"parity: max |{kind} - reference| = {diff:.1e} after {steps} steps, in {worst} "
        f"({limit}): {'OK' if ok else 'FAIL'}", flush=True)
    return ok


def report_norm_parity(norms: Sequence[float], reference: Sequence[float],
                       tolerance: float = NORM_TOLERANCES["fp32"], precision: str = "fp32",
                       floor: Optional[float] = None) -> bool:
    """Print the grad norms' parity line (each step's norm before clipping, relative to the
    reference's) and return whether it passed."""
    diff = max_norm_diff(norms, reference)
    ok = diff <= widened(tolerance, floor)
    print(
        f"parity: max |grad norm / reference - 1| = {diff:.1e} over {len(norms)} steps "
        f"({tolerance_text(tolerance, precision, floor)}): {'OK' if ok else 'FAIL'}", flush=True)
    return ok


def check_against_reference(cfg: Config, losses: Sequence[float], device: torch.device,
                            full_state: Optional[Dict[str, torch.Tensor]] = None,
                            start_step: int = 0, tolerance: Optional[float] = None,
                            grad_norms: Optional[Sequence[float]] = None) -> bool:
    """``--check`` for every script: rank 0 runs the reference and prints the verdict.

    ``losses`` and ``grad_norms`` (before clipping; None to skip them) are the parallel run's
    per-step values from ``start_step``; ``full_state`` is its gathered, unsharded state dict
    (on rank 0; None to skip the weight comparison). The reference runs in the same precision
    (``resolve_precision``); ``tolerance`` (losses and weights) defaults to that precision's,
    the grad norms' is its NORM_TOLERANCES (relative). In fp32 (``floor_applies``), if a
    difference exceeds its tolerance, the floor is measured (``measure_floor``, one more
    reference run) and each comparison is held to the larger of its tolerance and
    SAFETY_FACTOR x its floor (the module docstring). The verdict
    is broadcast so that every rank returns the same answer (and exit code).
    """
    precision = resolve_precision(cfg, device.type)
    norm_tolerance = NORM_TOLERANCES[precision]
    may_widen = tolerance is None and floor_applies(cfg, device.type)
    if tolerance is None:
        tolerance = parity_tolerance(cfg, device.type)
    ok = torch.ones(1, device=device)
    if comm.group_rank() == 0:
        reference, ref_norms, ref_model = run_reference(cfg, device)
        ref_state = ref_model.state_dict()
        over = max_loss_diff(losses, reference[start_step:]) > tolerance or (
            full_state is not None and max_weight_diff(full_state, ref_state) > tolerance)
        norm_over = grad_norms is not None and max_norm_diff(
            grad_norms, ref_norms[start_step:]) > norm_tolerance
        loss_floor = weight_floor = norm_floor = None
        if may_widen and (over or norm_over):  # the norm's floor: on its line's tolerance
            loss_floor, weight_floor, norm_floor, m = measure_floor(cfg, device, reference,
                                                                    ref_norms, ref_state)
            exceeded = f"{tolerance:.0e}" if over else f"{norm_tolerance:.0e} (the grad norm)"
            print(
                f"parity: floor = one device, micro-batches {cfg.data.num_micro_batches} vs {m}: "
                f"max |loss diff| {loss_floor:.1e}, max |weight diff| {weight_floor:.1e} "
                f"(measured since a difference exceeds {exceeded})", flush=True)
        passed = report_parity(losses, reference[start_step:], tolerance, precision, loss_floor)
        if full_state is not None:
            passed = report_weight_parity(full_state, ref_state, cfg.training.steps, tolerance,
                                          precision, weight_floor) and passed
        if grad_norms is not None:
            passed = report_norm_parity(grad_norms, ref_norms[start_step:], norm_tolerance,
                                        precision, norm_floor) and passed
        if not passed and loss_floor is None:  # a wrong layout, or a run too sensitive to rounding
            print(
                f"parity: do two single-device runs agree for {cfg.training.steps} steps? "
                f"python scripts/parity_floor.py CONFIG --steps {cfg.training.steps} "
                f"(doc/10_real_model.md, 'How long parity holds')", flush=True)
        elif not passed:  # above the floor: a wrong layout, or sums that drift more than m's
            print(
                f"parity: above {SAFETY_FACTOR} x the floor: a wrong layout, or one whose sums "
                f"drift more than another micro-batching's; try fewer --steps "
                f"(doc/10_real_model.md, 'How long parity holds')", flush=True)
        ok.fill_(float(passed))
    with get_ledger().paused():  # the verdict is not part of the strategy's traffic
        comm.broadcast(ok, src=0)
    return bool(ok.item())
