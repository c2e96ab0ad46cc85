"""Chapter 08: one mixed-precision policy; DDP and ZeRO reduce (and ZeRO-3 gathers) in its dtypes.

One 2-rank world trains every data-parallel strategy in bf16 for 4 steps with a bf16
``reduce_dtype`` (ZeRO-3, ours and FSDP2's ``fully_shard``, also with a bf16 ``param_dtype``)
and compares each with a single-device bf16 run of the same policy; it also reads the ledger's
bytes per element and skips an fp16 overflow that only one rank saw.
"""

import dataclasses
import unittest
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from scaletorch.dist import destroy_pg_manager, get_ledger
from scaletorch.models import build_model, loss_fn
from scaletorch.parallel.flat_unit import release_unit
from scaletorch.parallel.memory_report import measure_memory
from scaletorch.parallel.mixed_precision import (DynamicLossScaler, MixedPrecisionPolicy,
                                                 disable_autocast_cache_per_unit)
from scaletorch.parallel.mixed_precision import policy_for as policy
from scaletorch.parallel.mixed_precision import supports_fp16
from scaletorch.parallel.zero import ShardedDataParallel, ZeroAdamW, llama_units
from scaletorch.parallel.zero_mixed_precision import zero_in_dtypes
from scaletorch.parallel.zero_report import memory_formula
from scaletorch.rules.group_names import gradient_group_name
from scaletorch.trainer import Config, Trainer
from scaletorch.trainer.config import validate
from scaletorch.trainer.param_map import full_state_dict
from scaletorch.trainer.parity import max_weight_diff
from scaletorch.trainer.plain_loop import plain_training
from scaletorch.trainer.precision import TOLERANCES
from tests.harness import run_distributed
from tests.layouts import (assert_matches, build, config_of, layout, make_config, pg_manager_for,
                           reference_key, references, train)

STEPS = 4  # 2 past the 2 warm-up steps; the bounds' derivation below holds at 4, 8 and 20
# bf16 against bf16 with the same policy. A parallel run differs from the single-device run
# of its policy only in the order of its sums, so each bound is derived from the reference's
# own spread (``reference_spread``: the plain loop in bf16 with 1 and 2 micro-batches, and bf16
# against fp32; STEPS steps at lr 3e-3, the dense model), the larger of the two, times 4 to 16,
# as a power of two. Measured at 4 steps: loss 2.8e-4, grad norm 1.1e-3 relative, weights
# 3.4e-3 (at 8 steps: 2.8e-4, 1.2e-3, 4.2e-3; at 20: 4.1e-4, 1.4e-3, 4.4e-3). Bounds: loss
# 2^-9 = 2.0e-3, grad norm 2^-7 = 7.8e-3, weights 2^-5 = 3.1e-2 (7.0x, 7.4x, 9.2x at 4 steps;
# 7.0x, 6.7x, 7.4x at 8; 4.8x, 5.5x, 7.1x at 20; test_the_bounds_...). Four steps, not twenty:
# the spread grows at most 1.5x from 4 to 20 steps, so the bounds stand on the same derivation;
# twenty cost 5x as much. The parallel runs below reach at most 3.7e-4, 1.1e-3 and 5.0e-3
# (tp2_pp2, ep2_pp2_dp2).
# A skipped optimizer step moves the loss 3.2e-2 and the grad norm 3.6e-2 (20 steps,
# tests/test_planted_bugs.py): caught 16x and 4.6x; its weight change, 5.1e-3, lies inside
# bf16's own spread. At 4 steps, ZeroAdamW skipping step 2 moves zero1's loss 6.1e-2 and its
# grad norm 1.7e-2: caught 31x and 2.2x.
TOL = TOLERANCES["bf16"]  # 2^-5, as precision.py's --check uses for the weights
LOSS_TOL = 2.0**-9
NORM_RTOL = 2.0**-7
SPREAD_FACTORS = (4, 16)  # each bound over the reference's own spread: at least 4, at most 16


def reference_spread() -> dict:
    """{"loss", "grad norm", "weights"}: the larger of the plain loop's bf16 run with 1 vs 2
    micro-batches (two summation orders) and its bf16 vs its fp32 run (2 micro-batches); the
    grad norm relative; STEPS steps of tests/layouts.make_config's dense model."""
    runs = {}
    for precision, m in (("bf16", 1), ("bf16", 2), ("fp32", 2)):
        cfg = make_config(False, m)
        cfg.training.steps, cfg.training.precision = STEPS, precision
        losses, norms, model = plain_training(cfg)
        runs[precision, m] = losses, norms, model.state_dict()
    base = runs["bf16", 2]
    spread = {"loss": 0.0, "grad norm": 0.0, "weights": 0.0}
    for other in (runs["bf16", 1], runs["fp32", 2]):
        spread["loss"] = max([spread["loss"]] + [abs(a - b) for a, b in zip(base[0], other[0])])
        spread["grad norm"] = max([spread["grad norm"]] +
                                  [abs(a - b) / b for a, b in zip(base[1], other[1])])
        spread["weights"] = max(spread["weights"], max_weight_diff(base[2], other[2]))
    return spread


CASES = {  # name -> parallel config (2 ranks)
    "naive": dict(impl="naive"),
    "bucketed": dict(impl="ours", bucket_size_mb=0.01),  # several buckets
    "zero1": dict(zero_stage=1),
    "zero2": dict(zero_stage=2),
    "zero3": dict(zero_stage=3, param_dtype="bf16"),
    "fsdp2": dict(impl="torch", zero_stage=3, param_dtype="bf16"),  # fully_shard(mp_policy=...)
    "ddp_torch": dict(impl="torch"),  # torch's DDP with our reduce_dtype comm hook
    # fp16 with the loss scaler, gradients reduced in fp16 (CPU fp16 matmuls are slow: one case;
    # fp16 through a 2-stage pipeline, whose last stage's backward starts from the scale, is
    # MixedPrecisionComposedLayouts' fp16_pp2_dp2, with an overflow in one stage)
    "fp16_zero2": dict(zero_stage=2),
    # the other strategies (dp 1): activations and their gradients cross tp / pp / cp / ep in
    # the compute dtype (WIRE); ep is the MoE model
    "tp2": layout(tp=2, sequence_parallel=True),
    "pp2": layout(pp=2),
    "cp2": layout(cp=2),
    "ep2": layout(ep=2),
}
WIRE = {"tp2": "tp", "pp2": "pp", "cp2": "cp", "ep2": "ep"}  # case -> its group
DATA_PARALLEL = ("naive", "bucketed", "zero1", "zero2", "zero3", "fsdp2", "fp16_zero2")


def precision_of(name: str) -> str:
    return "fp16" if name.startswith("fp16") else "bf16"


def low_config(name: str, precision: str = "", steps: int = STEPS) -> Config:
    """Case ``name`` at its precision (or ``precision``), gradients reduced in it, STEPS steps;
    the MoE model (ep) with one micro-batch, as tests/layouts.py's."""
    precision = precision or precision_of(name)
    moe = name == "ep2"
    cfg = make_config(moe, 1 if moe else 2, reduce_dtype=precision, **CASES[name])
    cfg.training.steps, cfg.training.precision = steps, precision
    return cfg


def _wire(group: str, step: int) -> dict:
    """{op: (elements, bytes)} that went over ``group`` in ``step``."""
    ledger = get_ledger()
    out = {}
    for op in {r.op for r in ledger.select(group=group, step=step)}:
        out[op] = (ledger.total(op=op, group=group, step=step),
                   ledger.total(op=op, group=group, step=step, field="bytes"))
    return out


def _grad_bytes_per_element(step: int, group: str) -> dict:
    """Bytes per element of each op over ``group`` (the ledger's name: "dp" at cp 1)."""
    ledger = get_ledger()
    out = {}
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        elements = ledger.total(op=op, group=group, step=step)
        if elements:
            out[op] = ledger.total(op=op, group=group, step=step, field="bytes") / elements
    return out


def _overflow_on_one_rank() -> dict:
    """ZeRO-2 in fp32 with the loss scaler: rank 1's own gradient shard gets an inf at step 1;
    every rank must skip that step and halve the scale; the replicas stay equal."""
    cfg = make_config(micro_batches=1, zero_stage=2)
    cfg.training.precision = "fp32"
    pgm = pg_manager_for(cfg)
    model = build_model(cfg.model, seed=cfg.training.model_seed)
    zero = ShardedDataParallel(model, llama_units(model), pgm.gradient_sync_group, 2)
    optimizer = ZeroAdamW(zero, 1e-3, (0.9, 0.95), 0.0)
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=100, group=None)  # the world
    trainer = Trainer(cfg, zero, pgm, optimizer=optimizer, verbose=False)
    inputs, targets = trainer.loader.get_batch(0)
    stepped, scales = [], []
    for step in range(3):
        optimizer.zero_grad()
        half = inputs.shape[0] // 2
        rank = pgm.data_parallel_rank
        x, y = inputs[rank * half:(rank + 1) * half], targets[rank * half:(rank + 1) * half]
        (loss_fn(zero(x), y) * scaler.scale).backward()
        zero.finish_grad_sync()
        if step == 1 and rank == 1:
            next(iter(zero.parameters())).grad[0] = float("inf")  # this rank's shard only
        stepped.append(scaler.step(optimizer, zero.parameters()))
        scales.append(scaler.scale)
    # the gathered parameters (stage 2: the full replica on every rank)
    full = torch.cat([u.flat.detach() for u in zero.units])
    replicas = [torch.empty_like(full) for _ in range(2)]
    torch.distributed.all_gather(replicas, full)
    destroy_pg_manager()
    return {
        "stepped": stepped,
        "scales": scales,
        "skipped": scaler.skipped,
        # replicas of one update: the same ops on the same reduced gradients, bit for bit
        "replicas_equal": bool(torch.equal(replicas[0], replicas[1])),
        "finite": bool(torch.isfinite(full).all())
    }


def _rank_main(rank: int, world_size: int) -> dict:
    out = {}
    for name in CASES:
        cfg = low_config(name)
        pgm = pg_manager_for(cfg)
        get_ledger().clear()
        par, trainer = build(cfg, pgm)
        result = trainer.train()
        units = getattr(par.model, "units", [])  # ZeRO's, padded to a multiple of N
        gradients = gradient_group_name(cfg.parallel.context_parallel_size)  # "dp" at cp 1
        out[name] = {
            "losses": result.losses,
            "grad_norms": result.grad_norms,
            "state": full_state_dict(par),
            "bytes_per_element": _grad_bytes_per_element(STEPS - 1, gradients),
            "numel": sum(u.padded_numel for u in units),
        }
        if name in DATA_PARALLEL:
            out[name]["memory"] = measure_memory(par.model, trainer.optimizer)
        if name in WIRE:
            out[name]["wire"] = _wire(WIRE[name], STEPS - 1)
        if units and cfg.parallel.zero_stage == 3:  # ours: a gathered unit holds 2 x P' bytes
            units[1].gather()
            out[name]["gathered"] = (units[1].gathered_bytes, units[1].padded_numel,
                                     units[1].flat.dtype)
            release_unit(units[1].flat)
        destroy_pg_manager()
    for name, group in WIRE.items():  # the same strategies in fp32, for their bytes
        pgm = pg_manager_for(low_config(name, "fp32", 2))
        get_ledger().clear()
        build(low_config(name, "fp32", 2), pgm)[1].train()
        out[name]["wire_fp32"] = _wire(group, 1)
        destroy_pg_manager()
    out["overflow"] = _overflow_on_one_rank()
    return out


def _zero3_state(model: ShardedDataParallel) -> dict:
    """The reference-keyed fp32 master weights of a one-rank ZeRO-3 (its shards are whole)."""
    state = {}
    for unit in model.units:
        flat = unit.shard.detach()
        for names, shape, start in zip(unit.names, unit.shapes, unit.offsets):
            state[names[0]] = flat[start:start + shape.numel()].view(shape).clone()
    return state


def _reference(cfg: Config) -> tuple:
    """The single-device bf16 run with the same policy: autocast alone (DDP, ZeRO-1/2 keep fp32
    parameters and nothing is reduced on one device), or a one-rank ZeRO-3 that computes with a
    bf16 copy of its parameters, as the 2-rank ZeRO-3 does."""
    model = build_model(cfg.model, seed=cfg.training.model_seed)
    p = cfg.parallel
    cfg.parallel = Config().parallel  # one device; param_dtype and reduce_dtype read from p
    if p.zero_stage == 3:
        policy = MixedPrecisionPolicy.of(p.param_dtype, p.reduce_dtype)
        wrapper = zero_in_dtypes(ShardedDataParallel, policy.param_dtype, policy.reduce_dtype)
        zero = wrapper(model, llama_units(model), None, 3)
        disable_autocast_cache_per_unit(zero)  # as parallelize does
        t = cfg.training
        optimizer = ZeroAdamW(zero, t.lr, (t.beta1, t.beta2), t.weight_decay)
        trainer = Trainer(cfg, zero, None, optimizer=optimizer, verbose=False)
        result = trainer.train()
        return result.losses, result.grad_norms, _zero3_state(zero)
    result = Trainer(cfg, model, None, verbose=False).train()
    return result.losses, result.grad_norms, {k: v.detach() for k, v in model.state_dict().items()}


_REFERENCES: dict = {}  # what _reference reads of a config -> its run, shared by both classes


def shared_reference(cfg: Config) -> tuple:
    """``_reference(cfg)``, run once per distinct single-device run: it reads every section but
    ``parallel``, and of that only a ZeRO-3's param_dtype and reduce_dtype. So the data-parallel
    strategies, tp, pp and cp share one bf16 run, ZeRO-3 and fully_shard one, fp16_zero2 and
    chapter 07's fp16 pp 2 x dp 2 one: each is the same computation, bit for bit."""
    p = cfg.parallel
    policy = (p.param_dtype, p.reduce_dtype) if p.zero_stage == 3 else None
    key = repr(dataclasses.replace(cfg, parallel=Config().parallel)), policy
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference(cfg)
    return _REFERENCES[key]


class _WeightCasts(TorchDispatchMode):
    """Sees every op: keeps a weak reference to each bf16 copy of a 2-D fp32 tensor (a weight;
    activations are 3-D), so ``held()`` is the bytes of such copies still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args[0].dim() == 2 and \
                args[0].dtype == torch.float32 and out.dtype == torch.bfloat16:
            self.refs.append(weakref.ref(out))
        return out

    def held(self) -> int:
        alive = [r() for r in self.refs]
        return sum({
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in alive if t is not None
        }.values())


def _zero3_weight_copies_held(param_dtype: str) -> dict:
    """One process, ZeRO-3 over all units (world 1: the shard is the unit), one bf16 step:
    bytes of bf16 weight copies alive at the end of forward and of backward (inside autocast,
    as the Trainer's step), and the bytes ZeRO-3 says it holds gathered at most."""
    cfg = make_config()
    model = build_model(cfg.model, seed=0)
    policy = MixedPrecisionPolicy.of(param_dtype, "fp32", "bf16")
    wrapper = zero_in_dtypes(ShardedDataParallel, policy.param_dtype, policy.reduce_dtype)
    zero = wrapper(model, llama_units(model), None, 3)
    disable_autocast_cache_per_unit(zero)  # as parallelize does
    x = torch.randint(0, cfg.model.vocab_size, (4, 16))
    casts = _WeightCasts()
    with torch.autocast("cpu", dtype=torch.bfloat16), casts:
        loss = loss_fn(zero(x), x)
        forward = casts.held()
        loss.backward()
        backward = casts.held()
    return {
        "forward": forward,
        "backward": backward,
        "claim": zero.peak_gathered_bytes,
        "linear_bf16": 2 * sum(p.numel() for p in zero.shards.parameters())
    }


class MixedPrecisionPolicyConfig(unittest.TestCase):

    def test_zero3_under_bf16_holds_no_weight_copies_beyond_its_gathered_units(self):
        # default param_dtype (auto = the compute dtype): the unit gathers bf16 and autocast
        # has nothing to cast; what backward saves is on the flat buffer ZeRO-3 frees
        auto = _zero3_weight_copies_held("auto")
        print(f"\nZeRO-3 bf16, param_dtype auto: bf16 weight copies held after forward "
              f"{auto['forward']:,} B, after backward {auto['backward']:,} B; gathered at most "
              f"{auto['claim']:,} B")
        self.assertEqual((auto["forward"], auto["backward"]), (0, 0))
        # 2 units in flight (prefetch) of 2 bytes per element: under 2 bytes per parameter
        self.assertLess(auto["claim"], auto["linear_bf16"])
        # param_dtype fp32: autograd saves autocast's copies until each unit's backward (about
        # 2 bytes per parameter after forward); with the autocast cache off per unit they no
        # longer outlive backward (before: all of them, to the end of the step)
        fp32 = _zero3_weight_copies_held("fp32")
        print(f"ZeRO-3 bf16, param_dtype fp32: bf16 weight copies held after forward "
              f"{fp32['forward']:,} B, after backward {fp32['backward']:,} B; 2 bytes per "
              f"parameter {fp32['linear_bf16']:,} B")
        self.assertGreater(fp32["forward"], fp32["claim"])
        self.assertLessEqual(fp32["forward"], fp32["linear_bf16"])
        self.assertEqual(fp32["backward"], 0)

    def test_default_policy_is_fp32_and_bf16_names_resolve(self):
        cfg = Config()
        self.assertEqual(policy(cfg, "cpu"), MixedPrecisionPolicy())
        cfg.training.precision, cfg.parallel.param_dtype = "bf16", "bf16"
        cfg.parallel.reduce_dtype = "bf16"
        self.assertEqual(policy(cfg, "cpu"), MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16))

    def test_bad_input_raises_naming_the_values(self):
        cases = [  # (precision, param_dtype, reduce_dtype) -> message
            (("fp8", "fp32", "fp32"), "training.precision must be one of .* got 'fp8'"),
            (("bf16", "float", "fp32"), "parallel.param_dtype must be one of .* got 'float'"),
            (("bf16", "fp32", "int8"), "parallel.reduce_dtype must be one of .* got 'int8'"),
            (("fp32", "fp64", "fp32"), "param_dtype fp64 \\(8 bytes\\) is wider than the fp32"),
            (("bf16", "fp16", "fp32"), "param_dtype fp16 must be fp32 or the compute dtype .*bf16"),
            (("fp32", "bf16", "fp32"), "param_dtype bf16 must be fp32 or the compute dtype"),
        ]
        for (precision, param, reduce), message in cases:
            with self.subTest(precision=precision, param_dtype=param, reduce_dtype=reduce):
                cfg = Config()
                cfg.training.precision = precision
                cfg.parallel.param_dtype, cfg.parallel.reduce_dtype = param, reduce
                with self.assertRaisesRegex(ValueError, message):
                    validate(cfg)

    def test_fp16_on_a_device_type_without_fp16_autocast_raises(self):
        # asked of torch, not assumed: CPU autocast computes in fp16 in torch 2.x, "meta" not
        self.assertTrue(supports_fp16("cpu"))
        with self.assertRaisesRegex(ValueError, "fp16 .*device type 'meta' does not"):
            MixedPrecisionPolicy.from_names("fp16", "fp32", "fp32", "meta")


def assert_skipped_step_1_everywhere(test: unittest.TestCase, results: list) -> None:
    """Every rank's ``overflow`` run (3 steps, scale 2^10, an inf on one rank at step 1): each
    skipped step 1 alone, halved the scale once, and kept its replicas equal and finite."""
    for rank, res in enumerate(results):
        got = res["overflow"]
        with test.subTest(rank=rank):
            test.assertEqual(got["stepped"], [True, False, True])
            test.assertEqual(got["scales"], [2.0**10, 2.0**9, 2.0**9])
            test.assertEqual(got["skipped"], 1)
            test.assertTrue(got["replicas_equal"])
            test.assertTrue(got["finite"])


class MixedPrecisionDataParallel(unittest.TestCase):
    """2 ranks, 4 bf16 steps per strategy, one world."""

    @classmethod
    def setUpClass(cls):
        cls.results = run_distributed(_rank_main, 2, timeout=400)
        cls.references = {name: shared_reference(low_config(name)) for name in CASES}

    def test_low_precision_matches_single_device_of_the_same_policy_within_derived_bounds(self):
        # fp16 (11 significant bits) rounds finer than bf16: bf16's bounds hold for it. The one
        # parity helper: every rank's losses (LOSS_TOL) and grad norms (NORM_RTOL relative),
        # rank 0's weights (TOL); the bounds' derivation is the next test.
        for name in CASES:
            with self.subTest(strategy=name):
                got, (losses, norms, state) = self.results[0][name], self.references[name]
                loss_diff = max(abs(a - b) for a, b in zip(got["losses"], losses))
                norm_diff = max(abs(a - b) / b for a, b in zip(got["grad_norms"], norms))
                weight_diff = max_weight_diff(got["state"], state)
                print(f"\n{name}: {precision_of(name)}, {STEPS} steps: max |loss - reference| = "
                      f"{loss_diff:.1e}, max |grad norm / reference - 1| = {norm_diff:.1e}, "
                      f"max |weight - reference| = {weight_diff:.1e} (tolerances {LOSS_TOL:.1e}, "
                      f"{NORM_RTOL:.1e}, {TOL:.1e})")
                assert_matches(self, [res[name] for res in self.results], self.references[name],
                               name, tol=TOL, norm_tol=NORM_RTOL, loss_tol=LOSS_TOL)

    def test_the_bounds_are_4_to_16_times_the_references_own_spread(self):
        spread = reference_spread()
        low, high = SPREAD_FACTORS
        bounds = {"loss": LOSS_TOL, "grad norm": NORM_RTOL, "weights": TOL}
        print(f"\nbf16 reference's own spread ({STEPS} steps): " +
              ", ".join(f"{k} {v:.1e} (bound {bounds[k]:.1e} = {bounds[k] / v:.1f}x)"
                        for k, v in spread.items()))
        for key, bound in bounds.items():
            self.assertGreater(spread[key], 0.0, key)  # bf16 rounds: never bit-equal to fp32
            self.assertGreaterEqual(bound, low * spread[key], f"{key}: {spread}")
            self.assertLessEqual(bound, high * spread[key], f"{key}: {spread}")

    def test_our_zero3_matches_fully_shard_with_the_same_mixed_precision_policy(self):
        ours, torch_losses = self.results[0]["zero3"]["losses"], self.results[0]["fsdp2"]["losses"]
        diff = max(abs(a - b) for a, b in zip(ours, torch_losses))
        print(f"\nZeRO-3 vs fully_shard, param_dtype and reduce_dtype bf16, {STEPS} steps: "
              f"max |loss difference| = {diff:.1e} (tolerance {LOSS_TOL:.1e})")
        self.assertLessEqual(diff, LOSS_TOL)

    def test_gradients_cross_the_wire_in_2_bytes_and_zero3_gathers_bf16(self):
        # the ledger's bytes per element are the element size of the tensor that was sent
        want = {
            "naive": dict(all_reduce=2),
            "bucketed": dict(all_reduce=2),
            "ddp_torch": dict(all_reduce=2),  # reduce_dtype_hook: the buckets in bf16
            "zero1": dict(reduce_scatter=2, all_gather=4),  # stages 1, 2 gather fp32 masters
            "zero2": dict(reduce_scatter=2, all_gather=4),
            "zero3": dict(reduce_scatter=2, all_gather=2),  # param_dtype bf16: half
            "fp16_zero2": dict(reduce_scatter=2, all_gather=4),
        }
        for name, ops in want.items():
            for rank in (0, 1):
                got = self.results[rank][name]["bytes_per_element"]
                for op, size in ops.items():
                    with self.subTest(strategy=name, rank=rank, op=op):
                        # all_reduce also carries fp32 scalars (the loss average, fp16's
                        # overflow flag): 1 or 2 elements in ~25k
                        self.assertAlmostEqual(got[op], size, delta=1e-3)

    def test_memory_is_the_formula_exactly_at_every_stage_and_zero3_gathers_2_bytes(self):
        # The policy keeps fp32 master weights, fp32 gradients (DDP's buckets, ZeRO's shards)
        # and fp32 m, v: 4 + 4 + 8 bytes per parameter, sharded by the stage, so the planner's
        # formula (plan/memory.py, element size 4) holds exactly in bf16 too. What bf16 changes
        # is transient: ZeRO-3's gathered unit is bf16, 2 bytes per element.
        psi = build_model(make_config().model, seed=0).num_parameters()
        for rank in (0, 1):
            for name, stage in (("bucketed", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3)):
                got = self.results[rank][name]
                numel = psi if stage == 0 else got["numel"]
                with self.subTest(rank=rank, stage=stage):
                    self.assertEqual(got["memory"], memory_formula(stage, numel, 2))
            held, padded, dtype = self.results[rank]["zero3"]["gathered"]
            self.assertEqual((held, dtype), (2 * padded, torch.bfloat16))

    def test_tp_pp_cp_ep_send_activations_and_their_gradients_in_bf16_half_the_fp32_bytes(self):
        # Per group, bytes per element of the last step in bf16 over those of step 1 in fp32: 1/2,
        # up to what stays fp32 on purpose: the vocabulary-parallel loss statistics (max, sum
        # of exp, target logit) and the sequence-parallel norm weights' gradient over tp, the
        # loss over pp, the int64 token counts over ep. They are under 1% of the bytes.
        for name, group in WIRE.items():
            for rank in (0, 1):
                got = self.results[rank][name]
                bf16, fp32 = got["wire"], got["wire_fp32"]
                per_element = [
                    sum(b for _, b in wire.values()) / sum(e for e, _ in wire.values())
                    for wire in (bf16, fp32)
                ]
                ratio = per_element[0] / per_element[1]
                if rank == 0:
                    print(f"\n{name}: {group} bytes per element bf16 {per_element[0]:.3f}, fp32 "
                          f"{per_element[1]:.3f}: ratio {ratio:.4f}")
                with self.subTest(strategy=name, rank=rank):
                    self.assertGreaterEqual(ratio, 0.5)
                    self.assertLessEqual(ratio, 0.51)
        # exactly half where nothing else travels: the pipeline's sends, the ring's
        cfg = low_config("cp2")
        m = cfg.model
        b, s_local, hd = cfg.data.global_batch_size, cfg.data.seq_len // 2, m.hidden_size // \
            m.num_attention_heads
        ring = (3 * 2 - 2) * 2 * b * s_local * m.num_key_value_heads * hd * m.num_layers
        for rank in (0, 1):
            with self.subTest(rank=rank):
                pp = self.results[rank]["pp2"]
                self.assertEqual(pp["wire"]["send"][1], pp["wire_fp32"]["send"][1] / 2)
                # ring attention: K, V forward and backward, dK, dV: the formula x 2 bytes
                self.assertEqual(self.results[rank]["cp2"]["wire"]["send"], (ring, 2 * ring))

    def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(self):
        assert_skipped_step_1_everywhere(self, self.results)


# Chapter 07 layouts on 4 ranks in bf16 (fp16_*: fp16), gradients reduced in it:
# (moe, micro-batches, parallel)
COMPOSED = {
    "tp2_pp2": (False, 2, layout(tp=2, pp=2)),
    "cp2_dp2_zero1": (False, 2, layout(cp=2, zero_stage=1)),
    "ep2_pp2_dp2": (True, 1, layout(pp=2, ep=2, schedule="afab")),
    "fp16_pp2_dp2": (False, 2, layout(pp=2)),
}


def composed_config(name: str) -> Config:
    cfg = config_of(COMPOSED, name)
    cfg.parallel.reduce_dtype = cfg.training.precision = precision_of(name)
    cfg.training.steps = STEPS
    return cfg


def _overflow_in_one_stage() -> dict:
    """fp16, pp 2 x dp 2 (1F1B): after step 1's backward, the last stage's replica on dp rank
    1 gets an inf in its (already reduced) gradient; the first stage's ranks see none. Every
    rank must skip that step and halve the scale; each stage's two replicas stay equal."""
    cfg = composed_config("fp16_pp2_dp2")
    cfg.training.steps = 3
    pgm = pg_manager_for(cfg)
    par, trainer = build(cfg, pgm)
    trainer.scaler.scale = 2.0**10  # clean steps before and after (growth_interval 2000)
    forward_backward = trainer.forward_backward
    last, dp_rank = pgm.pipeline_model_parallel_rank == 1, pgm.data_parallel_rank

    def with_inf(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = forward_backward(inputs, targets)
        if trainer.step == 1 and last and dp_rank == 1:
            next(p for p in par.model.parameters() if p.grad is not None).grad[0] = float("inf")
        return loss

    trainer.forward_backward = with_inf
    stepped, scales = [], []
    for _ in range(3):
        skipped = trainer.scaler.skipped
        trainer.train_step()
        stepped.append(trainer.scaler.skipped == skipped)
        scales.append(trainer.scaler.scale)
    mine = torch.cat([p.detach().flatten() for p in par.model.parameters()])
    replicas = [torch.empty_like(mine) for _ in range(2)]
    torch.distributed.all_gather(replicas, mine, group=pgm.gradient_sync_group)
    destroy_pg_manager()
    return {
        "stepped": stepped,
        "scales": scales,
        "skipped": trainer.scaler.skipped,
        # replicas of one update: the same ops on the same reduced gradients, bit for bit
        "replicas_equal": bool(torch.equal(replicas[0], replicas[1])),
        "finite": bool(torch.isfinite(mine).all())
    }


def _composed_main(rank: int, world_size: int) -> dict:
    out = {name: train(composed_config(name)) for name in COMPOSED}
    out["overflow"] = _overflow_in_one_stage()
    return out


class MixedPrecisionComposedLayouts(unittest.TestCase):
    """4 ranks, three chapter-07 layouts in bf16 and pp 2 x dp 2 in fp16, 4 steps each, one
    world; and an fp16 overflow in one stage of one replica."""

    @classmethod
    def setUpClass(cls):
        cls.results = run_distributed(_composed_main, 4, timeout=400)
        bf16 = [name for name in COMPOSED if precision_of(name) == "bf16"]
        refs = references(composed_config(name) for name in bf16)
        # reference_key ignores the precision: fp16's single-device run (its own scaler) apart
        cls.references = {name: refs[reference_key(composed_config(name))] for name in bf16}
        cls.references.update({
            name: shared_reference(composed_config(name))
            for name in COMPOSED if name not in bf16
        })

    def test_composed_layouts_in_bf16_match_single_device_bf16_within_the_derived_bounds(self):
        # fp16 (11 significant bits) rounds finer than bf16: bf16's bound holds for it
        for name in COMPOSED:
            losses, norms, state = self.references[name]
            with self.subTest(layout=name):
                loss_diff = max(
                    abs(a - b) for rank in range(4)
                    for a, b in zip(self.results[rank][name]["losses"], losses))
                norm_diff = max(
                    abs(a - b) / b for rank in range(4)
                    for a, b in zip(self.results[rank][name]["grad_norms"], norms))
                weight_diff = max_weight_diff(self.results[0][name]["state"], state)
                print(f"\n{name}: {precision_of(name)}, {STEPS} steps: max |loss - reference| = "
                      f"{loss_diff:.1e}, max |grad norm / reference - 1| = {norm_diff:.1e}, "
                      f"max |weight - reference| = {weight_diff:.1e} (tolerances {LOSS_TOL:.1e}, "
                      f"{NORM_RTOL:.1e}, {TOL:.1e})")
                assert_matches(self, [res[name] for res in self.results], self.references[name],
                               name, tol=TOL, norm_tol=NORM_RTOL, loss_tol=LOSS_TOL)

    def test_an_overflow_in_one_pipeline_stage_skips_the_step_on_every_rank(self):
        assert_skipped_step_1_everywhere(self, self.results)


if __name__ == "__main__":
    unittest.main()
