"""Chapter 03: tensor parallel (+ sequence parallel) equals the single-device run.

One world of 4 gloo ranks computes everything (layer checks, six training layouts rebuilt in
turn with the pg_manager, the ledger, errors that need ranks); the test methods assert on its
results. Tolerances: 1e-6 for single layers (one matmul split in blocks; relative to the
largest value when that exceeds 1), 1e-5 for fp32 training steps (doc/design.md). STEPS 3:
past the 2 warm-up steps, with clipping active; a wrong shard, a missed reduction or a wrong
split shows from step 1 on, more steps add nothing.
"""

import copy
import unittest
from contextlib import nullcontext

import torch
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from scaletorch.dist import (destroy_pg_manager, full_state, get_ledger, init_pg_manager,
                             layout_check)
from scaletorch.models import LlamaConfig, build_model, loss_fn
from scaletorch.parallel import tensor_parallel as tp_lib
from scaletorch.parallel import tensor_parallel_dtensor as dtensor_tp
from scaletorch.parallel import tensor_parallel_layers as tp_layers
from scaletorch.parallel.data_parallel import apply_data_parallel
from scaletorch.parallel.step import make_data_parallel_step
from scaletorch.plan.traffic import tp_comm_elements as planned_tp_comm_elements
from scaletorch.rules.vocab import padded_vocab_size
from scaletorch.trainer import Config, Trainer
from tests.harness import run_distributed, value_error
from tests.layouts import assert_matches, reference

WORLD = 4
LAYER_TOL = 1e-6
STEPS = 3
TRAIN_TOL = 1e-5
# 8 query heads, 4 kv heads: tp 4 leaves each rank 2 query heads sharing 1 kv head (GQA).
MODEL = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_attention_heads=8, num_key_value_heads=4, max_seq_len=32)
# name: (tensor_model_parallel_size, sequence_parallel, num_micro_batches, impl)
LAYOUTS = {
    "tp4": (4, False, 1, "ours"),
    "tp4_sp": (4, True, 1, "ours"),
    "tp2_dp2_micro2": (2, False, 2, "ours"),
    "tp2_dp2_sp": (2, True, 1, "ours"),
    "dtensor_tp4": (4, False, 1, "torch"),
    "dtensor_tp4_sp": (4, True, 1, "torch"),
}


def make_cfg(tp: int = 1, sp: bool = False, micro: int = 1) -> Config:
    cfg = Config()
    cfg.model = copy.deepcopy(MODEL)
    cfg.data.seq_len, cfg.data.global_batch_size, cfg.data.num_micro_batches = 16, 8, micro
    cfg.training.steps, cfg.training.lr, cfg.training.warmup_steps = STEPS, 1e-2, 2
    cfg.training.grad_clip = 1.0  # the grad norm is about 1 here, so clipping is exercised
    cfg.logging.progress = False
    cfg.parallel.tensor_model_parallel_size, cfg.parallel.sequence_parallel = tp, sp
    return cfg


def _mine(t: torch.Tensor, dim: int, rank: int, n: int) -> torch.Tensor:
    return t.chunk(n, dim=dim)[rank]


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b|, relative to the largest |b| when that exceeds 1: a weight gradient
    summed over 16 tokens reaches about 10, where one fp32 ulp is already 1e-6."""
    b = b.detach()
    return ((a.detach() - b).abs().max() / b.abs().max().clamp(min=1.0)).item()


def _layer_checks(rank: int) -> dict:
    """Each parallel layer against its nn counterpart at tp 4, without and with sp."""
    pgm = init_pg_manager(tensor_model_parallel_size=WORLD)
    group, n = pgm.tensor_model_parallel_group, WORLD
    gen = torch.Generator().manual_seed(0)  # same draws on every rank
    torch.manual_seed(0)  # and the same nn.Linear / nn.Embedding initialisation
    out = {}
    for sp in (False, True):
        seq = (lambda t: _mine(t, 1, rank, n)) if sp else (lambda t: t)  # sp: (b, s/N, h)

        ref = nn.Linear(16, 24, bias=False)
        x = torch.randn(2, 8, 16, generator=gen, requires_grad=True)
        g = torch.randn(2, 8, 24, generator=gen)
        ref(x).backward(g)
        layer = tp_layers.ColumnParallelLinear.from_linear(ref, group, sequence_parallel=sp)
        x_in = seq(x).detach().requires_grad_()
        y = layer(x_in)  # (b, s, 24/N)
        y.backward(_mine(g, -1, rank, n))
        out[f"column sp={sp}"] = max(_diff(y, _mine(ref(x), -1, rank, n)),
                                     _diff(x_in.grad, seq(x.grad)),
                                     _diff(layer.weight.grad, _mine(ref.weight.grad, 0, rank, n)))

        ref = nn.Linear(24, 16, bias=False)
        x = torch.randn(2, 8, 24, generator=gen, requires_grad=True)
        g = torch.randn(2, 8, 16, generator=gen)
        ref(x).backward(g)
        layer = tp_layers.RowParallelLinear.from_linear(ref, group, sequence_parallel=sp)
        x_in = _mine(x, -1, rank, n).detach().requires_grad_()
        y = layer(x_in)  # (b, s, 16), or (b, s/N, 16) under sp
        y.backward(seq(g))
        out[f"row sp={sp}"] = max(_diff(y, seq(ref(x))), _diff(x_in.grad,
                                                               _mine(x.grad, -1, rank, n)),
                                  _diff(layer.weight.grad, _mine(ref.weight.grad, 1, rank, n)))

        ref = nn.Embedding(64, 16)
        ids = torch.randint(0, 64, (2, 8), generator=gen)
        g = torch.randn(2, 8, 16, generator=gen)
        ref(ids).backward(g)
        layer = tp_layers.VocabParallelEmbedding.from_embedding(ref, group, sequence_parallel=sp)
        y = layer(ids)
        y.backward(seq(g))
        out[f"embedding sp={sp}"] = max(
            _diff(y, seq(ref(ids))), _diff(layer.weight.grad, _mine(ref.weight.grad, 0, rank, n)))

    logits = torch.randn(2, 8, 64, generator=gen, requires_grad=True)
    targets = torch.randint(0, 64, (2, 8), generator=gen)
    ref_loss = loss_fn(logits, targets)
    ref_loss.backward()
    local = _mine(logits, -1, rank, n).detach().requires_grad_()
    get_ledger().clear()
    loss = tp_layers.vocab_parallel_cross_entropy(local, targets, group)
    loss.backward()
    out["cross_entropy"] = max(_diff(loss, ref_loss),
                               _diff(local.grad, _mine(logits.grad, -1, rank, n)))
    out["cross_entropy_comm"] = [(r.op, r.elements) for r in get_ledger().records]
    destroy_pg_manager()
    return out


def _error_checks() -> dict:
    """Errors that need a pg_manager: the conversion and the forward check their inputs."""
    out = {}
    pgm = init_pg_manager(tensor_model_parallel_size=WORLD)
    gqa2 = copy.deepcopy(MODEL)
    gqa2.num_key_value_heads = 2
    out["kv_heads"] = value_error(lambda: tp_lib.apply_tensor_parallel(build_model(gqa2, 0), pgm))
    model = tp_lib.apply_tensor_parallel(build_model(MODEL, 0), pgm, sequence_parallel=True)
    out["seq_len"] = value_error(lambda: model(torch.zeros(2, 10, dtype=torch.long)))
    destroy_pg_manager()
    return out


def _train(rank: int, cfg: Config, impl: str) -> dict:
    p = cfg.parallel
    pgm = init_pg_manager(tensor_model_parallel_size=p.tensor_model_parallel_size)
    model = build_model(cfg.model, seed=cfg.training.model_seed)
    if impl == "torch":
        model = dtensor_tp.apply_dtensor_tensor_parallel(model,
                                                         dtensor_tp.device_mesh(pgm, "cpu")["tp"],
                                                         p.sequence_parallel)
        loss = dtensor_tp.dtensor_loss_fn
        clip = dtensor_tp.native_clip_grad_norm(list(model.parameters()), pgm)
        tp_model = model
    else:  # chapter 03's own clip and gather, as examples/03_tensor_parallel.py uses them
        tp_model = tp_lib.apply_tensor_parallel(model, pgm, p.sequence_parallel)
        loss, clip = tp_lib.tensor_parallel_loss_fn(pgm), tp_lib.tensor_parallel_clip_grad_norm(
            tp_model, pgm)
        model = tp_model
        if pgm.data_parallel_world_size > 1:
            model = apply_data_parallel(tp_model, pgm, "ours")
    local_numel = sum(p.numel() for p in model.parameters())
    step = make_data_parallel_step(model, cfg.data.num_micro_batches, pgm.data_parallel_rank,
                                   pgm.data_parallel_world_size, pgm.gradient_sync_group, loss)
    get_ledger().clear()
    with loss_parallel() if impl == "torch" else nullcontext():
        result = Trainer(cfg, model, pgm, forward_backward=step, clip_grad_norm=clip,
                         verbose=False).train()
    ledger = get_ledger()
    comm = [{
        (r.op, r.group): ledger.total(op=r.op, group=r.group, step=s, field=field)
        for r in ledger.select(step=s)
    } for s in range(cfg.training.steps) for field in ("elements", "wire_bytes")]
    full = full_state.gather_tensor_parallel_state_dict(tp_model, pgm)  # collective: on rank 0
    destroy_pg_manager()
    return {
        "losses": result.losses,
        "grad_norms": result.grad_norms,
        "comm": comm,
        "local_numel": local_numel,
        "full": full
    }


def _world(rank: int, world_size: int) -> dict:
    results = {"layers": _layer_checks(rank), "errors": _error_checks(), "runs": {}}
    for name, (tp, sp, micro, impl) in LAYOUTS.items():
        results["runs"][name] = _train(rank, make_cfg(tp, sp, micro), impl)
    return results


def _reference(micro: int) -> tuple:
    """The plain loop's (losses, grad norms, weights) on one device (tests/layouts.reference)."""
    return reference(make_cfg(micro=micro))


class TestTensorParallelConfigErrors(unittest.TestCase):
    """Each impossible split is a ValueError naming the numbers (no ranks needed)."""

    def check(self, pattern: str, tp: int, sp: bool = False, seq_len=None, **model) -> None:
        config = LlamaConfig(**{**MODEL.__dict__, **model})
        with self.assertRaisesRegex(ValueError, pattern):
            layout_check.validate_tensor_parallel(config, tp, sp, seq_len)

    def test_attention_heads_not_divisible_by_tensor_size_raises(self):
        self.check(r"num_attention_heads \(6\) .* tensor_model_parallel_size \(4\)", 4,
                   hidden_size=48, num_attention_heads=6, num_key_value_heads=2)

    def test_kv_heads_not_divisible_by_tensor_size_raises(self):
        self.check(r"num_key_value_heads \(2\) .* \(4\)", 4, num_key_value_heads=2)

    def test_vocabulary_not_divisible_is_padded_not_refused(self):
        # 66 rows over tp 4 (66 = 4 x 16 + 2): no error; chapter 10's apply_tensor_parallel_padded
        # pads them to a multiple of vocab_pad_to x tp = 128 x 4, i.e. 512
        # (tests/test_vocab_padding.py)
        config = LlamaConfig(**{**MODEL.__dict__, "vocab_size": 66})
        self.assertEqual(value_error(lambda: layout_check.validate_tensor_parallel(config, 4)),
                         "no error")
        self.assertEqual(padded_vocab_size(66, 4, config.vocab_pad_to), 512)

    def test_intermediate_size_not_divisible_raises(self):
        self.check(r"intermediate_size \(66\) .* \(4\)", 4, intermediate_size=66)

    def test_sequence_parallel_without_tensor_parallel_raises(self):
        self.check(r"sequence parallel .* tensor_model_parallel_size > 1, got 1", 1, sp=True)

    def test_sequence_length_not_divisible_under_sequence_parallel_raises(self):
        self.check(r"sequence length \(30\) .* \(4\)", 4, sp=True, seq_len=30)
        layout_check.validate_tensor_parallel(MODEL, 4, False, 30)  # fine without sp


class TestChapterFormulaIsThePlanners(unittest.TestCase):
    """Chapter 03 prints its own formula (tensor_parallel.tp_comm_elements) beside the ledger;
    the planner's (plan/traffic.py, whole layouts) gives the same numbers for a whole model."""

    def test_chapter_03_formula_equals_the_planners_for_dense_models(self):
        for layers, tokens, sp, micro in ((2, 128, False, 1), (4, 512, True, 2), (3, 64, True, 1)):
            config = LlamaConfig(**{**MODEL.__dict__, "num_layers": layers})
            with self.subTest(layers=layers, sp=sp):
                self.assertEqual(tp_lib.tp_comm_elements(config, tokens, sp, micro),
                                 planned_tp_comm_elements(config, tokens, sp, micro))


class TestTensorParallel(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.results = run_distributed(_world, WORLD, timeout=300)
        cls.reference = {micro: _reference(micro) for micro in (1, 2)}

    # ---- layers ---------------------------------------------------------------------------

    def test_parallel_layers_match_nn_layers_outputs_and_gradients(self):
        for rank, res in enumerate(self.results):
            for name, diff in res["layers"].items():
                if name != "cross_entropy_comm":
                    with self.subTest(rank=rank, layer=name):
                        self.assertLess(diff, LAYER_TOL)

    def test_vocab_parallel_cross_entropy_never_gathers_the_logits(self):
        n = 2 * 8  # tokens; the full logits would be n x 64 elements
        comm = self.results[0]["layers"]["cross_entropy_comm"]
        self.assertEqual(comm, [("all_reduce", n), ("all_reduce", 2 * n)])  # max; [sum exp, y]

    # ---- model parity ---------------------------------------------------------------------

    def check_parity(self, name: str) -> None:
        # the one parity helper: every rank's losses and grad norms (within TRAIN_TOL: the
        # clip saw the same norm), rank 0's gathered weights
        tp, sp, micro, impl = LAYOUTS[name]
        runs = [res["runs"][name] for res in self.results]
        assert_matches(self, runs, self.reference[micro], name, weights="full", tol=TRAIN_TOL,
                       norm_tol=TRAIN_TOL)

    def test_tp4_matches_single_device(self):
        self.check_parity("tp4")

    def test_tp4_sequence_parallel_matches_single_device(self):
        self.check_parity("tp4_sp")

    def test_tp2_x_dp2_with_micro_batches_matches_single_device(self):
        self.check_parity("tp2_dp2_micro2")

    def test_tp2_x_dp2_sequence_parallel_matches_single_device(self):
        self.check_parity("tp2_dp2_sp")

    def test_dtensor_tp4_matches_single_device(self):
        self.check_parity("dtensor_tp4")

    def test_dtensor_tp4_sequence_parallel_matches_single_device(self):
        self.check_parity("dtensor_tp4_sp")

    # ---- the ledger -----------------------------------------------------------------------
    # Per step and rank, T = tokens of the rank (global batch / dp x s), L = 2 blocks, h = 32:
    #   blocks     4 L T h   2 forward (o_proj, down_proj outputs) + 2 backward (their inputs)
    #   embedding    T h     forward: sum of the vocabulary shards' rows
    #   head         T h     backward: the head's input gradient
    #   loss       3 T       max, then [sum exp, target logit]
    # and the grad norm: 1 element all-reduced over the world, not tp (grad_norm.py).
    # Without sp all are all-reduces; with sp the activation terms are one all-gather and one
    # reduce-scatter each, and the RMSNorm weight gradients (2 L + 1) h per micro-batch are
    # all-reduced.

    def ledger_terms(self, name: str):
        tp, sp, micro, _ = LAYOUTS[name]
        tokens, h, layers = 8 // (WORLD // tp) * 16, MODEL.hidden_size, MODEL.num_layers
        activations = 4 * layers * tokens * h + tokens * h + tokens * h
        scalars = 3 * tokens
        return activations, scalars, (2 * layers + 1) * h * micro

    def step_comm(self, name: str, rank: int, step: int, field: str = "elements") -> dict:
        return self.results[rank]["runs"][name]["comm"][2 * step + (field == "wire_bytes")]

    def test_ledger_all_reduce_is_four_bsh_per_block_plus_embedding_and_loss(self):
        for name in ("tp4", "tp2_dp2_micro2"):
            activations, scalars, _ = self.ledger_terms(name)
            for rank in range(WORLD):
                for step in range(STEPS):
                    comm = self.step_comm(name, rank, step)
                    self.assertEqual(comm[("all_reduce", "tp")], activations + scalars)
                    self.assertEqual(comm[("all_reduce", "world")], 1)  # the grad norm
                    self.assertNotIn(("all_gather", "tp"), comm)
        # the library's formula (printed by the script) says the same
        self.assertEqual(tp_lib.tp_comm_elements(MODEL, 128, False),
                         {"all_reduce": sum(self.ledger_terms("tp4")[:2])})

    def test_ledger_sequence_parallel_is_all_gather_plus_reduce_scatter_of_same_size(self):
        for name in ("tp4_sp", "tp2_dp2_sp"):
            activations, scalars, norms = self.ledger_terms(name)
            for rank in range(WORLD):
                for step in range(STEPS):
                    comm = self.step_comm(name, rank, step)
                    self.assertEqual(comm[("all_gather", "tp")], activations)
                    self.assertEqual(comm[("reduce_scatter", "tp")], activations)
                    self.assertEqual(comm[("all_reduce", "tp")], scalars + norms)
                    self.assertEqual(comm[("all_reduce", "world")], 1)  # the grad norm
        self.assertEqual(
            tp_lib.tp_comm_elements(MODEL, 128, True, 1), {
                "all_gather": self.ledger_terms("tp4_sp")[0],
                "reduce_scatter": self.ledger_terms("tp4_sp")[0],
                "all_reduce": sum(self.ledger_terms("tp4_sp")[1:])
            })

    def test_sequence_parallel_moves_the_same_wire_bytes_as_the_all_reduces(self):
        activations, scalars, norms = self.ledger_terms("tp4")
        ring = 2 * (WORLD - 1) / WORLD * 4  # bytes on the wire per all-reduced fp32 element
        plain = self.step_comm("tp4", 0, 1, "wire_bytes")
        sp = self.step_comm("tp4_sp", 0, 1, "wire_bytes")
        self.assertAlmostEqual(plain[("all_reduce", "tp")] - ring * scalars,
                               sp[("all_gather", "tp")] + sp[("reduce_scatter", "tp")])

    def test_data_parallel_all_reduces_only_the_local_shards(self):
        run = self.results[0]["runs"]["tp2_dp2_micro2"]
        full = sum(t.numel() for t in self.reference[1][2].values())
        norms = (2 * MODEL.num_layers + 1) * MODEL.hidden_size
        self.assertEqual(run["local_numel"], (full - norms) // 2 + norms)
        for step in range(STEPS):  # the gradient shards once per step (not per micro-batch) + loss
            comm = self.step_comm("tp2_dp2_micro2", 0, step)
            self.assertEqual(comm[("all_reduce", "dp")], run["local_numel"] + 1)

    # ---- errors that need ranks -----------------------------------------------------------

    def test_invalid_splits_raise_value_errors_on_ranks(self):
        errors = self.results[0]["errors"]
        self.assertRegex(errors["kv_heads"], r"num_key_value_heads \(2\)")
        self.assertRegex(
            errors["seq_len"], r"sequence length \(10\) of a cp rank divisible by "
            r"tensor_model_parallel_size \(4\)")


if __name__ == "__main__":
    unittest.main()
