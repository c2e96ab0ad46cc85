"""No code runs from a file: the code of scaletorch/, scripts/ and examples/, read as syntax.

A reader that can execute what a file holds (pickle's, torch.load without weights_only=True,
YAML's full or unsafe loaders, np.load with allow_pickle=True, marshal, shelve, eval or exec)
appears nowhere but in ALLOWED, each with the reason it reads no file a user hands us, or
reads it with an allow-list. Every other file is read through scaletorch/rules/boundary.py.
"""

import ast
import hashlib
import io
import json
import os
import pickle
import tempfile
import time
import unittest
import warnings
from typing import List, Tuple

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scaletorch.dist import flight_recorder
from scaletorch.rules import boundary
from scaletorch.rules.errors import InputError, clip
from scaletorch.rules.safe_files import write_checksummed
from scaletorch.trainer.checkpoint import MANIFEST, load_tensors_only, read_manifest
from scaletorch.trainer.config import load_yaml, parse_args
from tests.test_layering import ROOT, python_files

LONG = os.environ.get("SCALETORCH_LONG_TESTS") == "1"
# depths around the limit (100) and far past Python's recursion limit (1000)
DEPTHS = st.one_of(st.integers(1, 130), st.integers(900, 1100), st.integers(5000, 200_000))
OPENERS = st.sampled_from(["[", '{"a": '])
PYTHON_TAGS = st.builds(
    lambda kind, name, args: f"!!python/{kind}{name}{args}",
    st.sampled_from(["object/apply:", "object/new:", "object:", "name:", "module:"]),
    st.sampled_from(["os.system", "subprocess.call", "builtins.eval", "x"]),
    st.sampled_from(["", ' ["true"]', " {}", " [1]"]))
TAGS = st.one_of(PYTHON_TAGS, st.sampled_from(["!foo 1", "!<tag:x.org,2002:y> 1", "!!set {}"]))
FLAG_FORMS = st.sampled_from(["space", "equals", "set"])

# 1 KB of YAML that stands for 9^10 (3.5 billion) values: each line 9 aliases of the one before
ALIAS_BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 9) + "]\n"
    for i in range(9))


class _RunsCode:
    """A pickle that would create a file when unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


# (file, call): why it may stay. Nothing else may call a reader that could run code.
ALLOWED = {
    ("scaletorch/dist/spawn.py", "torch.load(weights_only=False)"):
    "bytes the test harness's parent process pickled in memory for its own ranks (the "
    "function's arguments and results), passed through a pipe: never a file",
    ("scaletorch/dist/flight_recorder.py", "pickle.loads"):
    "the bytes torch's C++ returns in this process (_dump_fr_trace); its JSON dump has no "
    "stacks. The dump is written as JSON, and a pickle dump is refused unread",
    ("scaletorch/trainer/dcp_pieces.py", "pickle.Unpickler"):
    "DCP's .metadata, with find_class restricted to DCP's own dataclasses and torch dtypes "
    "(_MetadataUnpickler): the one documented allow-list unpickler",
}

CODE_READERS = {
    "pickle.load", "pickle.loads", "pickle.Unpickler", "_pickle.load", "_pickle.loads",
    "cPickle.load", "cPickle.loads", "dill.load", "dill.loads", "cloudpickle.load",
    "cloudpickle.loads", "joblib.load", "marshal.load", "marshal.loads", "shelve.open", "yaml.load",
    "yaml.load_all", "yaml.unsafe_load", "yaml.unsafe_load_all", "yaml.full_load",
    "yaml.full_load_all", "yaml.Loader", "yaml.UnsafeLoader", "yaml.FullLoader", "yaml.CLoader",
    "yaml.UnsafeLoader", "eval", "exec", "compile", "pandas.read_pickle", "pd.read_pickle",
    "torch.serialization.load", "np.lib.format.read_array"
}


def dotted(node: ast.AST) -> str:
    """``a.b.c`` of a Name or Attribute chain, "" for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def keyword_is(call: ast.Call, name: str, value: object) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value == value
               for k in call.keywords)


def code_readers(source: str, path: str) -> List[Tuple[int, str]]:
    """(line, what) of every use of a reader that could run code in ``source``."""
    found = []
    aliases = {}  # "from pickle import load as l" -> {"l": "pickle.load"}
    tree = ast.parse(source, path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.Attribute)):
            name = dotted(node)
            head, _, rest = name.partition(".")
            name = aliases.get(head, head) + (f".{rest}" if rest else "")
            name = name.replace("numpy.", "np.")
            if name in CODE_READERS and not (name in ("eval", "exec", "compile")
                                             and not _called(tree, node)):
                found.append((node.lineno, name))
        if isinstance(node, ast.Call):
            name = dotted(node.func)
            head, _, rest = name.partition(".")
            name = aliases.get(head, head) + (f".{rest}" if rest else "")
            if name == "torch.load" and not keyword_is(node, "weights_only", True):
                found.append((node.lineno, "torch.load(weights_only=False)" if keyword_is(
                    node, "weights_only", False) else "torch.load without weights_only=True"))
            if name in ("np.load", "numpy.load") and not keyword_is(node, "allow_pickle", False) \
                    and any(k.arg == "allow_pickle" for k in node.keywords):
                found.append((node.lineno, "np.load(allow_pickle=True)"))
    return found


def _called(tree: ast.AST, name_node: ast.AST) -> bool:
    """Whether ``name_node`` is the function of a call (``eval(...)``, not ``model.eval``)."""
    return any(isinstance(n, ast.Call) and n.func is name_node for n in ast.walk(tree))


def scan() -> List[str]:
    offenders = []
    for path in python_files("scaletorch", "scripts", "examples"):
        rel = os.path.relpath(path, ROOT).replace(os.sep, "/")
        with open(path, encoding="utf-8") as f:
            for line, what in code_readers(f.read(), path):
                if (rel, what) not in ALLOWED:
                    offenders.append(f"{rel}:{line} {what}")
    return offenders


class NoReaderRunsCodeFromAFile(unittest.TestCase):

    def test_no_reader_that_could_run_code_outside_the_allow_list(self):
        self.assertGreater(len(python_files("scaletorch", "scripts", "examples")), 150)
        self.assertEqual(scan(), [], "read files through scaletorch/rules/boundary.py")

    def test_each_allowed_use_is_still_there(self):
        # an entry whose code went away must leave the list, so the list stays the truth
        found = set()
        for rel, _ in ALLOWED:
            with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
                found.update((rel, what) for _, what in code_readers(f.read(), rel))
        self.assertEqual(set(ALLOWED) - found, set())

    def test_the_scan_finds_planted_readers(self):
        planted = """
import pickle, yaml, marshal, shelve
import numpy as np
from pickle import loads as undo
import torch
pickle.load(open("f", "rb"))
undo(b"")
torch.load("f")
torch.load("f", weights_only=False)
torch.load("f", weights_only=True)  # fine
yaml.load("a", Loader=yaml.FullLoader)
yaml.safe_load("a")  # fine
np.load("f", allow_pickle=True)
np.load("f")  # fine
marshal.loads(b"")
shelve.open("f")
eval(open("f").read())
model.eval()  # fine
class U(pickle.Unpickler): pass
"""
        found = [what for _, what in code_readers(planted, "planted.py")]
        self.assertEqual(
            sorted(found),
            sorted([
                "pickle.load", "pickle.loads", "torch.load without weights_only=True",
                "torch.load(weights_only=False)", "yaml.load", "yaml.FullLoader",
                "np.load(allow_pickle=True)", "marshal.loads", "shelve.open", "eval",
                "pickle.Unpickler"
            ]))


class TheBoundaryRefusesBeforeItReads(unittest.TestCase):
    """The mechanisms one at a time, each with the input of the issue: refused in one line,
    in well under a second (a bound that a hang or a full read of 61 MB would exceed)."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.d = self.tmp.name

    def refused(self, fn, *words) -> str:
        start = time.perf_counter()
        with self.assertRaises(InputError) as ctx:
            fn()
        self.assertLess(time.perf_counter() - start, 2.0)  # seconds, on a loaded machine
        message = str(ctx.exception)
        self.assertNotIn("\n", message)
        for word in words:
            self.assertIn(word, message)
        return message

    def test_a_kilobyte_of_yaml_aliases_is_refused_fast(self):
        self.assertLess(len(ALIAS_BOMB), 1024)
        path = os.path.join(self.d, "bomb.yaml")
        with open(path, "w") as f:
            f.write(ALIAS_BOMB)
        self.refused(lambda: load_yaml(path), "aliases expand to over 100000")
        self.refused(lambda: boundary.load_yaml("a: &a [1, *a]", "x"), "holds itself")
        self.refused(lambda: parse_args(["--set", "training.lr=" + "[" * 200 + "]" * 200]),
                     "100 levels")
        # a config that uses an anchor or two as configs do still loads
        self.assertEqual(boundary.load_yaml("a: &lr 0.1\nb: *lr\n", "x"), {"a": 0.1, "b": 0.1})

    def test_a_control_character_anywhere_in_yaml_is_one_line_or_read(self):
        # Found by the long generated phase: a NUL appended to a config raised the YAML
        # reader's own traceback, from where the loader is built, outside its guard.
        chars = [chr(c) for c in [*range(0x20), *range(0x7f, 0xa0), 0xfeff, 0xfffe, 0xffff]]
        for char in chars:
            for text in (char, "a: 1\n" + char, "a: '" + char + "'\n", char + "a: 1\n"):
                try:
                    boundary.load_yaml(text, "x")
                except InputError as err:
                    self.assertNotIn("\n", str(err), repr(text))
                    self.assertTrue(str(err).startswith("x"), repr(text))

    def test_a_61_mb_yaml_is_refused_by_its_size_before_it_is_read(self):
        path = os.path.join(self.d, "big.yaml")
        with open(path, "wb") as f:
            f.truncate(61 << 20)  # sparse: 61 MB that take no disk
        self.refused(lambda: load_yaml(path), "63963136 bytes, over the limit of 1048576")

    def test_a_fifo_is_refused_without_being_opened(self):
        path = os.path.join(self.d, "fifo.yaml")
        os.mkfifo(path)  # opening it would block until a writer comes: none does
        self.refused(lambda: load_yaml(path), "is a FIFO")

    def test_an_error_quotes_at_most_a_few_hundred_characters_of_a_value(self):
        with self.assertRaises(ValueError) as ctx:
            parse_args(["--training.steps", "x" * 100_000])
        self.assertLess(len(str(ctx.exception)), 400)
        self.assertIn("(100002 characters)", str(ctx.exception))
        self.assertEqual(clip("abc"), "'abc'")

    def test_a_pickle_dump_is_refused_and_never_unpickled(self):
        marker = os.path.join(self.d, "ran")
        dumps = os.path.join(self.d, "fr")
        for protocol in (0, 2):  # protocol 0 has no 0x80 mark: it then fails as JSON
            write_checksummed(os.path.join(dumps, "rank_0"),
                              pickle.dumps(_RunsCode(marker), protocol=protocol))
            self.refused(lambda: flight_recorder.load(dumps), "rank_0")
        self.assertFalse(os.path.exists(marker))
        pickle.loads(pickle.dumps(_RunsCode(marker))).close()  # the planted pickle runs code
        self.assertTrue(os.path.exists(marker))

    def test_a_digest_that_is_missing_or_not_a_file_is_refused_unless_trusted(self):
        path = os.path.join(self.d, "dump.json")
        write_checksummed(path, json.dumps({"entries": []}).encode())
        os.remove(path + ".sha256")
        self.refused(lambda: boundary.load_json(path, "x"), "no checksum file", "--trust-unchecked")
        with boundary.trusting([self.d]):
            self.assertEqual(boundary.load_json(path, "x"), {"entries": []})
        os.mkdir(path + ".sha256")
        self.refused(lambda: boundary.load_json(path, "x"), "is a directory")


def _argv(form: str, value: str) -> List[str]:
    """training.lr set to ``value`` the three ways a command line can set a field."""
    return {
        "space": ["--training.lr", value],
        "equals": [f"--training.lr={value}"],
        "set": ["--set", f"training.lr={value}"]
    }[form]


class NestingAndTagsAreOneInputError(unittest.TestCase):
    """Generated: JSON nested to every depth (a manifest with its digest re-written, and any
    JSON file), YAML nested so on the command line, and every kind of tag the safe loader
    refuses. Each ends in one InputError line in under 2 s, never a RecursionError or a YAML
    traceback; past 100 levels it names the depth. The suite runs 40 examples each; the long
    profile (SCALETORCH_LONG_TESTS=1) 400."""

    @classmethod
    def setUpClass(cls):
        parse_args([])  # its first call imports what a config needs: not under the 2 s bound

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.d = self.tmp.name

    def outcome(self, fn) -> str:
        """'' when ``fn`` passes, else its one-line InputError (a ValueError from parse_args,
        which load_config prints as one line); any other exception fails."""
        start = time.perf_counter()
        try:
            fn()
            message = ""
        except ValueError as err:
            message = str(err)
        self.assertLess(time.perf_counter() - start, 2.0)  # seconds, on a loaded machine
        self.assertNotIn("\n", message)
        self.assertLess(len(message), 1500)
        return message

    @settings(max_examples=400 if LONG else 40, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(depth=DEPTHS, opener=OPENERS, closed=st.booleans(), as_manifest=st.booleans())
    def test_json_nested_to_any_depth_is_read_or_one_line(self, depth, opener, closed, as_manifest):
        closer = "]" if opener == "[" else "}"
        text = opener * depth + ("1" + closer * depth if closed else "")
        path = os.path.join(self.d, MANIFEST if as_manifest else "file.json")
        with open(path, "w") as f:
            f.write(text)
        if as_manifest:  # its digest re-written: the values, not the bytes, are wrong
            with open(path + ".sha256", "w") as f:
                f.write(f"{hashlib.sha256(text.encode()).hexdigest()}  {MANIFEST}\n")
            message = self.outcome(lambda: read_manifest(self.d))
        else:
            message = self.outcome(lambda: boundary.load_json(path, "a file", digest=False))
        an_object = opener != "[" and closed and depth <= boundary.NESTING
        self.assertEqual(message == "", an_object and not as_manifest, message)  # no manifest
        if depth > boundary.NESTING and closed:
            self.assertIn(f"more than {boundary.NESTING} levels deep", message)

    @settings(max_examples=400 if LONG else 40, deadline=None)
    @given(depth=DEPTHS, opener=st.sampled_from(["[", "{a: ", "- "]), closed=st.booleans(),
           form=FLAG_FORMS)
    def test_yaml_nested_on_the_command_line_is_one_line_fast(self, depth, opener, closed, form):
        # the flag's text stays small: a block list's indent grows with its depth
        depth = min(depth, 20_000 if opener != "- " else 300)
        closer = {"[": "]", "{a: ": "}", "- ": ""}[opener]
        text = (opener * depth + ("1" + closer * depth if closed else "") if opener != "- " else
                "".join(" " * (2 * i) + "-\n" for i in range(depth)) + " " * 2 * depth + "1")
        message = self.outcome(lambda: parse_args(_argv(form, text)))
        self.assertIn("training.lr", message)  # a list is no learning rate either
        if depth > boundary.NESTING:
            self.assertIn(f"more than {boundary.NESTING} levels deep", message)

    @settings(max_examples=400 if LONG else 40, deadline=None)
    @given(tag=TAGS, form=FLAG_FORMS)
    def test_a_tag_on_the_command_line_is_one_line_naming_the_flag(self, tag, form):
        message = self.outcome(lambda: parse_args(_argv(form, tag)))
        self.assertIn("training.lr", message)  # the flag, or the field a safe tag's value misses
        if tag.startswith("!!python") or not tag.startswith("!!"):
            self.assertIn("--training.lr: YAML", message)
            self.assertIn("could not determine a constructor for the tag", message)

    def test_text_that_is_no_yaml_stays_the_string_given(self):
        from scaletorch.trainer.config import _cli_value
        for text in ("[", "a: b: c", "{"):
            self.assertEqual(_cli_value(text, "--logging.name"), text)


if __name__ == "__main__":
    unittest.main()


def _saved_bytes() -> bytes:
    buffer = io.BytesIO()
    torch.save({
        "model": {
            "w": torch.arange(12.0).view(3, 4)
        },
        "step": 2,
        "rng": [1, 2.0, "x"]
    }, buffer)
    return buffer.getvalue()


class ADamagedTorchFileIsOneInputError(unittest.TestCase):
    """load_tensors_only (every torch file we read): flipped, cut or foreign bytes either load
    or raise one InputError, never torch's own exception (an IndexError from a flipped byte
    reached a user as a traceback, probe 51 round 5) nor a torch warning."""

    @settings(max_examples=2000 if LONG else 150, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def test_any_damage_loads_or_is_one_input_error(self, data):
        good = bytearray(_saved_bytes())
        kind = data.draw(st.sampled_from(["flip", "cut", "junk"]))
        if kind == "flip":
            for at in data.draw(st.lists(st.integers(0, len(good) - 1), min_size=1, max_size=8)):
                good[at] = data.draw(st.integers(0, 255))
        elif kind == "cut":
            good = good[:data.draw(st.integers(0, len(good) - 1))]
        else:
            good = bytearray(data.draw(st.binary(max_size=64)))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a warning would reach the user too
            try:
                load_tensors_only(bytes(good), "rank_00000.pt")
            except InputError as err:
                self.assertIn("rank_00000.pt", str(err))
                self.assertEqual(len(str(err).splitlines()), 1)


def _with_digest(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
    with open(path + ".sha256", "w") as f:
        f.write(f"{hashlib.sha256(text.encode()).hexdigest()}  {os.path.basename(path)}\n")


# A long path as a user may give one: components of letters, spaces, quotes and non-ASCII
LONG_TAILS = st.lists(
    st.text(alphabet="ab '\"\u6f22", min_size=100,
            max_size=200).filter(lambda c: c.strip(" ") != ""), min_size=2,
    max_size=20).map("/".join)
QUOTED = 200 + 60  # clip's 200 characters of a value, its quotes and "... (N characters)"


class EveryQuotedPathIsCut(unittest.TestCase):
    """An error line quotes a path through ``clip``, and InputError cuts any word longer than
    a clipped value (a path inside an OSError's text): a 4,000-character run directory made
    an 8,283-character line. Generated long paths under a file, missing, or no checkpoint,
    through each reader; 15 examples, 200 long."""

    def bounded(self, message: str, quotes: int) -> None:
        self.assertNotIn("\n", message)
        self.assertLess(len(message), 400 + quotes * QUOTED, message[:300])

    @settings(max_examples=200 if LONG else 15, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(tail=LONG_TAILS)
    def test_a_long_path_is_quoted_cut_by_every_reader(self, tail):
        from scaletorch.trainer.config import check_writable
        with tempfile.TemporaryDirectory() as tmp:
            afile = os.path.join(tmp, "afile")
            open(afile, "w").close()
            for read, path, quotes in (
                (lambda p: check_writable("logging.run_dir", p), os.path.join(afile, tail), 3),
                (load_yaml, os.path.join(tmp, tail), 1),
                (read_manifest, os.path.join(tmp, tail), 1),
            ):
                with self.subTest(reader=read), self.assertRaises(ValueError) as refused:
                    read(path)
                self.bounded(str(refused.exception), quotes)

    @settings(max_examples=200 if LONG else 15, deadline=None)
    @given(words=st.lists(st.text(alphabet="ab/'", min_size=1, max_size=5000), max_size=4),
           path=st.text(alphabet="ab/'", min_size=QUOTED + 1, max_size=5000))
    def test_no_word_of_an_input_error_is_longer_than_a_clipped_value(self, words, path):
        message = str(InputError("error in " + " ".join([*words, path]) + " here"))
        self.assertTrue(all(len(word) <= QUOTED for word in message.split(" ")), message[:300])
        self.assertTrue(message.startswith("error in ") and message.endswith(" here"))


class ValuesAParserCannotConvertAreOneLine(unittest.TestCase):
    """Generated: an integer longer than Python converts (4300 digits: a ValueError deep in the
    parser), a YAML date with month 13, in every reader (a flight-recorder dump, a Hugging
    Face config.json, a checkpoint manifest, a metrics line, a config file, a command-line
    value). Each is one InputError naming the file or the flag, and the key where JSON has
    one; never the parser's ValueError, which named neither."""

    @settings(max_examples=200 if LONG else 12, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(reader=st.sampled_from(["dump", "hf", "manifest", "metrics", "yaml", "set"]),
           digits=st.integers(boundary.INT_DIGITS + 1, 50_000), in_list=st.booleans())
    def test_an_integer_past_the_digit_limit_names_its_file_and_key(self, reader, digits, in_list):
        number = "-" * in_list + "7" * digits
        value = f"[1, {number}]" if in_list else number
        with tempfile.TemporaryDirectory() as d:
            json_text = f'{{"vocab_size": {value}}}'
            path = {
                "dump": os.path.join(d, "rank_0"),
                "hf": os.path.join(d, "config.json"),
                "manifest": os.path.join(d, MANIFEST),
                "metrics": os.path.join(d, "metrics.jsonl"),
                "yaml": os.path.join(d, "c.yaml")
            }.get(reader, "--training.steps")
            if reader == "yaml":
                with open(path, "w") as f:
                    f.write(f"training:\n  steps: {value}\n")
            elif reader != "set":
                _with_digest(path, json_text)
            read = {
                "dump": lambda: flight_recorder._load_dump(path, 0),
                "hf": lambda: __import__("scaletorch.models.hf").models.hf.load_hf_config(d),
                "manifest": lambda: read_manifest(d),
                "metrics": lambda: boundary.load_jsonl(path, "metrics file"),
                "yaml": lambda: load_yaml(path),
                "set": lambda: parse_args(["--set", f"training.steps={value}"])
            }[reader]
            with self.assertRaises(InputError) as refused:
                read()
        message = str(refused.exception)
        self.assertNotIn("\n", message)
        self.assertIn(f"{digits} digits", message)
        self.assertIn(path if reader != "set" else "--training.steps", message)
        if reader in ("dump", "hf", "manifest", "metrics") and not in_list:
            self.assertIn("'vocab_size'", message)
        self.assertNotIn("set_int_max_str_digits", message)

    def test_a_yaml_value_its_loader_cannot_build_is_one_line(self):
        for text in ("2020-13-45", "2020-01-01 99:00:00"):
            with self.subTest(text=text):
                with self.assertRaises(InputError) as refused:
                    parse_args(["--set", f"training.lr={text}"])
                self.assertIn("--training.lr", str(refused.exception))
