"""The ledger records what each collective carries; each autograd collective's backward is
the analytic conjugate of its forward (checked against single-process math on 4 ranks)."""

import unittest

import torch

from scaletorch.dist import all_to_all, comm, functional, get_ledger, split_regions
from scaletorch.dist.ledger import wire_bytes
from tests.harness import run_distributed

WORLD = 4


def _tensor(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _run(fn, x: torch.Tensor, grad_out: torch.Tensor):
    x = x.clone().requires_grad_(True)
    y = fn(x)
    y.backward(grad_out)
    return y.detach(), x.grad


def _splits(src: int, world: int) -> list:
    """Rows rank ``src`` sends to each rank: uneven on purpose, including a zero."""
    return [(src + dst) % 3 for dst in range(world)]


def _world(rank: int, world: int) -> dict:
    ledger = get_ledger()
    ledger.clear()
    out = {}
    xs = [_tensor(r, 2, 4, 8) for r in range(world)]  # (b, s, h): rank r's input
    gs = [_tensor(100 + r, 2, 4, 8) for r in range(world)]  # rank r's output gradient
    group = None  # the whole world

    # f: identity forward, all-reduce backward.
    out["f"] = _run(lambda x: functional.copy_to_parallel_region(x, group), xs[rank], gs[rank])
    # g: all-reduce forward, identity backward.
    out["g"] = _run(lambda x: functional.reduce_from_parallel_region(x, group), xs[rank], gs[rank])
    # scatter along the last dim: every rank holds the same input (xs[0]).
    out["scatter"] = _run(lambda x: split_regions.scatter_to_parallel_region(x, group, -1), xs[0],
                          gs[rank][..., :8 // world])
    # gather along the last dim.
    full_g = [_tensor(200 + r, 2, 4, 8 * world) for r in range(world)]
    out["gather"] = _run(lambda x: split_regions.gather_from_parallel_region(x, group, -1),
                         xs[rank], full_g[rank])
    # sequence parallel pair along dim 1.
    seq_g = [_tensor(300 + r, 2, 4 * world, 8) for r in range(world)]
    out["gather_seq"] = _run(lambda x: functional.gather_from_sequence_parallel_region(x, group, 1),
                             xs[rank], seq_g[rank])
    rs_x = [_tensor(400 + r, 2, 4 * world, 8) for r in range(world)]
    out["reduce_scatter_seq"] = _run(
        lambda x: functional.reduce_scatter_to_sequence_parallel_region(x, group, 1), rs_x[rank],
        gs[rank])
    # all-to-all with uneven splits.
    send = _splits(rank, world)
    recv = [_splits(src, world)[rank] for src in range(world)]
    a2a_x = _tensor(500 + rank, sum(send), 3)
    a2a_g = _tensor(600 + rank, sum(recv), 3)
    out["all_to_all"] = _run(lambda x: all_to_all.all_to_all(x, recv, send, group), a2a_x, a2a_g)

    # Ledger: plain collectives record the tensor they carry.
    ledger.clear()
    t = torch.ones(10, 3)
    comm.all_reduce(t)
    gathered = torch.empty(world * 5)
    comm.all_gather_into_tensor(gathered, torch.ones(5))
    scattered = torch.empty(5)
    comm.reduce_scatter_tensor(scattered, torch.ones(world * 5))
    out["ledger"] = [(r.op, r.group, r.group_size, r.elements, r.bytes, r.wire_bytes)
                     for r in ledger.records]
    out["sums"] = (t[0, 0].item(), gathered.sum().item(), scattered[0].item())
    return out


class AutogradCollectivesMatchAnalyticConjugates(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.results = run_distributed(_world, WORLD)
        cls.xs = [_tensor(r, 2, 4, 8) for r in range(WORLD)]
        cls.gs = [_tensor(100 + r, 2, 4, 8) for r in range(WORLD)]

    def assertClose(self, actual, expected):
        # Sums of 4 fp32 tensors in different orders: a few ulps.
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)

    def test_f_is_identity_forward_and_all_reduce_backward(self):
        for rank, res in enumerate(self.results):
            y, dx = res["f"]
            self.assertClose(y, self.xs[rank])
            self.assertClose(dx, sum(self.gs))

    def test_g_is_all_reduce_forward_and_identity_backward(self):
        for rank, res in enumerate(self.results):
            y, dx = res["g"]
            self.assertClose(y, sum(self.xs))
            self.assertClose(dx, self.gs[rank])

    def test_scatter_splits_forward_and_gathers_backward(self):
        chunk = 8 // WORLD
        grads = [self.gs[r][..., :chunk] for r in range(WORLD)]
        for rank, res in enumerate(self.results):
            y, dx = res["scatter"]
            self.assertClose(y, self.xs[0][..., rank * chunk:(rank + 1) * chunk])
            self.assertClose(dx, torch.cat(grads, dim=-1))

    def test_gather_concatenates_forward_and_splits_backward(self):
        for rank, res in enumerate(self.results):
            y, dx = res["gather"]
            self.assertClose(y, torch.cat(self.xs, dim=-1))
            full_g = _tensor(200 + rank, 2, 4, 8 * WORLD)
            self.assertClose(dx, full_g[..., rank * 8:(rank + 1) * 8])

    def test_sequence_gather_backward_is_reduce_scatter(self):
        total_g = sum(_tensor(300 + r, 2, 4 * WORLD, 8) for r in range(WORLD))
        for rank, res in enumerate(self.results):
            y, dx = res["gather_seq"]
            self.assertClose(y, torch.cat(self.xs, dim=1))
            self.assertClose(dx, total_g[:, rank * 4:(rank + 1) * 4])

    def test_sequence_reduce_scatter_backward_is_all_gather(self):
        total_x = sum(_tensor(400 + r, 2, 4 * WORLD, 8) for r in range(WORLD))
        for rank, res in enumerate(self.results):
            y, dx = res["reduce_scatter_seq"]
            self.assertClose(y, total_x[:, rank * 4:(rank + 1) * 4])
            self.assertClose(dx, torch.cat(self.gs, dim=1))

    def test_all_to_all_with_uneven_splits_and_reverse_backward(self):
        xs = [_tensor(500 + r, sum(_splits(r, WORLD)), 3) for r in range(WORLD)]

        def block(src, dst, tensors, splits_of):
            start = sum(splits_of(src)[:dst])
            return tensors[src][start:start + splits_of(src)[dst]]

        for rank, res in enumerate(self.results):
            y, dx = res["all_to_all"]
            expected = torch.cat(
                [block(src, rank, xs, lambda r: _splits(r, WORLD)) for src in range(WORLD)])
            self.assertClose(y, expected)
            # Rank j received our rows as its block number ``rank``; its gradient comes back.
            recv_of = lambda r: [_splits(src, WORLD)[r] for src in range(WORLD)]  # noqa: E731
            gs = [_tensor(600 + r, sum(recv_of(r)), 3) for r in range(WORLD)]
            expected_dx = torch.cat([block(dst, rank, gs, recv_of) for dst in range(WORLD)])
            self.assertClose(dx, expected_dx)

    def test_ledger_records_elements_bytes_and_ring_volume(self):
        n = WORLD
        expected = [
            ("all_reduce", "world", n, 30, 120, 2 * (n - 1) / n * 120),
            ("all_gather", "world", n, 5 * n, 20 * n, (n - 1) / n * 20 * n),
            ("reduce_scatter", "world", n, 5 * n, 20 * n, (n - 1) / n * 20 * n),
        ]
        for res in self.results:
            self.assertEqual(res["ledger"], expected)
            self.assertEqual(res["sums"], (float(n), float(n * 5), float(n)))


class LedgerWithoutProcessGroup(unittest.TestCase):

    def test_single_process_collectives_are_free_and_unrecorded(self):
        ledger = get_ledger()
        ledger.clear()
        t = torch.ones(3)
        comm.all_reduce(t)
        out = torch.empty(3)
        comm.all_gather_into_tensor(out, torch.full((3, ), 2.0))
        self.assertEqual(ledger.records, [])
        self.assertEqual(t.tolist(), [1.0, 1.0, 1.0])
        self.assertEqual(out.tolist(), [2.0, 2.0, 2.0])

    def test_wire_bytes_follow_the_ring_formulas(self):
        self.assertAlmostEqual(wire_bytes("all_reduce", 100, 4), 150.0)
        self.assertAlmostEqual(wire_bytes("all_gather", 100, 4), 75.0)
        self.assertAlmostEqual(wire_bytes("send", 100, 2), 100.0)
        self.assertEqual(wire_bytes("recv", 100, 2), 0.0)  # the sender counts the message

    def test_table_lists_each_op_and_group(self):
        ledger = get_ledger()
        ledger.clear()
        ledger.record("all_reduce", None, 2, 1000, 4)
        table = ledger.table()
        self.assertIn("all_reduce", table)
        self.assertIn("1,000", table)
        ledger.clear()
        self.assertIn("no communication", ledger.table())


if __name__ == "__main__":
    unittest.main()
