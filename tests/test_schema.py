"""Every config value is checked by one schema (scaletorch/rules/schema.py), before any rank.

The cases are generated from the schema, not listed by hand: for every field of ``Config``
(and of the model's ``LlamaConfig``), a value of the wrong type and values out of its rule's
range go to chapter 00 as a user gives them, on the command line and in a YAML file, through
the path scripts/launch.sh takes first (``--validate-only``). Each must be one line
``error: ...`` naming the key, exit status 2, and no traceback.
"""

import json
import math
import os
import shutil
import subprocess
import tempfile
import typing
import unittest
from typing import Any, List, Tuple

import torch
import yaml

from scaletorch.config import Config
from scaletorch.models import LlamaConfig
from scaletorch.models.hf import HFLlamaFields, config_to_hf, load_hf_config
from scaletorch.rules import boundary
from scaletorch.rules.errors import InputError
from scaletorch.rules.schema import Rule, conditions, rules_of
from scaletorch.trainer.config import ALIASES, parse_args, schema, setting
from tests.test_bad_inputs import C00, ROOT, run_in_process

FLAGS = {"checkpoint.resume": ["--resume"]}  # a key's own flag, named by check_resume
# the fields a run reads under some settings only (found by reading what reads each field)
IGNORED_UNLESS = {
    "data.path", "model.vocab_pad_to", "model.moe_top_k", "model.moe_layer_freq",
    "model.moe_intermediate_size", "model.moe_aux_loss_coeff", "model.moe_capacity_factor",
    "model.moe_bias_rate", "parallel.expert_model_parallel_size", "parallel.bucket_size_mb",
    "parallel.sequence_parallel", "parallel.schedule", "parallel.virtual_pipeline_stages",
    "parallel.cp_variant", "parallel.cp_attention", "parallel.layer_split", "parallel.param_dtype",
    "training.fail_rank", "checkpoint.keep_last", "checkpoint.async_save"
}


def _kind(annotation: Any) -> Any:
    if typing.get_origin(annotation) is typing.Union:
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def wrong_type(annotation: Any) -> str:
    """A command-line value (YAML syntax, as --set reads it) that is not of the field's type."""
    kind = _kind(annotation)
    if typing.get_origin(kind) is list:
        return "[a, b]"
    return {bool: "maybe", int: "ten", float: "fast"}[kind]


def out_of_range(annotation: Any, rule: Rule, d: str) -> List[Any]:
    """Values of the right type that the rule refuses: past each bound, outside the choices,
    not finite, empty, a path that does not exist or cannot be created."""
    kind = _kind(annotation)
    item = typing.get_args(kind)[0] if typing.get_origin(kind) is list else kind
    values: List[Any] = []
    if rule.choices:
        values.append(max(rule.choices) + 1 if item is int else "nope")
    step = 1 if item is int else 0.5
    if rule.low is not None:
        values.append(rule.low if rule.low_open else rule.low - step)
    if rule.high is not None:
        values.append(rule.high if rule.high_open else rule.high + step)
    if item is float:
        values += [math.inf, -math.inf, math.nan]
    if rule.non_empty:
        values.append("")
    if rule.path in ("file", "checkpoint"):
        values.append(os.path.join(d, "nope"))
    if rule.path == "dir":
        values.append(os.path.join(d, "a_file", "below"))
    if typing.get_origin(kind) is list:
        values = [[v] for v in values]
    return values


def _yaml(value: Any) -> str:
    """``value`` as the command line gives it (YAML: .inf, .nan, a list, an empty string)."""
    if isinstance(value, list):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, float) and not math.isfinite(value):
        return ".nan" if math.isnan(value) else ("-.inf" if value < 0 else ".inf")
    return str(value)


def _rule(key: str) -> Rule:
    return next(r for k, _, _, r, _ in schema(Config()) if k == key)


def reading(key: str, ignored: Tuple[Any, ...]) -> str:
    """A value of ``key`` its own rule allows and that is not one of ``ignored``."""
    rule = _rule(key)
    low = int(rule.low or 0) + (1 if rule.low_open else 0)
    return str(next(c for c in (rule.choices or range(low, 100)) if c not in ignored))


def read_when(rule: Rule, key: str, skip: str = "") -> List[str]:
    """Arguments under which the run reads ``key``: each setting its rule is ignored under
    (but ``skip``) set to another value its own rule allows (for checkpoint.dir: checkpoints
    saved)."""
    args = ["--checkpoint.every", "1"] if rule.path == "dir" else []
    for other, ignored in conditions(key, rule):
        if other != skip:
            args += [f"--{other}", reading(other, ignored)]
    return args


def given_value(annotation: Any, rule: Rule, default: Any) -> str:
    """A value of the field's type, other than its default, that its rule allows (as the
    command line gives it)."""
    kind = _kind(annotation)
    if rule.path:
        return "README.md"
    if rule.choices:
        return str(next(c for c in rule.choices if c != default))
    if typing.get_origin(kind) is list:
        return "[1, 1]"
    if kind is bool:
        return str(not default).lower()
    return str(default + 1)


def given_but_ignored(key: str, annotation: Any, rule: Rule,
                      default: Any) -> List[Tuple[str, List[str]]]:
    """(the setting that ignores ``key``, arguments): for each setting of the rule, ``key``
    given a valid value while that setting makes the run ignore it and every other one reads
    it."""
    out = []
    for other, ignored in conditions(key, rule):
        args = read_when(rule, key, skip=other)
        if setting(Config(), other) not in ignored:
            args += [f"--{other}", str(ignored[0])]
        out.append((other, [*args, f"--{key}", given_value(annotation, rule, default)]))
    return out


def cases(d: str) -> List[Tuple[str, str, List[str]]]:
    """(key, what, arguments) for every field: a wrong type, each out-of-range value (on the
    command line, and in a YAML file) and, where the rule says so, a value given but ignored."""
    out = []
    for key, _, annotation, rule, default in schema(Config()):
        if _kind(annotation) is str:  # the command line's text is a string: a file's 123 is not
            section, _, name = key.rpartition(".")
            path = os.path.join(d, f"{key}.type.yaml")
            with open(path, "w") as f:
                yaml.safe_dump({section: {name: 123}} if section else {name: 123}, f)
            out.append((key, "wrong type", ["--config", path]))
            path = os.path.join(d, f"{key}.yes.yaml")  # YAML 1.1 reads an unquoted yes as true
            with open(path, "w") as f:
                f.write(f"{section}:\n  {name}: yes\n" if section else f"{name}: yes\n")
            out.append((key, "wrong type yes", ["--config", path]))
        else:
            out.append((key, "wrong type", ["--set", f"{key}={wrong_type(annotation)}"]))
        context = read_when(rule, key)
        for i, value in enumerate(_yaml(v) for v in out_of_range(annotation, rule, d)):
            out.append((key, f"out of range {value!r}", [*context, "--set", f"{key}={value}"]))
            section, _, name = key.rpartition(".")
            body = {name: yaml.safe_load(value) if value else value}
            path = os.path.join(d, f"{key}.{i}.yaml")
            with open(path, "w") as f:
                yaml.safe_dump({section: body} if section else body, f)
            out.append((key, f"out of range {value!r} in YAML", [*context, "--config", path]))
        for other, args in given_but_ignored(key, annotation, rule, default):
            out.append((key, f"given but ignored by {other}", args))
    return out


class EveryFieldRefusesWrongTypesAndRanges(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.d = cls.tmp.name
        with open(os.path.join(cls.d, "a_file"), "w") as f:
            f.write("not a directory")
        cls.cases = cases(cls.d)
        runs = ["--logging.run_dir", os.path.join(cls.d, "runs")]
        cls.results = {
            (key, what): run_in_process(C00, [*runs, *args] if key != runs[0][2:] else args)
            for key, what, args in cls.cases
        }

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_every_field_has_a_rule_and_cases(self):
        keys = [key for key, *_ in schema(Config())]
        fields = sum(
            len(typing.get_type_hints(type(getattr(Config(), s))))
            for s in ("model", "data", "parallel", "training", "checkpoint", "logging")) + 1
        self.assertEqual(len(keys), fields)  # every field of every section, and check
        self.assertEqual({key for key, *_ in self.cases}, set(keys))
        self.assertGreater(len(self.cases), 3 * len(keys))

    def test_each_case_is_one_line_naming_the_key_exit_2(self):
        for key, what, args in self.cases:
            with self.subTest(key=key, what=what, args=args):
                code, out = self.results[key, what]
                self.assertEqual(code, 2, out[-2000:])
                self.assertNotIn("Traceback", out)
                self.assertEqual(len(out.strip().splitlines()), 1, out[-2000:])
                self.assertTrue(out.startswith("error: "), out)
                names = [key, *FLAGS.get(key, []), *[f for f, k in ALIASES.items() if k == key]]
                self.assertTrue(any(name in out for name in names), out)
                # a string field given a number or yes: the line says to quote it (the
                # recompute mode alone reads true as 'full', its flag given without a value)
                if what.startswith("wrong type") and "--config" in args and not (
                        key == "parallel.activation_checkpointing" and what.endswith("yes")):
                    self.assertIn("put the text in quotes", out)

    def test_the_issue_cases_say_what_is_allowed(self):
        by_args = {" ".join(args): self.results[key, what] for key, what, args in self.cases}
        self.assertEqual(by_args["--set training.lr=.inf"],
                         (2, "error: training.lr must be >= 0 and finite, got inf\n"))
        self.assertEqual(by_args["--set training.beta1=1"],
                         (2, "error: training.beta1 must be in [0, 1) and finite, got 1.0\n"))
        code, out = run_in_process(C00, ["--training.beta1", "1.5"])
        self.assertEqual((code, out),
                         (2, "error: training.beta1 must be in [0, 1) and finite, got 1.5\n"))
        code, out = run_in_process(C00, ["--data.path", "README.md"])
        self.assertEqual(code, 2)
        self.assertIn("data.path 'README.md' is given, but data.dataset 'synthetic' ignores it",
                      out)

    def test_each_given_but_ignored_value_names_the_setting_that_ignores_it(self):
        ignored = [(key, what, args) for key, what, args in self.cases if "ignored" in what]
        # the fields that only some layouts read, each declared beside its field (unless)
        self.assertEqual({key for key, *_ in ignored}, IGNORED_UNLESS)
        for key, what, args in ignored:
            other = what.rsplit(" ", 1)[1]
            with self.subTest(key=key, args=args):
                code, out = self.results[key, what]
                self.assertEqual(code, 2, out)
                self.assertRegex(
                    out, rf"^error: {key} .* is given, but {other} .* ignores it: "
                    rf"remove {key}, or set {other} to a value that reads it\n$")

    def test_a_sample_is_refused_by_the_launcher_before_torchrun(self):
        # the in-process cases above are launch.sh's pre-flight; one goes through launch.sh.
        # The launcher adds nothing per key: it runs that same pre-flight, passes its status
        # and line through and never starts torchrun, for any refusal (doc/bad_inputs.md's
        # launched rows, tests/test_bad_inputs.py, show it for other mistakes)
        sample = {"parallel.schedule"}
        for key, what, args in self.cases:
            if key in sample and "ignored" in what:
                with self.subTest(key=key, args=args):
                    # OMP_NUM_THREADS as launch.sh sets it without a GPU: it then starts no
                    # Python to ask torch for one (the pre-flight is the one it starts)
                    proc = subprocess.run(["bash", "scripts/launch.sh", C00, "--", *args], cwd=ROOT,
                                          capture_output=True, text=True, timeout=120, env={
                                              **os.environ, "OMP_NUM_THREADS": "1"
                                          })
                    self.assertEqual(proc.returncode, 2, proc.stderr)
                    self.assertEqual(proc.stderr, self.results[key, what][1])
                    self.assertNotIn("torchrun", proc.stdout)  # it never started

    def test_chapter_00_refuses_every_strategy_option_it_never_reads(self):
        # load_config(..., unread={"parallel.": ...}): one device, no strategy
        keys = [(k, a, r, d) for k, _, a, r, d in schema(Config()) if k.startswith("parallel.")]
        self.assertGreater(len(keys), 15)
        for key, annotation, rule, default in keys:
            value = given_value(annotation, rule, default)
            with self.subTest(key=key, value=value):
                code, out = run_in_process(C00, [f"--{key}", value])
                self.assertEqual(code, 2, out)
                self.assertEqual(len(out.splitlines()), 1, out)
                self.assertRegex(out, rf"^error: {key} .* is given, but ")
        code, out = run_in_process(C00, ["--zero-stage", "1"])
        self.assertEqual(
            out, "error: parallel.zero_stage 1 is given, but this script does not "
            "read parallel: one device, no strategy (chapters 01 on); remove "
            "parallel.zero_stage\n")

    def test_only_what_the_user_gave_counts(self):
        # chapter 04b's own file sets schedule zb-h1 at pp 2: a --pp 1 given on the command
        # line leaves it unread, and the script's file is not the user's mistake
        own = "examples/configs/04b_zero_bubble.yaml"
        self.assertEqual(parse_args(["--pp", "1"], own).parallel.schedule, "zb-h1")
        # the same file given by the user with --config: its schedule is given, and ignored
        mine = os.path.join(self.d, "mine.yaml")
        shutil.copy(os.path.join(ROOT, own), mine)
        with self.assertRaisesRegex(
                InputError, rf"^{mine}: parallel.schedule 'zb-h1' is given, "
                r"but parallel.pipeline_model_parallel_size 1 ignores it"):
            parse_args(["--config", mine, "--pp", "1"], own)
        # a setting given on the command line makes the file's value read: checked once, at
        # the end, not the file against itself
        with open(mine, "w") as f:
            yaml.safe_dump({"parallel": {"schedule": "afab"}}, f)
        self.assertEqual(parse_args(["--config", mine, "--pp", "2"]).parallel.schedule, "afab")
        code, out = run_in_process(C00, ["--config", mine])
        self.assertEqual(code, 2)
        self.assertTrue(out.startswith(f"error: {mine}: parallel.schedule 'afab' is given"), out)

    def test_valid_values_and_a_saved_config_still_load(self):
        code, out = run_in_process(C00, [
            "--logging.run_dir",
            os.path.join(self.d, "runs"), "--training.beta1", "0", "--model.num_layers", "3",
            "--training.weight_decay", "0"
        ])
        self.assertEqual((code, out), (0, ""))
        self.assertFalse(os.path.exists(os.path.join(self.d, "runs")))


def wrong_json_type(annotation: Any) -> Any:
    """A JSON value that is not of the field's type as it stands: a number as a string, a
    boolean as a string, null where no default stands in, a string where a list belongs."""
    kind = _kind(annotation)
    if typing.get_origin(kind) is list:
        return "LlamaForCausalLM"
    return {bool: "true", int: "2048", float: None, str: 1}[kind]


class EveryHuggingFaceFieldIsChecked(unittest.TestCase):
    """config.json: for every field we read (``HFLlamaFields``), a wrong JSON type, each
    out-of-range value, and a missing required field raise InputError naming the file and the
    field. The file is 4.x style (a top-level rope_theta); 5.x's rope_parameters is one more."""

    def setUp(self):
        # a directory made elsewhere (transformers' save_pretrained, or with our checksums
        # removed), as --trust-unchecked names it
        trust = boundary.trusting([tempfile.gettempdir()])
        trust.__enter__()
        self.addCleanup(trust.__exit__, None, None, None)

    def _refused(self, d: str, changes: dict, drop: str = "") -> str:
        hf = config_to_hf(LlamaConfig(), torch.float32)
        hf.pop("rope_parameters")
        hf.update(changes)
        hf.pop(drop, None)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(hf, f)  # inf and nan as JSON's Infinity and NaN, as Python writes them
        with self.assertRaises(InputError) as ctx:
            load_hf_config(d)
        return str(ctx.exception)

    def test_each_field_refuses_a_wrong_type_and_out_of_range_values(self):
        checked = 0
        with tempfile.TemporaryDirectory() as d:
            for name, annotation, rule, default in rules_of(HFLlamaFields):
                values = [wrong_json_type(annotation), *out_of_range(annotation, rule, d)]
                for value in values:
                    with self.subTest(field=name, value=value):
                        message = self._refused(d, {name: value})
                        self.assertTrue(message.startswith(os.path.join(d, "config.json")))
                        self.assertIn(name, message)
                        checked += 1
                if default is None and typing.get_origin(annotation) is not typing.Union:
                    with self.subTest(field=name, value="missing"):
                        self.assertIn(name, self._refused(d, {}, drop=name))
                        checked += 1
            self.assertIn(
                "rope_theta must be positive and finite, got -1",
                self._refused(d, {"rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": -1
                }}, drop="rope_theta"))
        self.assertGreater(checked, 2 * len(list(rules_of(HFLlamaFields))))

    def test_the_issue_cases_name_the_file_field_and_value(self):
        with tempfile.TemporaryDirectory() as d:
            file = os.path.join(d, "config.json")
            self.assertEqual(self._refused(d, {"max_position_embeddings": "2048"}),
                             f"{file}: max_position_embeddings must be int, got '2048'")
            self.assertEqual(self._refused(d, {"rms_norm_eps": None}),
                             f"{file}: rms_norm_eps must be positive and finite, got null")
            self.assertEqual(self._refused(d, {"tie_word_embeddings": "false"}),
                             f"{file}: tie_word_embeddings must be true or false, got 'false'")


if __name__ == "__main__":
    unittest.main()
