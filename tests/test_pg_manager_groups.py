"""The process groups the manager creates hold exactly the ranks the grid says.

One 8-rank gloo world builds a manager for tp2 pp2 dp2, checks every group with real
collectives, destroys it, and rebuilds tp2 cp2 dp2 with ep2 in the same world. The parent
compares what each rank measured with the pure-Python grid.
"""

import contextlib
import datetime
import io
import unittest
from typing import Any, Dict, List

import torch
import torch.distributed as dist

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
            "dp_cp":
            (pgm.data_parallel_rank_with_context, pgm.data_parallel_world_size_with_context),
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
        results.append({
            "members": members,
            "sums": sums,
            "names": names,
            "received": received,
            "attributes": attributes
        })
        destroy_pg_manager()
    return results


class TestProcessGroupManagerOnEightRanks(unittest.TestCase):
    """tp2 pp2 dp2, then tp2 cp2 dp2 ep2, on 8 gloo processes."""

    @classmethod
    def setUpClass(cls):
        cls.results = run_distributed(_measure_groups, WORLD_SIZE, LAYOUTS, timeout=120)
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
        for rank in range(WORLD_SIZE):
            for measured in self.results[rank]:
                self.assertEqual(measured["names"], {
                    **{
                        kind: kind
                        for kind in KINDS
                    }, "world": "world",
                    "WORLD": "world"
                })


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
        self.assertIsNone(pgm.data_parallel_group_with_context)
        self.assertEqual(pgm.tensor_model_parallel_world_size, 1)
        self.assertEqual(pgm.data_parallel_rank_with_context, 0)
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
