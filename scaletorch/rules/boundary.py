"""The trust boundary: every file that comes from outside the process is read through here.

    regular_file(path, what, max_bytes)   exists, a regular file (not a directory, a FIFO, a
                                          device), at most max_bytes: its size, before a read
    verified(path, what)                  its ``<path>.sha256`` matches, or the user trusted it
    read_bytes / read_text / load_json    the three, then the bytes (text, JSON values)
    parse_json(text, what, kind)          JSON text (a line of a .jsonl) at most NESTING deep;
                                          a key given twice in one object is refused
    load_jsonl(path, what)                a JSON-lines file: its objects, each by parse_json
    load_yaml(text, source)               YAML's safe loader, with size, depth and expansion limits;
                                          a key given twice in one mapping is refused; numbers
                                          as YAML 1.2 reads them (``010`` is 10, ``1:20`` text)
    dump_yaml(values)                     YAML text that load_yaml reads back as ``values``
    number(value, where, ...)             a value read from a file once it is a finite number
                                          (an int if asked, within bounds), else an InputError
                                          naming ``where`` (the file and the field)
    not_finite_as(tensor, dtype)          why a floating tensor is not finite in the dtype the run
                                          casts it to (1e300 in float64 is inf in float32), or ""

Nesting is limited (NESTING levels) because both parsers recurse: a file of 200,000 ``[``
would otherwise end in a RecursionError traceback. An integer longer than INT_DIGITS digits
(Python's own limit for converting text) is refused naming the key, or the YAML line. Any
failure to parse is one InputError.

The readers execute no code from a file: YAML's safe loader builds plain values only, JSON is
data, and the formats with code in them (pickle) are read nowhere but in torch's
``weights_only`` unpickler (``load_tensors_only`` in ``scaletorch/trainer/checkpoint.py``) and
the allow-list unpickler of DCP's ``.metadata`` (``scaletorch/trainer/dcp_pieces.py``).
``tests/test_trust_boundary.py`` scans the code for any other reader that could run code.

Digests are required: a file kind that ScaleTorch writes is read only once its ``.sha256``
matches. A missing, unreadable or wrong digest is an ``InputError``, one line. A file made
elsewhere (a Hugging Face directory from the Hub, a token file of another tool) has none; the
user names it with ``--trust-unchecked PATH`` (a directory trusts the files under it; a digest
that exists is still checked: the flag excuses a missing one only), and
``trust_unchecked`` records that for this process. It is process state on purpose: the user's
statement holds for every reader of the run, however deep, and is set once, from the command
line (``trusting`` scopes it to a block, for code that parses no command line).
"""

import contextlib
import json
import math
import os
import re
import stat
from typing import Any, Dict, Iterable, Iterator, List, Optional, Set

import yaml

from scaletorch.rules.errors import InputError, MissingInputError, clip
from scaletorch.rules.safe_files import (CorruptFileError, checksum_path, read_checksum,
                                         verify_checksum)

__all__ = [
    "CONFIG_BYTES", "INT_DIGITS", "JSON_BYTES", "NESTING", "TRUST_HELP", "YamlSyntaxError",
    "add_trust_flag", "TEXT_BYTES", "UNLIMITED", "YAML_NODES", "is_trusted_unchecked", "kind_of",
    "load_json", "load_jsonl", "dump_yaml", "load_yaml", "not_finite_as", "number", "parse_json",
    "read_bytes", "read_text", "regular_file", "trust_unchecked", "trusting", "verified"
]

CONFIG_BYTES = 1 << 20  # a config YAML: ours are under 2 KB
JSON_BYTES = 64 << 20  # a config.json, an index, a manifest, a flight-recorder dump, a profile
TEXT_BYTES = 1 << 30  # a text to tokenize, a tokenizer.json: read whole into memory
UNLIMITED = 1 << 60  # memory-mapped files (a .bin, safetensors): only what is sampled is read
# Nodes a YAML document may hold once its aliases are expanded: an alias is a reference, cheap
# to parse, but whatever walks the value (the schema, an error message) meets every copy
YAML_NODES = 100_000
NESTING = 100  # levels of lists and mappings in a JSON or YAML value: ours use under 10
# Digits an integer of a file may have: Python's default limit for int(text) (a longer one is a
# ValueError deep inside a parser); ours have under 20
INT_DIGITS = 4300
_trusted: Set[str] = set()  # real paths named with --trust-unchecked

TRUST_HELP = ("read PATH (a file, or every file under a directory) without the .sha256 that "
              "ScaleTorch writes beside its files: for files made elsewhere (a Hugging Face "
              "directory from the Hub, another tool's .bin or torch file). It excuses only a "
              "missing .sha256: one that exists is still checked, and a mismatch refused. "
              "RISK: a damaged or altered file without one is then not detected; it is still "
              "parsed only as data (no code runs). Repeatable.")


def add_trust_flag(parser: Any) -> None:
    """``--trust-unchecked PATH`` (repeatable) on an argparse parser, with its risk in the help;
    the script passes the values to ``trust_unchecked``."""
    parser.add_argument("--trust-unchecked", action="append", default=[], metavar="PATH",
                        help=TRUST_HELP)


def trust_unchecked(paths: Iterable[str]) -> None:
    """The files (or directories) this process reads without a digest (``--trust-unchecked``);
    replaces what an earlier call recorded. InputError for an empty path (``realpath("")`` is
    the current directory: it would trust every file under it) or one that does not exist (a
    typo would trust nothing, silently)."""
    paths = list(paths)
    for path in paths:
        if not path:
            raise InputError("--trust-unchecked '' names no file: give the file or directory "
                             "made elsewhere that you trust")
        if not os.path.lexists(path):
            raise MissingInputError(f"--trust-unchecked {clip(path)} does not exist: give the "
                                    f"file or directory made elsewhere that you trust")
    _trusted.clear()
    _trusted.update(os.path.realpath(p) for p in paths)


@contextlib.contextmanager
def trusting(paths: Iterable[str]) -> Iterator[None]:
    """``--trust-unchecked`` for ``paths`` inside the block only, added to what is trusted (for
    code that loads a file made elsewhere without parsing a command line, e.g. a test)."""
    added = {os.path.realpath(p) for p in paths} - _trusted
    _trusted.update(added)
    try:
        yield
    finally:
        _trusted.difference_update(added)


def is_trusted_unchecked(path: str) -> bool:
    """Whether the user named ``path`` or a directory above it with ``--trust-unchecked``."""
    real = os.path.realpath(path)
    return any(real == t or real.startswith(t.rstrip(os.sep) + os.sep) for t in _trusted)


KINDS = ((stat.S_ISREG, "a file"), (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symlink"),
         (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
         (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str:
    """What a file of ``mode`` (``os.stat``'s, or ``os.lstat``'s) is, in words: "a file", "a
    FIFO", "a character device"... An error line names a path as what it is."""
    return next((words for test, words in KINDS if test(mode)), "no file of a known kind")


def regular_file(path: str, what: str, max_bytes: int, hint: str = "give the file itself") -> int:
    """The size of ``path`` once it is a regular file of at most ``max_bytes`` (a symlink is
    followed); InputError naming ``what``, the path and what it is otherwise, with ``hint``
    for a FIFO or a device (what to give instead). Nothing is read."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise MissingInputError(f"{what} {clip(path)} does not exist") from None
    except OSError as err:  # a symlink loop, a path through a file, no permission
        raise InputError(f"{what} {clip(path)} cannot be opened ({err.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise InputError(f"{what} {clip(path)} is a directory, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{what} {clip(path)} is {kind_of(st.st_mode)}, not a regular file: "
                         f"{hint}")
    if st.st_size > max_bytes:
        raise InputError(f"{what} {clip(path)} has {st.st_size} bytes, over the limit of "
                         f"{max_bytes} for it: it is not the file meant")
    return st.st_size


def verified(path: str, what: str, content: bool = True) -> None:
    """InputError (a CorruptFileError) unless ``path`` matches ``<path>.sha256``. A missing
    digest is an error, unless the user trusted the file with ``--trust-unchecked``: removing
    it must not switch the check off. A digest that exists is checked, trusted or not: the
    flag is for files made elsewhere, which have none. ``content=False``: the digest file
    only, for a pre-flight that must not hash gigabytes (the load that reads the bytes hashes
    them)."""
    side = checksum_path(path)
    if not os.path.lexists(side):
        if is_trusted_unchecked(path):
            return
        raise CorruptFileError(
            f"{what} {clip(path)} has no checksum file {os.path.basename(side)}: ScaleTorch "
            f"writes one beside every file it makes. If the file was made elsewhere and you "
            f"trust it, add --trust-unchecked {clip(path)}")
    try:
        regular_file(side, "checksum file", 4096)
        if content:
            verify_checksum(path)
        else:
            read_checksum(path)
    except InputError as err:
        if not is_trusted_unchecked(path):
            raise
        raise CorruptFileError(
            f"{err}; --trust-unchecked excuses a missing digest only, not one that disagrees: "
            f"if you changed the file on purpose, remove {os.path.basename(side)}") from None


def read_bytes(path: str, what: str, max_bytes: int, digest: bool = True) -> bytes:
    """The bytes of ``path``: a regular file within ``max_bytes``, verified when ``digest``."""
    size = regular_file(path, what, max_bytes)
    if digest:
        verified(path, what)
    try:
        with open(path, "rb") as f:
            return f.read(size)  # what the size check saw, even if the file grew since
    except OSError as err:
        raise InputError(f"{what} {clip(path)} cannot be read ({err.strerror})") from None


def read_text(path: str, what: str, max_bytes: int, digest: bool = False) -> str:
    """The UTF-8 text of ``path`` (``read_bytes``), InputError naming the first bad byte."""
    data = read_bytes(path, what, max_bytes, digest)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InputError(f"{what} {clip(path)} is not text (byte 0x{data[err.start]:02x} at "
                         f"offset {err.start} is not UTF-8)") from None


def _depth(value: Any, limit: int, what: str = "") -> int:
    """How deeply lists and mappings nest in ``value`` (walked with a stack, no recursion),
    counting no further than ``limit + 1``; InputError naming ``what`` at a _LongInt."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= limit:
        item, level = stack.pop()
        if isinstance(item, _LongInt):
            raise _long_int(what, item.digits)
        if isinstance(item, (list, dict)):
            deepest = max(deepest, level)
            stack.extend(
                (v, level + 1) for v in (item.values() if isinstance(item, dict) else item))
    return deepest


class _LongInt:
    """Where JSON held an integer of over INT_DIGITS digits (``_json_int``): refused naming
    its key (``_unique_keys``), or, in a list, the file (``_long_int``)."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _json_int(text: str) -> Any:
    """json's ``parse_int``: the int, or a _LongInt past INT_DIGITS (``int`` would raise a
    ValueError that names neither file nor key)."""
    digits = len(text.lstrip("-"))
    return _LongInt(digits) if digits > INT_DIGITS else int(text)


def _long_int(what: str, digits: int, key: Optional[str] = None) -> InputError:
    at = f" at the key {clip(key)}" if key is not None else ""
    return InputError(f"{what} holds an integer of {digits} digits{at}, over the limit of "
                      f"{INT_DIGITS}: no value of ours is that long; it is not the file meant")


def _unique_keys(pairs: List[Any], what: str) -> Dict[str, Any]:
    """One JSON object from its ``(key, value)`` pairs; InputError naming a key given twice.
    ``json`` keeps the last of two, so which one a reader meant would be decided by order."""
    value: Dict[str, Any] = {}
    for key, item in pairs:
        if key in value:
            raise InputError(f"{what} gives the key {clip(key)} twice in one object: keep "
                             f"one of the two values")
        if isinstance(item, _LongInt):
            raise _long_int(what, item.digits, key)
        value[key] = item
    return value


def parse_json(text: str, what: str, kind: Optional[type] = dict) -> Any:
    """The JSON value of ``text`` (``what`` names it in errors): InputError, one line, when it
    is not JSON, gives a key twice in one object, nests more than NESTING levels, or is not a
    ``kind`` (None: any value)."""
    try:
        value = json.loads(text, object_pairs_hook=lambda pairs: _unique_keys(pairs, what),
                           parse_int=_json_int)
    except RecursionError:  # the C parser recurses per level: far past NESTING
        raise InputError(f"{what} nests lists or objects more than {NESTING} levels deep: it "
                         f"is not the file meant") from None
    except json.JSONDecodeError as err:
        raise InputError(f"{what} is not valid JSON ({str(err)[:200]})") from None
    except (ValueError, OverflowError) as err:  # a conversion inside the parser (a last guard:
        raise InputError(f"{what}: a value refused ({clip(str(err))})") from None  # _json_int)
    if _depth(value, NESTING, what) > NESTING:
        raise InputError(f"{what} nests lists or objects more than {NESTING} levels deep: it "
                         f"is not the file meant")
    if kind is not None and not isinstance(value, kind):
        wanted = "an object" if kind is dict else f"a {kind.__name__}"
        raise InputError(f"{what} holds a {type(value).__name__}, not {wanted}")
    return value


def load_json(path: str, what: str, max_bytes: int = JSON_BYTES, digest: bool = True,
              kind: Optional[type] = dict) -> Any:
    """The JSON value of ``path`` (``read_text``, then ``parse_json``): every JSON file is read
    here; InputError naming the file when it is not a ``kind`` within the limits."""
    return parse_json(read_text(path, what, max_bytes, digest), f"{what} {clip(path)}", kind)


def load_jsonl(path: str, what: str, max_bytes: int = JSON_BYTES) -> List[Dict[str, Any]]:
    """The objects of a JSON-lines file (a metrics.jsonl: ours, but appended to line by line,
    so without a digest), each through ``parse_json``; InputError naming the line number."""
    text = read_text(path, what, max_bytes)
    return [
        parse_json(line, f"{what} {clip(path)} line {n}")
        for n, line in enumerate(text.splitlines(), 1) if line.strip()
    ]


class YamlSyntaxError(InputError):
    """Text that is no YAML at all (a scanner or parser error): a command-line value keeps such
    text as the string it is; a tag the safe loader refuses is a plain InputError."""


MERGE_TAG = "tag:yaml.org,2002:merge"
INT_TAG, FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
# YAML 1.2's core schema for numbers. PyYAML resolves YAML 1.1's: ``010`` is octal 8 there,
# ``1:20`` sexagesimal 80, ``1e-3`` a string; here they read as a reader of the text expects
# (10; text, which a number field refuses; 0.001). Underscores between decimal digits are no
# YAML 1.2, but read as Python writes them (``1_000`` is 1000): a file's value counts as it
# stands, so a number field takes no text, and such a number must be read as one here.
YAML12_INT = re.compile(r"^(?:[-+]?[0-9]+(?:_[0-9]+)*|0o[0-7]+|0x[0-9a-fA-F]+)$")
YAML12_FLOAT = re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
                          r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$")


def _yaml12_numbers(cls: Any) -> Any:
    """``cls`` (a loader or dumper) resolving plain scalars to numbers by YAML 1.2's rules:
    YAML 1.1's int and float patterns removed, 1.2's added (booleans, null stay as they are)."""
    cls.yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in (INT_TAG, FLOAT_TAG)]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    cls.add_implicit_resolver(INT_TAG, YAML12_INT, list("-+0123456789"))
    cls.add_implicit_resolver(FLOAT_TAG, YAML12_FLOAT, list("-+.0123456789"))
    return cls


@_yaml12_numbers
class _LimitedLoader(yaml.SafeLoader):
    """YAML's safe loader (plain values only: no Python object is ever built), refusing
    nesting past NESTING levels as it composes: the composer recurses per level, and the
    scanner slows with every open level, so it stops at the first one too deep. Numbers are
    YAML 1.2's (``_yaml12_numbers``)."""

    def construct_yaml_int(self, node: Any) -> int:
        """A YAML 1.2 int (``0o17``, ``0x1F``, decimal: a leading 0 is decimal still), also
        under an explicit ``!!int``; InputError past INT_DIGITS digits, naming the line."""
        text = str(self.construct_scalar(node))
        digits = len(text.lstrip("-+"))
        if digits > INT_DIGITS:
            raise InputError(f"at line {node.start_mark.line + 1}: an integer of {digits} "
                             f"digits, over the limit of {INT_DIGITS}: no setting is that long")
        try:
            if text[:2] in ("0o", "0x"):
                return int(text[2:], 8 if text[1] == "o" else 16)
            return int(text, 10)
        except ValueError:  # "!!int 1:20", "!!int 0b1": no YAML 1.2 integer
            raise InputError(f"at line {node.start_mark.line + 1}: {clip(text)} is no integer "
                             f"(YAML 1.2: decimal digits, 0o octal or 0x hexadecimal)") from None

    def construct_yaml_float(self, node: Any) -> float:
        """A YAML 1.2 float (``.inf``, ``.nan``, decimal), also under an explicit ``!!float``."""
        text = str(self.construct_scalar(node))
        special = text.lower().lstrip("+")
        if special in (".inf", "-.inf", ".nan"):
            return float(special.replace(".", ""))
        if not YAML12_FLOAT.match(text):  # "!!float 1:20"
            raise InputError(f"at line {node.start_mark.line + 1}: {clip(text)} is no number "
                             f"(YAML 1.2: decimal, .inf or .nan)")
        return float(text)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        """The safe loader's mapping, refusing a key given twice in it (YAML would keep the
        last silently): ``steps: 3`` then ``steps: 5`` is ambiguous, not a choice. A key that a
        merge (``<<: *base``) brings in may be given again: that is what a merge is for."""
        if isinstance(node, yaml.MappingNode):
            first: Dict[Any, int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == MERGE_TAG:
                    continue
                key = self.construct_object(key_node)
                line = key_node.start_mark.line + 1
                if isinstance(key, (str, int, float, bool)) and key in first:
                    raise InputError(f"key {clip(key)} is given twice in one mapping (line "
                                     f"{first[key]} and line {line}): keep one")
                first.setdefault(key, line)
        return super().construct_mapping(node, deep)

    def compose_node(self, parent: Any, index: Any) -> Any:
        self.levels = getattr(self, "levels", 0) + 1
        if self.levels > NESTING:
            raise InputError(f"nested more than {NESTING} levels deep")
        try:
            return super().compose_node(parent, index)
        finally:
            self.levels -= 1


_LimitedLoader.add_constructor(INT_TAG, _LimitedLoader.construct_yaml_int)
_LimitedLoader.add_constructor(FLOAT_TAG, _LimitedLoader.construct_yaml_float)


@_yaml12_numbers
class _Dumper(yaml.SafeDumper):
    """YAML's safe dumper quoting what load_yaml would read as a number: the string ``1e5``
    (plain text to YAML 1.1) is written ``'1e5'``."""


def dump_yaml(values: Any) -> str:
    """``values`` (plain values) as YAML text that ``load_yaml`` reads back equal."""
    return yaml.dump(values, Dumper=_Dumper, sort_keys=False)


def _too_deep(text: str) -> bool:
    """Whether YAML ``text`` nests past NESTING levels, from libyaml's event parser (C, no
    recursion, a millisecond for 20,000 levels; events only, nothing is built). Its syntax
    errors are left to the safe loader, which names them; without libyaml the composer's own
    limit (``_LimitedLoader``) stops it, slower."""
    if not yaml.__with_libyaml__:
        return False
    from yaml.cyaml import CParser  # type: ignore[attr-defined]
    parser, depth = CParser(text), 0
    try:
        while True:
            event = parser.get_event()
            if event is None or isinstance(event, yaml.StreamEndEvent):
                return False
            if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                depth += 1
                if depth > NESTING:
                    return True
            elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                depth -= 1
    except yaml.YAMLError:
        return False
    finally:
        parser.dispose()


def _expanded_nodes(node: yaml.Node, seen: dict, depth: int = 0) -> int:
    """How many nodes ``node`` stands for once every alias is copied out (memoized by node,
    so a 1 KB "billion laughs" costs a few thousand steps to measure, not 10^9)."""
    key = id(node)
    if key in seen:
        if seen[key] is None:  # met again while its own children are being counted
            raise InputError("that holds itself (a recursive alias)")
        return seen[key]
    if depth > NESTING:
        raise InputError(f"nested more than {NESTING} levels deep (aliases expanded)")
    seen[key] = None
    children: list = []
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    total = 1
    for child in children:
        total += _expanded_nodes(child, seen, depth + 1)
        if total > YAML_NODES:
            break
    seen[key] = total
    return total


def _yaml_error(err: yaml.YAMLError, source: str) -> InputError:
    """One line for a YAML error: where, and what (a syntax error, or a tag refused)."""
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = (getattr(err, "problem", None) or str(err).splitlines()[0])[:300]
    if isinstance(err, yaml.constructor.ConstructorError):
        return InputError(f"{source}: YAML{where} {problem}: only plain values (numbers, "
                          f"strings, lists, mappings) are read, no tag builds an object")
    return YamlSyntaxError(f"{source} is not valid YAML{where}: {problem}; fix the syntax "
                           f"there")


def load_yaml(text: str, source: str) -> Any:
    """The value of YAML ``text`` (``source`` names it in errors): the safe loader, refused
    while composing past NESTING levels, before construction when aliases expand it past
    YAML_NODES nodes or it holds itself. Every failure is an InputError (a YamlSyntaxError
    when the text is no YAML)."""
    if len(text) > CONFIG_BYTES:
        raise InputError(f"{source}: {len(text)} characters of YAML, over the limit of "
                         f"{CONFIG_BYTES}")
    if _too_deep(text):
        raise InputError(f"{source}: YAML nested more than {NESTING} levels deep: it is not a "
                         f"config")
    try:  # the reader refuses control characters (a NUL) as it is built
        loader = _LimitedLoader(text)
    except yaml.YAMLError as err:
        raise _yaml_error(err, source) from None
    try:
        try:
            node = loader.get_single_node()
        except InputError as err:  # nested too deep
            raise InputError(f"{source}: YAML {err}: it is not a config") from None
        if node is None:
            return None
        try:  # measure what the aliases expand to before building anything
            nodes = _expanded_nodes(node, {})
        except InputError as err:
            raise InputError(f"{source}: YAML {err}: it is not a config") from None
        if nodes > YAML_NODES:
            raise InputError(f"{source}: YAML whose aliases expand to over {YAML_NODES} "
                             f"values: it is not a config (an alias bomb?)")
        try:
            return loader.construct_document(node)
        except InputError as err:  # a key given twice, an integer too long
            raise InputError(f"{source}: YAML {err}") from None
        except (ValueError, OverflowError) as err:  # the safe loader's own conversions: a
            raise InputError(f"{source}: YAML value refused ({clip(str(err))}): write it as a "
                             f"number or a string") from None  # date 2020-13-45, month 13
    except yaml.YAMLError as err:
        raise _yaml_error(err, source) from None
    except RecursionError:  # a last guard: the limits above stop nesting long before
        raise InputError(f"{source}: YAML nested too deep: it is not a config") from None
    finally:
        loader.dispose()


def number(value: Any, where: str, integer: bool = False, low: float = -math.inf,
           positive: bool = False) -> Any:
    """``value``, a field of a parsed file, as a finite float (``integer``: as the int it is),
    at least ``low`` (``positive``: above 0); InputError naming ``where`` ("profile 'p.json'
    event 3 'ts'") and the value otherwise. A bool is not a number here, though Python's
    ``True`` is 1: a file that writes ``true`` for a count meant something else."""
    kind = int if integer else (int, float)
    wanted = "an integer" if integer else "a finite number"
    if isinstance(value, bool) or not isinstance(value, kind):
        raise InputError(f"{where} is {clip(value)}, not {wanted}: fix or regenerate the file")
    if not integer:
        try:  # an int past float's range (10**400) is as unusable as inf
            value = float(value)
        except OverflowError:
            value = math.inf
        if not math.isfinite(value):
            raise InputError(f"{where} is {clip(value)}, not {wanted}: fix or regenerate the "
                             f"file")
    if integer and abs(value) >= 2**63:  # no count of ours is that large; torch's limit
        raise InputError(f"{where} is {clip(value, 60)}: it must be below 2**63")
    if value < low or (positive and value <= 0):
        bound = "positive" if positive and low <= 0 else f"at least {low:g}"
        raise InputError(f"{where} is {clip(value)}: it must be {bound}")
    return value


def not_finite_as(tensor: Any, dtype: Any) -> str:
    """Why floating ``tensor`` (a torch.Tensor read from a file) holds a value that is not
    finite once cast to ``dtype``, the dtype of the parameter or state it is loaded into, or
    "" when every value is finite there. Checked after the cast: a float64 weight of 1e300 is
    finite in its file and inf in a float32 model, where it would only show as a nan loss."""
    # the tensor's own methods only: the rules stay importable without torch
    cast = tensor.detach().to(dtype) if tensor.dtype != dtype else tensor.detach()
    finite = cast.isfinite()
    if bool(finite.all()):
        return ""
    index = int((~finite).flatten().nonzero()[0])
    value = float(tensor.detach().flatten()[index])
    if value != value or value in (float("inf"), float("-inf")):
        return f"holds {value} (element {index})"
    return (f"holds {value:.4g} (element {index}), beyond the largest {dtype}: it is inf "
            f"once cast to the run's {dtype}")
