"""Config: YAML < command line precedence, type conversion, and a ValueError for every bad value."""

import os
import tempfile
import unittest

import yaml

from scaletorch.config import Config, VisionRunConfig
from scaletorch.trainer.config import parse_args, save_config, validate

CONFIG_00 = "examples/configs/00_single_device.yaml"


class ConfigLoadsAndOverrides(unittest.TestCase):

    def test_yaml_values_then_command_line_overrides_win(self):
        cfg = parse_args([
            "--config", CONFIG_00, "--training.lr", "1e-3", "--steps", "7", "--set",
            "data.seq_len=16", "--model.num_layers=3"
        ])
        self.assertEqual(cfg.model.hidden_size, 64)  # from the YAML
        self.assertEqual(cfg.training.lr, 1e-3)
        self.assertEqual(cfg.training.steps, 7)
        self.assertEqual(cfg.data.seq_len, 16)
        self.assertEqual(cfg.model.num_layers, 3)

    def test_aliases_and_flags_set_parallel_fields(self):
        cfg = parse_args([
            "--tp", "2", "--pp", "2", "--sequence-parallel", "--check", "--impl", "torch",
            "--zero-stage", "3", "--resume"
        ])
        p = cfg.parallel
        self.assertEqual((p.tensor_model_parallel_size, p.pipeline_model_parallel_size), (2, 2))
        self.assertTrue(p.sequence_parallel)
        self.assertTrue(cfg.check)
        self.assertEqual((p.impl, p.zero_stage), ("torch", 3))
        self.assertEqual(cfg.checkpoint.resume, "latest")

    def test_saved_config_loads_back_equal(self):
        cfg = parse_args(["--config", CONFIG_00, "--steps", "3"])
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "config.yaml")
            save_config(cfg, path)
            again = parse_args(["--config", path])
        self.assertEqual(again, cfg)

    def test_every_example_config_is_valid_and_loads_its_own_values(self):
        names = sorted(n for n in os.listdir("examples/configs") if n.endswith(".yaml"))
        # one per numbered script built on load_config (every one), none without one
        scripts = []
        for n in sorted(os.listdir("examples")):
            if n.endswith(".py"):
                with open(os.path.join("examples", n)) as f:
                    scripts += [n[:-3] + ".yaml"] if "load_config(" in f.read() else []
        self.assertEqual(names, scripts)
        self.assertGreaterEqual(len(names), 11)  # 00-08 (with 04b) and 10 at least
        for name in names:
            path = os.path.join("examples/configs", name)
            with self.subTest(config=name):
                # chapter 12's config adds its own section, vision, to the shared ones
                kind = VisionRunConfig if name.startswith("12_") else Config
                cfg = parse_args(["--config", path], config_class=kind)
                with open(path) as f:
                    sections = yaml.safe_load(f)
                checked = 0
                for section, values in sections.items():
                    for key, value in values.items():
                        if f"{section}.{key}" == "parallel.activation_checkpointing" and \
                                isinstance(value, bool):  # older configs' true / false
                            value = {True: "full", False: "none"}[value]
                        self.assertEqual(getattr(getattr(cfg, section), key), value,
                                         f"{section}.{key}")
                        checked += 1
                self.assertGreater(checked, 10)  # every file sets model, data and training


class BadConfigsRaiseErrorsNamingTheValues(unittest.TestCase):
    """The invalid-configuration table: each row is (command line, world size, error, text)."""

    CASES = [
        # unknown keys and wrong types
        (["--training.lrr", "1"], None, ValueError, "training.lrr"),
        (["--optimizer.lr", "1"], None, ValueError, "optimizer.lr"),
        (["--training.steps", "ten"], None, ValueError, "'ten'"),
        (["--training.steps", "2.5"], None, ValueError, "2.5"),
        (["--logging.progress", "maybe"], None, ValueError, "'maybe'"),
        (["--set", "training.lr"], None, ValueError, "KEY=VALUE"),
        (["--data.seq_len"], None, ValueError, "needs a value"),
        (["stray"], None, ValueError, "'stray'"),
        # negative or zero sizes
        (["--steps", "0"], None, ValueError, "training.steps must be positive, got 0"),
        (["--tp", "-2"], None, ValueError, "tensor_model_parallel_size must be positive, got -2"),
        (["--training.lr",
          "-1"], None, ValueError, "training.lr must be >= 0 and finite, got -1.0"),
        (["--fail-rank", "-1"], None, ValueError, "fail_rank must be >= 0, got -1"),
        # choices
        (["--zero-stage",
          "4"], None, ValueError, "parallel.zero_stage must be one of 0, 1, 2, 3, got 4"),
        (["--schedule", "zigzag"], None, ValueError, "'zigzag'"),
        (["--impl", "fast"], None, ValueError, "'fast'"),
        # model and data
        (["--model.num_attention_heads", "3"], None, ValueError, "3"),
        (["--data.seq_len",
          "128"], None, ValueError, "data.seq_len (128) exceeds model.max_seq_len (64)"),
        (["--data.dataset", "text"], None, ValueError, "needs data.path"),
        (["--data.dataset", "bin", "--data.path",
          "missing.bin"], None, FileNotFoundError, "'missing.bin'"),
        # layouts that do not fit the world
        (["--tp",
          "4"], 6, ValueError, "world size 6 is not divisible by tensor_model_parallel_size (4) x "
         "pipeline_model_parallel_size (1) x context_parallel_size (1)"),
        (["--tp", "2", "--pp", "2", "--cp", "2"], 4, ValueError, "world size 4 is not divisible"),
        (["--dp", "3"], 4, ValueError, "data_parallel_size (3)"),
        (["--data.global_batch_size", "8", "--micro-batches",
          "3"], 2, ValueError, "global_batch_size (8) is not divisible by data_parallel_size (2) x "
         "data.num_micro_batches (3)"),
        (["--fail-at-step", "2", "--fail-rank",
          "4"], 4, ValueError, "fail_rank (4) is not a rank of a world of 4"),
        # pipeline schedule limits
        (["--pp", "4", "--micro-batches", "2"], 4, ValueError,
         "1F1B needs num_micro_batches (2) >= pipeline_model_parallel_size (4)"),
        ([
            "--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2", "--micro-batches",
            "3", "--data.global_batch_size", "12"
        ], 2, ValueError, "num_micro_batches (3) divisible by pipeline_model_parallel_size (2)"),
        (["--virtual-stages", "2", "--schedule", "interleaved"], 2, ValueError,
         "is given, but parallel.pipeline_model_parallel_size 1 ignores it"),
        # a synthetic chain over GPT-2's vocabulary would need 37.6 GiB: refused before any work
        (["--model.vocab_size", "50257"], 1, ValueError, "synthetic dataset over vocab_size 50257"),
    ]

    def test_each_bad_configuration_raises_with_the_value(self):
        self.assertGreaterEqual(len(self.CASES), 15)
        for argv, world_size, error, fragment in self.CASES:
            with self.subTest(argv=argv, world_size=world_size):
                with self.assertRaises(error) as ctx:
                    validate(parse_args(argv), world_size=world_size)
                self.assertIn(fragment, str(ctx.exception))

    def test_unknown_yaml_key_and_missing_file(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "bad.yaml")
            with open(path, "w") as f:
                f.write("training:\n  stepz: 3\n")
            with self.assertRaisesRegex(ValueError, "training.stepz"):
                parse_args(["--config", path])
            with open(path, "w") as f:
                f.write("data: 3\n")
            with self.assertRaisesRegex(ValueError, "section 'data' must be a mapping"):
                parse_args(["--config", path])
        with self.assertRaisesRegex(FileNotFoundError, "nope.yaml"):
            parse_args(["--config", "nope.yaml"])


if __name__ == "__main__":
    unittest.main()
