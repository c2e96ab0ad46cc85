"""The files the plots read and write, at their edges (issue 51's promise: nothing lost, one
line for every mistake):

- a picture is written whole or not at all: a full disk, or a suffix matplotlib cannot write,
  is one ``error:`` line naming the file, and nothing is left at ``--out`` (no empty PNG);
- every script draws through ``plot_base.save_figure`` (a scan of scripts/ finds no other
  ``savefig`` call), so the rule holds for pictures added later;
- what stands where a file or a checkpoint directory belongs is named as what it is (a FIFO, a
  directory, an empty metrics file), never "does not exist" or "not a complete checkpoint".
"""

import errno
import os
import re
import shutil
import tempfile
import unittest
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from scaletorch.rules import safe_files
from scripts import plot
from tests.test_bad_inputs import run_in_process
from tests.test_file_kinds import damage
from tests.test_file_values import _run

LONG = os.environ.get("SCALETORCH_LONG_TESTS") == "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRICS = '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'
# plot.py commands that draw from small inputs: (argv before --out, needs the metrics file)
DRAWINGS = {
    "loss": lambda tmp: ["loss", os.path.join(tmp, "metrics.jsonl")],
    "schedules": lambda tmp: ["schedules", "--pp", "2", "--micro-batches", "4"],
    "timeline": lambda tmp: ["timeline", "--simulate", "1f1b", "--pp", "2", "--micro-batches", "2"],
}


class APictureIsWrittenWholeOrNotAtAll(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        with open(os.path.join(self.tmp, "metrics.jsonl"), "w") as f:
            f.write(METRICS)

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    @settings(max_examples=30 if LONG else 3, deadline=None, derandomize=not LONG)
    @given(command=st.sampled_from(sorted(DRAWINGS)), suffix=st.sampled_from(["png", "svg", "pdf"]),
           code=st.sampled_from([errno.ENOSPC, errno.EIO, errno.EDQUOT]))
    def test_a_failed_write_is_one_line_and_leaves_no_file(self, command, suffix, code):
        out = os.path.join(self.tmp, f"{command}-{code}.{suffix}")

        def full(f, data):  # the disk fills halfway through the picture
            f.write(data[:len(data) // 2])
            raise OSError(code, os.strerror(code))

        with mock.patch.object(safe_files, "write_all", full):
            status, err = _run(plot.main, [*DRAWINGS[command](self.tmp), "--out", out])
        self.assertEqual(status, 2, err)
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertIn(repr(out), err)
        self.assertIn(os.strerror(code), err)
        self.assertEqual(sorted(os.listdir(self.tmp)), ["metrics.jsonl"])  # no file, no temporary

    @settings(max_examples=20 if LONG else 2, deadline=None, derandomize=not LONG)
    @given(
        command=st.sampled_from(sorted(DRAWINGS)),
        suffix=st.text(alphabet="abcxyz", min_size=1, max_size=5).filter(
            lambda s: s not in ("ps", "eps", "pdf", "svg", "svgz", "raw", "rgba")))
    def test_a_suffix_matplotlib_cannot_write_is_one_line_naming_it(self, command, suffix):
        out = os.path.join(self.tmp, f"picture.{suffix}")
        status, err = _run(plot.main, [*DRAWINGS[command](self.tmp), "--out", out])
        self.assertEqual(status, 2, err)
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertIn(f"no {suffix!r} files", err)
        self.assertFalse(os.path.exists(out))

    def test_every_script_draws_through_save_figure(self):
        scripts = os.path.join(ROOT, "scripts")
        for name in sorted(os.listdir(scripts)):
            if name.endswith(".py") and name != "plot_base.py":
                with open(os.path.join(scripts, name)) as f:
                    self.assertIsNone(re.search(r"\.savefig\(", f.read()),
                                      f"scripts/{name} calls savefig: use save_figure")


class WhatStandsInAFilesPlaceIsNamed(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.mkdtemp()

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def make(self, kind: str) -> str:
        """An empty file at ``kind``'s name, replaced (test_file_kinds.damage) by a FIFO, a
        directory or a device (a symlink to /dev/zero) unless ``kind`` is "empty"."""
        path = os.path.join(self.tmp, kind)
        open(path, "w").close()
        if kind != "empty":
            damage(path, kind, 0, 0, b"")
        return path

    @unittest.skipUnless(hasattr(os, "mkfifo"), "FIFOs need a POSIX system")
    def test_a_metrics_file_that_is_none_is_named_as_what_it_is(self):
        for kind, words in (("fifo", "is a FIFO"), ("directory", "is a directory"),
                            ("device", "is a character device"), ("empty", "holds no records")):
            status, err = _run(plot.main, ["loss", self.make(kind), "--out", self.tmp + "/p.png"])
            self.assertEqual(status, 2, err)
            self.assertEqual(len(err.splitlines()), 1, err)
            self.assertIn(words, err)

    @unittest.skipUnless(hasattr(os, "mkfifo"), "FIFOs need a POSIX system")
    def test_a_resume_path_that_is_no_directory_is_named_as_what_it_is(self):
        for kind in ("fifo", "device"):
            path = self.make(kind)
            status, out = run_in_process(
                "examples/00_single_device.py",
                ["--logging.run_dir", self.tmp, "--name", "r", "--resume", path])
            self.assertEqual(status, 2, out)
            self.assertEqual(len(out.splitlines()), 1, out)
            words = "a FIFO" if kind == "fifo" else "a character device"
            self.assertIn(f"is {words}, not a checkpoint directory", out)


if __name__ == "__main__":
    unittest.main()
