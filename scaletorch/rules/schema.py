"""One schema for every value: each config field declares its rule beside it.

    lr: float = checked(3e-3, at_least(0))  # a finite float >= 0
    beta1: float = checked(0.9, fraction())  # a finite float in [0, 1)
    path: Optional[str] = checked(None, unless(existing_file(), "dataset", "synthetic"))

``checked`` is a ``dataclasses.field`` whose metadata holds a ``Rule`` and the field's resume
policy (``resume=``: what a change of it at ``--resume`` does, REFUSED, PRINTED or SILENT;
scaletorch/trainer/resume_check.py compares a checkpoint's config with the resumed one by it).
The field's type is
its annotation; the rule adds what a type cannot say: a range, a set of choices, a path on
disk, or the settings under which the field is read at all. ``check_fields`` walks a
dataclass and raises InputError naming the key, the value and what is allowed. A float is
always finite: no field means anything by inf or nan.

Pure Python: the model, the run's config and the Hugging Face reader share these rules.
"""

import dataclasses
import math
import typing
import unicodedata
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Tuple

from scaletorch.rules.errors import InputError, clip

__all__ = [
    "MAX_LAYERS", "MAX_MICRO_BATCHES", "PRINTED", "REFUSED", "RESHARD", "RESUME", "RESUME_POLICIES",
    "Rule", "SILENT", "at_least", "check_applies", "check_fields", "check_type", "check_value",
    "checked", "conditions", "count", "creatable_dir", "existing_file", "fraction", "ignored_by",
    "one_of", "positive", "path_component", "resume_policy", "rules_of", "text", "unless"
]

RULE = "rule"  # the key of a field's metadata that holds its Rule
RESUME = "resume"  # the key that holds its resume policy, one of RESUME_POLICIES:
REFUSED = "refused"  # a resume that changes it is refused: another run (shapes, data, seed)
RESHARD = "reshard"  # the layout: refused for per-rank checkpoints, printed for dcp ones
PRINTED = "printed"  # allowed, and a line says old -> new (lr, steps, logging)
SILENT = "silent"  # allowed without a word: paths, the resume itself
RESUME_POLICIES = (REFUSED, RESHARD, PRINTED, SILENT)
# characters a run name may not hold: path separators, and (by Unicode category) control,
# format, surrogate and line or paragraph separator characters ("\n", "\x85", "\u200b", "\u2028")
NOT_IN_NAMES = "/\\"
NOT_IN_NAMES_CATEGORIES = ("Cc", "Cf", "Cs", "Zl", "Zp")
NAME_BYTES = 255  # a file name's limit on Linux and macOS, in bytes (UTF-8), not characters


@dataclass(frozen=True)
class Rule:
    """What a field allows beyond its type. ``low``/``high`` bound a number (``*_open``: the
    bound itself is out); ``choices`` is the whole set of values; ``path`` is "file" (must
    exist), "dir" (must be creatable) or "checkpoint" (one to resume), checked on disk with
    the run's other inputs; ``non_empty``: a string with something in it;
    ``ignored_when`` holds (key, values) pairs: the run does not read the field while any of
    those keys holds one of its values, so giving it then is a mistake; ``component``: a
    string that is one path component (no separator, not "." or "..", no control character)
    of at most ``max_len`` characters."""
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    choices: Tuple[Any, ...] = ()
    path: str = ""
    non_empty: bool = False
    ignored_when: Tuple[Tuple[str, Tuple[Any, ...]], ...] = ()
    component: bool = False
    max_len: int = 0

    def allowed(self, kind: Any = float) -> str:
        """What the rule allows, in words: "positive", ">= 0 and finite", "one of a, b, c"."""
        if self.choices:
            return "one of " + ", ".join(str(c) for c in self.choices)
        words = []
        if self.low == 0 and self.low_open and self.high is None:
            words.append("positive")
        elif self.low is not None and self.high is None:
            words.append(f"{'>' if self.low_open else '>='} {_number(self.low)}")
        elif self.low is not None and self.high is not None:
            words.append(f"in {'(' if self.low_open else '['}{_number(self.low)}, "
                         f"{_number(self.high)}{')' if self.high_open else ']'}")
        if self.non_empty:
            words.append("a non-empty string")
        if self.component:
            words.append("one path component (no / or \\, not . or .., no control character)")
        if self.max_len:
            bytes_too = f" and {NAME_BYTES} bytes in UTF-8" if self.component else ""
            words.append(f"at most {self.max_len} characters{bytes_too}")
        if kind is float:
            words.append("finite")
        return " and ".join(words) or _type_name(kind)

    def admits(self, value: Any) -> bool:
        """Whether ``value`` (already of the field's type) is in the rule's range or set."""
        if value is None:
            return True
        if self.choices:
            return value in self.choices
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        if self.high is not None and (value > self.high or (self.high_open and value == self.high)):
            return False
        if self.max_len and isinstance(value, str) and len(value) > self.max_len:
            return False
        if self.component and not is_one_component(value):
            return False
        return not (self.non_empty and value == "")


def is_one_component(name: str) -> bool:
    """Whether ``name`` is one file name as every OS writes it: not "." or "..", no separator,
    no character of NOT_IN_NAMES_CATEGORIES anywhere in it, at most NAME_BYTES in UTF-8."""
    if name in (".", "..") or any(c in NOT_IN_NAMES for c in name):
        return False
    if any(unicodedata.category(c) in NOT_IN_NAMES_CATEGORIES for c in name):
        return False  # also every surrogate, so the encoding below cannot fail
    return len(name.encode("utf-8")) <= NAME_BYTES


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def checked(default: Any, rule: Rule = Rule(), resume: Optional[str] = None) -> Any:
    """A dataclass field with ``default``, its ``rule`` (``Rule()``: the type alone, as for a
    boolean) and its ``resume`` policy (one of RESUME_POLICIES) in the metadata. Every field of
    the run's config declares one (tests/test_resume_policy.py checks it)."""
    if resume is not None and resume not in RESUME_POLICIES:
        raise ValueError(f"resume must be one of {', '.join(RESUME_POLICIES)}, got {resume!r}")
    return dataclasses.field(default=default, metadata={RULE: rule, RESUME: resume})


def resume_policy(cls: Any, name: str) -> Optional[str]:
    """The resume policy field ``name`` of dataclass ``cls`` declares (None: none declared)."""
    return next(f.metadata.get(RESUME) for f in dataclasses.fields(cls) if f.name == name)


def positive() -> Rule:
    """> 0 (an int from 1 on; a float finite too)."""
    return Rule(low=0, low_open=True)


# the largest count a size field takes: the pre-flight's checks walk layers, stages and
# micro-batches one by one, so a count beyond any real model's is refused before it is walked
MAX_LAYERS = 10_000  # model.num_layers, HF num_hidden_layers, virtual pipeline stages
MAX_MICRO_BATCHES = 10_000  # data.num_micro_batches: the schedules list each one's actions


def count(high: int) -> Rule:
    """In [1, ``high``]: a count of layers, stages or micro-batches that a check walks one by
    one (MAX_LAYERS, MAX_MICRO_BATCHES)."""
    return Rule(low=1, high=high)


def at_least(low: float) -> Rule:
    """>= ``low``."""
    return Rule(low=low)


SEED_LIMIT = 2**63  # torch.Generator.manual_seed takes a seed below it (an int64)


def seed_range() -> Rule:
    """In [0, 2**63): a seed torch's generators take (a larger one is an overflow error)."""
    return Rule(low=0, high=SEED_LIMIT, high_open=True)


def fraction() -> Rule:
    """In [0, 1): a probability that is never certain, Adam's betas."""
    return Rule(low=0, high=1, high_open=True)


def one_of(*choices: Any) -> Rule:
    """One of ``choices``, exactly."""
    return Rule(choices=tuple(choices))


def text() -> Rule:
    """A non-empty string."""
    return Rule(non_empty=True)


def path_component(max_len: int = 100) -> Rule:
    """A non-empty string that is one path component of at most ``max_len`` characters and
    NAME_BYTES bytes: a name under a directory that cannot point anywhere else (no separator,
    ".", ".."), nor break a line (``is_one_component``)."""
    return Rule(non_empty=True, component=True, max_len=max_len)


def existing_file() -> Rule:
    """The path of a file that must exist (checked on disk with the run's other inputs)."""
    return Rule(path="file")


def creatable_dir() -> Rule:
    """The path of a directory that must exist or be creatable, and writable (checked on disk
    with the run's other inputs); never empty: "" would be the current directory (the
    checkout), which no one means to write a run into."""
    return Rule(path="dir", non_empty=True)


def unless(rule: Rule, key: str, *values: Any) -> Rule:
    """``rule``, for a field the run ignores while ``key`` holds one of ``values``: given
    then, it is refused rather than silently ignored. ``key`` without a section is in the
    field's own section. Nested, each ``unless`` adds a setting that makes the run ignore it:
    ``unless(unless(r, "cp_variant", "ulysses"), "context_parallel_size", 1)``."""
    return dataclasses.replace(rule, ignored_when=(*rule.ignored_when, (key, values)))


def _kind(annotation: Any) -> Tuple[Any, bool]:
    """(the type under Optional, whether None is allowed)."""
    if typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], True
    return annotation, False


def check_type(key: str, value: Any, annotation: Any) -> None:
    """InputError unless ``value`` is of type ``annotation`` as it is, not converted: an int
    is no bool, a float may be an int, a list holds items of its type, None is Optional."""
    kind, optional = _kind(annotation)
    if value is None:
        if not optional:
            raise InputError(f"{key} must be {_type_name(kind)}, got None")
        return
    if typing.get_origin(kind) is list:
        if not isinstance(value, list):
            raise InputError(f"{key} must be {_type_name(kind)}, got {clip(value)}")
        for item in value:
            check_type(key, item, typing.get_args(kind)[0])
        return
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }[kind](value)
    if not ok:
        raise InputError(f"{key} must be {_type_name(kind)}, got {clip(value)}")


def _type_name(kind: Any) -> str:
    if typing.get_origin(kind) is list:
        item = typing.get_args(kind)[0]
        return "a list of " + {bool: "booleans", int: "ints", float: "floats", str: "strings"}[item]
    return {bool: "true or false", int: "int", float: "float", str: "a string"}[kind]


def check_value(key: str, value: Any, annotation: Any, rule: Rule) -> None:
    """InputError naming ``key``, ``value`` and what is allowed, unless ``value`` has the
    type and fits the rule (each item of a list fits it)."""
    check_type(key, value, annotation)
    kind, _ = _kind(annotation)
    for item in (value if isinstance(value, list) else [value]):
        if not rule.admits(item):
            item_kind = typing.get_args(kind)[0] if typing.get_origin(kind) is list else kind
            raise InputError(f"{key} must be {rule.allowed(item_kind)}, got {clip(item)}")


def rules_of(cls: Any) -> Iterator[Tuple[str, Any, Rule, Any]]:
    """(name, annotation, rule, default) of every field of dataclass ``cls`` that has a rule."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if RULE in f.metadata:
            default = f.default if f.default is not dataclasses.MISSING else None
            yield f.name, hints[f.name], f.metadata[RULE], default


def check_fields(obj: Any) -> None:
    """Check every field of dataclass ``obj`` that has a rule (keys: the field names; the
    run's config names them by section in scaletorch/trainer/config.py)."""
    for name, annotation, rule, _ in rules_of(type(obj)):
        check_value(name, getattr(obj, name), annotation, rule)


def conditions(key: str, rule: Rule) -> List[Tuple[str, Tuple[Any, ...]]]:
    """``rule.ignored_when`` of field ``key``, each other key named in full (a name without a
    section is in ``key``'s section)."""
    section = key.rsplit(".", 1)[0] + "." if "." in key else ""
    return [(other if "." in other else section + other, values)
            for other, values in rule.ignored_when]


def ignored_by(key: str, rule: Rule, setting: Callable[[str], Any]) -> Optional[str]:
    """The first key whose value makes the run ignore ``key`` (``rule.ignored_when``), or None
    when the run reads it. ``setting(other)`` reads another key of the run."""
    for other, values in conditions(key, rule):
        if setting(other) in values:
            return other
    return None


def check_applies(key: str, value: Any, rule: Rule, setting: Callable[[str], Any]) -> None:
    """InputError when ``key`` was given (``value``) but the run ignores it under its other
    settings: a value that would change nothing is a mistake, not a choice."""
    other = ignored_by(key, rule, setting)
    if other is not None and value is not None:
        raise InputError(
            f"{key} {clip(value)} is given, but {other} {setting(other)!r} ignores it: "
            f"remove {key}, or set {other} to a value that reads it")
