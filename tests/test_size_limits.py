"""A size the pre-flight would walk one unit at a time is refused in one line, at once.

The pre-flight (schema, layout check, memory check) reads counts: a layer count is capped
(``MAX_LAYERS``), the placement is ranges per stage (``stage_ranges``), and a zero-bubble
schedule's peak is counted on at most 4p + 1 micro-batches (``steady_micro_batches``). So a
huge value of any size field ends in one ``error:`` line naming it, well within a second,
and before anything is built or allocated.

The suite runs at most 20 examples a test; SCALETORCH_LONG_TESTS=1 runs 200.
"""

import json
import os
import tempfile
import time
import unittest
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

import scaletorch.models
from scaletorch.plan.pipeline import held_peak
from scaletorch.schedule.catalog import schedule_actions
from scaletorch.schedule.orders import peak_live_activations
from tests.test_bad_inputs import run_in_process
from tests.test_run_dirs import C00

EXAMPLES = 200 if os.environ.get("SCALETORCH_LONG_TESTS") == "1" else 20
BOUND = 2.0  # seconds for a refusal; the checks themselves take ~0.1 s on a loaded 2-core host
PP2 = "examples/04_pipeline_parallel.py"
ZB = "examples/04b_zero_bubble.py"
EP = "examples/06_expert_parallel.py"
# (script, world size, size field): each field a pre-flight check reads, under the script
# that reads it. The later world size wins
# over run_in_process's own --world-size 1.
FIELDS = [
    (C00, 1, "model.num_layers"),
    (C00, 1, "model.hidden_size"),
    (C00, 1, "model.intermediate_size"),
    (C00, 1, "model.vocab_size"),
    (C00, 1, "model.num_attention_heads"),
    (C00, 1, "model.num_key_value_heads"),
    (C00, 1, "data.global_batch_size"),
    (C00, 1, "data.seq_len"),
    (PP2, 2, "model.num_layers"),
    (PP2, 2, "parallel.virtual_pipeline_stages"),
    (PP2, 2, "data.num_micro_batches"),
    (ZB, 2, "data.num_micro_batches"),
    (EP, 2, "model.num_experts"),
    (EP, 2, "model.moe_intermediate_size"),
]


class AHugeSizeIsRefusedInOneLineAtOnce(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        for script in (C00, PP2, ZB, EP):  # imports once, outside the timed calls
            run_in_process(script, ["--world-size", "2", "--logging.run_dir", "/nonexistent/x"])

    @settings(max_examples=EXAMPLES, deadline=None)
    @given(st.sampled_from(FIELDS), st.integers(10**7, 10**18))  # far past any machine
    def test_each_size_field(self, field, value):
        script, world, key = field
        built = mock.Mock(side_effect=AssertionError("the model was built"))
        args = [
            "--world-size",
            str(world), "--logging.run_dir", "/nonexistent/x", f"--{key}",
            str(value)
        ]
        if key == "data.num_micro_batches" or key == "data.global_batch_size":
            args += ["--data.global_batch_size", str(value)]  # m divides the batch
        start = time.monotonic()
        with mock.patch.object(scaletorch.models, "build_model", built):
            code, out = run_in_process(script, args)
        seconds = time.monotonic() - start
        self.assertEqual(code, 2, out)
        self.assertLess(seconds, BOUND, f"{key}={value} took {seconds:.1f} s")
        self.assertEqual(out.count("\n"), 1, out)
        self.assertTrue(out.startswith("error: "), out)
        # the line names the field, or is the memory check's (which names both sizes)
        self.assertTrue(key.split(".")[-1] in out or "the run needs" in out, out)
        built.assert_not_called()


REAL = "examples/10_real_model.py"
HF_FIELDS = [
    "num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size", "num_attention_heads",
    "num_key_value_heads"
]


class AHugeSizeInAHuggingFaceConfigIsRefusedInOneLineAtOnce(unittest.TestCase):
    """--init-from DIR: config.json's sizes are checked (schema, layout, memory) before any
    tensor is read or any model built, and the expected names come from one block."""

    @classmethod
    def setUpClass(cls):
        from scaletorch.models import LlamaConfig, build_model
        from scaletorch.models.hf import export_hf_llama
        cls.tmp = tempfile.TemporaryDirectory()
        cls.dir = os.path.join(cls.tmp.name, "model")
        model = build_model(LlamaConfig(vocab_size=50, hidden_size=32, num_layers=2), seed=0)
        export_hf_llama(model, cls.dir)
        with open(os.path.join(cls.dir, "config.json")) as f:
            cls.config = json.load(f)
        for name in os.listdir(cls.dir):  # as the Hub gives it: --trust-unchecked reads it
            if name.endswith(".sha256"):
                os.remove(os.path.join(cls.dir, name))
        run_in_process(REAL, cls.args())  # imports once, outside the timed calls

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    @classmethod
    def args(cls):
        return [
            "--init-from", cls.dir, "--trust-unchecked", cls.dir, "--logging.run_dir",
            "/nonexistent/x"
        ]

    @settings(max_examples=EXAMPLES // 2, deadline=None)
    @given(st.sampled_from(HF_FIELDS), st.integers(10**3, 10**18))
    def test_each_size_field_of_config_json(self, key, value):
        with open(os.path.join(self.dir, "config.json"), "w") as f:
            json.dump({**self.config, key: value}, f)
        built = mock.Mock(side_effect=AssertionError("the model was built"))
        start = time.monotonic()
        with mock.patch.object(scaletorch.models, "build_model", built):
            code, out = run_in_process(REAL, self.args())
        seconds = time.monotonic() - start
        self.assertEqual(code, 2, out)
        self.assertLess(seconds, BOUND, f"{key}={value} took {seconds:.1f} s")
        self.assertEqual(out.count("\n"), 1, out)
        self.assertTrue(out.startswith("error: "), out)
        self.assertIn(self.dir, out)  # the line names the directory (or its config.json)
        built.assert_not_called()


class TheSteadyPeakIsTheWholeSchedulesPeak(unittest.TestCase):

    @settings(max_examples=EXAMPLES, deadline=None)
    @given(st.sampled_from([("zb-h1", 1), ("zbv", 2), ("dualpipev", 2)]), st.integers(2, 5),
           st.integers(1, 60), st.data())
    def test_held_peak_past_4p_equals_the_count_over_every_micro_batch(self, sv, pp, extra, data):
        schedule, v = sv
        m = 4 * pp + extra  # past the shortcut: held_peak lists 4p + m % 2 micro-batches
        rank = data.draw(st.integers(0, pp - 1))
        sizes = data.draw(st.none() | st.lists(st.floats(0.5, 4.0), min_size=v, max_size=v))
        whole = peak_live_activations(schedule_actions(schedule, pp, m, rank, v), sizes)
        got = held_peak(schedule, pp, m, v, rank, sizes)
        if sizes is None:  # counts: exact
            self.assertEqual(got, whole)
        else:  # float sizes summed in another order may differ in the last bit (19.02027049303164
            # against ...646 once): equal within 1e-12, far below one micro-batch's 0.5
            self.assertAlmostEqual(got, whole, delta=1e-12 * abs(whole))


if __name__ == "__main__":
    unittest.main()
