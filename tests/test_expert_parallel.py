"""Expert parallel on 4 gloo ranks equals the single-device MoE: the all-to-all dispatch and
combine, the gradients of experts and router, whole-model training at ep 2 and 4 (and with
tensor parallel), the all-to-all volume in the ledger, and the layout errors.

One world of 4 ranks; each layout rebuilds the pg_manager inside it. The references run in
this (parent) process, which has no process group.
"""

import unittest

import torch

from scaletorch.dist import all_to_all, destroy_pg_manager, get_ledger, init_pg_manager
from scaletorch.dist.layout_check import validate_expert_parallel
from scaletorch.models import MoE, build_model, moe_aux_loss
from scaletorch.parallel.expert_parallel import (AllToAllDispatcher, apply_expert_parallel,
                                                 moe_layers)
from scaletorch.parallel.parallelize import tensor_parallel_plan
from scaletorch.parallel.step import make_data_parallel_step
from scaletorch.parallel.tensor_parallel import apply_tensor_parallel, tensor_parallel_loss_fn
from scaletorch.trainer import Config, Trainer
from tests.harness import run_distributed
from tests.layouts import assert_parity, clip_fn, full_state, reference

WORLD, H, FFN, E, K = 4, 32, 64, 4, 2
TOKENS = 32  # tokens of the single-layer checks, split over the 4 ranks


def _config() -> Config:
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.hidden_size, m.intermediate_size, m.num_layers = 64, H, FFN, 2
    m.num_attention_heads, m.num_key_value_heads, m.max_seq_len = 4, 2, 32
    m.num_experts, m.moe_top_k, m.moe_aux_loss_coeff = E, K, 0.1  # aux: ~0.2 of the loss
    cfg.data.seq_len, cfg.data.global_batch_size = 16, 8
    # 3 steps: past the 2 warm-up steps; a wrong dispatch or combine shows from step 1 on
    cfg.training.steps, cfg.training.warmup_steps, cfg.training.lr = 3, 2, 1e-2
    cfg.logging.progress = False
    return cfg


def _layer() -> MoE:
    torch.manual_seed(0)
    layer = MoE(H, FFN, E, top_k=K, aux_loss_coeff=0.1)
    layer.experts.init_weights(0.1, 0.1)
    layer.router.weight.data.normal_(0, 0.3)
    return layer


def _layer_data():
    g = torch.Generator().manual_seed(7)
    return torch.randn(TOKENS, H, generator=g), torch.randn(TOKENS, H, generator=g)


def _layer_loss(layer, x, g):
    """Mean over tokens of <y_t, g_t> plus the aux loss: shaped like the training loss."""
    return (layer(x) * g).sum() / x.size(0) + moe_aux_loss(layer)


def _splits(src: int) -> list:
    """Rows rank ``src`` sends to each rank, uneven and with zeros."""
    return [(3 * src + dst) % 4 for dst in range(WORLD)]


def _rows(rank: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed + rank))


class _TaggingExperts:
    """Stand-in experts: multiply each token by (global expert id + 1), so the result tells
    which expert saw it. The dispatcher hands them tokens grouped by local expert."""

    def __init__(self, first: int, local: int) -> None:
        self.first, self.num_experts = first, local

    def __call__(self, x: torch.Tensor, counts: list) -> torch.Tensor:
        """``counts``: tokens per local expert, on the host (the dispatcher's one transfer)."""
        ids = torch.arange(self.first,
                           self.first + self.num_experts).repeat_interleave(torch.tensor(counts))
        return x * (ids + 1).unsqueeze(-1).to(x.dtype)


def _check_all_to_all(rank: int) -> dict:
    """Forward and backward of the variable-split all-to-all over the world."""
    send = _splits(rank)
    recv = [_splits(src)[rank] for src in range(WORLD)]
    x = _rows(rank, sum(send), 100).requires_grad_(True)
    grad_out = _rows(rank, sum(recv), 200)
    y = all_to_all.all_to_all(x, recv, send, None)
    y.backward(grad_out)
    return {"y": y.detach(), "grad": x.grad}


def _check_dispatcher(pgm) -> dict:
    """Random routing over ep ranks through tagging experts: did each token reach its expert
    and come back to its row?"""
    ep, rank = pgm.expert_model_parallel_world_size, pgm.rank
    local = E // ep
    counts = torch.randint(0, 5, (E, ), generator=torch.Generator().manual_seed(rank))
    routed = _rows(rank, int(counts.sum()), 300)
    expert_of_row = torch.arange(E).repeat_interleave(counts)
    dispatcher = AllToAllDispatcher(pgm.expert_model_parallel_group)
    experts = _TaggingExperts(pgm.expert_model_parallel_rank * local, local)
    out = dispatcher(experts, routed, counts)
    return {"out": out, "expected": routed * (expert_of_row + 1).unsqueeze(-1)}


def _check_layer(pgm) -> dict:
    """One MoE layer, each rank with its shard of the tokens, after the gradient sync."""
    layer = _layer()
    model = apply_expert_parallel(layer, pgm)
    x, g = _layer_data()
    r, n = pgm.gradient_sync_rank, pgm.gradient_sync_world_size
    rows = slice(r * TOKENS // n, (r + 1) * TOKENS // n)
    loss = _layer_loss(model, x[rows], g[rows])
    loss.backward()
    model.finish_grad_sync()
    out = {
        "expert_rank": pgm.expert_model_parallel_rank,
        "ep": pgm.expert_model_parallel_world_size,
        "loss": loss.detach(),
        "router": layer.router.weight.grad.clone()
    }
    for name in ("gate_proj", "up_proj", "down_proj"):
        out[name] = getattr(layer.experts, name).grad.clone()
    return out


def _train(cfg: Config, pgm, tensor_parallel: bool = False) -> dict:
    model = build_model(cfg.model, seed=cfg.training.model_seed)
    if tensor_parallel:  # tensor parallel first, then the experts (torchtitan's order)
        apply_tensor_parallel(model, pgm, plan=tensor_parallel_plan)  # the MoE stays whole
    model = apply_expert_parallel(model, pgm)
    step = None
    if tensor_parallel:  # the vocab-parallel loss; the step drives the wrapper's grad sync
        step = make_data_parallel_step(model, 1, pgm.data_parallel_rank,
                                       pgm.data_parallel_world_size, pgm.gradient_sync_group,
                                       loss_fn=tensor_parallel_loss_fn(pgm))
    get_ledger().clear()
    result = Trainer(cfg, model, pgm, verbose=False, forward_backward=step,
                     clip_grad_norm=clip_fn(model, pgm)).train()
    last = cfg.training.steps - 1
    records = get_ledger().select(op="all_to_all", group="ep", step=last)
    remote = [
        d.remote_tokens(pgm.expert_model_parallel_rank)
        for d in (layer.dispatch_fn for layer in moe_layers(model))
    ]
    state = full_state(model, pgm)  # collective: on rank 0
    return {
        "losses": result.losses,
        "grad_norms": result.grad_norms,
        "state": state,
        # token rows (fp32) vs the int64 count exchange, told apart by element size
        "token_elements": sum(r.elements for r in records if r.bytes != 8 * r.elements),
        "count_elements": sum(r.elements for r in records if r.bytes == 8 * r.elements),
        "remote": remote,
    }


def _world(rank: int, world: int) -> dict:
    cfg = _config()
    out = {}
    out["all_to_all"] = _check_all_to_all(rank)  # over the world group: no pg_manager needed
    for ep in (2, 4):
        pgm = init_pg_manager(expert_model_parallel_size=ep)
        out[f"dispatch_ep{ep}"] = _check_dispatcher(pgm)
        out[f"layer_ep{ep}"] = _check_layer(pgm)
        out[f"train_ep{ep}"] = _train(cfg, pgm)
        if ep == 4:  # 6 experts do not split over 4 ranks
            bad = _config()
            bad.model.num_experts = 6
            try:
                apply_expert_parallel(build_model(bad.model, seed=0), pgm)
            except ValueError as err:
                out["indivisible_experts"] = str(err)
        destroy_pg_manager()
    try:
        init_pg_manager(expert_model_parallel_size=3)
    except ValueError as err:
        out["ep_not_dividing_dp"] = str(err)
    pgm = init_pg_manager(tensor_model_parallel_size=2, expert_model_parallel_size=2)
    out["train_tp2_ep2"] = _train(cfg, pgm, tensor_parallel=True)
    destroy_pg_manager()
    return out


class ExpertParallelMatchesSingleDevice(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.results = run_distributed(_world, WORLD, timeout=240)
        cls.reference = reference(_config())  # the plain loop's (tests/layouts.py)
        layer = _layer()
        x, g = _layer_data()
        loss = _layer_loss(layer, x, g)
        loss.backward()
        cls.layer_loss = loss.item()
        cls.layer_grads = {"router": layer.router.weight.grad}
        for name in ("gate_proj", "up_proj", "down_proj"):
            cls.layer_grads[name] = getattr(layer.experts, name).grad

    def test_all_to_all_forward_and_backward_equal_the_analytic_exchange(self):
        for rank, res in enumerate(self.results):
            out = res["all_to_all"]
            # Forward: rank j's rows for this rank, in source order.
            expected_y = []
            for src in range(WORLD):
                send = _splits(src)
                start = sum(send[:rank])
                expected_y.append(_rows(src, sum(send), 100)[start:start + send[rank]])
            torch.testing.assert_close(out["y"], torch.cat(expected_y), rtol=0, atol=0)
            # Backward: the gradient of the rows sent to rank j is the slice of j's output
            # gradient that came from this rank: the reverse exchange, splits swapped.
            expected_grad = []
            for dst in range(WORLD):
                recv_dst = [_splits(src)[dst] for src in range(WORLD)]
                start = sum(recv_dst[:rank])
                grad_dst = _rows(dst, sum(recv_dst), 200)
                expected_grad.append(grad_dst[start:start + recv_dst[rank]])
            torch.testing.assert_close(out["grad"], torch.cat(expected_grad), rtol=0, atol=0)

    def test_dispatch_then_combine_brings_every_token_back_from_its_own_expert(self):
        for ep in (2, 4):
            for rank, res in enumerate(self.results):
                out = res[f"dispatch_ep{ep}"]
                with self.subTest(ep=ep, rank=rank):
                    self.assertGreater(out["out"].size(0), 0)
                    torch.testing.assert_close(out["out"], out["expected"], rtol=0, atol=0)

    def test_layer_gradients_of_router_and_experts_are_nonzero_and_equal_the_reference(self):
        for ep in (2, 4):
            for rank, res in enumerate(self.results):
                out = res[f"layer_ep{ep}"]
                local = E // out["ep"]
                experts = slice(out["expert_rank"] * local, (out["expert_rank"] + 1) * local)
                with self.subTest(ep=ep, rank=rank):
                    # fp32 sums of 32 products in a different order: ~1e-8 apart.
                    torch.testing.assert_close(out["router"], self.layer_grads["router"], rtol=0,
                                               atol=1e-6)
                    self.assertGreater(out["router"].abs().sum().item(), 0)
                    for name in ("gate_proj", "up_proj", "down_proj"):
                        torch.testing.assert_close(out[name], self.layer_grads[name][experts],
                                                   rtol=0, atol=1e-6, msg=name)
                        self.assertGreater(out[name].abs().sum().item(), 0)
            # The mean of the ranks' losses (mean loss + aux each) is the reference's loss.
            mean = sum(res[f"layer_ep{ep}"]["loss"] for res in self.results) / WORLD
            self.assertAlmostEqual(mean.item(), self.layer_loss, delta=1e-6)

    def _assert_parity(self, key: str):
        # every rank's losses and grad norms, rank 0's weights, within layouts.TOL (1e-5)
        assert_parity(self, self.results, key, self.reference)

    def test_ep2_with_data_parallel_folding_matches_single_device_losses_and_weights(self):
        self._assert_parity("train_ep2")  # world 4 = dp 4 = ep 2 x edp 2

    def test_ep4_matches_single_device_losses_and_weights(self):
        self._assert_parity("train_ep4")  # world 4 = dp 4 = ep 4 x edp 1

    def test_ep2_with_tensor_parallel_2_matches_single_device_losses_and_weights(self):
        self._assert_parity("train_tp2_ep2")  # tp 2 x dp 2, dp 2 = ep 2 x edp 1

    def test_ledger_all_to_all_carries_dispatched_and_combined_tokens_twice_per_layer(self):
        layers = _config().model.num_layers
        for key, ep in (("train_ep2", 2), ("train_ep4", 4)):
            total_remote = 0
            for rank, res in enumerate(self.results):
                out = res[key]
                # per MoE layer: forward dispatch (sent) + combine (received back), and the
                # same two in backward, each token a row of h elements
                formula = sum(2 * H * (sent + received) for sent, received in out["remote"])
                with self.subTest(key=key, rank=rank):
                    self.assertEqual(out["token_elements"], formula)
                    self.assertEqual(out["count_elements"], layers * (ep - 1) * (E // ep))
                total_remote += sum(sent for sent, _ in out["remote"])
            # Over the ep groups: per direction, dispatched + combined = routed-away x h x 2.
            total_elements = sum(res[key]["token_elements"] for res in self.results)
            self.assertEqual(total_elements, 2 * (2 * total_remote * H))
            self.assertGreater(total_remote, 0)

    def test_invalid_layouts_raise_value_errors_naming_the_numbers(self):
        res = self.results[0]
        self.assertIn("(6)", res["indivisible_experts"])
        self.assertIn("(4)", res["indivisible_experts"])
        self.assertIn("(3)", res["ep_not_dividing_dp"])
        cases = [((6, 4, 4), ["(6)", "(4)"]), ((6, 3, 4), ["(3)", "(4)"]),
                 ((0, 2, 4), ["num_experts is 0"])]
        for args, numbers in cases:
            with self.subTest(args=args), self.assertRaises(ValueError) as ctx:
                validate_expert_parallel(*args)
            for number in numbers:
                self.assertIn(number, str(ctx.exception))

    def test_top_k_larger_than_num_experts_raises(self):
        cfg = _config()
        cfg.model.moe_top_k = 5
        with self.assertRaises(ValueError) as ctx:
            cfg.model.__post_init__()
        self.assertIn("moe_top_k (5)", str(ctx.exception))


if __name__ == "__main__":
    unittest.main()
