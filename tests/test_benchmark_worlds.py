"""scripts/benchmark.py runs every family at the world it needs: with no flags, zero_bubble (pp
= 4) at 4 ranks and the others at 2; a world it cannot run at skips it with one line."""

import types
import unittest

import scripts.benchmarks.zero_bubble as zero_bubble
from scripts.benchmark import DEFAULT_WORLD_SIZE, available, world_for


class EachFamilyAtItsWorld(unittest.TestCase):

    def test_no_flag_runs_each_family_at_its_own_world(self):
        self.assertEqual(world_for(zero_bubble, None), (4, ""))
        self.assertEqual(world_for(types.SimpleNamespace(), None), (DEFAULT_WORLD_SIZE, ""))
        self.assertEqual(world_for(types.SimpleNamespace(), 4), (4, ""))
        self.assertEqual(world_for(zero_bubble, 4), (4, ""))

    def test_another_world_skips_a_fixed_world_family_saying_why(self):
        world, why = world_for(zero_bubble, 2)
        self.assertIsNone(world)
        self.assertEqual(why, "skipped: it runs at world size 4 only (--world-size 2 asked)")

    def test_only_zero_bubble_has_a_fixed_world(self):
        fixed = {
            name
            for name in available()
            if hasattr(__import__(f"scripts.benchmarks.{name}", fromlist=["_"]), "WORLD_SIZE")
        }
        self.assertEqual(fixed, {"zero_bubble"})


if __name__ == "__main__":
    unittest.main()
