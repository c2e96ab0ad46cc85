"""Files checked by what the run makes of them, not by how they are stored.

A probe found inputs that pass every check of their bytes and mean something else to the run:
a float64 weight finite in its file and inf in the float32 model; a uint32 token file read as
uint16 halves; an empty text turned into a token file of nothing; a token file cut while the
run reads it (a SIGBUS through a memory map); a tokenizer or an image that its own library
cannot process (a traceback from outside). Each class is generated here: every case is one
InputError naming the file and the entry, or is read exactly as written.

The suite runs at most 20 examples a test; SCALETORCH_LONG_TESTS=1 runs 200.
"""

import copy
import os
import re
import shutil
import signal
import tempfile
import unittest

import numpy as np
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from scaletorch.data.datasets import build_dataset, check_data_file
from scaletorch.data.tokenizer import bin_dtype, meta_path, write_token_file
from scaletorch.models import LlamaConfig, build_model
from scaletorch.rules import boundary
from scaletorch.rules.errors import InputError
from scaletorch.rules.safe_files import write_checksummed
from scaletorch.trainer import checkpoint as ckpt
from scripts.prepare_text import prepare

LONG = os.environ.get("SCALETORCH_LONG_TESTS") == "1"
SMALL = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, max_seq_len=32)


def _settings(examples: int):
    # no shrinking: a failing case is printed as drawn (each case writes files; shrinking one
    # through a model export takes minutes)
    return settings(max_examples=10 * examples if LONG else examples, deadline=None,
                    derandomize=not LONG, suppress_health_check=list(HealthCheck),
                    phases=[Phase.explicit, Phase.reuse, Phase.generate])


class _Tmp(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="data_files_")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def fresh(self) -> str:
        return tempfile.mkdtemp(dir=self.tmp)


# finite in float64, inf once cast to the float32 a model holds (float32's max is 3.4e38); and
# inf or nan in any dtype (tests/test_file_kinds.py plants those in the other files)
OVERFLOWS = st.sampled_from([1e300, -1e300, 1e39, -3.5e38, 1.7e308, float("nan"), float("inf")])


class WeightsAreCheckedInTheRunsDtype(_Tmp):
    """A weight (or an AdamW moment) stored in float64 is checked after the cast to the dtype
    the run loads it into: every place tensors enter (a Hugging Face directory for
    --init-from, a consolidated checkpoint, a per-rank checkpoint's model and optimizer)."""

    @_settings(8)
    @given(where=st.sampled_from(["hf", "consolidated", "rank model", "rank optimizer"]),
           value=OVERFLOWS, which=st.integers(0, 10**6), at=st.integers(0, 10**6))
    def test_a_value_that_overflows_the_models_dtype_is_refused_naming_the_tensor(
            self, where, value, which, at):
        from scaletorch.models.hf import check_hf_llama, export_hf_llama, to_hf_name
        model = build_model(SMALL, seed=0)
        names = sorted(n for n, _ in model.named_parameters())
        name = names[which % len(names)]
        wide = {n: t.detach().double() for n, t in model.state_dict().items()}
        wide[name].view(-1)[at % wide[name].numel()] = value  # finite: it is a float64
        self.assertEqual(bool(torch.isfinite(wide[name]).all()), abs(value) < float("inf"))
        if where == "hf":
            path = os.path.join(self.fresh(), "hf")
            with torch.no_grad():
                planted = build_model(SMALL, seed=0).double()
                planted.load_state_dict(wide)
            export_hf_llama(planted, path)  # float64 weights, fresh digests
            with self.assertRaises(InputError) as ctx:
                check_hf_llama(path, values=True)
            expected = f"tensor {to_hf_name(name)} holds"
        elif where == "consolidated":
            with self.assertRaises(InputError) as ctx:
                ckpt.check_consolidated_state("consolidated.pt", {
                    "model": wide,
                    "step": 1
                }, SMALL, "the model", "")
            expected = name
        else:
            optimizer = torch.optim.AdamW(model.parameters())
            model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
            optimizer.step()
            state = {
                "model": {
                    n: t.detach().clone()
                    for n, t in model.state_dict().items()
                },
                "optimizer": copy.deepcopy(optimizer.state_dict())
            }
            if where == "rank model":
                state["model"] = wide
                expected = name
            else:
                index = which % len(state["optimizer"]["state"])
                moment = state["optimizer"]["state"][index]["exp_avg_sq"].double()
                moment.view(-1)[at % moment.numel()] = abs(value)
                state["optimizer"]["state"][index]["exp_avg_sq"] = moment
                if abs(value) < float("inf"):
                    ckpt.check_every_tensor("rank file", state)  # finite as stored: passes
                expected = f"exp_avg_sq of parameter {index}"
            with self.assertRaises(InputError) as ctx:
                ckpt.load_model_and_optimizer(model, optimizer, state, "rank file")
        message = str(ctx.exception)
        self.assertIn(expected, message)
        self.assertNotIn("\n", message)

    def test_a_float64_value_inside_float32s_range_loads(self):
        model = build_model(SMALL, seed=0)
        wide = {n: t.detach().double() for n, t in model.state_dict().items()}
        wide["norm.weight"][0] = 3.0e38  # finite in float32 too
        ckpt.check_consolidated_state("consolidated.pt", {
            "model": wide,
            "step": 1
        }, SMALL, "the model", "")


class TokenFilesAreReadAtTheirRecordedWidth(_Tmp):
    """scripts/prepare_text.py records a token file's width, vocabulary and tokenizer beside
    it; a run reads the tokens at that width, whatever model.vocab_size says, or refuses a
    vocabulary smaller than the file's. A file with our digest but no record is refused; a
    trusted one is read at the width of model.vocab_size (doc/bad_inputs.md)."""

    @_settings(12)
    @given(file_vocab=st.sampled_from([256, 5000, 65536, 65537, 70001, 2**20]),
           run_vocab=st.sampled_from([256, 5000, 65536, 65537, 70001,
                                      2**20]), n=st.integers(40, 300), seed=st.integers(0, 2**16))
    def test_a_run_reads_the_tokens_written_or_refuses_naming_the_vocabulary(
            self, file_vocab, run_vocab, n, seed):
        tokens = np.random.default_rng(seed).integers(0, file_vocab, n)
        tokens[0] = file_vocab - 1  # the largest id is there
        path = os.path.join(self.fresh(), "t.bin")
        write_token_file(path, tokens.astype(bin_dtype(file_vocab)), file_vocab, "byte")
        if run_vocab < file_vocab:
            for read in (lambda: check_data_file("bin", path, run_vocab, 8),
                         lambda: build_dataset("bin", run_vocab, 0, path)):
                with self.assertRaises(InputError) as ctx:
                    read()
                self.assertIn(f"--model.vocab_size {file_vocab}", str(ctx.exception))
            return
        check_data_file("bin", path, run_vocab, 8)
        data = build_dataset("bin", run_vocab, 0, path)
        np.testing.assert_array_equal(data.window(0, n), tokens)  # not halves nor pairs

    @_settings(15)
    @given(damage=st.sampled_from(["dtype", "tokens", "format", "not json", "no digest"]))
    def test_a_damaged_record_is_one_input_error_naming_it(self, damage):
        path = os.path.join(self.fresh(), "t.bin")
        write_token_file(path, np.arange(50, dtype=np.uint16), 256, "byte")
        import json
        with open(meta_path(path)) as f:
            record = json.load(f)
        text = {
            "dtype": lambda: json.dumps({
                **record, "dtype": "float32"
            }),
            "tokens": lambda: json.dumps({
                **record, "tokens": 49
            }),
            "format": lambda: json.dumps({
                **record, "format": "other"
            }),
            "not json": lambda: "{",
            "no digest": lambda: json.dumps(record),
        }[damage]()
        write_checksummed(meta_path(path), text.encode())
        if damage == "no digest":
            os.remove(meta_path(path) + ".sha256")
        with self.assertRaises(InputError) as ctx:
            check_data_file("bin", path, 256, 8)
        self.assertIn("t.bin", str(ctx.exception))
        self.assertNotIn("\n", str(ctx.exception))

    def test_a_trusted_file_without_record_is_read_at_the_width_of_the_vocabulary(self):
        path = os.path.join(self.fresh(), "old.bin")
        write_checksummed(path, np.arange(100, dtype=np.uint16).tobytes())
        with self.assertRaisesRegex(InputError, "has no record old.bin.json"):
            check_data_file("bin", path, 256, 8)  # our digest: prepare_text wrote a record
        with boundary.trusting([path]):
            check_data_file("bin", path, 256, 8)
            np.testing.assert_array_equal(
                build_dataset("bin", 256, 0, path).window(0, 100), np.arange(100))

    def test_an_empty_text_is_refused_and_an_empty_bin_holds_no_tokens(self):
        d = self.fresh()
        for text in ("", "x"):
            with open(os.path.join(d, "e.txt"), "w") as f:
                f.write(text)
            with self.assertRaisesRegex(InputError, f"holds {len(text)} token"):
                prepare([os.path.join(d, "e.txt")], "byte", os.path.join(d, "e.bin"))
            self.assertFalse(os.path.exists(os.path.join(d, "e.bin")))
        write_token_file(os.path.join(d, "z.bin"), np.zeros(0, dtype=np.uint16), 256, "byte")
        with self.assertRaisesRegex(InputError, "holds no tokens"):
            check_data_file("bin", os.path.join(d, "z.bin"), 256, 8)

    def test_a_failed_write_leaves_no_token_file_and_says_so(self):
        """A write that fails at the .bin (the first write) or at its record (the third) leaves
        neither, and the line says that, not a run's words about checkpoints."""
        import errno
        from unittest import mock

        from scaletorch.rules import safe_files
        real = safe_files.write_all
        for failing in (0, 2):
            d, calls = self.fresh(), []

            def write_all(f, data):
                calls.append(f.name)
                if len(calls) == failing + 1:
                    raise OSError(errno.ENOSPC, "No space left on device")
                real(f, data)

            with mock.patch.object(safe_files, "write_all", write_all):
                with self.assertRaises(safe_files.WriteError) as ctx:
                    prepare(["README.md"], "byte", os.path.join(d, "t.bin"))
            self.assertIn("no token file is left there", str(ctx.exception))
            self.assertNotIn("checkpoint", str(ctx.exception))
            self.assertEqual(os.listdir(d), [], f"failing write {failing}")


class ATokenFileCutWhileTheRunReadsIt(_Tmp):
    """A .bin truncated while a run samples it is an InputError naming it, never a SIGBUS:
    each case forks a child that opens the file, cuts it to a drawn length and samples."""

    @_settings(4)
    @given(vocab=st.sampled_from([256, 70001]), cut=st.floats(0, 0.8), steps=st.integers(1, 3))
    def test_a_cut_is_one_input_error_naming_the_file(self, vocab, cut, steps):
        path = os.path.join(self.fresh(), "live.bin")
        write_token_file(path, np.zeros(4000, dtype=bin_dtype(vocab)), vocab, "byte")
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: a run's reads, the file cut between two batches
            os.close(read)
            code = 1  # any other exception
            try:
                data = build_dataset("bin", vocab, 0, path)
                data.sample(4, 33, np.random.default_rng(0))
                os.truncate(path, int(cut * 4000) * np.dtype(bin_dtype(vocab)).itemsize)
                for step in range(30 * steps):
                    data.sample(4, 33, np.random.default_rng(step))
                code = 0
            except InputError as err:
                os.write(write, str(err).encode()[:4000])
                code = 2
            finally:
                os._exit(code)
        os.close(write)
        message = os.read(read, 4096).decode()
        os.close(read)
        _, status = os.waitpid(pid, 0)
        self.assertFalse(
            os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGBUS,
            "the child died of SIGBUS")
        self.assertEqual(os.WEXITSTATUS(status), 2, message)
        self.assertIn("live.bin' changed while the run read it", message)

    def test_in_a_run_the_line_names_the_step_and_the_checkpoint_to_resume_from(self):
        from unittest import mock

        from scaletorch.trainer import parse_args
        from scaletorch.trainer.stops import interruptible
        path = os.path.join(self.fresh(), "live.bin")
        write_token_file(path, np.zeros(4000, dtype=np.uint16), 256, "byte")
        cfg = parse_args([
            "--config", "examples/configs/00_single_device.yaml", "--steps", "8",
            "--logging.run_dir",
            self.fresh(), "--checkpoint.every", "2"
        ])
        data = build_dataset("bin", 256, 0, path)
        os.truncate(path, 100)
        saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        self.addCleanup(lambda: [signal.signal(s, h) for s, h in saved.items()])
        for checkpoint, where in ((None, "no checkpoint was saved (checkpoint.every 2)"),
                                  ("R/step_4", "last complete checkpoint R/step_4; resume with:")):
            with mock.patch("scaletorch.trainer.stops.latest_checkpoint", lambda _: checkpoint), \
                    self.assertRaises(InputError) as raised, interruptible(cfg, [5]):
                data.sample(4, 33, np.random.default_rng(0))
            self.assertRegex(
                str(raised.exception),
                r"^data.path '.*live.bin' changed while the run read it: it had 8000 "
                r"bytes, now 100 \(truncated or rewritten\); restore the file, then "
                r"resume at step 5 of 8: " + re.escape(where))


class OutsideLibrariesFailOnOneLine(_Tmp):
    """The tokenizers library and Pillow raise their own exceptions (a bare Exception, a
    DecompressionBombError, SyntaxError, struct.error): each is one InputError naming the
    file, raised where the library is called."""

    @_settings(12)
    @given(words=st.lists(st.sampled_from(["a", "b", "c", "zz"]), min_size=2, max_size=30),
           known=st.sets(st.sampled_from(["a", "b", "c"]), min_size=1))
    def test_a_tokenizer_that_cannot_encode_names_its_file_and_where(self, words, known):
        try:
            from tokenizers import Tokenizer, models, pre_tokenizers
        except ImportError:
            self.skipTest("needs the hf extra (tokenizers)")
        d = self.fresh()
        tok = Tokenizer(
            models.WordLevel({
                w: i
                for i, w in enumerate(sorted(known))
            }, unk_token="[UNK]"))  # its unk token is not in it
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.save(os.path.join(d, "tok.json"))
        with open(os.path.join(d, "t.txt"), "w") as f:
            f.write(" ".join(words))
        unknown = [i for i, w in enumerate(words) if w not in known]
        if not unknown:
            prepare([os.path.join(d, "t.txt")], os.path.join(d, "tok.json"),
                    os.path.join(d, "t.bin"))
            return
        with self.assertRaises(InputError) as ctx:
            prepare([os.path.join(d, "t.txt")], os.path.join(d, "tok.json"),
                    os.path.join(d, "t.bin"))
        message = str(ctx.exception)
        self.assertIn("tok.json' cannot encode the text at character", message)
        first = sum(len(w) + 1 for w in words[:unknown[0]])  # where the first unknown word is
        at = int(message.split("at character ")[1].split()[0])
        self.assertTrue(first <= at < first + len(words[unknown[0]]), (message, first))
        self.assertNotIn("\n", message)

    @_settings(15)
    @given(damage=st.sampled_from(["bomb", "truncate", "flip", "empty", "text"]),
           at=st.integers(0, 10**6), folder=st.sampled_from(["a", "b"]))
    def test_a_damaged_or_huge_image_is_one_input_error_naming_it(self, damage, at, folder):
        try:
            import PIL.Image
        except ImportError:
            self.skipTest("needs the vision extra (Pillow)")
        from scaletorch.data.images import ImageFolder
        root = self.fresh()
        for c in "ab":
            os.makedirs(os.path.join(root, c))
            for i in range(2):
                PIL.Image.new("RGB", (16, 16), (i * 90, 40, 200)).save(f"{root}/{c}/{i}.png")
        bad = os.path.join(root, folder, "1.png")
        with open(bad, "rb") as f:
            data = f.read()
        if damage == "truncate":
            data = data[:max(1, at % len(data))]
        elif damage == "flip":
            data = bytearray(data)
            data[at % len(data)] ^= 1 << (at % 8)
            data = bytes(data)
        elif damage == "empty":
            data = b""
        elif damage == "text":
            data = b"not an image\n"
        with open(bad, "wb") as f:
            f.write(data)
        limit = PIL.Image.MAX_IMAGE_PIXELS
        if damage == "bomb":
            PIL.Image.MAX_IMAGE_PIXELS = 16 * 16 - 1  # a 16 x 16 image is a bomb now
        try:
            folder_ = ImageFolder(root, resize=8)
            for index in range(len(folder_)):  # decoding every image, as the epochs do
                folder_.load(index)
        except InputError as err:
            # a bomb is the first image read (all are 16 x 16 now); the damage names its file
            self.assertIn(os.path.join(root, "a", "0.png") if damage == "bomb" else bad, str(err))
            self.assertNotIn("\n", str(err))
            return
        finally:
            PIL.Image.MAX_IMAGE_PIXELS = limit
        # a flipped bit in pixel data or an ancillary chunk, a cut after the pixels: still an
        # image; everything else is refused
        self.assertIn(damage, ("flip", "truncate"), "a damaged image was read without a word")


class AResumeNoticesChangedDataContents(_Tmp):
    """The checkpoint's record keeps the sha256 of data.path's contents; a resume whose file
    (same path) holds other bytes is refused in one line naming the file and both digest
    prefixes. A checkpoint without the record, or the same bytes, resume as before."""

    @_settings(12)
    @given(dataset=st.sampled_from(["text", "bin"]),
           change=st.sampled_from(["none", "append", "flip", "truncate",
                                   "replace"]), at=st.integers(0, 10**6))
    def test_a_changed_data_file_is_refused_naming_it(self, dataset, change, at):
        from scaletorch.config import Config
        from scaletorch.data import datasets
        from scaletorch.trainer.resume_check import DATA_DIGEST, check_resumed, record
        path = os.path.join(self.fresh(), "data.txt" if dataset == "text" else "data.bin")
        data = bytes(range(97, 123)) * 20

        def write(contents: bytes) -> None:
            if dataset == "bin":  # rewritten with a fresh digest, as prepare_text would
                write_checksummed(path, contents)
                return
            with open(path, "wb") as f:
                f.write(contents)

        write(data)
        cfg = Config()
        cfg.data.dataset, cfg.data.path = dataset, path
        saved = record(cfg)
        manifest = {"format": "per-rank", "layout": {"config": saved}}
        new = bytearray(data)
        if change == "append":
            new += b"ab"
        elif change == "flip":
            new[at % len(new)] ^= 1 << (at % 8)
        elif change == "truncate":
            new = new[:at % len(new) // 2 * 2]
        elif change == "replace":
            new = bytearray(reversed(new))
        write(bytes(new))
        datasets._DIGESTS.clear()  # a resume is another process: nothing hashed yet
        if bytes(new) == data:
            self.assertIsNone(check_resumed("ck", manifest, cfg))
            return
        with self.assertRaises(InputError) as ctx:
            check_resumed("ck", manifest, cfg)
        message = str(ctx.exception)
        self.assertIn(f"the contents of data.path {path!r} (sha256 {saved[DATA_DIGEST][:12]}",
                      message)
        self.assertNotIn("\n", message)
        old = {
            "format": "per-rank",
            "layout": {
                "config": {
                    k: v
                    for k, v in saved.items() if k != DATA_DIGEST
                }
            }
        }
        self.assertIsNone(check_resumed("ck", old, cfg))  # written before the record


if __name__ == "__main__":
    unittest.main()
