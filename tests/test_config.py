"""Config: YAML < command line precedence, type conversion, and a ValueError for every bad value."""

import os
import tempfile
import unittest

from scaletorch.trainer.config import Config, parse_args, save_config, validate

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

    def test_every_example_config_is_valid(self):
        for name in sorted(os.listdir("examples/configs")):
            with self.subTest(config=name):
                parse_args(["--config", os.path.join("examples/configs", name)])


class BadConfigsRaiseValueErrorsNamingTheValues(unittest.TestCase):

    CASES = [
        (["--training.lrr", "1"], "training.lrr"),
        (["--optimizer.lr", "1"], "optimizer.lr"),
        (["--training.steps", "ten"], "'ten'"),
        (["--training.steps", "2.5"], "2.5"),
        (["--steps", "0"], "training.steps must be positive, got 0"),
        (["--tp", "-2"], "tensor_model_parallel_size must be positive, got -2"),
        (["--zero-stage", "4"], "zero_stage must be 0, 1, 2 or 3, got 4"),
        (["--schedule", "zigzag"], "'zigzag'"),
        (["--impl", "fast"], "'fast'"),
        (["--data.dataset", "text"], "needs data.path"),
        (["--data.seq_len", "128"], "data.seq_len (128) exceeds model.max_seq_len (64)"),
        (["--model.num_attention_heads", "3"], "3"),
        (["--training.lr", "-1"], "training.lr must be >= 0, got -1"),
        (["--set", "training.lr"], "KEY=VALUE"),
        (["--data.seq_len"], "needs a value"),
        (["stray"], "'stray'"),
    ]

    def test_each_bad_command_line_raises_with_the_value(self):
        for argv, fragment in self.CASES:
            with self.subTest(argv=argv):
                with self.assertRaises(ValueError) as ctx:
                    parse_args(argv)
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

    def test_layouts_that_do_not_fit_the_world(self):
        cfg = Config()
        cfg.parallel.tensor_model_parallel_size = 4
        with self.assertRaisesRegex(
                ValueError, r"world size 6 is not divisible by "
                r"tensor_model_parallel_size \(4\)"):
            validate(cfg, world_size=6)
        cfg = Config()
        cfg.parallel.data_parallel_size = 3
        with self.assertRaisesRegex(ValueError, r"data_parallel_size \(3\).*world size \(4\)"):
            validate(cfg, world_size=4)
        cfg = Config()
        cfg.data.global_batch_size, cfg.data.num_micro_batches = 8, 3
        with self.assertRaisesRegex(
                ValueError, r"global_batch_size \(8\) is not divisible by "
                r"data_parallel_size \(2\) x data.num_micro_batches \(3\)"):
            validate(cfg, world_size=2)


if __name__ == "__main__":
    unittest.main()
