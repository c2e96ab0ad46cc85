"""Chapter 08: one mixed-precision policy; DDP and ZeRO reduce (and ZeRO-3 gathers) in its dtypes.

One 2-rank world trains every data-parallel strategy in bf16 for 20 steps with a bf16
``reduce_dtype`` (ZeRO-3, ours and FSDP2's ``fully_shard``, also with a bf16 ``param_dtype``)
and compares each with a single-device bf16 run of the same policy; it also reads the ledger's
bytes per element and skips an fp16 overflow that only one rank saw.
"""

import unittest

import torch

from scaletorch.dist import destroy_pg_manager, get_ledger
from scaletorch.models import build_model, loss_fn
from scaletorch.parallel.mixed_precision import (DynamicLossScaler, MixedPrecisionPolicy,
                                                 supports_fp16)
from scaletorch.parallel.zero import ShardedDataParallel, ZeroAdamW, llama_units
from scaletorch.parallel.zero_memory import measure_memory, memory_formula
from scaletorch.trainer import Config, Trainer
from scaletorch.trainer.config import validate
from scaletorch.trainer.parity import max_weight_diff
from scaletorch.trainer.precision import TOLERANCES, policy
from tests.harness import run_distributed
from tests.layouts import build, make_config, pg_manager_for

STEPS = 20
# bf16 against bf16 with the same policy: precision.py derives 8 u = 2^-5 = 3.1e-2 from
# bf16's unit roundoff u = 2^-8 (rounding-level activation differences of ~u relative, and
# AdamW's ~lr moves of elements whose tiny gradient the rounding flips). The same bound here.
TOL = TOLERANCES["bf16"]

CASES = {  # name -> parallel config (2 ranks, all data parallel)
    "naive": dict(impl="naive"),
    "bucketed": dict(impl="scaletorch", bucket_size_mb=0.01),  # several buckets
    "zero1": dict(zero_stage=1),
    "zero2": dict(zero_stage=2),
    "zero3": dict(zero_stage=3, param_dtype="bf16"),
    "fsdp2": dict(impl="torch", zero_stage=3, param_dtype="bf16"),  # fully_shard(mp_policy=...)
    # fp16 with the loss scaler, gradients reduced in fp16 (CPU fp16 matmuls are slow: one case)
    "fp16_zero2": dict(zero_stage=2),
}


def precision_of(name: str) -> str:
    return "fp16" if name.startswith("fp16") else "bf16"


def low_config(name: str) -> Config:
    """Case ``name`` at its precision, gradients reduced in that precision, 20 steps."""
    precision = precision_of(name)
    cfg = make_config(micro_batches=2, reduce_dtype=precision, **CASES[name])
    cfg.training.steps, cfg.training.precision = STEPS, precision
    return cfg


def _grad_bytes_per_element(step: int) -> dict:
    ledger = get_ledger()
    out = {}
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        elements = ledger.total(op=op, group="dp_cp", step=step)
        if elements:
            out[op] = ledger.total(op=op, group="dp_cp", step=step, field="bytes") / elements
    return out


def _overflow_on_one_rank() -> dict:
    """ZeRO-2 in fp32 with the loss scaler: rank 1's own gradient shard gets an inf at step 1;
    every rank must skip that step and halve the scale; the replicas stay equal."""
    cfg = make_config(micro_batches=1, zero_stage=2)
    cfg.training.precision = "fp32"
    pgm = pg_manager_for(cfg)
    model = build_model(cfg.model, seed=cfg.training.model_seed)
    zero = ShardedDataParallel(model, llama_units(model), pgm.data_parallel_group_with_context, 2)
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
        "replicas_equal": bool(torch.equal(replicas[0], replicas[1]))
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
        out[name] = {
            "losses": result.losses,
            "state": par.full_state_dict(),
            "bytes_per_element": _grad_bytes_per_element(STEPS - 1),
            "memory": measure_memory(par.model, trainer.optimizer),
            "numel": sum(u.padded_numel for u in units),
        }
        if units and cfg.parallel.zero_stage == 3:  # ours: a gathered unit holds 2 x P' bytes
            units[1].gather()
            out[name]["gathered"] = (units[1].gathered_bytes, units[1].padded_numel,
                                     units[1].flat.dtype)
            units[1].free()
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
    if p.zero_stage == 3:
        zero = ShardedDataParallel(model, llama_units(model), None, 3,
                                   policy=MixedPrecisionPolicy.of(p.param_dtype, p.reduce_dtype))
        t = cfg.training
        optimizer = ZeroAdamW(zero, t.lr, (t.beta1, t.beta2), t.weight_decay)
        trainer = Trainer(cfg, zero, None, optimizer=optimizer, verbose=False)
        return trainer.train().losses, _zero3_state(zero)
    trainer = Trainer(cfg, model, None, verbose=False)
    return trainer.train().losses, {k: v.detach() for k, v in model.state_dict().items()}


class MixedPrecisionPolicyConfig(unittest.TestCase):

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


class MixedPrecisionDataParallel(unittest.TestCase):
    """2 ranks, 20 bf16 steps per strategy, one world."""

    @classmethod
    def setUpClass(cls):
        cls.results = run_distributed(_rank_main, 2, timeout=400)
        cls.references = {name: _reference(low_config(name)) for name in CASES}

    def test_low_precision_matches_single_device_of_the_same_policy_within_2_to_the_minus_5(self):
        # fp16 (11 significant bits) rounds finer than bf16: bf16's bound holds for it
        for name in CASES:
            with self.subTest(strategy=name):
                got, (losses, state) = self.results[0][name], self.references[name]
                loss_diff = max(abs(a - b) for a, b in zip(got["losses"], losses))
                weight_diff = max_weight_diff(got["state"], state)
                print(f"\n{name}: {precision_of(name)}, {STEPS} steps: max |loss - reference| = "
                      f"{loss_diff:.1e}, max |weight - reference| = {weight_diff:.1e} "
                      f"(tolerance {TOL:.1e})")
                self.assertEqual(len(got["losses"]), STEPS)
                self.assertLessEqual(loss_diff, TOL)
                self.assertLessEqual(weight_diff, TOL)

    def test_our_zero3_matches_fully_shard_with_the_same_mixed_precision_policy(self):
        ours, torch_losses = self.results[0]["zero3"]["losses"], self.results[0]["fsdp2"]["losses"]
        diff = max(abs(a - b) for a, b in zip(ours, torch_losses))
        print(f"\nZeRO-3 vs fully_shard, param_dtype and reduce_dtype bf16, {STEPS} steps: "
              f"max |loss difference| = {diff:.1e} (tolerance {TOL:.1e})")
        self.assertLessEqual(diff, TOL)

    def test_gradients_cross_the_wire_in_2_bytes_and_zero3_gathers_bf16(self):
        # the ledger's bytes per element are the element size of the tensor that was sent
        want = {
            "naive": dict(all_reduce=2),
            "bucketed": dict(all_reduce=2),
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

    def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(self):
        for rank in (0, 1):
            got = self.results[rank]["overflow"]
            with self.subTest(rank=rank):
                self.assertEqual(got["stepped"], [True, False, True])
                self.assertEqual(got["scales"], [2.0**10, 2.0**9, 2.0**9])
                self.assertEqual(got["skipped"], 1)
                self.assertTrue(got["replicas_equal"])


if __name__ == "__main__":
    unittest.main()
