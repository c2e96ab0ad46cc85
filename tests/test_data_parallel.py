"""Data parallel (naive, bucketed, torch DDP) reproduces the single-device run.

Two worlds: 4 ranks (parity of the three implementations, with and without gradient
accumulation) and 2 ranks (the ledger, the bucket order and overlap, unused and odd-sized
parameters, and a backward without finish_grad_sync). Parity at 2 ranks is chapter 01's
documented run (tests/test_docs.py) and test_parallelize_chapters'; the 4-rank world's six
trainings are not repeated here.
"""

import copy
import unittest
from typing import Dict, List

import torch
from torch import nn

from scaletorch.dist import destroy_pg_manager, get_ledger, init_pg_manager
from scaletorch.dist.overlap_text import BucketLaunch, SyncTimeline, format_overlap, format_timeline
from scaletorch.models import LlamaConfig, build_model, loss_fn
from scaletorch.parallel.data_parallel import IMPLS, BucketedDataParallel, apply_data_parallel
from scaletorch.parallel.data_parallel_any_module import apply_data_parallel_any
from scaletorch.parallel.overlap_chart import record_overlap
from scaletorch.parallel.step import forward_backward
from scaletorch.trainer import Config, Trainer, validate
from scaletorch.trainer.trainer import build_loader
from tests.harness import run_distributed
from tests.layouts import assert_matches, reference

TOLERANCE = 1e-5  # fp32 over 3 AdamW steps; gradient sums differ from one device in ulps only
# 3 steps: 2 of warmup and 1 of decay (both parts of the schedule); an implementation that
# sums or averages a gradient wrongly is off at step 1, its update at step 2: more steps
# only repeat the same exchange (a deterministic difference, no drift to wait for)
STEPS = 3
SMALL_BUCKET_MB = 0.01  # ~2,600 fp32 elements: the tiny model spreads over ~12 buckets
MICRO_BATCHES = (1, 2)


def _config(num_micro_batches: int = 1) -> Config:
    cfg = Config()
    cfg.model = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_seq_len=32)
    cfg.data.seq_len, cfg.data.global_batch_size = 16, 8
    cfg.data.num_micro_batches = num_micro_batches
    cfg.training.steps, cfg.training.warmup_steps = STEPS, 2
    cfg.training.lr, cfg.training.min_lr = 1e-2, 1e-3
    cfg.parallel.bucket_size_mb = SMALL_BUCKET_MB
    cfg.logging.progress = False
    return cfg


def _train_every_impl(rank: int, world: int) -> Dict[tuple, dict]:
    """Per (impl, micro-batches): losses, final weights, all-reduced elements per step."""
    pgm = init_pg_manager()
    out = {}
    for impl in IMPLS:
        for m in MICRO_BATCHES:
            cfg = _config(m)
            model = build_model(cfg.model, seed=cfg.training.model_seed)
            model = apply_data_parallel(model, pgm, impl, cfg.parallel.bucket_size_mb)
            get_ledger().clear()
            result = Trainer(cfg, model, pgm, device=torch.device("cpu"), verbose=False).train()
            state = {k: v.clone() for k, v in model.state_dict().items()}
            reduced = [
                get_ledger().total(op="all_reduce", group="dp", step=s)
                for s in range(cfg.training.steps)
            ]
            out[(impl, m)] = dict(losses=result.losses, grad_norms=result.grad_norms, state=state,
                                  all_reduced=reduced)
    destroy_pg_manager()
    return out


class _Toy(nn.Module):
    """Odd sizes, a parameter nobody uses, one only rank 0's data uses."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 5)  # 35 + 5 elements
        self.unused = nn.Parameter(torch.randn(13))
        self.rank0_only = nn.Parameter(torch.randn(3))
        self.b = nn.Linear(5, 3)
        self.use_rank0_only = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(torch.tanh(self.a(x)))
        return y + self.rank0_only if self.use_rank0_only else y


def _toy_grads(rank: int, world: int, impl: str) -> dict:
    """Two steps of 2 micro-batches with tiny buckets; wrapped grads vs the averaged math."""
    torch.manual_seed(0)
    base = _Toy()
    xs = torch.randn(world, 2, 4, 7)  # (rank, micro-batch, b, in)
    # The math: average over ranks of each rank's accumulated gradient, on one process.
    expected = copy.deepcopy(base)
    for r in range(world):
        expected.use_rank0_only = r == 0
        for mb in range(2):
            (expected(xs[r, mb]).pow(2).mean() / (2 * world)).backward()
    # torch DDP's flag: without it a parameter no rank's backward reached raises
    model = apply_data_parallel_any(copy.deepcopy(base), None, impl, bucket_size_mb=1e-4,
                                    find_unused_parameters=True)
    model.module.use_rank0_only = rank == 0
    for _ in range(2):  # the second step checks that the buckets were reset
        model.zero_grad(set_to_none=True)
        with model.no_sync():
            (model(xs[rank, 0]).pow(2).mean() / 2).backward()
        (model(xs[rank, 1]).pow(2).mean() / 2).backward()
        model.finish_grad_sync()
    grads = {
        n: None if p.grad is None else p.grad.clone()
        for n, p in model.module.named_parameters()
    }
    want = {n: None if p.grad is None else p.grad.clone() for n, p in expected.named_parameters()}
    buckets = len(model.buckets) if isinstance(model, BucketedDataParallel) else None
    return dict(grads=grads, expected=want, buckets=buckets)


def _mechanics(rank: int, world: int) -> dict:
    """Ledger once per step, bucket order and overlap, unused params, backward-only sync."""
    out = {}
    pgm = init_pg_manager()
    cfg = _config(num_micro_batches=2)
    loader = build_loader(cfg)
    inputs, targets = loader.get_batch(0)
    shard = slice(rank * 4, rank * 4 + 4)
    for impl in ("naive", "ours"):
        model = apply_data_parallel(build_model(cfg.model, seed=1), pgm, impl, SMALL_BUCKET_MB)
        if impl == "ours":
            model = record_overlap(model)  # chapter 01's chart, attached from outside
        get_ledger().clear()
        forward_backward(model, inputs[shard], targets[shard], num_micro_batches=2)
        records = get_ledger().select(op="all_reduce")
        elements = sum(r.elements for r in records)
        out[f"ledger_{impl}"] = (elements, len(records), model.num_parameters())
        if impl == "ours":
            out["launches"] = [(x.index, x.in_backward, x.grads_pending, x.t_launch
                                < model.timeline.t_backward_end) for x in model.timeline.launches]
            # every completion mark taken (gloo's callback thread done) when the sync returned
            out["marked"] = [x.t_done <= x.t_done for x in model.timeline.launches]  # not NaN
            out["bucket_params"] = [b.param_ids for b in model.buckets]
            out["bucket_numels"] = [(b.buffer.numel(), len(b.param_ids)) for b in model.buckets]
            out["num_params"] = len(model.params)
            out["timeline"] = format_timeline(model.timeline)
    # A plain loop (no finish_grad_sync): the end-of-backward callback syncs.
    model = apply_data_parallel(build_model(cfg.model, seed=1), pgm, "ours", 25.0)
    loss_fn(model(inputs[shard]), targets[shard]).backward()
    out["plain_loop_grads"] = {n: p.grad.clone() for n, p in model.module.named_parameters()}
    out["toy"] = {impl: _toy_grads(rank, world, impl) for impl in ("naive", "ours")}
    destroy_pg_manager()
    return out


class _ParityMixin:
    """Compare each (impl, micro-batches) run of a world with the single-device reference."""
    results: List[dict]

    @classmethod
    def references(cls) -> dict:
        """The plain loop's (losses, grad norms, weights) per micro-batch count, in the parent."""
        return {m: reference(_config(m)) for m in MICRO_BATCHES}

    def check_parity(self, results: List[dict], refs: dict) -> None:
        """layouts.assert_matches on every rank: losses and weights within TOLERANCE, grad
        norms within NORM_TOL relative; every rank ends with the reference weights."""
        checked = 0
        for impl, m in results[0]:
            for rank, res in enumerate(results):
                run = res[(impl, m)]
                self.assertEqual(set(run["state"]), set(refs[m][2]))  # no "module." prefix
                assert_matches(self, [run], refs[m], f"{impl} m={m} rank {rank}", tol=TOLERANCE)
                checked += 1
        self.assertEqual(checked, len(IMPLS) * len(MICRO_BATCHES) * len(results))


class DataParallel4MatchesSingleDevice(_ParityMixin, unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.results = run_distributed(_train_every_impl, 4)
        cls.refs = cls.references()

    def test_naive_bucketed_and_torch_ddp_match_single_device_with_and_without_accumulation(self):
        self.check_parity(self.results, self.refs)

    def test_ledger_all_reduces_parameter_count_once_per_step(self):
        psi = build_model(_config().model, seed=0).num_parameters()
        for (impl, m), run in self.results[0].items():
            # +1: the trainer all-reduces the scalar loss for reporting. torch DDP's own
            # all-reduces bypass our ledger, so only that scalar shows for it.
            expected = 1 if impl == "torch" else psi + 1
            self.assertEqual(run["all_reduced"], [expected] * STEPS, (impl, m))


class DataParallel2Mechanics(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.results = run_distributed(_mechanics, 2)

    def test_accumulation_all_reduces_each_gradient_once_not_per_micro_batch(self):
        res = self.results[0]
        elements, calls, psi = res["ledger_ours"]
        self.assertEqual(elements, psi)
        self.assertEqual(calls, len(res["bucket_params"]))  # one all-reduce per bucket
        elements, calls, psi = res["ledger_naive"]
        self.assertEqual(elements, psi)
        self.assertEqual(calls, res["num_params"])  # one all-reduce per parameter

    def test_buckets_hold_parameters_in_reverse_order_within_the_size_cap(self):
        res = self.results[0]
        flat = [i for ids in res["bucket_params"] for i in ids]
        self.assertEqual(flat, list(reversed(range(res["num_params"]))))
        self.assertGreaterEqual(len(res["bucket_params"]), 3)
        capacity = int(SMALL_BUCKET_MB * 2**20) // 4
        for numel, count in res["bucket_numels"]:
            self.assertTrue(numel <= capacity or count == 1, (numel, count, capacity))

    def test_buckets_fire_in_order_while_backward_is_still_running(self):
        for res in self.results:
            launches = res["launches"]
            self.assertEqual([x[0] for x in launches], list(range(len(res["bucket_params"]))))
            for index, in_backward, pending, before_end in launches:
                self.assertTrue(in_backward and before_end, launches)
            # All but the last bucket went out while gradients were still being computed.
            self.assertTrue(all(pending > 0 for _, _, pending, _ in launches[:-1]), launches)
            self.assertIn("bucket 0", res["timeline"])
            self.assertTrue(all(res["marked"]), res["marked"])

    def test_unused_and_odd_sized_parameters_are_reduced_and_ranks_agree(self):
        for impl in ("naive", "ours"):
            for res in self.results:
                toy = res["toy"][impl]
                for name, grad in toy["grads"].items():
                    if name == "unused":  # no rank used it: None everywhere, as on one device
                        self.assertIsNone(grad, impl)
                        continue
                    # Two micro-batches and two ranks summed in another order: ulps.
                    torch.testing.assert_close(grad, toy["expected"][name], rtol=1e-5, atol=1e-6,
                                               msg=f"{impl} {name}")
            if impl == "ours":
                self.assertGreaterEqual(self.results[0]["toy"][impl]["buckets"], 3)

    def test_backward_alone_syncs_without_finish_grad_sync(self):
        a, b = (r["plain_loop_grads"] for r in self.results)
        for name in a:
            # exactly: an all-reduce leaves the same bytes on every rank (one rank adds each
            # piece, the others receive the sum)
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)


class DataParallelRejectsBadConfig(unittest.TestCase):

    def test_non_positive_bucket_size_and_unknown_impl_raise_value_error(self):
        model = build_model(_config().model, seed=0)
        for size in (0, -1.0, float("nan")):
            with self.assertRaisesRegex(ValueError, "bucket_size_mb must be positive"):
                apply_data_parallel(model, None, "ours", size)
            with self.assertRaisesRegex(ValueError, "bucket_size_mb must be positive"):
                BucketedDataParallel(model, None, size)
        with self.assertRaisesRegex(ValueError, "impl must be one of"):
            apply_data_parallel(model, None, "fast")
        cfg = _config()
        cfg.parallel.bucket_size_mb = 0
        with self.assertRaisesRegex(ValueError, "parallel.bucket_size_mb must be positive"):
            validate(cfg)

    def test_the_overlap_recorder_attaches_to_the_bucketed_wrapper_only(self):
        model = build_model(_config().model, seed=0)
        with self.assertRaisesRegex(ValueError, "takes a BucketedDataParallel, got "
                                    "NaiveDataParallel"):
            record_overlap(apply_data_parallel(model, None, "naive"))
        bucketed = apply_data_parallel(model, None, "ours", SMALL_BUCKET_MB)
        buckets = list(bucketed.buckets)
        recorder = record_overlap(bucketed)  # in place: the same buckets, nothing recorded yet
        self.assertIs(recorder, bucketed)
        self.assertEqual(recorder.buckets, buckets)
        self.assertEqual(recorder.timeline.launches, [])

    def test_wrapper_state_dict_is_the_model_state_dict(self):
        model = build_model(_config().model, seed=0)
        wrapped = apply_data_parallel(model, None, "ours")
        self.assertEqual(list(wrapped.state_dict()), list(model.state_dict()))
        wrapped.load_state_dict(build_model(_config().model, seed=1).state_dict())
        self.assertEqual(wrapped.num_parameters(), model.num_parameters())


def _timeline(backward_end: float, wait_end: float, *buckets: tuple) -> SyncTimeline:
    """A recorded step in seconds: forward at 0, each bucket's (launch, done)."""
    launches = [BucketLaunch(i, 100, True, 1, a, b) for i, (a, b) in enumerate(buckets)]
    return SyncTimeline(0.0, 0.001, backward_end, wait_end, launches)


class OverlapChartDrawsEveryRankOnOneAxis(unittest.TestCase):
    """format_overlap, chapter 01's chart: exact rows for a made-up step of two ranks (no
    ranks spawned). 12 columns over 12 ms: a column is 1 ms, read at its middle."""

    def test_compute_wait_and_all_reduces_in_flight_per_rank(self):
        fast = _timeline(0.004, 0.012, (0.001, 0.012), (0.003, 0.012))  # waits for the other
        slow = _timeline(0.010, 0.012, (0.002, 0.006), (0.008, 0.012))
        self.assertEqual(
            format_overlap([slow, fast], width=12).splitlines(), [
                "rank 0 compute   |==========..| backward 10.0 ms, waited 2.0 ms",
                "rank 0 in flight |  1111  1111| 2 buckets, 1 done before backward ended",
                "rank 1 compute   |====........| backward 4.0 ms, waited 8.0 ms",
                "rank 1 in flight | 11222222222| 2 buckets, 0 done before backward ended",
            ])

    def test_ten_and_more_all_reduces_in_flight_are_letters(self):
        many = _timeline(0.001, 0.002, *[(0.0, 0.002)] * 12)
        self.assertEqual(
            format_overlap([many], width=2).splitlines()[1][:21], "rank 0 in flight |cc|")
        self.assertEqual(
            format_timeline(many, width=2).splitlines()[1][:21], "bucket 0         |##|")


if __name__ == "__main__":
    unittest.main()
