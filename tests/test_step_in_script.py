"""Chapters 00-06 write their training step in the script (issue 53), 04b's too.

A learner reads the loop their strategy changes in the script itself: the step sits between
``# [core: step]`` and ``# [end: step]`` inside ``with start_run(...) as run:``, and holds the
batch loop, ``zero_grad``, the forward and backward (or the strategy's call that runs them: a
pipeline schedule), ``run.record`` and ``optimizer.step()``. No script of these chapters hands
its step to the shared ``Trainer`` (chapter 04 did until a probe found it); 06b runs each
remedy and its one-device reference through one loop of its own, chapter 06's step.
No process is started: the scripts are parsed.
"""

import ast
import os
import re
import textwrap
import unittest
from typing import List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = [
    "00_single_device", "01_ddp", "02_fsdp", "03_tensor_parallel", "04_pipeline_parallel",
    "04b_zero_bubble", "05_context_parallel", "06_expert_parallel", "06b_load_balance"
]


def step_lines(source: str) -> List[str]:
    """The lines between the script's ``# [core: step]`` and ``# [end: step]`` markers."""
    lines = source.splitlines()
    start = [i for i, line in enumerate(lines) if line.strip() == "# [core: step]"]
    end = [i for i, line in enumerate(lines) if line.strip() == "# [end: step]"]
    return lines[start[0] + 1:end[0]] if len(start) == 1 and len(end) == 1 else []


def calls(tree: ast.AST) -> List[str]:
    """The names every call in ``tree`` calls: ``f`` for f(...), ``attr`` for x.attr(...)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            names.append(f.id if isinstance(f, ast.Name) else getattr(f, "attr", ""))
    return names


class EachChapterWritesItsStep(unittest.TestCase):

    def test_the_step_is_in_the_script_and_no_trainer_runs_it(self):
        for name in SCRIPTS:
            with self.subTest(script=name):
                with open(os.path.join(ROOT, "examples", f"{name}.py")) as f:
                    source = f.read()
                step = step_lines(source)
                self.assertTrue(step, f"{name}: no '# [core: step]' ... '# [end: step]' block")
                self.assertLessEqual(len(step), 30, f"{name}: the step is not one screen")
                called = calls(ast.parse(textwrap.dedent("\n".join(step))))
                for needed in ("start_run", "batches", "zero_grad", "record", "step"):
                    self.assertIn(needed, called, f"{name}: the step does not call {needed}")
                self.assertNotIn("Trainer", calls(ast.parse(source)),
                                 f"{name}: the shared Trainer runs a step")

    def test_their_pages_say_the_script_runs_the_step_not_the_trainer(self):
        # a probe found pages 01 and 06 still saying "the trainer" calls finish_grad_sync,
        # divides and averages: words left from before the step moved into the script
        allowed = "the Trainer that chapters 07 on share"  # doc/00's evidence
        for name in SCRIPTS:
            with self.subTest(page=name):
                with open(os.path.join(ROOT, "doc", f"{name}.md")) as f:
                    text = " ".join(f.read().replace(allowed, "").split())
                said = re.findall(r"(?i)\b(?:the|its|by the) trainer(?:'s)?\b[^.]{0,40}", text)
                self.assertEqual(said, [], f"doc/{name}.md names the trainer as running the step")
