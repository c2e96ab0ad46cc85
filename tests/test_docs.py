"""The docs reproduce: scripts/check_docs.py's parser and comparison on a synthetic page, then
the documented commands marked ``ci`` re-run and compared with what doc/*.md shows."""

import concurrent.futures
import os
import re
import shlex
import tempfile
import unittest
from typing import Tuple

from scripts import check_docs, doc_names
from tests.harness import NCCL_CHECKS, launch_forked, run_forked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = "```"

PAGE = f"""# A page

Commands without output are not checked:

{FENCE}
scripts/launch.sh examples/01_ddp.py --nproc-per-node 2 -- --check
{FENCE}

<!-- check: ci timing-columns=ms/step -->
{FENCE}bash
scripts/launch.sh examples/01_ddp.py --nproc-per-node 2 -- \\
    --steps 10 --check
{FENCE}

{FENCE}text
step    10 | loss 2.5955 | lr 1.00e-02 | grad norm 0.970 | 34,342 tok/s
communication per rank (step 9)
all_reduce      dp         2       9        82,241     0.329     0.329
...
parity: max |loss - reference| = 2.4e-07 over 10 steps (tolerance 1e-05): OK
{FENCE}

{FENCE}bash
python scripts/benchmark.py --only ddp
{FENCE}
{FENCE}text
name  ms/step  MB
ddp   51.7     3.41
{FENCE}
"""

OUTPUT = """+ OMP_NUM_THREADS=1 python -m torch.distributed.run ...
step    10 | loss 2.5955 | lr 1.00e-02 | grad norm 0.970 | 12,001 tok/s
communication per rank (step 9)
all_reduce      dp         2       9        82,241     0.329     0.329
gradients all-reduced in step 9: 82,240 elements
overlap in step 9 (rank 0; = compute, # a bucket's all-reduce in flight, . waiting):
bucket 0         |                 ######                        |     3.6 -    7.2 ms  0.049 MB
parity: max |loss - reference| = 3.1e-07 over 10 steps (tolerance 1e-05): OK
"""


class ParserFindsCommandsAndOutputs(unittest.TestCase):

    def test_a_bash_block_followed_by_a_text_block_is_one_checked_block(self):
        blocks, errors = check_docs.parse("page.md", PAGE)
        self.assertEqual(errors, [])
        self.assertEqual(len(blocks), 2)
        first = blocks[0]
        # the continuation line is joined into one command; the marker's options are read
        self.assertEqual(
            first.commands,
            ["scripts/launch.sh examples/01_ddp.py --nproc-per-node 2 -- --steps 10 "
             "--check"])
        self.assertEqual(first.options, {"ci": "", "timing-columns": "ms/step"})
        self.assertEqual(first.expected[0][:10], "step    10")
        self.assertNotIn("ci", blocks[1].options)

    def test_output_without_its_command_is_an_error(self):
        page = PAGE.replace(f"{FENCE}bash\npython scripts/benchmark.py --only ddp\n{FENCE}\n", "")
        _, errors = check_docs.parse("page.md", page)
        self.assertEqual(len(errors), 1)
        self.assertIn("output block without its command", errors[0])

    def test_unlabeled_output_is_an_error(self):
        page = PAGE + f"\n{FENCE}\nparity: max |loss - reference| = 2.4e-07 over 9 steps\n{FENCE}\n"
        _, errors = check_docs.parse("page.md", page)
        self.assertEqual(len(errors), 1)
        self.assertIn("looks like program output", errors[0])

    def test_a_launch_without_steps_is_an_error(self):
        _, errors = check_docs.parse("page.md", PAGE.replace("--steps 10 ", ""))
        self.assertEqual(len(errors), 1)
        self.assertIn("--steps", errors[0])


class LintCountsTheWordsOfProseSentences(unittest.TestCase):
    """--lint: a prose sentence has at most 40 words; code, tables and output do not count."""

    def test_a_41_word_sentence_fails_and_a_40_word_one_passes(self):
        forty = " ".join(f"Word{i}" for i in range(40)) + "."
        page = f"# Title\n\nShort one. {forty}\nNext sentence here.\n"
        self.assertEqual(check_docs.long_sentences("page.md", page), [])
        errors = check_docs.long_sentences("page.md", page.replace(forty, "And " + forty))
        self.assertEqual(len(errors), 1)
        self.assertIn("page.md:3: a sentence of 41 words", errors[0])

    def test_code_tables_output_and_numbers_are_not_prose(self):
        long_line = " ".join(["word"] * 50)
        page = (f"{FENCE}text\n{long_line}\n{FENCE}\n\n| {long_line} |\n\n    {long_line}\n\n"
                f"- an item with a table:\n\n  | {long_line} |\n\n"
                f"Numbers are not words: {' '.join(['1,024'] * 50)}.\n")
        self.assertEqual(check_docs.long_sentences("page.md", page), [])

    def test_a_sentence_runs_across_lines_and_a_list_item_starts_a_new_one(self):
        half = " ".join(["word"] * 21)
        self.assertEqual(len(check_docs.long_sentences("page.md", f"{half}\n{half}.\n")), 1)
        self.assertEqual(check_docs.long_sentences("page.md", f"- {half}\n- {half}.\n"), [])

    def test_every_page_keeps_its_sentences_short(self):
        errors = [e for path in check_docs.doc_files([]) for e in check_docs.long_sentences(path)]
        self.assertEqual(errors, [])

    def test_a_chapter_page_and_the_readme_hold_sentences_to_30_words_other_pages_to_40(self):
        text = " ".join(["word"] * 31) + ".\n"
        for page in ("doc/05_context_parallel.md", "doc/04b_zero_bubble.md", "README.md"):
            self.assertEqual(len(check_docs.long_sentences(page, text)), 1, page)
        self.assertEqual(check_docs.long_sentences("doc/glossary.md", text), [])


class ComparisonIgnoresTimingAndCatchesDrift(unittest.TestCase):

    def setUp(self):
        self.block = check_docs.parse("page.md", PAGE)[0][0]

    def test_the_same_run_reproduces_whatever_its_timings(self):
        # tok/s differ, a timeline chart is skipped, 2.4e-07 vs 3.1e-07 is rounding-level
        self.assertEqual(check_docs.compare(self.block.expected, OUTPUT), [])

    def test_a_changed_ledger_number_is_drift_with_a_diff(self):
        diff = check_docs.compare(self.block.expected, OUTPUT.replace("82,241", "82,242"))
        self.assertIn("-all_reduce      dp         2       9        82,241     0.329     0.329",
                      diff)
        self.assertIn("+all_reduce      dp         2       9        82,242     0.329     0.329",
                      diff)

    def test_a_new_row_inside_a_shown_table_is_drift(self):
        # between two '...' lines the doc's lines must be consecutive output lines
        extra = "recv            pp         2       8        32,768     0.131     0.000\n"
        output = OUTPUT.replace("communication per rank (step 9)\n",
                                "communication per rank (step 9)\n" + extra)
        self.assertNotEqual(check_docs.compare(self.block.expected, output), [])

    def test_a_changed_verdict_or_tolerance_is_drift(self):
        for old, new in (("OK", "FAIL"), ("1e-05", "1e-04"), ("3.1e-07", "4.2e-05")):
            with self.subTest(new=new):
                output = OUTPUT.replace(old, new)
                self.assertNotEqual(check_docs.compare(self.block.expected, output), [])

    def test_a_tolerance_is_exact_where_a_deviation_may_move(self):
        line = "parity: max |loss - reference| = {} over 10 steps (tolerance {}, bf16): OK"
        doc = [line.format("3.1e-04", "3.1e-02")]
        self.assertEqual(check_docs.compare(doc, line.format("2.2e-04", "3.1e-02")), [])
        self.assertNotEqual(check_docs.compare(doc, line.format("3.1e-04", "4.0e-02")), [])

    def test_a_tolerance_derived_from_a_measured_floor_may_move_like_a_deviation(self):
        line = (
            "parity: max |weight - reference| = 1.2e-05 after 50 steps, in w (tolerance {} = 32 "
            "x floor {}, measured this run): OK")
        doc = [line.format("9.6e-05", "3.0e-06")]
        self.assertEqual(check_docs.compare(doc, line.format("8.0e-05", "2.5e-06")), [])
        self.assertNotEqual(check_docs.compare(doc, line.format("9.6e-04", "3.0e-05")), [])
        fixed = "parity: max |loss - reference| = 2.4e-07 over 10 steps (tolerance {}): OK"
        self.assertNotEqual(check_docs.compare([fixed.format("1e-05")], fixed.format("2e-05")), [])

    def test_timing_columns_named_by_the_marker_are_ignored(self):
        doc = ["name  ms/step  MB", "ddp   51.7     3.41"]
        same, other = "name ms/step MB\nddp 99.0 3.41", "name ms/step MB\nddp 99.0 3.42"
        self.assertEqual(check_docs.compare(doc, same, ["ms/step"]), [])
        self.assertNotEqual(check_docs.compare(doc, other, ["ms/step"]), [])
        # a column in the header's right half counts from the right: arguments may hold spaces
        tour = [
            "script  arguments      MB/step  seconds  result",
            "07      --tp 2 --pp 2  1.311    11.6     ok"
        ]
        slower = "script arguments MB/step seconds result\n07 --tp 2 --pp 2 1.311 19.0 ok"
        self.assertEqual(check_docs.compare(tour, slower, ["seconds"]), [])
        self.assertNotEqual(check_docs.compare(tour, slower.replace("1.311", "1.312"), ["seconds"]),
                            [])
        # in an aligned table a value belongs to the header above it, whatever the spaces in
        # the columns before it (a benchmark's name) or after it (a target such as "<= 1.2")
        bench = [
            "name                       ours_ms  native_ms  ratio  target  ranks",
            "ZeRO-3 (ours) step, bf16   167      209        0.808  <= 1.2  2"
        ]
        faster = "\n".join(bench).replace("167      209        0.808", "86       120        0.709")
        self.assertEqual(check_docs.compare(bench, faster, ["ours_ms", "native_ms", "ratio"]), [])
        for drift in (faster.replace("<= 1.2", "<= 1.3"), faster.replace("bf16 ", "fp16 ")):
            self.assertNotEqual(check_docs.compare(bench, drift, ["ours_ms", "native_ms", "ratio"]),
                                [])

    def test_the_weight_of_a_rounding_level_deviation_and_blank_lines_are_not_drift(self):
        line = "parity: max |weight - reference| = {} after 50 steps, in {} (tolerance 1e-05): OK"
        doc = [line.format("4.8e-07", "layers.0.post_attention_layernorm.weight"), "stderr"]
        out = line.format("7.2e-07", "layers.0.mlp.down_proj.weight") + "\n\nstderr"
        self.assertEqual(check_docs.compare(doc, out), [])
        self.assertNotEqual(check_docs.compare(doc, out.replace("OK", "FAIL")), [])

    def test_ellipsis_inside_a_line_matches_any_text(self):
        doc = ["RuntimeError: rank 0: step 0 failed; ... Connection closed by peer ..."]
        out = "RuntimeError: rank 0: step 0 failed; the last [gloo] Connection closed by peer x"
        self.assertEqual(check_docs.compare(doc, out), [])


class SourceExcerptsEqualTheSource(unittest.TestCase):
    """A ```python fence after ``<!-- excerpt: FILE NAME -->`` is FILE between its markers."""

    SOURCE = "scaletorch/parallel/pipeline_schedules.py"

    def page(self, code: str, name: str = "schedules") -> str:
        marker = f"<!-- excerpt: {self.SOURCE} {name} -->"
        return f"# A page\n\n{marker}\n{FENCE}python\n{code}\n{FENCE}\n"

    def errors(self, text: str) -> list:
        return check_docs.parse(os.path.join(ROOT, "doc", "page.md"), text)[1]

    def test_the_current_source_passes_and_a_changed_line_or_a_missing_marker_fails(self):
        code = "\n".join(check_docs.source_excerpt(self.SOURCE, "schedules"))
        self.assertIn("def one_f_one_b(", code)
        self.assertEqual(self.errors(self.page(code)), [])
        drifted = code.replace("send_forward_recv_backward", "send_forward_then_recv_backward")
        errors = self.errors(self.page(drifted))
        self.assertEqual(len(errors), 1)
        self.assertIn("doc/page.md:4: excerpt differs from " + self.SOURCE, errors[0])
        self.assertIn("-        dy = this_rank.send_forward_then_recv_backward(", errors[0])
        self.assertIn("no such file", self.errors(self.page(code, "no-such-marker"))[0])

    def test_chapter_04_shows_its_loops_from_the_source(self):
        with open(os.path.join(ROOT, "doc", "04_pipeline_parallel.md")) as f:
            text = f.read()
        self.assertIn(f"<!-- excerpt: {self.SOURCE} schedules -->", text)
        self.assertEqual(self.errors(text), [])


class DocumentedCommandsReproduce(unittest.TestCase):

    def test_the_docs_have_no_output_without_its_command(self):
        blocks, errors = [], []
        for path in check_docs.doc_files([]):
            found, problems = check_docs.parse(path)
            blocks += found
            errors += problems
        self.assertEqual(errors, [])
        self.assertGreater(len(blocks), 0)

    def test_the_commands_marked_ci_print_what_the_docs_show(self):
        # the blocks marked ci: chapters 00's and 01's 50-step --check runs, 04's and 04b's
        # printed schedules and 07's refusal. Chapters 03, 05 and 06 run with --check in
        # test_examples, 11's profile in test_debugging (doc/design.md says so);
        # `scripts/check_docs.py --all` runs every block. Each is checked as check_docs.py
        # --ci checks it (check_block: exit status, the doc's lines, its last lines), its
        # commands run by _run_ci_block: forked where the numbers are the script's
        blocks = [
            b for path in check_docs.doc_files([]) for b in check_docs.parse(path)[0]
            if "ci" in b.options
        ]
        self.assertEqual(len(blocks), 5, [b.name for b in blocks])
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # as check_docs.py --jobs 2
            problems = dict(
                zip((b.name for b in blocks),
                    pool.map(lambda b: check_docs.check_block(b, 600, _run_ci_block), blocks)))
        for name, found in problems.items():
            self.assertEqual(found, [], f"{name}:\n" + "\n".join(found))


LAUNCH = re.compile(r"^scripts/launch\.sh (examples/\S+\.py)(?: --nproc-per-node (\d+))? -- (.*)$")


def _run_ci_block(block: check_docs.Block, timeout: float) -> Tuple[int, str, str]:
    """check_docs.run_block for the ci blocks, without a new Python where the claim is the
    script's output: a ``scripts/launch.sh`` run on ranks forked from the suite's forkserver
    (``launch_forked``: the same script in each rank, without launch.sh's pre-flight, torchrun
    and a new Python per rank; their own work is tests/test_launch.py's, test_layout_errors',
    test_fault_tolerance's), a ``python examples/...`` command forked (``run_forked``). A
    launch that must fail (07's refusal) is refused by launch.sh's pre-flight, before torchrun:
    its command (``SCRIPT --validate-only --world-size N ARGS``, with launch.sh's
    LOCAL_WORLD_SIZE) forked, not bash, launch.sh and a new Python; that launch.sh passes its
    line and status on unchanged, for this very command, is test_layout_errors'
    BadLayoutsReachTheUserOnce. (exit status, stdout, stderr); a forked launch's output is
    one stream."""
    command, = block.commands  # each ci block is one command
    fails = "fails" in block.options
    with tempfile.TemporaryDirectory() as tmp:
        runs = os.path.join(tmp, "runs")
        # a block that must fail runs as written (check_docs.run_block), but for the directory
        command = check_docs.in_run_dir(command if fails else check_docs.overwriting(command), runs)
        launched = LAUNCH.match(command)
        if launched and fails:
            script, nproc, args = launched.groups()
            proc = run_forked(
                script, "--validate-only", "--world-size", nproc or "1", *shlex.split(args), env={
                    **os.environ, "PYTHONPATH": ROOT,
                    **NCCL_CHECKS, "LOCAL_WORLD_SIZE": nproc or "1"
                }, timeout=timeout)
            return proc.returncode, proc.stdout.replace(runs, "runs"), \
                proc.stderr.replace(runs, "runs")
        if fails:
            return check_docs.run_block(block, timeout)
        if launched:
            script, nproc, args = launched.groups()
            out, code = launch_forked(script, int(nproc or 1), *shlex.split(args), timeout=timeout)
            return code, out.replace(runs, "runs"), ""
        python, script, *args = shlex.split(command)
        if python != "python":
            raise AssertionError(f"{block.name}: a ci block runs scripts/launch.sh or python, "
                                 f"not {command!r}")
        proc = run_forked(script, *args, env={
            **os.environ, "PYTHONPATH": ROOT,
            **NCCL_CHECKS
        }, timeout=timeout)
        return proc.returncode, proc.stdout.replace(runs, "runs"), proc.stderr.replace(runs, "runs")


if __name__ == "__main__":
    unittest.main()


class PagesNameWhatExists(unittest.TestCase):
    """--lint's names check (scripts/doc_names.py): paths, names, flags and "above"/"below"."""

    def errors(self, text: str) -> list:
        return doc_names.page_errors(os.path.join(ROOT, "doc", "page.md"), text)

    def test_every_page_names_what_exists_and_points_the_right_way(self):
        errors = [e for path in check_docs.doc_files([]) for e in doc_names.page_errors(path)]
        self.assertEqual(errors, [])

    def test_a_missing_path_module_name_class_attribute_or_flag_is_an_error(self):
        good = ("See `scaletorch/parallel/zero.py`, [chapter 01](01_ddp.md), `gradient_sync.py`, "
                "`pipeline_schedules.PipelineRank`, `pgm.gradient_sync_group`, "
                "`parallel.impl`, `apply_zero(...)` and `--zero-stage`.\n")
        self.assertEqual(self.errors(good), [])
        for old, new in (("parallel/zero.py", "parallel/zeros.py"), ("01_ddp.md", "01_dp.md"),
                         ("gradient_sync.py", "grad_sync.py"), ("PipelineRank", "Stage"),
                         ("gradient_sync_group", "data_parallel_group_with_context"),
                         ("parallel.impl", "parallel.implementation"),
                         ("apply_zero(", "apply_zero3("), ("--zero-stage", "--zero-level")):
            with self.subTest(new=new):
                self.assertEqual(len(self.errors(good.replace(old, new))), 1, new)

    def test_a_flag_in_a_command_is_one_its_script_accepts(self):
        page = (f"{FENCE}bash\nscripts/launch.sh examples/01_ddp.py --nproc-per-node 2 -- "
                f"--steps 5 --training.lr 1e-3 --impl naive --check\npython scripts/benchmark.py "
                f"--list\n{FENCE}\n")
        self.assertEqual(self.errors(page), [])
        # the last: one name, one meaning, 05 has no naive version (the glossary's table)
        mistakes = [("--nproc-per-node", "--nprocs"), ("--training.lr", "--training.rate"),
                    ("--check", "--verify"), ("--list", "--lst"), ("--impl naive", "--impl fast"),
                    ("01_ddp.py", "05_context_parallel.py")]
        for old, new in mistakes:
            with self.subTest(new=new):
                self.assertEqual(len(self.errors(page.replace(old, new, 1))), 1, new)

    def test_the_picture_above_must_be_above_in_its_section(self):
        picture = "![a chart](img/01_buckets.png)\n"
        above = f"## A\n\n{picture}\nIn the picture above, rank 1 waits.\n"
        self.assertEqual(self.errors(above), [])
        below = f"## A\n\nIn the picture above, rank 1 waits.\n\n{picture}"
        self.assertIn("'picture above' but no picture above it", self.errors(below)[0])
        self.assertEqual(self.errors(below.replace("picture above", "picture below")), [])
        other_section = f"## A\n\n{picture}\n## B\n\nIn the picture above, rank 1 waits.\n"
        self.assertEqual(len(self.errors(other_section)), 1)


class OutputBlocksShowTheLastLines(unittest.TestCase):
    """A block that does not end with '...' ends where the command's output ends."""

    def test_a_hidden_last_line_is_drift(self):
        output = "step 1\nparity: loss OK\nparity: weight OK\nparity: grad norm OK\n"
        self.assertEqual(check_docs.compare(["...", "parity: grad norm OK"], output), [])
        self.assertEqual(check_docs.compare(["parity: loss OK", "..."], output), [])
        # the README's claim: "--check ends with" two lines, where the run prints three
        self.assertNotEqual(
            check_docs.compare(["...", "parity: loss OK", "parity: weight OK"], output), [])

    def test_stdout_may_end_before_stderr(self):
        doc = ["...", "parity: weight OK"]
        self.assertEqual(
            check_docs.compare(doc, "parity: weight OK\n\nW1128 a warning", (),
                               "parity: weight OK\n"), [])

    def test_no_output_block_hides_its_last_lines(self):
        # --lint's elided_ends is an error: every block shows the command's real last lines (a
        # verdict or an error there is part of the claim), a --check run its gradient norms' line
        hidden = [e for path in check_docs.doc_files([]) for e in check_docs.elided_ends(path)]
        self.assertEqual(hidden, [])

    def test_the_lint_names_a_block_that_ends_with_an_ellipsis(self):
        with tempfile.NamedTemporaryFile("w", suffix=".md") as f:  # not in doc/: no page
            f.write(PAGE.replace("(tolerance 1e-05): OK\n", "(tolerance 1e-05): OK\n...\n"))
            f.flush()
            errors = check_docs.elided_ends(f.name)
        self.assertEqual(len(errors), 1, errors)
        self.assertIn("the output ends with '...'", errors[0])


class ReadmeArchitectureListsThePackage(unittest.TestCase):
    """The README's architecture section, tested against scaletorch/ (claim of issue 53)."""

    def section(self) -> list:
        with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
            text = f.read()
        body = text.split("## Architecture", 1)[1].split(FENCE)[1]
        return body.splitlines()

    def test_every_parallel_module_is_listed_with_what_it_holds(self):
        listed = {}
        for line in self.section():
            m = re.match(r"^  (\w+\.py)\s+(?:\d\d[a-z]?\s+)?(\S.*)$", line)
            if m:
                listed[m.group(1)] = m.group(2)
        modules = {
            f
            for f in os.listdir(os.path.join(ROOT, "scaletorch", "parallel"))
            if f.endswith(".py") and f != "__init__.py"
        }
        self.assertEqual(sorted(modules - set(listed)), [], "modules the README does not list")
        self.assertEqual(sorted(set(listed) - modules), [], "listed modules that do not exist")
        self.assertTrue(all(len(what.split()) >= 3 for what in listed.values()), listed)

    def test_every_package_of_scaletorch_is_listed_and_exists(self):
        named = {
            m.group(1)
            for line in self.section()
            for m in [re.match(r"^scaletorch/(\w+(?:\.py)?)\s", line)] if m
        }
        packages = {
            d
            for d in os.listdir(os.path.join(ROOT, "scaletorch"))
            if os.path.isfile(os.path.join(ROOT, "scaletorch", d, "__init__.py"))
        }
        self.assertEqual(sorted(packages - named), [])
        for name in named:
            self.assertTrue(os.path.exists(os.path.join(ROOT, "scaletorch", name)), name)
