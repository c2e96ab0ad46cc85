"""scripts/chapter_plots.py: each chapter picture's reader, on the text its run prints.

The samples are excerpts of real runs (the command is above each one; long lines' padding and
chart bars shortened to fit 100 columns): a changed table in a script breaks its reader here,
not only in ``check_docs.py --all``. No ranks, no matplotlib needed (a drawing is asked for
once, with matplotlib reported missing): well under a second.
"""

import glob
import json
import os
import re
import tempfile
import unittest
from unittest import mock

import yaml

from scripts import chapter_plots as cp
from scripts.plot import main
from tests.harness import run_main

# scripts/launch.sh examples/01_ddp.py --nproc-per-node 2 -- --steps 3 --verbose
DDP = """\
overlap in step 1 (rank 0; = compute, # a bucket's all-reduce in flight, . waiting):
bucket 0         |             ######           |     1.0 -    2.0 ms  0.049 MB
overlap in step 2 (rank 0; = compute, # a bucket's all-reduce in flight, . waiting):
forward+backward |============================================================|     0.0 -   13.5 ms
bucket 0         |             ######           |     5.8 -    8.4 ms  0.049 MB
bucket 1         |              #####           |     6.2 -    8.6 ms  0.033 MB
bucket 7         |                              |    13.4 -   13.5 ms  0.049 MB
wait             |                                                           .|    13.5 -   13.5 ms
overlap in step 2 (rank 1; = compute, # a bucket's all-reduce in flight, . waiting):
forward+backward |============================================================|     0.0 -    7.0 ms
bucket 0         |             ######           |     3.1 -   15.0 ms  0.049 MB
wait             |                                                           .|     7.0 -   15.2 ms
memory per rank, bytes (data parallel, N = 2, Psi = 82,240)
rank            params       grads   optimizer         total
0              328,960     328,960     657,920     1,315,840
1              328,960     328,960     657,920     1,315,840
formula        328,960     328,960     657,920     1,315,840
                  4Psi        4Psi        8Psi         16Psi
"""
# scripts/launch.sh examples/02_fsdp.py --nproc-per-node 2 -- --steps 2 --zero-stage 2
ZERO2 = """\
memory per rank, bytes (ZeRO-2, N = 2, Psi = 82,240, Psi' = 82,240 with padding to multiples of N)
rank            params       grads   optimizer         total   peak gathered
0              328,960     164,480     328,960       822,400               0
1              328,960     164,480     328,960       822,400               0
formula        328,960     164,480     328,960       822,400
                  4Psi      4Psi/N      8Psi/N  4Psi+12Psi/N
"""
# scripts/launch.sh examples/03_tensor_parallel.py --nproc-per-node 2 -- --steps 3
TP = """\
one transformer block, one micro-batch: b x s x h = 512 x 64 = 32,768 elements per collective, tp 2
site                      forward         backward
attention input (f)       -               all_reduce
o_proj output (f-bar)     all_reduce      -
MLP input (f)             -               all_reduce
down_proj output (f-bar)  all_reduce      -
communication per rank (step 2)
op              group      N   calls      elements        MB   wire MB
all_reduce      tp         2      12       329,216     1.317     1.317
all_reduce      world      2       1             1     0.000     0.000
all_reduce over tp in step 2: ledger 329,216 elements, formula 329,216 (OK)
"""
# scripts/launch.sh examples/05_context_parallel.py --nproc-per-node 2 -- --steps 3
CP = ("attention tiles per layer per forward, by cp rank (full + diagonal): rank 0: 3 + 2, "
      "rank 1: 3 + 2\n")
# scripts/launch.sh examples/06_expert_parallel.py --nproc-per-node 2 -- --steps 3
MOE = """\
routing of the last forward: 4 experts, top-2, over ep 2 (2 experts per rank)
MoE layer 0: tokens per expert over all ranks [227 294 204 299]
  rank  experts  tokens per local expert   sent   recv  dispatch KB  combine KB
     0      0-1               [227, 294]    256    265        65.54       67.84
     1      2-3               [204, 299]    265    256        67.84       65.54
MoE layer 1: tokens per expert over all ranks [249 242 298 235]
  rank  experts  tokens per local expert   sent   recv  dispatch KB  combine KB
     0      0-1               [249, 242]    248    227        63.49       58.11
     1      2-3               [298, 235]    227    248        58.11       63.49
communication per rank (step 2)
"""
# scripts/launch.sh examples/07_nd_parallel.py --nproc-per-node 4 -- --tp 2 --pp 2 --steps 2
GRID = """\
rank grid: world 4 = tp 2 x cp 1 x dp 1 x pp 2, order tp-cp-dp-pp (fastest first)
per rank, step 1: coordinates | wire MB per group | memory MB
rank tp cp dp pp ep |  tp  cp    dp  pp  ep  edp world |  params  grads  adam  total
 0 0 0 0 0 0 | 1.180 0.000 0.000 0.131 0.000 0.000 0.000 |  0.157  0.157  0.313  0.627
 1 1 0 0 0 0 | 1.180 0.000 0.000 0.131 0.000 0.000 0.000 |  0.157  0.157  0.313  0.627
 2 0 0 0 1 0 | 1.186 0.000 0.000 0.131 0.000 0.000 0.000 |  0.157  0.157  0.314  0.628
 3 1 0 0 1 0 | 1.186 0.000 0.000 0.131 0.000 0.000 0.000 |  0.157  0.157  0.314  0.628
pipeline timeline of step 1 (1f1b), rank 0's pipeline:
"""
# scripts/launch.sh examples/08_mixed_precision.py --nproc-per-node 2 -- --steps 3
BF16 = """\
82,240 parameters, ZeRO stage 3, compute bf16, param_dtype bf16, reduce_dtype bf16
traffic in step 2 (rank 0, over dp):
  all_reduce              1 elements x 4.00 B =         4 B, on the wire         4 B
  reduce_scatter     82,240 elements x 2.00 B =   164,480 B, on the wire    82,240 B
  all_gather        164,480 elements x 2.00 B =   328,960 B, on the wire   164,480 B
memory per rank, bytes (ZeRO-3, N = 2, Psi = 82,240, Psi' = 82,240 with padding to multiples of N)
"""


class ChapterPlotReaders(unittest.TestCase):

    def test_ddp_overlap_rows_keep_each_ranks_buckets_of_the_last_step(self):
        charts = cp.parse_overlap(DDP)
        self.assertEqual(sorted(charts), [0, 1])  # step 1's chart is not the last step's
        rows = charts[0]
        self.assertEqual([r["row"] for r in rows],
                         ["forward+backward", "bucket 0", "bucket 1", "bucket 7", "wait"])
        self.assertEqual((rows[1]["start_ms"], rows[1]["end_ms"], rows[1]["mb"]), (5.8, 8.4, 0.049))
        self.assertIsNone(rows[0]["mb"])
        self.assertEqual([(r["row"], r["end_ms"]) for r in charts[1]], [("forward+backward", 7.0),
                                                                        ("bucket 0", 15.0),
                                                                        ("wait", 15.2)])

    def test_memory_tables_give_each_ranks_bytes_and_the_formula(self):
        ddp, zero2 = cp.parse_memory(DDP)[0], cp.parse_memory(ZERO2)[0]
        self.assertEqual(ddp["title"], "data parallel, N = 2")
        self.assertEqual(len(ddp["ranks"]), 2)
        self.assertEqual(ddp["ranks"][0]["optimizer"], 657_920)  # 8 Psi
        self.assertIsNone(ddp["ranks"][0]["peak"])
        self.assertEqual(zero2["title"], "ZeRO-2, N = 2")
        self.assertEqual(zero2["ranks"][1]["grads"], 164_480)  # 4 Psi / N
        self.assertEqual(zero2["formula"]["grads"], 164_480)
        self.assertEqual(zero2["ranks"][0]["peak"], 0)
        self.assertEqual(zero2["symbols"], ["4Psi", "4Psi/N", "8Psi/N"])

    def test_tp_sites_and_the_ledger(self):
        info = cp.parse_tp_sites(TP)
        self.assertEqual((info["tokens"], info["hidden"], info["elements"], info["tp"]),
                         (512, 64, 32_768, 2))
        self.assertEqual(info["sites"][1], ("o_proj output (f-bar)", "all_reduce", "-"))
        self.assertEqual(len(info["sites"]), 4)
        ledger = cp.parse_ledger(TP)
        self.assertEqual([(r["op"], r["group"], r["calls"]) for r in ledger],
                         [("all_reduce", "tp", 12), ("all_reduce", "world", 1)])
        self.assertEqual(ledger[0]["elements"], 329_216)

    def test_zigzag_blocks_measured_equal_the_rule_and_contiguous_is_unequal(self):
        self.assertEqual(cp.parse_cp_tiles(CP), [(3, 2), (3, 2)])
        self.assertEqual(cp.expected_tiles(2, "zigzag"), [(3, 2), (3, 2)])
        self.assertEqual(cp.expected_tiles(2, "contiguous"), [(1, 2), (5, 2)])
        # cp 4: zigzag keeps 2 cp - 1 full tiles per rank, contiguous grows with the rank
        self.assertEqual(cp.expected_tiles(4, "zigzag"), [(7, 2)] * 4)
        self.assertEqual([f for f, _ in cp.expected_tiles(4, "contiguous")], [1, 5, 9, 13])

    def test_routing_gives_tokens_per_local_expert_and_traffic(self):
        info = cp.parse_routing(MOE)
        self.assertEqual((info["experts"], info["top_k"], info["ep"]), (4, 2, 2))
        self.assertEqual(len(info["layers"]), 2)
        rank1 = info["layers"][0][1]
        self.assertEqual((rank1["first"], rank1["tokens"], rank1["sent"], rank1["recv"]),
                         (2, [204, 299], 265, 256))
        # every token goes to top-k experts: 16 x 32 tokens x 2 slots
        self.assertEqual(sum(sum(r["tokens"]) for r in info["layers"][1]), 1024)

    def test_rank_table_gives_coordinates_and_wire_per_group(self):
        info = cp.parse_rank_table(GRID)
        self.assertEqual(info["sizes"], dict(world=4, tp=2, cp=1, dp=1, pp=2))
        self.assertEqual(info["groups"], ["tp", "cp", "dp", "pp", "ep", "edp", "world"])
        self.assertEqual([(r["rank"], r["tp"], r["pp"]) for r in info["ranks"]], [(0, 0, 0),
                                                                                  (1, 1, 0),
                                                                                  (2, 0, 1),
                                                                                  (3, 1, 1)])
        self.assertEqual(info["ranks"][2]["wire"]["tp"], 1.186)

    def test_dtype_traffic_reads_bytes_per_element(self):
        run = cp.parse_dtype_traffic(BF16)
        self.assertEqual(run["group"], "dp")
        self.assertEqual(run["label"], "compute bf16, params bf16, reduce bf16")
        self.assertEqual([(r["op"], r["element_bytes"], r["wire"]) for r in run["rows"]],
                         [("all_reduce", 4.0, 4.0), ("reduce_scatter", 2.0, 82_240.0),
                          ("all_gather", 2.0, 164_480.0)])

    def test_loss_floor_of_the_synthetic_chain_and_of_text(self):
        with tempfile.TemporaryDirectory() as run:
            cfg = dict(model=dict(vocab_size=64), data=dict(dataset="synthetic", seed=1234))
            with open(os.path.join(run, "config.yaml"), "w") as f:
                yaml.safe_dump(cfg, f)
            what, floor = cp.loss_floor(run)
            self.assertEqual(what, "entropy floor")
            self.assertAlmostEqual(floor, 1.5654, places=4)  # doc/00's run prints 1.5654
            cfg = dict(model=dict(vocab_size=256), data=dict(dataset="text", seed=0))
            with open(os.path.join(run, "config.yaml"), "w") as f:
                yaml.safe_dump(cfg, f)
            self.assertAlmostEqual(cp.loss_floor(run)[1], 5.545, places=3)  # log 256

    def test_pipeline_costs_and_the_simulated_twin_without_matplotlib(self):
        # AFAB, two micro-batches on two stages: F 1 s, B 2 s
        events = [[0, "F", 0, 0, 0.0, 1.0], [0, "F", 1, 0, 1.0, 2.0], [1, "F", 0, 0, 1.0, 2.0],
                  [1, "F", 1, 0, 2.0, 3.0], [1, "B", 0, 0, 3.0, 5.0], [1, "B", 1, 0, 5.0, 7.0],
                  [0, "B", 0, 0, 5.0, 7.0], [0, "B", 1, 0, 7.0, 9.0]]
        with tempfile.TemporaryDirectory() as run:
            with open(os.path.join(run, "timeline.json"), "w") as f:
                json.dump(dict(pp=2, micro_batches=2, virtual_stages=1, schedule="", events=events),
                          f)  # "": not V-shaped; the config names it
            with open(os.path.join(run, "config.yaml"), "w") as f:
                yaml.safe_dump(dict(parallel=dict(schedule="afab")), f)
            with mock.patch("scripts.chapter_plots.pyplot", return_value=None):
                status, out, _ = run_main(main, "pipeline-vs-sim", run)
        self.assertEqual(status, 0)
        self.assertIn("measured mean F 1000.00 ms, B 2000.00 ms", out)
        # each rank busy 6 of the 9 s step, the simulator's the same: (p-1)/(m+p-1) = 1/3
        self.assertIn("measured   step 9000.0 ms, bubble 33%, peak live per rank [2, 2]", out)
        self.assertIn("simulated  step 9000.0 ms, bubble 33%, peak live per rank [2, 2]", out)

    def test_a_log_of_another_chapter_is_one_error_line(self):
        with tempfile.TemporaryDirectory() as run:
            path = os.path.join(run, "03.log")
            with open(path, "w") as f:
                f.write(TP)
            status, _, err = run_main(main, "experts", path)
            self.assertEqual(status, 2)
            self.assertIn("no 'routing of the last forward' line", err)
            status, _, err = run_main(main, "zero-memory", os.path.join(run, "missing.log"))
            self.assertEqual(status, 2)
            self.assertIn("does not exist", err)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHAPTERS = ("00", "01", "02", "03", "04", "04b", "05", "06", "07", "08", "10")


class EveryChapterPageHasItsPicture(unittest.TestCase):

    def test_each_page_shows_a_picture_its_own_commands_draw(self):
        # Where: after the idea it pictures (issue 41: a page explains before it measures).
        for chapter in CHAPTERS:
            (page, ) = glob.glob(os.path.join(ROOT, "doc", f"{chapter}_*.md"))
            with open(page, encoding="utf-8") as f:
                text = f.read()
            with self.subTest(page=os.path.basename(page)):
                images = re.findall(r"^!\[[^]]+\]\((img/[^)]+\.png)\)", text, re.M)
                self.assertTrue(images, "no picture")
                self.assertIn("scripts/plot.py", text)
                self.assertIn(f"--out doc/{images[0]}", text.replace("\\\n    ", ""))
                self.assertTrue(os.path.isfile(os.path.join(ROOT, "doc", images[0])), images[0])


if __name__ == "__main__":
    unittest.main()
