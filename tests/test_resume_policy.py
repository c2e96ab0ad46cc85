"""A resume compares the whole run, by the policy each field declares (resume_check.py).

The checks are generated from the declarations: every field has a policy; each field is
changed alone to another valid value, and the comparison must refuse it (REFUSED; RESHARD for
a per-rank checkpoint), print it (PRINTED; RESHARD for a dcp one) or say nothing (SILENT).
One real checkpoint shows the road a user takes: the one refusal line, then the printed one.
"""

import contextlib
import copy
import dataclasses
import io
import os
import signal
import sys
import tempfile
import typing
import unittest
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scaletorch.config import Config
from scaletorch.models import build_model
from scaletorch.rules.schema import (PRINTED, REFUSED, RESHARD, RESUME, RESUME_POLICIES, SILENT,
                                     Rule, conditions)
from scaletorch.trainer import Trainer, parse_args
from scaletorch.trainer.checkpoint import check_resume
from scaletorch.trainer.config import load_config
from scaletorch.trainer.resume_check import SAID_BY_THE_TRAINER, changes, fields, record, setting
from scaletorch.trainer.run_dir import release
from scaletorch.trainer.stops import release_stop_signals
from tests.test_bad_inputs import run_in_process
from tests.test_run_dirs import C00

CONFIG_00 = "examples/configs/00_single_device.yaml"
LONG = os.environ.get("SCALETORCH_LONG_TESTS") == "1"
# (option, value, what the refusal says) of chapter 00's run: model shapes and its data
REFUSED_CHANGES = [("--model.num_layers", "3", "model.num_layers 2 -> 3"),
                   ("--model.intermediate_size", "96", "model.intermediate_size 128 -> 96"),
                   ("--model.num_key_value_heads", "4", "model.num_key_value_heads 2 -> 4"),
                   ("--model.vocab_size", "72", "model.vocab_size 64 -> 72"),
                   ("--data.seq_len", "16", "data.seq_len 32 -> 16"),
                   ("--data.seed", "7", "data.seed 1234 -> 7"),
                   ("--model.rope_theta", "500", "model.rope_theta 10000.0 -> 500.0")]


def another(value: Any, annotation: Any, rule: Rule, avoid: tuple = ()) -> Any:
    """A value of the field's type, other than ``value`` (and than ``avoid``), that its rule
    admits."""
    kind = annotation
    if typing.get_origin(kind) is typing.Union:
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    if rule.choices:
        return next(c for c in rule.choices if c != value and c not in avoid)
    if kind is bool:
        return not value
    if kind is str or kind is type(None):
        return "other" if value != "other" else "another"
    if typing.get_origin(kind) is list:
        return [1] if value != [1] else [2]
    base = value if isinstance(value, (int, float)) and not isinstance(value, bool) else 0
    for candidate in (base + 1, base * 2, base / 2, (rule.low or 0) + 1):
        candidate = int(candidate) if kind is int else float(candidate)
        if candidate != value and candidate not in avoid and rule.admits(candidate):
            return candidate
    raise AssertionError(f"no other value for {value!r} under {rule}")


def set_key(cfg: Config, key: str, value: Any) -> None:
    section, _, name = key.rpartition(".")
    setattr(getattr(cfg, section) if section else cfg, name, value)


def read_by_the_run(cfg: Config, key: str, rule: Rule) -> None:
    """Set the keys that would make the run ignore ``key`` (its rule's ``unless``) to values
    that read it."""
    annotations = {k: (v, r) for k, v, _, _, r in fields(cfg)}
    for other, values in conditions(key, rule):
        if setting(cfg, other) in values:
            annotation = typing.get_type_hints(type(getattr(cfg, other.rpartition(".")[0])))
            ann = annotation[other.rpartition(".")[2]]
            set_key(cfg, other, another(setting(cfg, other), ann, annotations[other][1], values))


class EveryFieldDeclaresWhatAResumeDoesWithIt(unittest.TestCase):

    def test_every_field_of_every_section_has_a_policy(self):
        cfg = Config()
        declared = {}
        for top in dataclasses.fields(cfg):
            obj = getattr(cfg, top.name)
            for f in dataclasses.fields(obj) if dataclasses.is_dataclass(obj) else [top]:
                declared[f"{top.name}.{f.name}" if obj is not None and dataclasses.
                         is_dataclass(obj) else f.name] = f.metadata.get(RESUME)
        self.assertGreater(len(declared), 60)
        self.assertEqual({k: v for k, v in declared.items() if v not in RESUME_POLICIES}, {})

    def test_each_field_changed_alone_is_refused_printed_or_silent_as_declared(self):
        base = Config()
        hints = {}
        for top in dataclasses.fields(base):
            obj = getattr(base, top.name)
            if dataclasses.is_dataclass(obj):
                hints.update({
                    f"{top.name}.{k}": v
                    for k, v in typing.get_type_hints(type(obj)).items()
                })
        hints["check"] = bool
        seen = {policy: 0 for policy in RESUME_POLICIES}
        for key, value, policy, _, rule in fields(base):
            with self.subTest(key=key, policy=policy):
                saved_cfg = copy.deepcopy(base)
                read_by_the_run(saved_cfg, key, rule)
                now = copy.deepcopy(saved_cfg)
                old = setting(saved_cfg, key)
                new = another(old, hints[key], rule)
                set_key(now, key, new)
                said = f"{key} {old!r} -> {new!r}"
                saved = record(saved_cfg)
                for fmt in ("per-rank", "dcp"):
                    refused, printed = changes(saved, now, fmt)
                    if policy == REFUSED or (policy == RESHARD and fmt == "per-rank"):
                        self.assertEqual((refused, printed), ([said], []))
                    elif policy == SILENT or key in SAID_BY_THE_TRAINER:
                        self.assertEqual((refused, printed), ([], []))
                        self.assertEqual(policy == SILENT, key not in saved)
                    else:
                        self.assertIn(policy, (PRINTED, RESHARD))
                        self.assertEqual((refused, printed), ([], [said]))
                seen[policy] += 1
        self.assertTrue(all(seen.values()), seen)  # every policy is in use


class AResumeOfAnotherRunIsOneLine(unittest.TestCase):
    """A real checkpoint of chapter 00 (2 steps), resumed as a user would."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cfg = parse_args([
            "--config", CONFIG_00, "--steps", "2", "--checkpoint.every", "2", "--logging.run_dir",
            cls.tmp.name, "--logging.progress", "false"
        ])
        with contextlib.redirect_stdout(io.StringIO()):
            Trainer(cfg, build_model(cfg.model, 42), verbose=True).train()
        cls.argv = ["--logging.run_dir", cls.tmp.name, "--resume", "--steps", "4"]

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_every_refused_change_in_one_line_old_and_new(self):
        code, out = run_in_process(C00, [
            *self.argv, "--data.seed", "7", "--data.seq_len", "16", "--model.rope_theta", "500",
            "--set", "data.global_batch_size=4"
        ])
        self.assertEqual(code, 2, out)
        self.assertEqual(len(out.splitlines()), 1, out)
        self.assertRegex(
            out, r"^error: --resume \S+step_0000002 was written by another run: "
            r"model.rope_theta 10000.0 -> 500.0, data.seq_len 32 -> 16, data.global_batch_size "
            r"16 -> 4, data.seed 1234 -> 7 \(checkpoint -> this run\)")

    @settings(max_examples=100 if LONG else 8, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(picked=st.lists(st.sampled_from(REFUSED_CHANGES), min_size=1, unique=True))
    def test_model_shapes_and_data_together_are_all_named(self, picked):
        """A model's shape and its data changed at once: one line names every one (the model's
        own check, which names only its shapes, comes after the field-by-field comparison)."""
        argv = [a for option, value, _ in picked for a in (option, value)]
        code, out = run_in_process(C00, [*self.argv, *argv])
        self.assertEqual(code, 2, out)
        self.assertEqual(len(out.splitlines()), 1, out)
        self.assertIn("was written by another run: ", out)
        for _, _, said in picked:
            self.assertIn(said, out)

    def test_the_printed_changes_in_one_line_before_the_run(self):
        out = io.StringIO()
        saved = sys.excepthook, {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            with contextlib.redirect_stdout(out):
                load_config(CONFIG_00, "00", argv=[*self.argv, "--logging.log_every", "1"])
        finally:
            release()
            release_stop_signals()
            sys.excepthook = saved[0]
            for signum, handler in saved[1].items():
                signal.signal(signum, handler)
        path = os.path.join(self.tmp.name, "00_single_device", "checkpoints", "step_0000002")
        self.assertEqual(out.getvalue().splitlines(), [
            f"resuming {path} with changed settings: training.steps 2 -> 4, checkpoint.every "
            f"2 -> 0, logging.log_every 25 -> 1"
        ])


class ABareResumeThatFindsNothingIsRefused(unittest.TestCase):
    """``--resume`` alone with no checkpoint where this config points (another --name, a
    --config that replaced the defaults, only a save killed before its manifest): one line
    naming the directory, exit 2, nothing written. A torchrun restart starts from step 0."""

    @settings(max_examples=100 if LONG else 10, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(name=st.text(alphabet="abz_-0", min_size=1, max_size=12), partial=st.booleans())
    def test_one_line_naming_where_it_looked(self, name, partial):
        with tempfile.TemporaryDirectory() as tmp:
            checkpoints = os.path.join(tmp, name, "checkpoints")
            if partial:  # a save killed before its manifest: no checkpoint either
                os.makedirs(os.path.join(checkpoints, "step_0000002"))
            before = sorted(os.walk(tmp))
            code, out = run_in_process(C00,
                                       ["--logging.run_dir", tmp, f"--name={name}", "--resume"])
            self.assertEqual(code, 2, out)
            self.assertEqual(
                out, f"error: --resume found no checkpoint to resume in {checkpoints!r}: give "
                f"the --config and --name of the run to continue, a checkpoint directory, or "
                f"start a new run without --resume\n")
            self.assertEqual(sorted(os.walk(tmp)), before)

    def test_a_torchrun_restart_before_any_checkpoint_starts_from_step_0(self):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = parse_args(["--config", CONFIG_00, "--logging.run_dir", tmp])
            os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
            try:
                check_resume(cfg, 1)  # no refusal: the restarted run trains from step 0
            finally:
                del os.environ["TORCHELASTIC_RESTART_COUNT"]


if __name__ == "__main__":
    unittest.main()
