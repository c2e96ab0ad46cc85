"""--check compares like with like: one function decides the precision of the run and of its
reference, and the tolerance is that precision's."""

import re
import unittest
from unittest import mock

import torch

from scaletorch.trainer import Config
from scaletorch.trainer.precision import (BF16_UNIT_ROUNDOFF, TOLERANCES, autocast,
                                          parity_tolerance, precision_note, resolve_precision)
from tests.test_examples import launch


def _cfg(precision: str, check: bool) -> Config:
    cfg = Config()
    cfg.training.precision, cfg.check = precision, check
    return cfg


class PrecisionResolution(unittest.TestCase):
    """The device type is injected as a string: the CUDA rows need no GPU."""

    def test_auto_is_bf16_on_cuda_fp32_on_cpu_and_fp32_everywhere_under_check(self):
        table = [  # training.precision, --check, device type -> what the run computes in
            ("auto", False, "cuda", "bf16"),
            ("auto", False, "cpu", "fp32"),
            ("auto", True, "cuda", "fp32"),  # --check proves fp32 parity
            ("auto", True, "cpu", "fp32"),
            ("bf16", True, "cuda", "bf16"),  # asked for explicitly: checked in bf16
            ("bf16", True, "cpu", "bf16"),
            ("bf16", False, "cpu", "bf16"),
            ("fp32", False, "cuda", "fp32"),
            ("fp32", True, "cuda", "fp32"),
        ]
        # a GPU with native bf16 (an A100, an H100): asked, never assumed
        native = mock.patch.object(torch.cuda, "is_bf16_supported", lambda **kw: True)
        for precision, check, device_type, want in table:
            with self.subTest(precision=precision, check=check, device_type=device_type), native:
                cfg = _cfg(precision, check)
                self.assertEqual(resolve_precision(cfg, device_type), want)
                self.assertEqual(parity_tolerance(cfg, device_type), TOLERANCES[want])

    def test_auto_is_bf16_only_on_a_gpu_with_native_bf16(self):
        # V100 / T4 (compute capability 7.x) emulate bf16: auto computes in fp32 there; bf16
        # asked for by name stays the user's choice
        for native, want in ((True, "bf16"), (False, "fp32")):
            with self.subTest(native=native):
                self.assertEqual(resolve_precision(_cfg("auto", False), "cuda", native), want)
        self.assertEqual(resolve_precision(_cfg("bf16", False), "cuda", False), "bf16")
        self.assertEqual(resolve_precision(_cfg("auto", True), "cuda", True), "fp32")

    def test_the_gpu_is_asked_for_hardware_bf16_not_emulation(self):
        # without the argument, the GPU's answer decides; emulation does not count
        asked = []

        def is_bf16_supported(including_emulation=True):
            asked.append(including_emulation)
            return False

        with mock.patch.object(torch.cuda, "is_bf16_supported", is_bf16_supported):
            self.assertEqual(resolve_precision(_cfg("auto", False), "cuda"), "fp32")
        self.assertEqual(asked, [False])
        with mock.patch.object(torch.cuda, "is_bf16_supported", lambda **kw: True):
            self.assertEqual(resolve_precision(_cfg("auto", False), "cuda"), "bf16")
        # the CPU never asks CUDA
        with mock.patch.object(torch.cuda, "is_bf16_supported", side_effect=AssertionError):
            self.assertEqual(resolve_precision(_cfg("auto", False), "cpu"), "fp32")

    def test_a_torch_without_including_emulation_reads_the_compute_capability(self):

        def old_api():  # torch 2.x before the keyword: TypeError on it
            return True

        for capability, want in (((7, 0), "fp32"), ((8, 0), "bf16"), ((9, 0), "bf16")):
            with self.subTest(capability=capability), \
                    mock.patch.object(torch.cuda, "is_bf16_supported", old_api), \
                    mock.patch.object(torch.cuda, "get_device_capability", lambda: capability):
                self.assertEqual(resolve_precision(_cfg("auto", False), "cuda"), want)

    def test_bf16_tolerance_is_eight_unit_roundoffs_and_fp32_is_1e_5(self):
        self.assertEqual(BF16_UNIT_ROUNDOFF, 2.0**-8)
        self.assertEqual(TOLERANCES["bf16"], 2.0**-5)
        self.assertEqual(TOLERANCES["fp32"], 1e-5)

    def test_the_note_says_what_auto_became_under_check(self):
        note = precision_note(_cfg("auto", True), "cuda")
        self.assertIn("auto is fp32 under --check", note)
        self.assertIn("3.1e-02", precision_note(_cfg("bf16", True), "cpu"))

    def test_autocast_computes_in_the_resolved_dtype(self):
        a = torch.randn(4, 4)
        with autocast(_cfg("bf16", True), torch.device("cpu")):
            self.assertEqual((a @ a).dtype, torch.bfloat16)
        with autocast(_cfg("auto", True), torch.device("cpu")):
            self.assertEqual((a @ a).dtype, torch.float32)

    def test_unknown_precision_raises_naming_it(self):
        with self.assertRaisesRegex(ValueError, "training.precision .* got 'fp8'"):
            resolve_precision(_cfg("fp8", False), "cpu")


class Bf16CheckOnCpu(unittest.TestCase):

    def test_bf16_check_compares_with_a_bf16_reference_and_passes_within_printed_tolerance(self):
        # Chapter 01 at dp 2, 10 steps: measured 3e-4 (loss) and 7e-3 (weights) in bf16
        # against a bf16 reference, which fp32's 1e-5 would call FAIL.
        out = launch("examples/01_ddp.py", 2, "--steps", "10", "--check", "--training.precision",
                     "bf16")
        self.assertIn("precision: bf16 for the run and the reference", out)
        lines = re.findall(
            r"parity: max \|(?:loss|weight) - reference\| = (\S+) .*"
            r"\(tolerance 3\.1e-02, bf16\): OK", out)
        self.assertEqual(len(lines), 2, out[-2000:])
        for diff in lines:
            self.assertGreater(float(diff), TOLERANCES["fp32"])  # bf16 really ran
            self.assertLessEqual(float(diff), TOLERANCES["bf16"])


if __name__ == "__main__":
    unittest.main()
