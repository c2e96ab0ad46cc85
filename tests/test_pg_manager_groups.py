"""The process groups the manager creates hold exactly the ranks the grid says.

One 8-rank gloo world builds a manager for tp2 pp2 dp2, checks every group with real
collectives, destroys it, and rebuilds tp2 cp2 dp2 with ep2 in the same world. The parent
compares what each rank measured with the pure-Python grid.
"""

import contextlib
import datetime
import io
import os
import unittest
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from scaletorch.dist import comm, get_ledger
from scaletorch.dist.pg_manager import (KINDS, ProcessGroupManager, RankGrid, destroy_pg_manager,
                                        get_pg_manager, init_pg_manager)
from tests.harness import run_distributed

WORLD_SIZE = 8
LAYOUTS = [
    {
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 2
    },
    {
        "tensor_model_parallel_size": 2,
        "context_parallel_size": 2,
        "expert_model_parallel_size": 2
    },
]


def _measure_groups(rank: int, world_size: int, layouts: List[Dict[str, int]]) -> List[Any]:
    """Per layout: the members of each group seen through collectives, and the attributes."""
    results = []
    for layout in layouts:
        pgm = init_pg_manager(**layout, timeout=datetime.timedelta(seconds=60))
        members, sums, names = {}, {}, {}
        for kind in KINDS:
            group = pgm.get_group(kind)
            size = dist.get_world_size(group)
            gathered = [torch.zeros(1, dtype=torch.long) for _ in range(size)]
            dist.all_gather(gathered, torch.tensor([rank]), group=group)
            members[kind] = [int(t) for t in gathered]
            total = torch.tensor([rank])
            dist.all_reduce(total, group=group)
            sums[kind] = int(total)
            names[kind] = pgm.name_of(group)
        # send our rank down the pipeline: each stage must hear from pipeline_prev_rank
        received = None
        if not pgm.is_pipeline_first_stage:
            buf = torch.zeros(1, dtype=torch.long)
            dist.recv(buf, src=pgm.pipeline_prev_rank)
            received = int(buf)
        if not pgm.is_pipeline_last_stage:
            dist.send(torch.tensor([rank]), dst=pgm.pipeline_next_rank)
        attributes = {
            "rank":
            pgm.rank,
            "world_size":
            pgm.world_size,
            "tp": (pgm.tensor_model_parallel_rank, pgm.tensor_model_parallel_world_size),
            "pp": (pgm.pipeline_model_parallel_rank, pgm.pipeline_model_parallel_world_size),
            "cp": (pgm.context_parallel_rank, pgm.context_parallel_world_size),
            "dp": (pgm.data_parallel_rank, pgm.data_parallel_world_size),
            "dp_cp": (pgm.gradient_sync_rank, pgm.gradient_sync_world_size),
            "ep": (pgm.expert_model_parallel_rank, pgm.expert_model_parallel_world_size),
            "edp": (pgm.expert_data_parallel_rank, pgm.expert_data_parallel_world_size),
            "pipeline":
            (pgm.is_pipeline_first_stage, pgm.is_pipeline_last_stage, pgm.pipeline_prev_rank,
             pgm.pipeline_next_rank, pgm.pipeline_first_rank, pgm.pipeline_last_rank),
            "group_ranks": {
                kind: pgm.group_ranks(kind)
                for kind in KINDS
            },
        }
        names["world"] = pgm.name_of(None)
        names["WORLD"] = pgm.name_of(dist.group.WORLD)
        # which kinds share one group object, and what the ledger writes for a call per kind
        same = {
            kind: [k for k in KINDS if pgm.get_group(k) is pgm.get_group(kind)]
            for kind in KINDS
        }
        # the group gradients are averaged over: dp, or dp x cp once cp > 1
        same["gradient_sync"] = [k for k in KINDS if pgm.get_group(k) is pgm.gradient_sync_group]
        attributes["gradient_sync_world_size"] = pgm.gradient_sync_world_size
        ledger = get_ledger()
        ledger.clear()
        comm.all_reduce(torch.ones(1), pgm.gradient_sync_group)
        comm.all_reduce(torch.ones(2), pgm.expert_data_parallel_group, name="edp")
        comm.all_reduce(torch.ones(3), pgm.context_parallel_group, name="cp")
        ledger_groups = {r.elements: r.group for r in ledger.records}
        ledger.clear()
        results.append({
            "same": same,
            "ledger": ledger_groups,
            "distinct": len(pgm.group_names),
            "members": members,
            "sums": sums,
            "names": names,
            "received": received,
            "attributes": attributes
        })
        destroy_pg_manager()
    # rebuilding the manager in one process: the threads of the destroyed groups go with them
    threads = []
    for _ in range(3):
        init_pg_manager(**layouts[0])
        destroy_pg_manager()
        threads.append(_threads())
    return [results, threads]


def _threads() -> int:
    """This process's threads, C++ ones (gloo's) included; 0 where /proc is not there."""
    path = "/proc/self/task"
    return len(os.listdir(path)) if os.path.isdir(path) else 0


class TestProcessGroupManagerOnEightRanks(unittest.TestCase):
    """tp2 pp2 dp2, then tp2 cp2 dp2 ep2, on 8 gloo processes."""

    @classmethod
    def setUpClass(cls):
        measured = run_distributed(_measure_groups, WORLD_SIZE, LAYOUTS, timeout=120)
        cls.results = [m[0] for m in measured]
        cls.threads = [m[1] for m in measured]
        cls.grids = [RankGrid(WORLD_SIZE, **layout) for layout in LAYOUTS]

    def test_every_group_gathers_exactly_the_grid_members(self):
        for i, grid in enumerate(self.grids):
            for rank in range(WORLD_SIZE):
                measured = self.results[rank][i]
                for kind in KINDS:
                    expected = grid.group_of(kind, rank)
                    self.assertEqual(measured["members"][kind], expected, (i, rank, kind))
                    self.assertEqual(measured["sums"][kind], sum(expected), (i, rank, kind))
                    self.assertEqual(measured["attributes"]["group_ranks"][kind], expected)

    def test_ranks_and_sizes_match_grid_coordinates(self):
        for i, grid in enumerate(self.grids):
            for rank in range(WORLD_SIZE):
                attributes = self.results[rank][i]["attributes"]
                coords = grid.coordinates(rank)
                self.assertEqual((attributes["rank"], attributes["world_size"]), (rank, WORLD_SIZE))
                for kind in KINDS:
                    self.assertEqual(attributes[kind], (coords[kind], grid.size(kind)),
                                     (i, rank, kind))

    def test_pipeline_neighbours_are_the_adjacent_stages(self):
        grid = self.grids[0]  # tp2 pp2 dp2: pp groups [0 4] [1 5] [2 6] [3 7]
        for rank in range(WORLD_SIZE):
            measured = self.results[rank][0]
            first, last = rank < 4, rank >= 4
            prev_rank = None if first else rank - 4
            next_rank = None if last else rank + 4
            self.assertEqual(measured["attributes"]["pipeline"],
                             (first, last, prev_rank, next_rank, rank % 4, rank % 4 + 4))
            self.assertEqual(measured["received"], prev_rank)
            self.assertEqual(grid.group_of("pp", rank), [rank % 4, rank % 4 + 4])
        # without pipeline parallel every rank is both first and last stage
        for rank in range(WORLD_SIZE):
            self.assertEqual(self.results[rank][1]["attributes"]["pipeline"],
                             (True, True, None, None, rank, rank))

    def test_experts_are_folded_into_data_times_context(self):
        # tp2 cp2 dp2 ep2: dp_cp [0 2 4 6] [1 3 5 7]; ep consecutive, edp strided
        members = {rank: self.results[rank][1]["members"] for rank in range(WORLD_SIZE)}
        self.assertEqual(members[6]["dp_cp"], [0, 2, 4, 6])
        self.assertEqual(members[6]["ep"], [4, 6])
        self.assertEqual(members[6]["edp"], [2, 6])
        self.assertEqual(members[3]["ep"], [1, 3])
        self.assertEqual(members[3]["edp"], [3, 7])

    def test_name_of_labels_every_group_for_the_ledger(self):
        # a group that serves several kinds has one name: "dp" for dp_cp at cp 1 (chapter 01
        # has no context parallel), "dp_cp" only once cp > 1 makes it a group of its own
        names = [{
            "tp": "tp",
            "cp": "cp",
            "dp": "dp",
            "dp_cp": "dp",
            "pp": "pp",
            "ep": "cp",
            "edp": "dp"
        }, {
            "tp": "tp",
            "cp": "cp",
            "dp": "dp",
            "dp_cp": "dp_cp",
            "pp": "pp",
            "ep": "cp",
            "edp": "dp"
        }]
        for rank in range(WORLD_SIZE):
            for i, measured in enumerate(self.results[rank]):
                self.assertEqual(measured["names"], {
                    **names[i], "world": "world",
                    "WORLD": "world"
                }, (i, rank))

    def test_kinds_with_the_same_ranks_share_one_group(self):
        # tp2 pp2 dp2 (cp = ep = 1): dp, dp_cp and edp are one group; cp and ep are the rank
        # alone; tp2 cp2 dp2 ep2: ep's blocks are the cp groups and edp's the dp groups
        expected = [[["tp"], ["cp", "ep"], ["dp", "dp_cp", "edp"], ["pp"]],
                    [["tp"], ["cp", "ep"], ["dp", "edp"], ["dp_cp"], ["pp"]]]
        for rank in range(WORLD_SIZE):
            for i, measured in enumerate(self.results[rank]):
                for kinds in expected[i]:
                    for kind in kinds:
                        self.assertEqual(measured["same"][kind], kinds, (i, rank, kind))
                # gradients are averaged over dp (= dp_cp at cp 1), then over dp x cp
                self.assertEqual(measured["same"]["gradient_sync"], expected[i][2 + i], (i, rank))
                self.assertEqual(measured["attributes"]["gradient_sync_world_size"], 2 * (i + 1))
                # tp2 pp2: tp, the cp/ep singleton, dp/dp_cp/edp, pp (= embd); tp2 cp2 dp2
                # ep2: tp, cp/ep, dp/edp, dp_cp and the pp singleton
                self.assertEqual(measured["distinct"], 4 if i == 0 else 5, (i, rank))

    def test_the_ledger_names_the_kind_a_call_was_made_for(self):
        # one group for dp, dp_cp and edp (tp2 pp2), yet each call is written down under its
        # kind ("dp" for dp_cp at cp 1); a call on a group of one rank is not written down
        for rank in range(WORLD_SIZE):
            self.assertEqual(self.results[rank][0]["ledger"], {1: "dp", 2: "edp"})
            self.assertEqual(self.results[rank][1]["ledger"], {1: "dp_cp", 2: "edp", 3: "cp"})

    def test_rebuilding_the_manager_leaves_no_threads_behind(self):
        # each gloo group holds threads (3 on this torch); a destroyed group used to keep them
        # while the ledger's name for it kept the object alive: 21 more per rebuild
        for rank in range(WORLD_SIZE):
            threads = self.threads[rank]
            if threads[0] == 0:
                self.skipTest("no /proc/self/task to count threads")
            self.assertEqual(len(set(threads)), 1, (rank, threads))


class TestProcessGroupManagerWithoutProcessGroup(unittest.TestCase):
    """Single-device code paths: no torch.distributed, every group None, ranks 0, sizes 1."""

    def setUp(self):
        if dist.is_initialized():
            self.skipTest("needs a process without a default process group")
        destroy_pg_manager()

    def tearDown(self):
        destroy_pg_manager()

    def test_world_1_manager_has_no_groups_and_trivial_ranks(self):
        pgm = ProcessGroupManager(RankGrid(1))
        for kind in KINDS:
            self.assertIsNone(pgm.get_group(kind))
            self.assertEqual(pgm.group_ranks(kind), [0])
        self.assertEqual((pgm.rank, pgm.world_size), (0, 1))
        self.assertIsNone(pgm.tensor_model_parallel_group)
        self.assertIsNone(pgm.gradient_sync_group)
        self.assertEqual(pgm.tensor_model_parallel_world_size, 1)
        self.assertEqual(pgm.gradient_sync_rank, 0)
        self.assertEqual(pgm.expert_data_parallel_world_size, 1)
        self.assertTrue(pgm.is_pipeline_first_stage and pgm.is_pipeline_last_stage)
        self.assertIsNone(pgm.pipeline_next_rank)
        self.assertIsNone(pgm.pipeline_prev_rank)
        self.assertEqual((pgm.pipeline_first_rank, pgm.pipeline_last_rank), (0, 0))
        self.assertEqual(pgm.name_of(pgm.tensor_model_parallel_group), "world")

    def test_log_topology_prints_the_grid(self):
        pgm = ProcessGroupManager(RankGrid(1))
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            pgm.log_topology()
        self.assertEqual(out.getvalue(), RankGrid(1).describe() + "\n")

    def test_accessor_lifecycle(self):
        with self.assertRaisesRegex(
                RuntimeError, r"pg_manager is not initialized; call "
                r"init_pg_manager\(...\) first"):
            get_pg_manager()
        pgm = init_pg_manager()
        self.assertIs(get_pg_manager(), pgm)
        with self.assertRaisesRegex(RuntimeError, "already initialized"):
            init_pg_manager()
        destroy_pg_manager()
        with self.assertRaises(RuntimeError):
            get_pg_manager()

    def test_larger_grid_without_process_group_is_refused(self):
        with self.assertRaisesRegex(RuntimeError, "world size 2"):
            ProcessGroupManager(RankGrid(2))
        with self.assertRaisesRegex(ValueError, r"tensor_model_parallel_size \(2\)"):
            init_pg_manager(tensor_model_parallel_size=2)


if __name__ == "__main__":
    unittest.main()
