"""Every file kind, damaged every way, is refused by the trust boundary before work starts.

Hypothesis draws a file kind (a config YAML, a text, a .bin, a per-rank checkpoint, a
consolidated checkpoint, a Hugging Face directory, a flight-recorder dump), one of its files,
a damage (truncated, extended, one bit flipped, replaced by a directory, a FIFO, a symlink to
a device or a symlink loop) and whether the digests stay. Each case runs the check that the
run's pre-flight (or the script) makes, in this process: the point is the reader, not the
process (``tests/test_bad_inputs.py`` shows that an InputError is one ``error:`` line, exit 2).

The claim: a kind that ScaleTorch writes (digest required) is refused, as an InputError of one
line, whenever a byte changed or a digest is gone. A kind the user writes (config, text: no
digest) is refused, or read as the data it still is (doc/bad_inputs.md). No case raises any
other exception, and none blocks: a FIFO is never opened.

The suite runs 60 examples; SCALETORCH_LONG_TESTS=1 runs 1000 (a phase of .ci/run).

A missing companion (a digest, a .bin's record, a manifest field, the run's config in it) is
its own class: ``AMissingCompanionIsRefusedUnlessTrusted``.
"""

import io
import json
import os
import shutil
import signal
import tempfile
import unittest

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scaletorch.data.datasets import check_data_file
from scaletorch.data.tokenizer import RECORD_FIELDS, write_token_file
from scaletorch.dist import flight_recorder
from scaletorch.models import LlamaConfig, build_model
from scaletorch.rules import boundary
from scaletorch.rules.errors import InputError
from scaletorch.rules.safe_files import write_checksummed
from scaletorch.trainer import checkpoint as ckpt
from scaletorch.trainer.config import load_yaml
from scaletorch.trainer.consolidated import load_consolidated
from scaletorch.trainer.resume_check import check_resumed, record

LONG = os.environ.get("SCALETORCH_LONG_TESTS") == "1"
EXAMPLES = 1000 if LONG else 60
DAMAGES = ("truncate", "extend", "flip", "directory", "fifo", "device", "loop")
NAMED = {"directory": "is a directory", "fifo": "is a FIFO", "device": "is a character device"}
SMALL = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, max_seq_len=32)


def _hf(path: str) -> None:
    from scaletorch.models.hf import check_hf_llama, verify_export_file
    check_hf_llama(path)  # the pre-flight: config.json, headers, digests present
    for name in sorted(os.listdir(path)):  # the load: every byte, before a weight is used
        if not name.endswith(".sha256"):
            verify_export_file(os.path.join(path, name))


# kind: (make it in a directory -> the path the check takes, the check, digest required)
def _make_config(d: str) -> str:
    path = os.path.join(d, "run.yaml")
    with open(path, "w") as f:
        f.write("training:\n  steps: 5\n  lr: 0.001\nmodel:\n  hidden_size: 64\n")
    return path


def _make_text(d: str) -> str:
    path = os.path.join(d, "corpus.txt")
    with open(path, "w") as f:
        f.write("Tensor parallel splits every matrix. " * 4)
    return path


def _make_bin(d: str) -> str:
    path = os.path.join(d, "tokens.bin")
    write_token_file(path, (np.arange(200) % 64).astype(np.uint16), 64, "byte")
    return path


def _make_per_rank(d: str) -> str:
    state = {"model": build_model(SMALL, seed=0).state_dict(), "step": 3}
    ckpt.save_checkpoint(d, 3, state, 0, 1, keep_last=0)
    return ckpt.step_dir(d, 3)


def _make_per_rank_with_config(d: str) -> str:
    """A per-rank step directory whose manifest holds the run's config, as the Trainer's."""
    from scaletorch.config import Config
    state = {"model": build_model(SMALL, seed=0).state_dict(), "step": 3}
    ckpt.save_checkpoint(d, 3, state, 0, 1, keep_last=0, layout={"config": record(Config())})
    return ckpt.step_dir(d, 3)


def _make_consolidated(d: str) -> str:
    path = os.path.join(d, "consolidated.pt")
    buffer = io.BytesIO()
    torch.save({"step": 3, "model": build_model(SMALL, seed=0).state_dict()}, buffer)
    write_checksummed(path, buffer.getvalue())
    return path


def _make_hf(d: str) -> str:
    from scaletorch.models.hf import export_hf_llama
    path = os.path.join(d, "hf")
    export_hf_llama(build_model(SMALL, seed=0), path, max_shard_bytes=20_000)
    return path


# one collective as a flight-recorder dump records it (tests/test_file_values.py uses it too)
DUMP_ENTRY = {
    "process_group": ["0", "default_pg"],
    "collective_seq_id": 1,
    "profiling_name": "gloo:all_reduce",
    "input_sizes": [[3]],
    "input_dtypes": ["Float"],
    "time_created_ns": 1,
    "frames": [{
        "filename": "x.py",
        "line": 1,
        "name": "f"
    }]
}


def _make_dump(d: str) -> str:
    path = os.path.join(d, "flight_recorder")
    entry = DUMP_ENTRY
    for rank in (0, 1):
        write_checksummed(os.path.join(path, f"rank_{rank}"),
                          json.dumps({
                              "entries": [entry],
                              "pg_config": {},
                              "rank": rank
                          }).encode())
    return path


KINDS = {
    "config": (_make_config, load_yaml, False),
    "text": (_make_text, lambda p: check_data_file("text", p, 256, 16), False),
    "bin": (_make_bin, lambda p: check_data_file("bin", p, 64, 16), True),
    "per_rank": (_make_per_rank, ckpt.verify_checkpoint, True),
    "consolidated": (_make_consolidated, load_consolidated, True),
    "hf": (_make_hf, _hf, True),
    "dump": (_make_dump, flight_recorder.load, True),
}


def files_of(path: str) -> list:
    """The files of a kind: the file itself and its digest, or every file of its directory."""
    if os.path.isdir(path):
        return sorted(os.path.join(path, n) for n in os.listdir(path))
    return [p for p in (path, path + ".sha256") if os.path.lexists(p)]


def damage(file: str, how: str, at: int, bit: int, tail: bytes) -> bool:
    """Damage ``file`` in place; False when the damage changes nothing (truncate to its size)."""
    size = os.path.getsize(file)
    if how == "truncate":
        if size == 0:
            return False
        with open(file, "rb") as f:
            f.seek(size - 1)
            last = f.read(1)
        if file.endswith(".sha256") and at % size == size - 1 and last == b"\n":
            return False  # a digest line without its newline is read as documented (an editor's)
        os.truncate(file, at % size)
    elif how == "extend":
        with open(file, "ab") as f:
            f.write(tail)
    elif how == "flip":
        if size == 0:
            return False
        with open(file, "r+b") as f:
            f.seek(at % size)
            byte = f.read(1)[0]
            f.seek(at % size)
            f.write(bytes([byte ^ (1 << bit)]))
    else:
        os.remove(file)
        if how == "directory":
            os.mkdir(file)
        elif how == "fifo":
            os.mkfifo(file)
        elif how == "device":
            os.symlink("/dev/zero", file)
        else:  # a symlink to itself
            os.symlink(os.path.basename(file), file)
    return True


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout("the check blocked (a FIFO opened?)")


@unittest.skipUnless(hasattr(os, "mkfifo"), "FIFOs need a POSIX system")
class EveryFileKindDamagedIsOneInputError(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        import torch._dynamo  # noqa: F401  (torch.load imports it, slowly: not under the alarm)
        cls.tmp = tempfile.mkdtemp(prefix="file_kinds_")
        cls.pristine = {}
        for kind, (make, _, _) in KINDS.items():
            d = os.path.join(cls.tmp, "pristine", kind)
            os.makedirs(d)
            cls.pristine[kind] = make(d)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def check(self, kind: str, path: str) -> str:
        """'' when the check passes, else its one-line message; any other error fails."""
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(60)
        try:
            KINDS[kind][1](path)
            return ""
        except InputError as err:
            return str(err)
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)

    def copy(self, kind: str) -> str:
        source = self.pristine[kind]
        d = tempfile.mkdtemp(dir=self.tmp)
        root = os.path.dirname(source)
        shutil.copytree(root, d, dirs_exist_ok=True, symlinks=True)
        return os.path.join(d, os.path.relpath(source, root))

    def test_every_kind_undamaged_with_its_digests_passes(self):
        for kind in KINDS:
            with self.subTest(kind=kind):
                self.assertEqual(self.check(kind, self.copy(kind)), "")

    def test_a_kind_we_write_without_its_digest_is_refused_unless_trusted(self):
        for kind, (_, _, required) in KINDS.items():
            if not required or kind == "per_rank":  # its manifest holds the digests too
                continue
            with self.subTest(kind=kind):
                path = self.copy(kind)
                for file in files_of(path):
                    if file.endswith(".sha256"):
                        os.remove(file)
                message = self.check(kind, path)
                self.assertIn("has no checksum file", message)
                self.assertIn("--trust-unchecked", message)
                with boundary.trusting([path]):
                    self.assertEqual(self.check(kind, path), "")

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=not LONG,
              suppress_health_check=[HealthCheck.too_slow])
    @given(kind=st.sampled_from(sorted(KINDS)), which=st.integers(0, 50),
           how=st.sampled_from(DAMAGES), at=st.integers(0, 1 << 20), bit=st.integers(0, 7),
           tail=st.binary(min_size=1, max_size=64), keep_digests=st.booleans())
    def test_a_damaged_file_is_one_input_error_or_read_as_documented(self, kind, which, how, at,
                                                                     bit, tail, keep_digests):
        path = self.copy(kind)
        files = files_of(path)
        changed = damage(files[which % len(files)], how, at, bit, tail)
        if not keep_digests:
            for file in files_of(
                    path) if os.path.isdir(path) or not os.path.isdir(path + ".sha256") else []:
                if file.endswith(".sha256") and os.path.isfile(file):
                    os.remove(file)
        message = self.check(kind, path)
        self.assertNotIn("\n", message)
        self.assertLess(len(message), 1500)
        if KINDS[kind][2] and (changed or not keep_digests):
            self.assertNotEqual(
                message, "", f"{kind}: {how} of {files[which % len(files)]} "
                f"(digests kept: {keep_digests}) was not refused")
        if how in NAMED and keep_digests:  # named as what it is, not "missing", not "a file"
            self.assertIn(NAMED[how], message)

    @settings(max_examples=EXAMPLES // 3, deadline=None, derandomize=not LONG,
              suppress_health_check=[HealthCheck.too_slow])
    @given(kind=st.sampled_from(sorted(KINDS)), which=st.integers(0, 50),
           how=st.sampled_from(sorted(NAMED)))
    def test_a_file_replaced_is_named_as_what_it_is(self, kind, which, how):
        """Any file of any kind (a digest too) replaced by a directory, a FIFO or a symlink to
        a device: the line says which of them it is, not "missing", not "not a file" (a FIFO
        given as data.path is a stream to save first). 20 examples (long: 333)."""
        path = self.copy(kind)
        files = files_of(path)
        damage(files[which % len(files)], how, 0, 0, b"")
        self.assertIn(NAMED[how], self.check(kind, path), files[which % len(files)])

    @settings(max_examples=EXAMPLES // 3, deadline=None, derandomize=not LONG,
              suppress_health_check=[HealthCheck.too_slow])
    @given(kind=st.sampled_from(sorted(k for k, v in KINDS.items() if v[2])),
           which=st.integers(0, 50), how=st.sampled_from(
               ("truncate", "extend", "flip")), at=st.integers(0, 1 << 20), bit=st.integers(0, 7),
           tail=st.binary(min_size=1, max_size=64), whole_dir=st.booleans())
    def test_trust_never_excuses_a_digest_that_disagrees(self, kind, which, how, at, bit, tail,
                                                         whole_dir):
        """--trust-unchecked excuses a missing .sha256 only: a file of a kind we write whose
        digest exists and disagrees (a byte changed in the file or in the digest) is refused
        with the flag naming the file or its directory. 20 examples (long: 333)."""
        path = self.copy(kind)
        files = files_of(path)
        file = files[which % len(files)]
        if not damage(file, how, at, bit, tail):
            return
        trusted = os.path.dirname(file) if whole_dir else file.removesuffix(".sha256")
        with boundary.trusting([trusted]):
            message = self.check(kind, path)
        self.assertNotEqual(message, "", f"{kind}: {how} of {file}, trusted, was read")
        self.assertNotIn("\n", message)


# A missing companion (class 3 of the probe): every companion file and required field of the
# kinds we write, as (kind, what is deleted, the words the refusal names, whether
# --trust-unchecked lets the check pass). "field" cases rewrite the digest, as a forger would.
COMPANIONS = [
    ("bin", "tokens.bin.sha256", "has no checksum file tokens.bin.sha256", True),
    ("bin", "tokens.bin.json", "has no record tokens.bin.json", True),
    ("bin", "tokens.bin.json.sha256", "has no checksum file tokens.bin.json.sha256", True),
    *[("bin", f"field tokens.bin.json {k}", f"has no field {k!r}", False) for k in RECORD_FIELDS],
    ("per_rank", "manifest.json", "no manifest.json", False),
    ("per_rank", "manifest.json.sha256", "has no checksum file manifest.json.sha256", False),
    ("per_rank", "rank_00000.pt", "is missing rank_00000.pt", False),
    ("per_rank", "rank_00000.pt.sha256", "has no checksum file rank_00000.pt.sha256", False),
    *[("per_rank", f"field manifest.json {k}",
       k.replace("_", " ") if k == "format_version" else f"no field {k!r}", False)
      for k in ckpt.MANIFEST_FIELDS if k != "sha256"],
    ("per_rank", "field manifest.json sha256", "no sha256", False),
    ("per_rank", "field manifest.json layout.config", "has no layout.config", True),
    ("consolidated", "consolidated.pt.sha256", "has no checksum file consolidated.pt.sha256", True),
    ("hf", "config.json", "config.json", False),
    ("hf", "config.json.sha256", "has no checksum file config.json.sha256", True),
    ("hf", "model.safetensors", "model.safetensors", False),
    ("hf", "model.safetensors.sha256", "has no checksum file model.safetensors.sha256", True),
    ("dump", "rank_0.sha256", "has no checksum file rank_0.sha256", True),
]


def _resume_check(path: str) -> None:
    """What --resume checks of a per-rank step directory before training: its files, then
    the settings of the run that wrote it against this run's (the defaults here)."""
    from scaletorch.config import Config
    check_resumed(path, ckpt.verify_checkpoint(path), Config())


def _delete_field(file: str, key: str) -> None:
    """Remove ``key`` ("a" or "a.b") from JSON ``file``, its digest rewritten to match."""
    with open(file) as f:
        value = json.load(f)
    *parents, last = key.split(".")
    inner = value
    for parent in parents:
        inner = inner[parent]
    del inner[last]
    write_checksummed(file, json.dumps(value).encode())


class AMissingCompanionIsRefusedUnlessTrusted(unittest.TestCase):
    """Deleting a companion file or a required field of a kind we write (a digest, a .bin's
    record, a manifest or one of its fields, the run's config in it, a rank file, a Hugging
    Face config.json) never switches a check off: it is one InputError line naming what is
    missing. ``--trust-unchecked`` lets the check pass where the missing part only vouches
    for the rest (a digest, a record, the config); never where it is the data. 30 examples
    drawn from the cases of COMPANIONS; SCALETORCH_LONG_TESTS=1 draws 200."""

    KINDS = dict(KINDS, per_rank=(_make_per_rank_with_config, _resume_check, True))

    @classmethod
    def setUpClass(cls):
        import torch._dynamo  # noqa: F401
        cls.tmp = tempfile.mkdtemp(prefix="companions_")
        cls.pristine = {}
        for kind in {c[0] for c in COMPANIONS}:
            d = os.path.join(cls.tmp, "pristine", kind)
            os.makedirs(d)
            cls.pristine[kind] = cls.KINDS[kind][0](d)

    def check(self, kind: str, path: str) -> str:
        try:
            self.KINDS[kind][1](path)
            return ""
        except InputError as err:
            return str(err)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    copy = EveryFileKindDamagedIsOneInputError.copy

    def test_every_kind_here_passes_whole(self):
        for kind in self.pristine:
            self.assertEqual(self.check(kind, self.copy(kind)), "", kind)

    @settings(max_examples=200 if LONG else 30, deadline=None, derandomize=not LONG,
              suppress_health_check=[HealthCheck.too_slow])
    @given(case=st.sampled_from(COMPANIONS))
    def test_a_deleted_companion_is_one_line_naming_it_unless_trusted(self, case):
        kind, what, named, trust_passes = case
        path = self.copy(kind)
        where = path if os.path.isdir(path) else os.path.dirname(path)
        if what.startswith("field "):
            _, name, key = what.split(" ")
            _delete_field(os.path.join(where, name), key)
        else:
            os.remove(os.path.join(where, what))
        message = self.check(kind, path)
        self.assertIn(named, message, what)
        self.assertNotIn("\n", message)
        with boundary.trusting([where]):  # the directory the kind's files are in
            message = self.check(kind, path)
        self.assertEqual(message == "", trust_passes, f"{what} trusted: {message!r}")


def _trained_state() -> dict:
    """What Trainer.state_dict saves after one AdamW step: the model, the optimizer's moments
    and step counters, the scheduler, RNG states."""
    model = build_model(SMALL, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.zeros(1, 4, dtype=torch.long)).float().sum().backward()
    optimizer.step()
    scheduler.step()
    return {
        "step": 1,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": ckpt.rng_state()
    }


def _float_entries(value, where=""):
    """(path, container, key) of every floating tensor and float in a state, as
    check_every_tensor names them."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return []
    out = []
    for key, item in items:
        here = f"{where}.{key}" if where and isinstance(value, dict) else (
            f"{where}[{key}]" if where else str(key))
        if (isinstance(item, torch.Tensor) and item.is_floating_point()) or isinstance(item, float):
            out.append((here, value, key))
        out.extend(_float_entries(item, here))
    return out


BAD_VALUES = st.sampled_from([float("nan"), float("inf"), float("-inf")])
WRONG = st.one_of(st.none(), st.booleans(), st.text(max_size=20), st.floats(allow_nan=True),
                  st.integers(-10**40, 10**40), st.lists(st.integers(0, 3), max_size=3),
                  st.dictionaries(st.text("abc", max_size=3), st.integers(), max_size=2))


class _SavedStates(unittest.TestCase):
    """A temporary directory (``cls.tmp``, made by the subclass's setUpClass) where ``saved``
    writes a state as a one-rank checkpoint, with the digests of what it writes."""

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def saved(self, state) -> str:
        d = tempfile.mkdtemp(dir=self.tmp)
        ckpt.save_checkpoint(d, 1, state, 0, 1, keep_last=0)  # digests of what is written
        return ckpt.step_dir(d, 1)


class ValuesAreCheckedOnceTheDigestsMatch(_SavedStates):
    """Files whose digests were re-written over wrong values (the bytes are those written,
    the values are not sane): every tensor of a per-rank file (model, AdamW moments and step
    counters, scheduler, RNG) and every manifest field (a Hugging Face directory's weights:
    tests/test_data_files.py). Each is one InputError naming the entry, from the check the
    pre-flight makes (``check_rank_files``, ``read_manifest``). The suite runs 20 examples
    each; SCALETORCH_LONG_TESTS=1 runs 300."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="values_")
        cls.state = _trained_state()
        cls.entries = [e[0] for e in _float_entries(cls.state)]

    def test_a_sane_state_passes_and_every_section_is_walked(self):
        ckpt.check_rank_files(self.saved(self.state))
        for section in ("model.", "optimizer.state.", "optimizer.param_groups", "scheduler."):
            self.assertTrue(any(e.startswith(section) for e in self.entries), section)

    @settings(max_examples=300 if LONG else 20, deadline=None, derandomize=not LONG,
              suppress_health_check=[HealthCheck.too_slow])
    @given(which=st.integers(0, 10**6), bad=BAD_VALUES, at=st.integers(0, 10**6),
           dtype=st.sampled_from([None, torch.int64, torch.complex64]))
    def test_a_bad_value_or_dtype_anywhere_in_a_rank_file_is_refused(self, which, bad, at, dtype):
        import copy
        state = copy.deepcopy(self.state)
        where, container, key = _float_entries(state)[which % len(self.entries)]
        item = container[key]
        if isinstance(item, float):
            container[key] = bad
        elif dtype is not None:
            container[key] = item.to(dtype)
        else:
            flat = item.reshape(-1)
            flat[at % flat.numel()] = bad
        if isinstance(item, float) and dtype is not None:
            return  # a float has no dtype to change
        if where.startswith("model.") and dtype == torch.int64:
            # a model may hold integer buffers (BatchNorm's num_batches_tracked): the files'
            # check passes it, the load compares each entry with the model's own dtype
            ckpt.check_rank_files(self.saved(state))
            model = build_model(SMALL, seed=0).state_dict()
            with self.assertRaises(InputError) as ctx:
                ckpt.check_state_keys("the file", state["model"], model, "the model", "")
            self.assertIn(where[len("model."):], str(ctx.exception))
            return
        with self.assertRaises(InputError) as ctx:
            ckpt.check_rank_files(self.saved(state))
        self.assertIn(where, str(ctx.exception))
        self.assertNotIn("\n", str(ctx.exception))

    @settings(max_examples=300 if LONG else 20, deadline=None, derandomize=not LONG)
    @given(field=st.sampled_from(sorted({
        **ckpt.MANIFEST_FIELDS,
        **ckpt.LAYOUT_FIELDS
    })), value=WRONG)
    def test_a_manifest_field_of_the_wrong_type_or_range_is_refused_naming_it(self, field, value):
        d = tempfile.mkdtemp(dir=self.tmp)
        manifest = {
            "format_version": ckpt.FORMAT_VERSION,
            "step": 3,
            "world_size": 1,
            "layout": {
                "zero_stage": 0,
                "model": {}
            },
            "sha256": {}
        }
        (manifest if field in ckpt.MANIFEST_FIELDS else manifest["layout"])[field] = value
        write_checksummed(os.path.join(d, ckpt.MANIFEST), json.dumps(manifest).encode())
        kind, low, high = {**ckpt.MANIFEST_FIELDS, **ckpt.LAYOUT_FIELDS}[field]
        fits = (isinstance(value, kind) and not (kind is int and isinstance(value, bool))
                and (low is None or value >= low) and (high is None or value <= high))
        if field == "format_version":
            fits = value == ckpt.FORMAT_VERSION and not isinstance(value, bool)
        if field == "sha256":  # each entry names a file of the directory with its digest
            fits = value == {}
        try:
            ckpt.read_manifest(d)
            message = ""
        except InputError as err:
            message = str(err)
        self.assertEqual(message == "", fits, message)
        if not fits:
            self.assertIn(field if field != "format_version" else "format version", message)
            if not isinstance(value, kind) and field not in ("format_version", "sha256"):
                self.assertIn(type(value).__name__, message)

    # a non-finite weight of an --init-from directory: tests/test_data_files.py, with the
    # values that overflow only once cast to the model's dtype


TOP_KEYS = tuple(ckpt.TRAINER_STATE)  # step, model, optimizer, scheduler, rng


class RankFilesOfAnotherStructureAreRefused(_SavedStates):
    """A rank file whose digests and manifest were re-written over another structure (a
    ``torch.save({})``, an entry missing, an entry of another type, an optimizer or RNG state
    without its parts), or one whose step (or scheduler's last_epoch) is not its manifest's:
    the pre-flight (``check_rank_files``) and the load each refuse it with one InputError
    naming the entry, never a KeyError later. 20 and 10 examples; 300 long."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="structure_")
        cls.state = _trained_state()

    @settings(max_examples=300 if LONG else 20, deadline=None, derandomize=not LONG,
              suppress_health_check=[HealthCheck.too_slow])
    @given(how=st.sampled_from(["drop", "retype", "drop_part",
                                "not_a_dict"]), key=st.sampled_from(TOP_KEYS),
           part=st.sampled_from(["optimizer", "rng"]), wrong=WRONG, index=st.integers(0, 10))
    def test_another_structure_is_one_input_error(self, how, key, part, wrong, index):
        state = dict(self.state)
        if how == "drop":
            del state[key]
        elif how == "retype":
            kind = ckpt.TRAINER_STATE[key]
            if isinstance(wrong, kind) and not isinstance(wrong, bool):
                wrong = None  # the same type is no other structure
            state[key] = wrong
        elif how == "drop_part":
            parts = sorted(state[part])
            state[part] = {k: v for k, v in state[part].items() if k != parts[index % len(parts)]}
        else:
            state = wrong if not isinstance(wrong, dict) else [wrong]
        path = self.saved(state)
        with self.assertRaises(InputError) as refused:
            ckpt.check_rank_files(path)
        self.assertNotIn("\n", str(refused.exception))
        if how in ("drop", "retype"):
            self.assertIn(repr(key), str(refused.exception))
        if how != "not_a_dict" and key in ckpt.RANK_STATE:  # what every loop's load checks
            with self.assertRaises(InputError):
                ckpt.load_checkpoint(path, 0, 1)

    @settings(max_examples=300 if LONG else 10, deadline=None, derandomize=not LONG,
              suppress_health_check=[HealthCheck.too_slow])
    @given(entry=st.sampled_from(["step", "last_epoch"]),
           step=st.integers(0, 10**6).filter(lambda s: s != 1))
    def test_a_step_other_than_the_manifests_is_one_input_error(self, entry, step):
        state = dict(self.state)  # saved at step 1, its manifest re-written at step 1
        if entry == "step":
            state["step"] = step
        else:
            state["scheduler"] = dict(state["scheduler"], last_epoch=step)
        path = self.saved(state)
        checks = [ckpt.check_rank_files]
        if entry == "step":  # what every loop's load reads: the step it resumes at
            checks.append(lambda p: ckpt.load_checkpoint(p, 0, 1))
        for check in checks:
            with self.assertRaises(InputError) as refused:
                check(path)
            message = str(refused.exception)
            self.assertNotIn("\n", message)
            self.assertRegex(message, f"is {step}, but its manifest.json says step 1:")

    def test_the_trainers_own_state_passes(self):
        ckpt.check_rank_files(self.saved(self.state))
        self.assertEqual(ckpt.load_checkpoint(self.saved(self.state), 0, 1)["step"], 1)


class ChecksumLinesInEitherSha256sumForm(unittest.TestCase):
    """A .sha256 line in either form ``sha256sum -c`` reads ("<hex>  <name>" or the binary
    mode's "<hex> *<name>", with or without its newline) is read; any other line is refused
    as a line of another format, naming the file; a wrong digest is a mismatch. Generated
    contents and names; 30 examples, 300 long."""

    @settings(max_examples=300 if LONG else 30, deadline=None)
    @given(
        data=st.binary(max_size=64),
        name=st.text("abcxyz_.0", min_size=1, max_size=12).filter(lambda n: n not in (".", "..")),
        binary=st.booleans(), newline=st.booleans(),
        damage=st.sampled_from(["none", "upper", "one_space", "tab", "other_name", "digest"]))
    def test_both_forms_read_any_other_line_refused(self, data, name, binary, newline, damage):
        from scaletorch.rules.safe_files import CorruptFileError, sha256, verify_checksum
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, name)
            with open(path, "wb") as f:
                f.write(data)
            digest, sep, shown = sha256(data), " *" if binary else "  ", name
            if damage == "upper":
                digest = digest.upper()
            elif damage == "one_space":
                sep = " "
            elif damage == "tab":
                sep = "\t"
            elif damage == "other_name":
                shown = name + "x"
            elif damage == "digest":
                digest = sha256(data + b"!")
            with open(path + ".sha256", "w") as f:
                f.write(f"{digest}{sep}{shown}" + ("\n" if newline else ""))
            if damage == "none":
                verify_checksum(path)
                return
            with self.assertRaises(CorruptFileError) as refused:
                verify_checksum(path)
            message = str(refused.exception)
            self.assertNotIn("\n", message)
            self.assertIn("does not match" if damage == "digest" else "not a sha256 line", message)


if __name__ == "__main__":
    unittest.main()
