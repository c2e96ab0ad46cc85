"""Every refusal is raised by the one layout check, before anything is built, in the user's
terms (the settings and what to change), and reaches the user once, without a traceback."""

import unittest

from scaletorch.dist import destroy_pg_manager, init_pg_manager
from scaletorch.dist.layout_check import (check_fp32_without_hooks, check_recompute_without_hook,
                                          check_tied_without_hooks)
from scaletorch.models import build_model
from scaletorch.parallel.parallelize import parallelize
from scaletorch.parallel.tensor_layout import TensorLayout
from scaletorch.trainer import parse_args, validate_layout
from scaletorch.trainer.param_map import DTensorParamMap
from tests.harness import run_forked, under_torchrun
from tests.layouts import layout, make_config
from tests.test_examples import launch_status

ND = "examples/07_nd_parallel.py"


def _error(cfg, world_size: int) -> str:
    try:
        validate_layout(cfg, world_size)
    except ValueError as err:
        return str(err)
    raise AssertionError(f"no error for world size {world_size}")


class RefusalsNameTheSettings(unittest.TestCase):
    """Computed from the config's sizes: no process group, no model."""

    def test_what_later_chapters_attach_to_parallelize_is_refused_without_their_hooks(self):
        # chapter 07's script runs these checks before any process starts (its limits)
        cases = [  # (a check, parallel config, tied, the start of its message)
            (check_recompute_without_hook, dict(activation_checkpointing="selective"), False,
             "parallel.activation_checkpointing 'selective' needs chapter 10's hook"),
            (check_tied_without_hooks, dict(pp=2), True, "model.tie_word_embeddings true with "
             "pipeline_model_parallel_size 2 and zero_stage 0 needs chapter 10's hooks"),
            (check_tied_without_hooks, dict(zero_stage=3), True, "model.tie_word_embeddings true "
             "with pipeline_model_parallel_size 1 and zero_stage 3 needs chapter 10's hooks"),
            (check_fp32_without_hooks, dict(reduce_dtype="bf16"), False,
             "training.precision auto, parallel.param_dtype auto, parallel.reduce_dtype bf16 "
             "need chapter 08's hooks"),
        ]
        for check, parallel, tied, message in cases:
            cfg = make_config(False, 2, **layout(**parallel))
            cfg.model.tie_word_embeddings = tied
            with self.assertRaises(ValueError, msg=message) as raised:
                check(cfg)
            self.assertTrue(str(raised.exception).startswith(message), str(raised.exception))
        plain = make_config(False, 2, **layout(pp=2, zero_stage=1))
        for check in (check_fp32_without_hooks, check_recompute_without_hook,
                      check_tied_without_hooks):
            check(plain)  # untied, fp32, no recomputation: nothing to attach
        plain.model.tie_word_embeddings, plain.parallel.impl = True, "torch"
        check_tied_without_hooks(plain)  # PyTorch's own keep the tie themselves

    def test_a_dtensor_param_map_of_our_layout_is_refused_naming_the_other_map(self):
        with self.assertRaisesRegex(
                ValueError, "whose dtensor_model is set; this one has none: "
                "use ParamMap"):
            DTensorParamMap(TensorLayout(None, {}, []))  # type: ignore[arg-type]

    def test_tied_embeddings_run_with_zero_our_pipeline_and_a_v_without_a_wrapper(self):
        cfg = make_config(False, 2, **layout(pp=2, zero_stage=2))
        cfg.model.tie_word_embeddings = True
        validate_layout(cfg, 4)  # ZeRO shards it once; the pipeline keeps two synced copies
        cfg.parallel.schedule, cfg.parallel.virtual_pipeline_stages = "zbv", 2
        cfg.data.num_micro_batches = 4
        message = _error(cfg, 4)  # a V's two chunks share the weight: one wrapper each refuses
        self.assertIn(
            "model.tie_word_embeddings true with parallel.schedule 'zbv' "
            "(pipeline_model_parallel_size 2), dp 2, zero_stage 2, num_experts 0", message)
        self.assertIn("or model.tie_word_embeddings false", message)
        cfg.parallel.zero_stage = 0
        self.assertIn("dp 2, zero_stage 0", _error(cfg, 4))
        cfg.parallel.schedule = "dualpipev"
        validate_layout(cfg, 2)  # pp 2 alone: rank 0's chunks hold the one parameter
        cfg.parallel.tensor_model_parallel_size = 2
        validate_layout(cfg, 4)
        cfg.parallel.tensor_model_parallel_size = 1
        cfg.parallel.schedule, cfg.parallel.virtual_pipeline_stages = "1f1b", 1
        cfg.parallel.impl, cfg.parallel.zero_stage, cfg.data.num_micro_batches = "torch", 0, 2
        message = _error(cfg, 4)
        self.assertIn(
            "model.tie_word_embeddings true with parallel.impl 'torch' and "
            "pipeline_model_parallel_size 2", message)
        self.assertIn("stages do not share parameters across ranks", message)
        self.assertIn("use impl 'ours'", message)
        cfg.parallel.pipeline_model_parallel_size = 1  # FSDP2 / DTensor tie without a pipeline
        validate_layout(cfg, 4)

    def test_an_unpadded_vocabulary_under_dtensor_tp_is_refused_ours_pads_it(self):
        cfg = make_config(False, 1, **layout(tp=2, impl="torch"))
        cfg.model.vocab_size = 63
        message = _error(cfg, 2)
        self.assertIn("vocab_size 63 is not divisible by tensor_model_parallel_size 2", message)
        cfg.parallel.impl = "ours"  # pads the embedding and the head to 128 x tp rows
        validate_layout(cfg, 2)

    def test_ulysses_under_tp_counts_heads_from_the_configured_numbers(self):
        cfg = make_config(False, 1, **layout(tp=2, cp=8, cp_variant="ulysses"))
        cfg.model.num_attention_heads, cfg.model.num_key_value_heads = 8, 4
        cfg.model.hidden_size, cfg.data.seq_len = 64, 32
        message = _error(cfg, 16)
        self.assertIn(
            "model.num_attention_heads 8 / tensor_model_parallel_size 2 = 4 heads per "
            "tp rank, not divisible by context_parallel_size 8 for Ulysses", message)
        self.assertIn("--cp-variant ring", message)
        cfg.parallel.context_parallel_size = 2  # 4 and 2 heads per tp rank: both split over 2
        validate_layout(cfg, 4)

    def test_layer_split_is_a_config_key_and_its_errors_name_it(self):
        cfg = make_config(False, 4, **layout(pp=4))
        cfg.model.num_layers = 6
        self.assertIn("set parallel.layer_split, e.g. --layer-split 2,2,1,1", _error(cfg, 4))
        cfg.parallel.layer_split = [1, 2, 2, 1]
        validate_layout(cfg, 4)
        cfg.parallel.layer_split = [1, 4]
        self.assertRegex(
            _error(cfg, 4), r"parallel.layer_split \[1, 4\] must have one entry per "
            r"pipeline stage \(4 = .*summing to model.num_layers \(6\)")
        cfg.parallel.pipeline_model_parallel_size = 1
        self.assertIn("parallel.layer_split [1, 4] needs a pipeline", _error(cfg, 1))

    def test_layer_split_from_the_command_line_and_yaml_forms(self):
        for argv in (["--layer-split", "1,3"], ["--parallel.layer_split",
                                                "[1,3]"], ["--set", "parallel.layer_split=[1, 3]"]):
            with self.subTest(argv=argv):
                self.assertEqual(parse_args(argv + ["--pp", "2"]).parallel.layer_split, [1, 3])
        with self.assertRaisesRegex(ValueError, "parallel.layer_split must be int, got '1.5'"):
            parse_args(["--layer-split", "1.5,2"])

    def test_parallelize_refuses_before_any_surgery(self):
        cfg = make_config(False, 2, **layout(zero_stage=1, impl="naive"))
        model = build_model(cfg.model, seed=0)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        pgm = init_pg_manager()  # one process
        try:
            with self.assertRaisesRegex(ValueError, "impl 'naive' is plain data parallel"):
                parallelize(model, cfg, pgm, next(model.parameters()).device)
        finally:
            destroy_pg_manager()
        self.assertEqual(type(model.lm_head).__name__, "Linear")  # no wrapper, no shard
        self.assertEqual(set(model.state_dict()), set(before))


class BadLayoutsReachTheUserOnce(unittest.TestCase):
    """Through scripts/launch.sh, as a user runs them."""

    def _assert_once(self, output: str, code: int, message: str) -> None:
        self.assertEqual(code, 2, output[-2000:])
        self.assertEqual(output.count(message), 1, output[-2000:])
        self.assertEqual(output.count("error: "), 1, output[-2000:])
        self.assertNotIn("Traceback", output)

    def test_the_launcher_checks_before_any_process_starts(self):
        out, code, _ = launch_status(ND, 3, "--pp", "2", timeout=120)
        self._assert_once(
            out, code, "error: world size 3 is not divisible by "
            "tensor_model_parallel_size (1) x pipeline_model_parallel_size (2)")
        self.assertNotIn("torchrun.py", out)  # no rank was started
        # the same road (launch.sh passes on the pre-flight's line and status) for another
        # layout: its pre-flight command alone, in a process of its own
        done = run_forked(ND, "--validate-only", "--world-size", "3", "--tp", "3")
        self._assert_once(
            done.stdout + done.stderr, done.returncode,
            "model.num_attention_heads (8) is not divisible by tensor_model_parallel_size (3)")
        self.assertEqual(done.stdout, "")

    @under_torchrun  # two new Pythons that torchrun starts and ends: --torchrun's phase
    def test_without_the_pre_flight_rank_0_says_it_once_and_every_rank_exits_2(self):
        out, code, _ = launch_status(ND, 2, "--pp", "2", "--impl", "torch",
                                     "--model.tie_word_embeddings", "true",
                                     env={"SCALETORCH_PREFLIGHT": "0"}, timeout=120)
        self.assertIn("torchrun.py", out)  # the ranks started and refused
        self._assert_once(out, code, "model.tie_word_embeddings true with parallel.impl 'torch'")
        # torchrun ended rank 1 (waiting, so that rank 0 says it) and added nothing: its notes
        # of a rank's status 2 and of the ranks it stopped would repeat the line. The same road
        # for every refusal of status 2 (a bad data file in tests/test_bad_inputs.py, a full
        # disk in tests/test_stops.py, whose ranks are forked)
        for note in ("SIGTERM", "exitcode"):
            self.assertNotIn(note, out)

    def test_validate_only_accepts_a_valid_layout_silently(self):
        # a process of its own, as launch.sh's pre-flight (forked from the suite's forkserver)
        proc = run_forked(ND, "--validate-only", "--world-size", "8", "--tp", "2", "--pp", "2")
        self.assertEqual((proc.returncode, proc.stdout, proc.stderr), (0, "", ""))


if __name__ == "__main__":
    unittest.main()
