"""Chapter 02: ZeRO-1/2/3 and FSDP2 reproduce the single-device run; the ledgers match the formulas.

Two worlds: 4 ranks (every stage with accumulation, stage 3 without prefetch, invalid layouts)
and 2 ranks (every stage with accumulation, fully_shard, sharded checkpoints, the consolidated
checkpoint). References run in the test process.
"""

import copy
import os
import tempfile
import unittest

import torch

from scaletorch.dist import destroy_pg_manager, get_ledger, init_pg_manager
from scaletorch.models import LlamaConfig, build_model
from scaletorch.parallel.fully_shard import apply_fully_shard
from scaletorch.parallel.memory_report import measure_memory
from scaletorch.parallel.parallelize import parallelize
from scaletorch.parallel.zero import ShardedDataParallel, ZeroAdamW, apply_zero, llama_units
from scaletorch.parallel.zero_report import comm_formula, memory_formula
from scaletorch.parallel.zero_tied import TiedShardedDataParallel, zero_units
from scaletorch.trainer import Config, Trainer
from scaletorch.trainer import checkpoint as ckpt
from scaletorch.trainer import max_weight_diff, run_reference
from scaletorch.trainer.consolidated import save_consolidated
from scaletorch.trainer.param_map import full_state_dict
from tests.harness import bit_exact, run_distributed
from tests.layouts import assert_matches, full_state, reference

# fp32, 5 steps. Each rank averages its own tokens and the ranks' means are averaged, where the
# reference averages all tokens at once: the same sum in another order, ~1e-7 per step. We see
# <= 1e-6, FSDP2 too (doc/design.md, "The correctness contract").
TOL = 1e-5
STEPS = 5


def tiny_config(num_micro_batches: int, tied: bool = False, **training) -> Config:
    cfg = Config()
    # Units of 1920 (embedding), 7950 (each block) and 1950 (head) elements: over 4 ranks the
    # blocks and the head need padding (hidden is even, so over 2 ranks nothing does). Tied:
    # the head unit is the norm's 30 and borrows the embedding unit's 1920 (zero_tied.py).
    cfg.model = LlamaConfig(vocab_size=64, hidden_size=30, intermediate_size=61, num_layers=2,
                            num_attention_heads=3, num_key_value_heads=1, max_seq_len=16,
                            tie_word_embeddings=tied)
    cfg.data.seq_len, cfg.data.global_batch_size = 16, 8
    cfg.data.num_micro_batches = num_micro_batches
    cfg.training.steps, cfg.training.warmup_steps, cfg.training.lr = STEPS, 2, 1e-2
    for key, value in training.items():
        setattr(cfg.training, key, value)
    cfg.logging.progress = False
    return cfg


def _run(cfg: Config, pgm, stage, prefetch: bool = True) -> dict:
    """Train ``cfg`` under ZeRO ``stage`` (or "torch": fully_shard); collect what tests check."""
    model = build_model(cfg.model, seed=cfg.training.model_seed)
    numel = model.num_parameters()
    get_ledger().clear()
    if stage == "torch":
        model = apply_fully_shard(model, pgm)
        trainer = Trainer(cfg, model, pgm, verbose=False)
    else:
        if cfg.model.tie_word_embeddings:  # one weight in two units: chapter 10's subclass
            model = TiedShardedDataParallel(model, zero_units(model), pgm.gradient_sync_group,
                                            stage, prefetch)
        else:
            model = apply_zero(model, pgm, stage, prefetch=prefetch)
        t = cfg.training
        optimizer = ZeroAdamW(model, t.lr, (t.beta1, t.beta2), t.weight_decay)
        # the wrapper's clip: grad_norm.py's rule with each shard element counted once
        trainer = Trainer(cfg, model, pgm, optimizer=optimizer, clip_grad_norm=model.clip_grad_norm,
                          verbose=False)
    result = trainer.train()
    last = cfg.training.steps - 1
    out = {
        "losses":
        result.losses,
        "grad_norms":
        result.grad_norms,
        "numel":
        numel,
        "memory":
        measure_memory(model, trainer.optimizer),
        "comm": {
            op: get_ledger().total(op=op, step=last)
            for op in ("all_gather", "reduce_scatter")
        },
        "wire":
        sum(get_ledger().total(op=op, step=last, field="wire_bytes")
            for op in ("all_gather", "reduce_scatter")),
    }
    if stage != "torch":
        out.update(padded=model.padded_numel, units=[u.padded_numel for u in model.units],
                   peak_units=model.peak_gathered_units, peak_bytes=model.peak_gathered_bytes)
    out["full"] = full_state(model, pgm)  # on rank 0; after the ledger reads (it gathers)
    if stage != "torch":  # the chapter's own gather (02_fsdp's --check) gives the same tensors
        out["own_full"] = model.full_state_dict()
    return out


def world_of_four(rank: int, world_size: int) -> dict:
    pgm = init_pg_manager()
    out = {stage: _run(tiny_config(2), pgm, stage) for stage in (1, 2, 3)}
    out["3 no prefetch"] = _run(tiny_config(1), pgm, 3, prefetch=False)
    for stage in (1, 2, 3):  # tied embeddings: one shard, the head borrows it
        out[f"tied {stage}"] = _run(tiny_config(2, tied=True), pgm, stage)
    destroy_pg_manager()
    errors = {}
    for kind, kwargs in (("tp", dict(tensor_model_parallel_size=2)),
                         ("pp", dict(pipeline_model_parallel_size=2))):
        pgm = init_pg_manager(**kwargs)
        model = build_model(tiny_config(1).model, seed=0)
        for fn in (lambda: apply_zero(model, pgm, 3), lambda: apply_fully_shard(model, pgm)):
            try:
                fn()
            except ValueError as e:
                errors.setdefault(kind, []).append(str(e))
        destroy_pg_manager()
    out["errors"] = errors
    return out


def _resume_run(cfg: Config, pgm, stage, root: str) -> dict:
    """Run 5 steps saving at step 3, then a fresh model resumed from it; both results."""
    cfg = copy.deepcopy(cfg)
    cfg.checkpoint.dir, cfg.checkpoint.every = root, 3
    first = _run(cfg, pgm, stage)
    path = ckpt.latest_checkpoint(root)
    saved = torch.load(ckpt.rank_file(path, pgm.rank), weights_only=True)
    cfg.checkpoint.every, cfg.checkpoint.resume = 0, "latest"
    second = _run(cfg, pgm, stage)
    return {
        "first":
        first,
        "second":
        second,
        "model_numel":
        sum(v.numel() for v in saved["model"].values()),
        "optimizer_numel":
        sum(v.numel() for s in saved["optimizer"]["state"].values() for v in s.values()
            if v.dim() > 0),
    }


def world_of_two(rank: int, world_size: int, tmp: str) -> dict:
    pgm = init_pg_manager()
    out = {stage: _run(tiny_config(2), pgm, stage) for stage in (1, 2, 3, "torch")}
    for stage in (1, 3):
        out[f"resume {stage}"] = _resume_run(tiny_config(1), pgm, stage, f"{tmp}/stage{stage}")
    cfg = tiny_config(1)  # the script's way: parallelize with zero_stage 3, save before step 1
    cfg.parallel.zero_stage = 3
    par = parallelize(build_model(cfg.model, seed=7), cfg, pgm, torch.device("cpu"))
    path = os.path.join(tmp, "consolidated.pt")
    save_consolidated(path, Trainer.from_parallelized(cfg, par, pgm, verbose=False), par)
    out["consolidated"] = {"path": path, "gathered": full_state_dict(par)}
    destroy_pg_manager()
    return out


class _Worlds(unittest.TestCase):
    """Shared assertions; subclasses spawn one world in setUpClass."""

    world = 0
    results: list = []
    references: dict = {}

    def assert_parity(self, key, cfg_key):
        # every rank's losses and grad norms, and the full weights gathered from every rank's
        # shards on rank 0, within TOL of the plain loop (tests/layouts.py)
        runs = [result[key] for result in self.results]
        self.assertEqual(len(runs[0]["losses"]), STEPS)
        assert_matches(self, runs, self.references[cfg_key], str(key), weights="full", tol=TOL)
        if "own_full" in self.results[0][key]:  # ZeRO's own gather: the same tensors
            own, full = self.results[0][key]["own_full"], self.results[0][key]["full"]
            self.assertEqual(sorted(own), sorted(full))
            for name in own:
                self.assertTrue(torch.equal(own[name], full[name]), f"{key}: {name}")

    def assert_memory_is_the_formula(self, key, stage):
        n = self.world
        for result in self.results:
            run = result[key]
            self.assertEqual(run["memory"], memory_formula(stage, run["padded"], n))
            self.assertLess(run["padded"] - run["numel"], len(run["units"]) * n)  # padding only

    def assert_comm_is_the_formula(self, key, stage, num_micro_batches):
        n = self.world
        for result in self.results:
            run = result[key]
            expected = comm_formula(stage, run["padded"], num_micro_batches)
            self.assertEqual(run["comm"], expected)
            self.assertAlmostEqual(run["wire"], sum(expected.values()) * 4 * (n - 1) / n)


class ZeroOnFourRanks(_Worlds):
    world = 4

    @classmethod
    def setUpClass(cls):
        cls.references = {m: reference(tiny_config(m)) for m in (1, 2)}
        cls.references["tied"] = reference(tiny_config(2, tied=True))
        cls.results = run_distributed(world_of_four, 4, timeout=240)

    def test_every_stage_matches_single_device_with_accumulation(self):
        for stage in (1, 2, 3):
            with self.subTest(stage=stage):
                self.assert_parity(stage, 2)
        self.assert_parity("3 no prefetch", 1)

    def test_memory_per_rank_is_the_formula(self):
        for stage in (1, 2, 3):
            with self.subTest(stage=stage):
                self.assert_memory_is_the_formula(stage, stage)
        self.assert_memory_is_the_formula("3 no prefetch", 3)

    def test_tied_embeddings_match_single_device_sharded_once_every_stage(self):
        vocab_by_hidden = 64 * 30
        for stage in (1, 2, 3):
            with self.subTest(stage=stage):
                key = f"tied {stage}"
                self.assert_parity(key, "tied")
                self.assert_memory_is_the_formula(key, stage)  # Psi counts the weight once
                for result in self.results:
                    run = result[key]
                    self.assertEqual(run["numel"], result[stage]["numel"] - vocab_by_hidden)
        # stage 3 gathers the embedding also around the head, forward and backward, per
        # micro-batch (2 here); its one gradient (both uses) is reduce-scattered once
        for result in self.results:
            run, plain = result["tied 3"], comm_formula(3, result["tied 3"]["padded"], 2)
            self.assertEqual(run["comm"]["all_gather"],
                             plain["all_gather"] + 2 * 2 * vocab_by_hidden)
            self.assertEqual(run["comm"]["reduce_scatter"], plain["reduce_scatter"])

    def test_units_not_divisible_by_four_are_padded(self):
        for result in self.results:
            run = result[3]
            self.assertEqual(run["padded"] - run["numel"], 2 * 2 + 2)  # two blocks, the head
            self.assertTrue(all(size % 4 == 0 for size in run["units"]))

    def test_zero3_holds_one_gathered_unit_two_with_prefetch(self):
        for result in self.results:
            alone, prefetched = result["3 no prefetch"], result[3]
            self.assertEqual(alone["peak_units"], 1)
            self.assertEqual(alone["peak_bytes"], max(alone["units"]) * 4)
            self.assertEqual(prefetched["peak_units"], 2)
            self.assertLessEqual(prefetched["peak_bytes"],
                                 sum(sorted(prefetched["units"])[-2:]) * 4)

    def test_zero3_moves_three_psi_per_step_and_reduces_once_per_accumulation(self):
        self.assert_comm_is_the_formula("3 no prefetch", 3, 1)  # 3 Psi' (N-1)/N on the wire
        self.assert_comm_is_the_formula(3, 3, 2)  # gathers per micro-batch, one reduce-scatter

    def test_zero1_and_zero2_move_what_an_all_reduce_moves(self):
        for stage in (1, 2):
            with self.subTest(stage=stage):
                self.assert_comm_is_the_formula(stage, stage, 2)
                for result in self.results:  # reduce-scatter + all-gather = 2 (N-1)/N Psi'
                    run = result[stage]
                    self.assertAlmostEqual(run["wire"], 2 * 3 / 4 * 4 * run["padded"])

    def test_tensor_or_pipeline_parallel_with_zero_raises_value_error(self):
        for kind, name in (("tp", "tensor_model_parallel_size (2)"),
                           ("pp", "pipeline_model_parallel_size (2)")):
            messages = self.results[0]["errors"][kind]
            self.assertEqual(len(messages), 2)
            for message in messages:
                self.assertIn(name, message)


class ZeroAndFullyShardOnTwoRanks(_Worlds):
    world = 2

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.references = {m: reference(tiny_config(m)) for m in (1, 2)}
        cls.results = run_distributed(world_of_two, 2, cls.tmp.name, timeout=240)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_every_stage_and_fully_shard_match_single_device_with_accumulation(self):
        for stage in (1, 2, 3, "torch"):
            with self.subTest(stage=stage):
                self.assert_parity(stage, 2)

    def test_memory_per_rank_is_the_formula(self):
        for stage in (1, 2, 3):
            with self.subTest(stage=stage):
                self.assert_memory_is_the_formula(stage, stage)
        # fully_shard holds the same 16 Psi/N, but pads each parameter's dim 0 to a multiple
        # of N for params and grads; its Adam state is the uneven, unpadded local shard.
        model = build_model(tiny_config(1).model, seed=0)
        padded = sum(-(-p.shape[0] // 2) * 2 * p[0].numel() for p in model.parameters())
        numel = self.results[0]["torch"]["numel"]
        for result in self.results:
            memory = result["torch"]["memory"]
            for kind in ("params", "grads"):
                self.assertEqual(memory[kind], memory_formula(3, padded, 2)[kind])
        self.assertEqual(sum(r["torch"]["memory"]["optimizer"] for r in self.results),
                         2 * memory_formula(3, numel, 2)["optimizer"])

    @bit_exact  # a resumed run is the uninterrupted run: the same code, the same steps
    def test_sharded_checkpoint_holds_shards_and_resumes_exactly(self):
        for stage in (1, 3):
            for result in self.results:
                with self.subTest(stage=stage):
                    run = result[f"resume {stage}"]
                    first, second = run["first"], run["second"]
                    self.assertEqual(second["losses"], first["losses"][3:])  # bit for bit
                    self.assertEqual(run["model_numel"], first["padded"] // 2)
                    self.assertEqual(run["optimizer_numel"], 2 * first["padded"] // 2)
            run = self.results[0][f"resume {stage}"]  # the full weights are on rank 0
            for key, value in run["first"]["full"].items():
                self.assertTrue(torch.equal(value, run["second"]["full"][key]), key)

    @bit_exact  # a save and a load copy bytes
    def test_consolidated_checkpoint_loads_into_the_single_device_model(self):
        consolidated = self.results[0]["consolidated"]
        model = build_model(tiny_config(1).model, seed=0)  # other weights, replaced by the load
        state = torch.load(consolidated["path"], weights_only=True)
        self.assertIsNone(state["optimizer"])  # saved before the first step: no AdamW state yet
        model.load_state_dict(state["model"])  # strict: same keys and shapes
        for key, value in model.state_dict().items():
            self.assertTrue(torch.equal(value, consolidated["gathered"][key]), key)
        self.assertEqual(
            max_weight_diff(model.state_dict(),
                            build_model(tiny_config(1).model, seed=7).state_dict()), 0.0)


class ZeroOnOneRank(unittest.TestCase):
    """No process group: ZeRO over one rank is plain AdamW on flat tensors."""

    def setUp(self):
        self.pgm = init_pg_manager()

    def tearDown(self):
        destroy_pg_manager()

    def test_one_rank_every_stage_equals_torch_adamw_tied_or_not(self):
        # Clipping off: ours sums the squares of flat shards, the reference per parameter.
        # The same torch AdamW runs on one flat shard instead of one tensor per parameter:
        # measured bit for bit on two CPUs, but an element's position decides whether a CPU
        # kernel takes it in its vector body or its scalar tail, which may round the last bit
        # differently. So bounds: the weights within 1e-7 (one ulp of a weight near 0.02 is
        # 2e-9; a step moves each by up to its lr, 1e-2), the losses within 1e-6 relative.
        for tied in (False, True):
            cfg = tiny_config(2, tied=tied, grad_clip=0.0)
            losses, _, reference = run_reference(cfg)
            for stage in (1, 2, 3):
                with self.subTest(tied=tied, stage=stage):
                    run = _run(cfg, self.pgm, stage)
                    for a, b in zip(run["losses"], losses, strict=True):
                        self.assertLessEqual(abs(a - b), 1e-6 * b, (a, b))
                    self.assertLessEqual(max_weight_diff(run["full"], reference.state_dict()), 1e-7)
                    if tied:  # one tensor under both names, as on one device
                        self.assertIs(run["full"]["lm_head.weight"],
                                      run["full"]["embed_tokens.weight"])

    def test_chapter_formulas_are_the_planners(self):
        # zero_report.py writes ZeRO's formulas in chapter 02's own module; the planner keeps
        # its own (torch-free) copy: both must say the same
        from scaletorch.plan.memory import memory_formula as plan_memory
        from scaletorch.plan.traffic import zero_comm_elements as plan_comm
        for stage, numel, world, m in ((0, 82240, 2, 1), (1, 82241, 4, 2), (2, 10, 3, 1), (3, 82240,
                                                                                           4, 3)):
            self.assertEqual(memory_formula(stage, numel, world), plan_memory(stage, numel, world))
            if stage:
                self.assertEqual(comm_formula(stage, numel, m), plan_comm(stage, numel, m))

    def test_invalid_stage_raises_value_error(self):
        model = build_model(tiny_config(1).model, seed=0)
        for stage in (0, 4):
            with self.assertRaisesRegex(ValueError, f"got {stage}"):
                apply_zero(model, self.pgm, stage)
        with self.assertRaisesRegex(ValueError, "no unit"):
            ShardedDataParallel(model, llama_units(model)[1:], None, 3)
        with self.assertRaisesRegex(ValueError, "got 5"):
            memory_formula(5, 10, 2)


if __name__ == "__main__":
    unittest.main()
