"""What gloo forgives and NCCL does not, made to fail on the CPU: NCCL's point-to-point order
(scaletorch/dist/p2p_order.py) and the zero-bubble runtime's posting order
(scaletorch/schedule/simulate.py), the simulator in both modes (no ranks), then every pipeline
schedule trained in NCCL's order at pp 2 and pp 4, m from p to 2p + 1, beside dp and tp,
each matching the single device (two worlds, 2 and 4 ranks); and, in the world of 2, a pair's
receive-then-send hanging in the mode and host-made tensors reaching a collective
(scaletorch/dist/device_check.py).
"""

import datetime
import importlib.util
import os
import time
import unittest
from unittest import mock

import torch
import torch.distributed as dist

from scaletorch.dist import comm, destroy_pg_manager, device_check, p2p_order
from scaletorch.dist.device_check import HostTensorError, check_devices, made_on_host
from scaletorch.parallel.mixed_precision import DynamicLossScaler
from scaletorch.schedule.catalog import action_p2p, schedule_actions
from scaletorch.schedule.in_order import simulate_posted
from scaletorch.schedule.placement import V_SHAPED
from scaletorch.schedule.simulate import PipelineDeadlock, posting_program, simulate_async
from scaletorch.trainer.param_map import full_state_dict
from tests.harness import run_distributed
from tests.layouts import (assert_matches, build, layout, make_config, pg_manager_for, reference,
                           train)

VALID = [  # (schedule, chunks per rank, p, m): m from p to 2p + 1 where the schedule runs
    (s, v, p, m) for s, v in (("afab", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1),
                              ("zbv", 2), ("dualpipev", 2)) for p in (2, 4)
    for m in range(p, 2 * p + 2)
    if not (s == "interleaved" and m % p) and not (s == "dualpipev" and m < 2 * p)
]


def receives_ahead(schedule: str, p: int, m: int, rank: int, v: int) -> list:
    """The runtime's first posting order, as a program: one receive posted ahead on every
    channel (in the sender's order), the next one once it arrived, each send alone."""
    v_shape = schedule in V_SHAPED
    plans = [schedule_actions(schedule, p, m, q, v) for q in range(p)]
    expected = {q: [] for q in range(p) if q != rank}  # per peer: its sends to us, in order
    for q, plan in enumerate(plans):
        for action in plan:
            send = action_p2p(action, q, p, v, v_shape)[1]
            if send is not None and send.peer == rank:
                expected[q].append(send)
    mirror = {
        q: [op.__class__("recv", q, op.kind, op.micro_batch, op.src, op.dst) for op in ops]
        for q, ops in expected.items()
    }
    posted = {q: 0 for q in mirror}
    program, last_send = [], None

    def post_next(q):
        if posted[q] < len(mirror[q]):
            posted[q] += 1
            return [(mirror[q][posted[q] - 1], )]
        return []

    first = [batch for q in mirror for batch in post_next(q)]
    for action in plans[rank]:
        recv, send = action_p2p(action, rank, p, v, v_shape)
        batches = first + ([(last_send, )] if last_send else [])
        first = []
        if recv is not None:
            while recv not in mirror[recv.peer][:posted[recv.peer]]:
                batches += post_next(recv.peer)
            batches += post_next(recv.peer)  # the next one ahead (before the wait: close enough)
        program.append((tuple(batches), action, recv))
        last_send = send
    program.append((((last_send, ), ) if last_send else (), None, None))
    return program


class TestPostingOrder(unittest.TestCase):
    """The simulator's NCCL mode: a rank's batches one after the other, each a rendezvous."""

    def test_posting_order_runs_in_nccl_order_with_the_asynchronous_bubble(self):
        for schedule, v, p, m in VALID:
            with self.subTest(schedule=schedule, p=p, m=m):
                programs = [posting_program(schedule, p, m, r, v) for r in range(p)]
                nominal = simulate_async(schedule, p, m, v).bubble_fraction()
                for in_order in (True, False):
                    got = simulate_posted(programs, m, v, in_order=in_order).bubble_fraction()
                    self.assertAlmostEqual(got, nominal, places=12)
                # other costs than the order was built with (F = B = W): never stuck, and at
                # most 0.0125 of the step above the asynchronous bubble (interleaved, p = 4)
                uneven = simulate_posted(programs, m, v, 1.0, 2.0, 0.5).bubble_fraction()
                self.assertLessEqual(
                    uneven,
                    simulate_async(schedule, p, m, v, 1.0, 2.0, 0.5).bubble_fraction() + 0.013)

    def test_the_first_runtime_order_hangs_in_nccl_order_and_runs_on_gloo(self):
        # rank 0 posts "receive gradient 0" before "send activation 0", which rank 1 needs to
        # make that gradient: NCCL runs them in that order, gloo does not
        for schedule, v, p, m in [("zb-h1", 1, 2, 2), ("zb-h1", 1, 4, 8), ("zbv", 2, 2, 4),
                                  ("zbv", 2, 4, 8), ("dualpipev", 2, 2, 4), ("1f1b", 1, 2, 2)]:
            with self.subTest(schedule=schedule, p=p, m=m):
                programs = [receives_ahead(schedule, p, m, r, v) for r in range(p)]
                gloo = simulate_posted(programs, m, v, in_order=False).bubble_fraction()
                self.assertAlmostEqual(gloo,
                                       simulate_async(schedule, p, m, v).bubble_fraction(),
                                       places=12)
                with self.assertRaisesRegex(PipelineDeadlock, "in NCCL's order"):
                    simulate_posted(programs, m, v, in_order=True)

    def test_a_send_and_receive_that_disagree_on_the_message_are_a_value_error(self):
        # NCCL has no tags: the k-th send of a channel meets its k-th receive. Rank 1 posting
        # its receives of activations 0 and 1 the other way round is caught, not mixed up.
        programs = [posting_program("afab", 2, 2, r) for r in range(2)]
        batches, action, recv = programs[1][0]
        self.assertEqual([b[0].micro_batch for b in batches], [0, 1])
        programs[1][0] = (batches[::-1], action, recv)
        with self.assertRaisesRegex(
                ValueError, r"message 0 from rank 0 to rank 1 is .*'recv'.*"
                r"micro_batch=1.* and .*'send'.*micro_batch=0"):
            simulate_posted(programs, 2)


class TestDevices(unittest.TestCase):

    def test_the_fp16_overflow_flag_is_on_the_parameters_device_without_gradients(self):
        # a rank whose parameters got no gradient: the flag goes to NCCL, so not to the CPU
        params = [torch.nn.Parameter(torch.zeros(2, device="meta"))]
        seen = []

        def all_reduce(tensor, group=None, op=None):
            seen.append(tensor.device.type)
            raise StopIteration  # the flag's .item() cannot run on meta

        with mock.patch.object(comm, "all_reduce", all_reduce):
            with self.assertRaises(StopIteration):
                DynamicLossScaler().unscale_and_check(params)
        self.assertEqual(seen, ["meta"])
        with self.assertRaisesRegex(ValueError, r"parameters \(none given\)"):
            DynamicLossScaler().unscale_and_check([])

    def test_the_mode_is_off_by_default_and_marks_only_inside(self):
        self.assertFalse(device_check.enabled())
        self.assertFalse(made_on_host(torch.randn(2)))
        with check_devices():
            self.assertTrue(device_check.enabled())
            host, dev = torch.randn(2), torch.randn(2, device="cpu")
            self.assertEqual([made_on_host(host), made_on_host(dev)], [True, False])
            self.assertTrue(made_on_host(host.to(torch.bfloat16)))  # a dtype is no device
            self.assertFalse(made_on_host(host.to("cpu")))
        self.assertFalse(device_check.enabled())


# ---- two worlds: every schedule trained in NCCL's order --------------------------------------

STEPS = 2
# name: (layers, micro-batches, global batch, parallel config), run at world size 2 or 4
RUNS = {
    2: {
        "afab pp2 m2": (4, 2, 8, layout(pp=2, schedule="afab")),
        "1f1b pp2 m3": (4, 3, 6, layout(pp=2, schedule="1f1b")),
        "interleaved pp2 m4":
        (4, 4, 8, layout(pp=2, schedule="interleaved", virtual_pipeline_stages=2)),
        "zb-h1 pp2 m2": (4, 2, 8, layout(pp=2, schedule="zb-h1")),
        "zb-h1 pp2 m5": (4, 5, 5, layout(pp=2, schedule="zb-h1")),
        "zbv pp2 m3": (4, 3, 6, layout(pp=2, schedule="zbv", virtual_pipeline_stages=2)),
        "dualpipev pp2 m5": (4, 5, 5, layout(pp=2, schedule="dualpipev",
                                             virtual_pipeline_stages=2)),
    },
    4: {
        "afab pp4 m4": (4, 4, 8, layout(pp=4, schedule="afab")),
        "1f1b pp4 m5": (4, 5, 5, layout(pp=4, schedule="1f1b")),
        "interleaved pp4 m8":
        (8, 8, 8, layout(pp=4, schedule="interleaved", virtual_pipeline_stages=2)),
        "zb-h1 pp4 m9": (4, 9, 9, layout(pp=4, schedule="zb-h1")),
        "zbv pp4 m4": (8, 4, 8, layout(pp=4, schedule="zbv", virtual_pipeline_stages=2)),
        "dualpipev pp4 m8": (8, 8, 8, layout(pp=4, schedule="dualpipev",
                                             virtual_pipeline_stages=2)),
        "zb-h1 pp2 dp2 m4": (4, 4, 8, layout(pp=2, schedule="zb-h1")),
        "dualpipev pp2 tp2 m4":
        (4, 4, 8, layout(pp=2, tp=2, schedule="dualpipev", virtual_pipeline_stages=2)),
    },
}
TIMEOUT = 30  # seconds a wait may take: a posting order that hangs fails in step 0 after it


def config(layers: int, m: int, batch: int, parallel: dict):
    cfg = make_config(micro_batches=m, **parallel)
    cfg.model.num_layers, cfg.data.global_batch_size, cfg.training.steps = layers, batch, STEPS
    return cfg


def two_batches(group, peer: int) -> float:
    """Receive, then send, as two batches: the order that hangs on NCCL."""
    buffer = torch.zeros(3)
    works = comm.batch_isend_irecv([dist.P2POp(dist.irecv, buffer, peer, group)], group)
    works += comm.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(3), peer, group)], group)
    for work in works:
        work.wait()
    return buffer.sum().item()


def mode_checks(rank: int) -> dict:
    """On a side group with a 2 s timeout: the order gloo forgives and the mode does not."""
    out = {}
    side = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    if rank > 1:
        return out
    p2p_order.set_in_order(False)
    out["gloo"] = two_batches(side, 1 - rank)
    p2p_order.set_in_order(True)
    start = time.time()
    try:
        out["nccl"] = two_batches(side, 1 - rank)
    except RuntimeError as error:
        out["nccl"] = str(error)
    out["seconds"] = time.time() - start
    return out


def error_of(fn) -> str:
    """"" if ``fn()`` ran, else the name of what it raised."""
    try:
        fn()
    except HostTensorError:
        return "HostTensorError"
    return ""


def chapter_08():
    path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples",
                        "08_mixed_precision.py")
    spec = importlib.util.spec_from_file_location("chapter_08", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def device_checks() -> dict:
    """Collectives of tensors made on the host (refused) or on the run's device, in the mode."""
    device = torch.device("cpu")  # the run's device, named
    on_device = lambda: torch.ones(4, device=device)  # noqa: E731
    calls = {
        "randn": lambda: comm.all_reduce(torch.randn(4)),
        "derived": lambda: comm.all_reduce(torch.ones(4) * 2),
        "cpu()": lambda: comm.all_reduce(on_device().cpu()),
        "gather input": lambda: comm.all_gather_into_tensor(on_device().repeat(2), torch.ones(4)),
        "on device": lambda: comm.all_reduce(on_device()),
        "moved": lambda: comm.all_reduce(torch.randn(4).to(device)),
        "scalar times device": lambda: comm.all_reduce(on_device() * torch.tensor(2.0)),
        "bf16_sum_error": lambda: chapter_08().bf16_sum_error(None, device),
    }
    out = {}
    with check_devices():
        for name, call in calls.items():
            out[name] = error_of(call)
        # a tensor-parallel layout trained and gathered: each gathered piece moved to the host
        cfg = config(4, 2, 8, layout(tp=2))
        pgm = pg_manager_for(cfg)
        par, trainer = build(cfg, pgm)
        trainer.train()
        full = full_state_dict(par)
        out["gathered on host"] = full is None or all(made_on_host(t) for t in full.values())
        destroy_pg_manager()
    return out


def world(rank: int, world_size: int) -> dict:
    out = {}
    if world_size == 2:  # the mode's pair and the devices need no more ranks than 2
        out["mode"], out["devices"] = mode_checks(rank), device_checks()
    p2p_order.set_in_order(True)  # every batch of every run below in NCCL's order
    with check_devices():  # and no host-made tensor in a collective
        out["parity"] = {name: train(config(*spec)) for name, spec in RUNS[world_size].items()}
    return out


class OrderWorld:
    size = 0

    @classmethod
    def setUpClass(cls):
        cls.results = run_distributed(world, cls.size, timeout=TIMEOUT)
        # the plain loop's (losses, grad norms, weights), once per (layers, m, batch), here
        keys = sorted({spec[:3] for spec in RUNS[cls.size].values()})
        cls.references = {key: reference(config(*key, {})) for key in keys}

    def test_every_schedule_in_nccl_order_matches_the_single_device(self):
        for name, spec in RUNS[self.size].items():
            with self.subTest(run=name):
                assert_matches(self, [res["parity"][name] for res in self.results],
                               self.references[spec[:3]], name)


class TestNcclOrderTwoRanks(OrderWorld, unittest.TestCase):
    size = 2

    def test_receive_then_send_hangs_in_nccl_order_and_runs_on_gloo(self):
        # a pair's order: the world of 4 ran the same pair again, waiting out the 2 s timeout
        modes = [self.results[rank]["mode"] for rank in (0, 1)]
        for mode in modes:  # both fail: the one that timed out first closes the pair
            self.assertEqual(mode["gloo"], 3.0)
            self.assertIn("SCALETORCH_P2P_ORDER=nccl", mode["nccl"])
            self.assertLess(mode["seconds"], 10)
        self.assertTrue(any("Timed out" in mode["nccl"] for mode in modes), modes)

    def test_a_collective_refuses_tensors_made_on_the_host_and_takes_the_devices(self):
        for rank, res in enumerate(self.results):
            self.assertEqual(
                res["devices"],
                {
                    "randn": "HostTensorError",
                    "derived": "HostTensorError",
                    "cpu()": "HostTensorError",
                    "gather input": "HostTensorError",
                    "on device": "",
                    "moved": "",
                    "scalar times device": "",
                    "bf16_sum_error": "",  # chapter 08 draws on the CPU, then moves to the device
                    "gathered on host": True,  # the full weights piece by piece in host memory
                },
                f"rank {rank}")


class TestNcclOrderFourRanks(OrderWorld, unittest.TestCase):
    size = 4
