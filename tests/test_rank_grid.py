"""The rank grid against hand-written group lists; no process group, runs in milliseconds.

Every golden list below was derived by hand from the order string, e.g. for the default
"tp-cp-dp-pp": rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank)).
Expert groups: cut each dp_cp group (ranks in increasing order) into consecutive blocks of ep
ranks ("ep"); the ranks at the same position of every block form an "edp" group.
"""

import unittest
from typing import Dict, List

from scaletorch.dist.pg_manager import KINDS, RankGrid, ledger_name
from scaletorch.rules.group_names import gradient_group_name


def singletons(world_size: int) -> List[List[int]]:
    return [[r] for r in range(world_size)]


class RankGridInvariants:
    """Checks that hold for every layout, used by the golden tests and the large layouts."""

    def check_invariants(self, grid: RankGrid) -> None:
        world = grid.world_size
        sizes = {
            "tp": grid.tensor_model_parallel_size,
            "cp": grid.context_parallel_size,
            "dp": grid.data_parallel_size,
            "pp": grid.pipeline_model_parallel_size,
            "dp_cp": grid.data_parallel_size * grid.context_parallel_size,
            "ep": grid.expert_model_parallel_size,
            "edp": grid.expert_data_parallel_size
        }
        self.assertEqual(sizes["tp"] * sizes["cp"] * sizes["dp"] * sizes["pp"], world)
        self.assertEqual(sizes["ep"] * sizes["edp"], sizes["dp_cp"])
        for kind in KINDS:
            groups = grid.groups(kind)
            # a partition of the world into equal groups, each sorted, sorted by first rank
            self.assertEqual(sorted(r for g in groups for r in g), list(range(world)), kind)
            self.assertEqual(len(groups), world // sizes[kind], kind)
            self.assertTrue(all(len(g) == sizes[kind] for g in groups), kind)
            self.assertTrue(all(g == sorted(g) for g in groups), kind)
            self.assertEqual(groups, sorted(groups), kind)
        for rank in range(world):
            coords = grid.coordinates(rank)
            for kind in KINDS:
                self.assertEqual(grid.group_of(kind, rank)[coords[kind]], rank, (kind, rank))
            # folding: ep and edp live inside dp_cp and cross only at this rank
            dp_cp = set(grid.group_of("dp_cp", rank))
            ep, edp = set(grid.group_of("ep", rank)), set(grid.group_of("edp", rank))
            self.assertTrue(ep <= dp_cp and edp <= dp_cp)
            self.assertEqual(ep & edp, {rank})
            self.assertEqual(coords["dp_cp"], coords["edp"] * sizes["ep"] + coords["ep"])
            if grid.order == "tp-cp-dp-pp":
                expected = coords["tp"] + sizes["tp"] * (
                    coords["cp"] + sizes["cp"] * (coords["dp"] + sizes["dp"] * coords["pp"]))
                self.assertEqual(rank, expected)

        # one torch group per distinct set of ranks, serving every kind that has those ranks
        distinct = grid.distinct_groups()
        sets = [tuple(ranks) for ranks, _ in distinct]
        self.assertEqual(len(sets), len(set(sets)))
        for kind in KINDS + ("embd", ):
            groups = grid.embedding_groups() if kind == "embd" else grid.groups(kind)
            serving = [ranks for ranks, kinds in distinct if kind in kinds]
            self.assertEqual(sorted(serving), sorted(groups), kind)
        for ranks, kinds in distinct:
            self.assertEqual(kinds, sorted(kinds, key=(KINDS + ("embd", )).index))

    def check_golden(self, grid: RankGrid, golden: Dict[str, List[List[int]]]) -> None:
        for kind, expected in golden.items():
            self.assertEqual(grid.groups(kind), expected, kind)
        self.check_invariants(grid)


class TestRankGridGoldenLayouts(unittest.TestCase, RankGridInvariants):

    def test_world_1_has_one_singleton_group_of_every_kind(self):
        grid = RankGrid(1)
        self.check_golden(grid, {kind: [[0]] for kind in KINDS})
        self.assertEqual(grid.coordinates(0), {kind: 0 for kind in KINDS})

    def test_tp2_dp2(self):
        self.check_golden(
            RankGrid(4, tensor_model_parallel_size=2), {
                "tp": [[0, 1], [2, 3]],
                "cp": singletons(4),
                "dp": [[0, 2], [1, 3]],
                "dp_cp": [[0, 2], [1, 3]],
                "pp": singletons(4),
                "ep": singletons(4),
                "edp": [[0, 2], [1, 3]],
            })

    def test_tp2_pp2_dp2(self):
        # rank = tp + 2 * (dp + 2 * pp)
        grid = RankGrid(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
        self.check_golden(
            grid, {
                "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
                "cp": singletons(8),
                "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                "dp_cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
                "ep": singletons(8),
                "edp": [[0, 2], [1, 3], [4, 6], [5, 7]],
            })
        self.assertEqual(grid.coordinates(6), {
            "tp": 0,
            "cp": 0,
            "dp": 1,
            "dp_cp": 1,
            "pp": 1,
            "ep": 0,
            "edp": 1
        })
        self.assertEqual(grid.group_of("pp", 5), [1, 5])

    def test_embedding_groups_pair_each_pipelines_first_and_last_rank(self):
        # Megatron's embedding group: one pair per (tp, cp, dp) coordinate; none without pp
        grid = RankGrid(16, tensor_model_parallel_size=2, pipeline_model_parallel_size=4)
        self.assertEqual(grid.embedding_groups(), [[0, 12], [1, 13], [2, 14], [3, 15]])
        self.assertEqual(
            RankGrid(8, pipeline_model_parallel_size=2).embedding_groups(),
            [[0, 4], [1, 5], [2, 6], [3, 7]])
        self.assertEqual(RankGrid(8, tensor_model_parallel_size=2).embedding_groups(), [])

    def test_tp2_cp2_dp2(self):
        # rank = tp + 2 * (cp + 2 * dp)
        grid = RankGrid(8, tensor_model_parallel_size=2, context_parallel_size=2)
        self.check_golden(
            grid, {
                "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
                "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
                "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
                "pp": singletons(8),
                "ep": singletons(8),
                "edp": [[0, 2, 4, 6], [1, 3, 5, 7]],
            })
        self.assertEqual(grid.coordinates(7), {
            "tp": 1,
            "cp": 1,
            "dp": 1,
            "dp_cp": 3,
            "pp": 0,
            "ep": 0,
            "edp": 3
        })

    def test_pp2_cp2_tp2_without_data_parallel(self):
        # dp = 1; rank = tp + 2 * (cp + 2 * pp)
        grid = RankGrid(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                        context_parallel_size=2)
        self.assertEqual(grid.data_parallel_size, 1)
        self.check_golden(
            grid, {
                "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
                "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                "dp": singletons(8),
                "dp_cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            })

    def test_128_ranks_tp8_pp4_dp4(self):
        # rank = tp + 8 * (dp + 4 * pp)
        grid = RankGrid(128, tensor_model_parallel_size=8, pipeline_model_parallel_size=4)
        self.assertEqual(grid.data_parallel_size, 4)
        self.assertEqual(grid.groups("tp"), [list(range(8 * k, 8 * k + 8)) for k in range(16)])
        self.assertEqual(grid.group_of("dp", 0), [0, 8, 16, 24])
        self.assertEqual(grid.group_of("dp", 37), [37, 45, 53, 61])  # tp 5, dp 0, pp 1
        self.assertEqual(grid.group_of("pp", 0), [0, 32, 64, 96])
        self.assertEqual(grid.group_of("pp", 127), [31, 63, 95, 127])
        self.assertEqual(grid.groups("pp")[:2], [[0, 32, 64, 96], [1, 33, 65, 97]])
        self.assertEqual(grid.coordinates(127)["pp"], 3)
        self.assertEqual(grid.coordinates(100), {
            "tp": 4,
            "cp": 0,
            "dp": 0,
            "dp_cp": 0,
            "pp": 3,
            "ep": 0,
            "edp": 0
        })
        self.check_invariants(grid)

    def test_expert_folding_tp2_dp4_ep2(self):
        # dp groups [0 2 4 6] [1 3 5 7]; ep = consecutive halves, edp = strided
        grid = RankGrid(8, tensor_model_parallel_size=2, expert_model_parallel_size=2)
        self.check_golden(
            grid, {
                "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
                "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
                "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            })
        self.assertEqual(grid.expert_data_parallel_size, 2)
        self.assertEqual(grid.coordinates(6)["ep"], 1)
        self.assertEqual(grid.coordinates(6)["edp"], 1)

    def test_expert_folding_tp2_cp2_dp2_ep4_spans_context_ranks(self):
        # dp_cp groups [0 2 4 6] [1 3 5 7] (cp and dp together); ep 4 takes all of each
        grid = RankGrid(8, tensor_model_parallel_size=2, context_parallel_size=2,
                        expert_model_parallel_size=4)
        self.check_golden(grid, {
            "ep": [[0, 2, 4, 6], [1, 3, 5, 7]],
            "edp": singletons(8),
        })

    def test_expert_folding_with_pipeline_tp2_cp2_dp2_pp2_ep2(self):
        # rank = tp + 2 * (cp + 2 * (dp + 2 * pp)); dp_cp of (tp 0, pp 1) is [8 10 12 14]
        grid = RankGrid(16, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                        context_parallel_size=2, expert_model_parallel_size=2)
        self.check_golden(
            grid, {
                "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
                "cp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
                "dp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
                "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
                "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
                "ep": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
                "edp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
            })

    def test_order_pp_dp_tp_cp_puts_pipeline_fastest(self):
        # rank = pp + 2 * (dp + 2 * tp)
        grid = RankGrid(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                        order="pp-dp-tp-cp")
        self.check_golden(
            grid, {
                "pp": [[0, 1], [2, 3], [4, 5], [6, 7]],
                "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                "tp": [[0, 4], [1, 5], [2, 6], [3, 7]],
                "cp": singletons(8),
            })
        self.assertEqual(grid.coordinates(5)["tp"], 1)
        self.assertEqual(grid.coordinates(5)["pp"], 1)

    def test_order_tp_dp_cp_pp_folds_experts_in_rank_order(self):
        # rank = tp + 2 * (dp + 2 * cp); dp_cp [0 2 4 6] = (dp0 cp0, dp1 cp0, dp0 cp1, dp1 cp1)
        grid = RankGrid(8, tensor_model_parallel_size=2, context_parallel_size=2,
                        expert_model_parallel_size=2, order="tp-dp-cp-pp")
        self.check_golden(
            grid, {
                "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
                "cp": [[0, 4], [1, 5], [2, 6], [3, 7]],
                "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
                "ep": [[0, 2], [1, 3], [4, 6], [5, 7]],
                "edp": [[0, 4], [1, 5], [2, 6], [3, 7]],
            })
        self.assertEqual(grid.coordinates(6), {
            "tp": 0,
            "cp": 1,
            "dp": 1,
            "dp_cp": 3,
            "pp": 0,
            "ep": 1,
            "edp": 1
        })

    def test_512_ranks_all_axes_keep_the_invariants(self):
        grid = RankGrid(512, tensor_model_parallel_size=8, pipeline_model_parallel_size=4,
                        context_parallel_size=2, expert_model_parallel_size=4)
        self.assertEqual(grid.data_parallel_size, 8)
        self.assertEqual(grid.expert_data_parallel_size, 4)
        # tp 3, cp 1, dp 5, pp 2 -> 3 + 8 * (1 + 2 * (5 + 8 * 2)) = 347
        self.assertEqual(grid.coordinates(347)["dp_cp"], 11)  # cp + 2 * dp
        self.assertEqual(grid.group_of("ep", 347), [323, 331, 339, 347])  # dp_cp 8..11
        self.check_invariants(grid)

    def test_describe_shows_each_stage_as_dp_by_cp_by_tp(self):
        grid = RankGrid(16, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                        context_parallel_size=2, expert_model_parallel_size=2)
        lines = grid.describe(experts=True).splitlines()
        self.assertEqual(lines, [
            "rank grid: world 16 = tp 2 x cp 2 x dp 2 x pp 2, order tp-cp-dp-pp (fastest first)",
            "experts: ep 2 x edp 2; [..] = one tp group, cp ranks side by side",
            "pp 0 | dp 0: [ 0  1] [ 2  3] | dp 1: [ 4  5] [ 6  7]",
            "pp 1 | dp 0: [ 8  9] [10 11] | dp 1: [12 13] [14 15]",
        ])

    def test_describe_shows_experts_and_the_brackets_key_only_where_they_apply(self):
        # a dense model (chapters 01-05) has no expert split; without tp or cp every bracket
        # holds one rank and needs no key
        self.assertEqual(
            RankGrid(2).describe().splitlines(), [
                "rank grid: world 2 = tp 1 x cp 1 x dp 2 x pp 1, order tp-cp-dp-pp (fastest first)",
                "pp 0 | dp 0: [0] | dp 1: [1]",
            ])
        self.assertEqual(
            RankGrid(2, expert_model_parallel_size=2).describe(experts=True).splitlines()[1],
            "experts: ep 2 x edp 1")
        self.assertEqual(
            RankGrid(2, tensor_model_parallel_size=2).describe().splitlines()[1],
            "[..] = one tp group, cp ranks side by side")


class TestOneGroupPerDistinctSetOfRanks(unittest.TestCase):
    """The kinds that have the same ranks share one group (one NCCL communicator on GPUs)."""

    def test_with_cp_and_ep_1_dp_dp_cp_and_edp_are_one_group(self):
        grid = RankGrid(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
        self.assertEqual(
            grid.distinct_groups(),
            [
                ([0, 1], ["tp"]),
                ([2, 3], ["tp"]),
                ([4, 5], ["tp"]),
                ([6, 7], ["tp"]),
                *[([r], ["cp", "ep"]) for r in range(8)],
                ([0, 2], ["dp", "dp_cp", "edp"]),
                ([1, 3], ["dp", "dp_cp", "edp"]),
                ([4, 6], ["dp", "dp_cp", "edp"]),
                ([5, 7], ["dp", "dp_cp", "edp"]),
                ([0, 4], ["pp", "embd"]),  # pp 2: the embedding group is the pipeline group
                ([1, 5], ["pp", "embd"]),
                ([2, 6], ["pp", "embd"]),
                ([3, 7], ["pp", "embd"]),
            ])
        # 20 groups where one per kind (and embd) made 4 + 8 + 4 + 4 + 4 + 8 + 4 + 4 = 40:
        # every rank holds 4 groups instead of 8
        groups = grid.distinct_groups()
        self.assertEqual(len(groups), 20)
        self.assertEqual(sum(1 for ranks, _ in groups if 5 in ranks), 4)

    def test_chapter_06_at_two_ranks_shares_ep_with_dp_cp(self):
        grid = RankGrid(2, expert_model_parallel_size=2)  # ep 2 = dp 2: edp is each rank alone
        self.assertEqual(grid.distinct_groups(), [([0], ["tp", "cp", "pp", "edp"]),
                                                  ([1], ["tp", "cp", "pp", "edp"]),
                                                  ([0, 1], ["dp", "dp_cp", "ep"])])

    def test_ep_equal_to_cp_shares_their_groups_and_edp_shares_dp(self):
        grid = RankGrid(8, tensor_model_parallel_size=2, context_parallel_size=2,
                        expert_model_parallel_size=2)
        kinds = {tuple(ranks): kinds for ranks, kinds in grid.distinct_groups()}
        self.assertEqual(kinds[(0, 2)], ["cp", "ep"])
        self.assertEqual(kinds[(0, 4)], ["dp", "edp"])
        self.assertEqual(kinds[(0, 2, 4, 6)], ["dp_cp"])

    def test_the_ledger_names_a_shared_group_by_the_kind_whose_calls_name_none(self):
        self.assertEqual(ledger_name(["dp", "dp_cp", "edp"]), "dp")
        self.assertEqual(ledger_name(["dp", "dp_cp", "ep"]), "dp")
        self.assertEqual(ledger_name(["cp", "dp_cp"]), "dp_cp")
        self.assertEqual(ledger_name(["pp", "embd"]), "pp")
        self.assertEqual(ledger_name(["cp", "ep"]), "cp")
        self.assertEqual(ledger_name(["tp", "cp", "pp", "edp"]), "tp")
        self.assertEqual(ledger_name(["edp"]), "edp")

    def test_the_gradient_group_is_dp_until_context_parallel_makes_it_dp_cp(self):
        # chapter 01 has no context parallel: its gradients' group is "dp" in the ledger; from
        # chapter 05 on (cp > 1) the dp_cp group differs from dp and is "dp_cp"
        for sizes in [(2, 1, 1, 1, 1), (8, 2, 2, 1, 1), (8, 2, 1, 1, 2), (8, 1, 1, 2, 1),
                      (8, 2, 1, 2, 2), (4, 1, 1, 4, 1), (16, 2, 2, 2, 2)]:
            world, tp, pp, cp, ep = sizes
            grid = RankGrid(world, tp, pp, context_parallel_size=cp, expert_model_parallel_size=ep)
            ranks = grid.group_of("dp_cp", 0)
            kinds = dict((tuple(r), k) for r, k in grid.distinct_groups())[tuple(ranks)]
            self.assertEqual(ledger_name(kinds), "dp" if cp == 1 else "dp_cp", sizes)
            self.assertEqual(gradient_group_name(cp), ledger_name(kinds), sizes)


class TestRankGridRejectsInvalidLayouts(unittest.TestCase):

    def assertRaisesWith(self, fragments: List[str], *args, **kwargs) -> None:
        with self.assertRaises(ValueError) as ctx:
            RankGrid(*args, **kwargs)
        for fragment in fragments:
            self.assertIn(fragment, str(ctx.exception))

    def test_world_not_divisible_names_every_size(self):
        self.assertRaisesWith([
            "world size 6 is not divisible by tensor_model_parallel_size (4) x "
            "pipeline_model_parallel_size (1) x context_parallel_size (1)"
        ], 6, tensor_model_parallel_size=4)
        self.assertRaisesWith([
            "world size 8 is not divisible by tensor_model_parallel_size (2) x "
            "pipeline_model_parallel_size (3) x context_parallel_size (1)"
        ], 8, tensor_model_parallel_size=2, pipeline_model_parallel_size=3)
        self.assertRaisesWith(["world size 4", "context_parallel_size (8)"], 4,
                              context_parallel_size=8)

    def test_non_positive_sizes(self):
        self.assertRaisesWith(["world_size", "0"], 0)
        self.assertRaisesWith(["tensor_model_parallel_size", "0"], 8, tensor_model_parallel_size=0)
        self.assertRaisesWith(["pipeline_model_parallel_size", "-2"], 8,
                              pipeline_model_parallel_size=-2)
        self.assertRaisesWith(["context_parallel_size", "2.0"], 8, context_parallel_size=2.0)
        self.assertRaisesWith(["expert_model_parallel_size", "0"], 8, expert_model_parallel_size=0)

    def test_expert_size_must_divide_data_times_context(self):
        self.assertRaisesWith([
            "expert_model_parallel_size (3)", "data_parallel_size (4)", "context_parallel_size (1)"
        ], 8, tensor_model_parallel_size=2, expert_model_parallel_size=3)
        self.assertRaisesWith([
            "expert_model_parallel_size (4)", "data_parallel_size (1)", "context_parallel_size (2)"
        ], 4, tensor_model_parallel_size=2, context_parallel_size=2, expert_model_parallel_size=4)

    def test_bad_order_strings(self):
        for order in ["tp-cp-dp", "tp-cp-dp-pp-ep", "tp-tp-dp-pp", "tp,cp,dp,pp", ""]:
            self.assertRaisesWith([repr(order), "tp, cp, dp, pp"], 4, order=order)

    def test_unknown_kind_and_rank_out_of_range(self):
        grid = RankGrid(4, tensor_model_parallel_size=2)
        with self.assertRaisesRegex(ValueError, "unknown group kind 'mp'"):
            grid.groups("mp")
        with self.assertRaisesRegex(ValueError, "rank 4 is outside world size 4"):
            grid.group_of("tp", 4)


if __name__ == "__main__":
    unittest.main()
