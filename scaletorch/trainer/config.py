"""Loading a run's configuration: YAML, then the command line, then every value checked.

The fields themselves (one ``Config`` of sections that match the YAML files in
``examples/configs``) live in scaletorch/config.py, re-exported here.
Precedence: dataclass defaults < YAML file < command line. Overrides:

    --training.lr 1e-3          any field, by section and name
    --set training.lr=1e-3      the same, in one token (repeatable)
    --steps 20 --tp 2 ...       short aliases for the fields used most (see ALIASES)

Every value is checked: unknown keys, wrong types and impossible layouts raise ValueError
naming the offending values, before any process group or model exists; so is every file the
run reads (config, data, checkpoint to resume) and every directory it writes (``check_inputs``):
a mistake there is an InputError naming the file and what to do.
"""

import argparse
import contextlib
import dataclasses
import difflib
import json
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import typing
from types import TracebackType
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Type

import torch

from scaletorch.config import (CheckpointConfig, Config, DataConfig, LoggingConfig, ParallelConfig,
                               TrainingConfig, recompute_mode)
from scaletorch.data.datasets import check_data_file, check_synthetic_vocab
from scaletorch.dist import restart_count
# the one layout check (also run by parallelize): re-exported for the scripts
from scaletorch.dist.layout_check import validate_layout
from scaletorch.parallel.mixed_precision import policy_for as precision_policy
from scaletorch.plan.cluster import load_cluster
from scaletorch.rules import boundary
from scaletorch.rules.errors import (INTERRUPTED, TERMINATED, InputError, MissingInputError,
                                     OneLineParser, RunStopped, clip)
from scaletorch.rules.safe_files import write_atomic
from scaletorch.rules.schema import Rule, check_applies, check_value, ignored_by, rules_of
from scaletorch.trainer.checkpoint import (check_rank_files, check_resume, latest_valid_checkpoint,
                                           load_tensors_only, nothing_to_resume, read_manifest)
from scaletorch.trainer.memory_limit import check_memory
from scaletorch.trainer.resume_check import check_resumed
from scaletorch.trainer.run_dir import (check_run_dir, move_aside, other_option, remove_unused,
                                        take_ownership)
from scaletorch.trainer.stops import catch_stop_signals, is_output_failure, stopped

__all__ = [
    "CheckpointConfig", "Config", "DataConfig", "InputError", "LoggingConfig", "ParallelConfig",
    "TrainingConfig", "check_inputs", "load_config", "parse_args", "save_config", "validate",
    "validate_layout"
]

SECTIONS = ("model", "data", "parallel", "training", "checkpoint", "logging")


def sections(cfg: Config) -> Tuple[str, ...]:
    """The sections of ``cfg``: SECTIONS, and a subclass's own (chapter 12's ``vision``)."""
    return tuple(f.name for f in dataclasses.fields(cfg)
                 if dataclasses.is_dataclass(getattr(cfg, f.name)))


# Short command-line flags for the fields every chapter uses.
ALIASES = {
    "--steps": "training.steps",
    "--tp": "parallel.tensor_model_parallel_size",
    "--pp": "parallel.pipeline_model_parallel_size",
    "--cp": "parallel.context_parallel_size",
    "--ep": "parallel.expert_model_parallel_size",
    "--dp": "parallel.data_parallel_size",
    "--impl": "parallel.impl",
    "--zero-stage": "parallel.zero_stage",
    "--schedule": "parallel.schedule",
    "--virtual-stages": "parallel.virtual_pipeline_stages",
    "--cp-variant": "parallel.cp_variant",
    "--layer-split": "parallel.layer_split",
    "--micro-batches": "data.num_micro_batches",
    "--name": "logging.name",
    "--fail-at-step": "training.fail_at_step",
    "--fail-rank": "training.fail_rank",
    "--profile": "logging.profile_steps",
}
RECOMPUTE = "parallel.activation_checkpointing"  # --activation-checkpointing [MODE]
FLAGS = {
    "--sequence-parallel": "parallel.sequence_parallel",
    "--check": "check",
    "--verbose": "logging.verbose",
    "--overwrite": "logging.overwrite",
}


def _convert(value: Any, annotation: Any, key: str, as_typed: bool = False) -> Any:
    """Coerce a YAML or command-line value to the field's type, or raise ValueError.
    ``as_typed`` (a file's value): it counts as it stands, so text (``"2"``, ``"true"``,
    ``"1,3"``) is no number, boolean or list. A command-line value is text by nature: what
    YAML leaves text there (``1,3``, a quoted ``"3"``) is converted."""
    if typing.get_origin(annotation) is typing.Union:  # Optional[T]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    listed = typing.get_origin(annotation) is list
    if as_typed and annotation is not str and (isinstance(value, str) or
                                               (listed and not isinstance(value, list))):
        kind = annotation.__name__ if annotation in (int, float) else (
            "true or false" if annotation is bool else "a list, e.g. [1, 3]")
        try:  # text that would convert was quoted (YAML reads an unquoted 2 as a number)
            _convert(value, annotation, key)
        except ValueError:  # no such value however written (0b10 for an int): no advice
            raise ValueError(f"{key} must be {kind}, got {clip(value)}") from None
        raise ValueError(f"{key} must be {kind}, got {clip(value)}: a value counts as it "
                         f"stands in the file, so write it "
                         f"{'as a YAML list' if listed else 'without quotes'}")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        raise ValueError(f"{key} must be true or false, got {clip(value)}")
    if annotation in (int, float):
        if isinstance(value, bool) or (isinstance(value, str) and not value.isascii()):
            raise ValueError(f"{key} must be {annotation.__name__}, got {clip(value)}")
        try:  # command-line text: Python's decimal, not its other digits (\uff11\uff10)
            converted = annotation(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
            raise ValueError(f"{key} must be {annotation.__name__}, got {clip(value)}") from None
        if annotation is int and isinstance(value, float) and value != converted:
            raise ValueError(f"{key} must be int, got {clip(value)}")
        return converted
    if annotation is str:  # a file's 123 or true is no name: a value counts as it stands
        if not isinstance(value, str):  # (the command line keeps a string field's text)
            quote = ("" if isinstance(value, (list, dict)) or value is None else
                     ": YAML reads an unquoted yes, no, on, off, true, false or number as "
                     "such, so put the text in quotes")
            raise ValueError(f"{key} must be a string, got {clip(value)}{quote}")
        return value
    if typing.get_origin(annotation) is list:  # a YAML list, or "1,3" / "[1,3]" on the CLI
        if isinstance(value, (int, str)) and not isinstance(value, bool):
            value = [v for v in str(value).strip("[] ").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)) or not value:
            raise ValueError(f"{key} must be a non-empty list, e.g. [1, 3], got {clip(value)}")
        item = typing.get_args(annotation)[0]
        return [
            _convert(v.strip() if isinstance(v, str) and not as_typed else v, item, key, as_typed)
            for v in value
        ]
    return value


def _field_types(obj: Any) -> Dict[str, Any]:
    return typing.get_type_hints(type(obj))


def is_text_field(cfg: Config, key: str) -> bool:
    """Whether ``key`` names a field of type str (or Optional[str]): its command-line value
    stays the text typed ("--name 123" is "123", "--name -" is "-"), not what YAML reads."""
    section, _, name = key.rpartition(".")
    target = getattr(cfg, section, None) if section else cfg
    if target is None or not dataclasses.is_dataclass(target):
        return False
    kind = _field_types(target).get(name)
    if typing.get_origin(kind) is typing.Union:
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    return kind is str


def unknown_key(cfg: Config, key: str) -> Optional[str]:
    """Why ``key`` names no field of ``cfg``, listing the valid keys of the level where it goes
    wrong (the top level: the sections and the top-level fields; a section: its fields) and
    the nearest one; None when it names a field."""
    top = [n for n in _field_types(cfg) if n not in sections(cfg)]
    section, *rest = key.split(".")
    if not rest:
        if section in top:
            return None
        if section in sections(cfg):
            return (f"config key {clip(key)} is a section, not a value: give its fields, as "
                    f"{section}.NAME")
        wrong, valid, where = section, [*sections(cfg), *top], "at the top level (sections first)"
    elif section not in sections(cfg):
        wrong, valid, where = section, list(sections(cfg)), "before the dot (the sections)"
    elif len(rest) == 1 and rest[0] in _field_types(getattr(cfg, section)):
        return None
    else:
        wrong, valid = ".".join(rest), list(_field_types(getattr(cfg, section)))
        where = f"in section {section}"
    near = difflib.get_close_matches(wrong, valid, n=1)
    nearest = f" (did you mean {near[0]!r}?)" if near else ""
    # a field given in the wrong section (training.zero_stage), or without its section
    elsewhere = [
        name if owner is None else f"{owner}.{name}" for owner, name in _all_fields(cfg)
        if name == key.rsplit(".", 1)[-1] and f"{owner}.{name}" != key
    ]
    if elsewhere:
        nearest = f" (it is {' or '.join(map(repr, elsewhere))})"
    return f"unknown config key {clip(key)}{nearest}; valid keys {where}: {', '.join(valid)}"


def _all_fields(cfg: Config) -> List[Tuple[Optional[str], str]]:
    """(section, name) of every field (section None: a top-level field)."""
    return [(None, n) for n in _field_types(cfg) if n not in sections(cfg)] + [
        (section, n) for section in sections(cfg) for n in _field_types(getattr(cfg, section))
    ]


def _spelled(cfg: Config, token: str) -> str:
    """" (it is --vision.batchnorm)" when an unknown ``--batchnorm`` names a field of ``cfg``
    (an option chapter 12 had of its own, now a dotted key as in every chapter); else ""."""
    name = token[2:].split("=", 1)[0].replace("-", "_")
    keys = [f"--{s}.{n}" for s, n in _all_fields(cfg) if s and n == name]
    return f" (it is {' or '.join(keys)})" if token.startswith("--") and keys else ""


def set_value(cfg: Config, key: str, value: Any, as_typed: bool = False) -> None:
    """Set ``section.name`` (or a top-level name) on ``cfg``, converting the type
    (``as_typed``: a file's value, which counts as it stands; see ``_convert``)."""
    why = unknown_key(cfg, key)
    if why is not None:
        raise ValueError(why)
    section, _, name = key.rpartition(".")
    target = getattr(cfg, section) if section else cfg
    types = _field_types(target)
    if key == RECOMPUTE and str(value).lower() in ("true", "false"):  # older configs' form
        value = recompute_mode(value)
    setattr(target, name, _convert(value, types[name], key, as_typed))


def _flattened(values: Dict[str, Any], cfg: Config) -> List[Tuple[str, Any, str]]:
    """The settings of a YAML file as ``(section.name, value, how the file spelled it)``: a
    section's key, or a dotted key at the top level (``"training.steps": 3``)."""
    flat = []
    for section, body in values.items():
        if section in sections(cfg):
            if not isinstance(body, dict):
                raise ValueError(f"section {section!r} must be a mapping")
            flat += [(f"{section}.{name}", value, f"in section {section}")
                     for name, value in body.items()]
        else:
            flat.append((section, body, f"as the top-level key {clip(section)}"))
    return flat


def apply_dict(cfg: Config, values: Dict[str, Any], source: str = "config") -> Dict[str, Any]:
    """Apply a nested dict (as read from YAML) onto ``cfg``, each value checked against its
    rule; the keys it gave, with their values (whether the run reads them depends on the
    command line too: ``parse_args`` checks that once every value is in). A key the file gives
    twice, in a section and as a dotted top-level key, is refused: no order decides it."""
    if not isinstance(values, dict):
        raise InputError(f"{source} must be a mapping of sections, got {type(values).__name__}")
    try:
        given: Dict[str, Any] = {}
        spelled: Dict[str, Tuple[Any, str]] = {}
        for key, value, how in _flattened(values, cfg):
            if key in spelled:
                value0, how0 = spelled[key]
                raise ValueError(f"{key} is given twice: {clip(value0)} {how0} and "
                                 f"{clip(value)} {how}; keep one")
            spelled[key] = (value, how)
            set_value(cfg, key, value, as_typed=True)
            if "." in key:  # a section's field, however the file spelled it
                given[key] = value
        check_schema(cfg)  # the file's own values
        # LlamaConfig validates itself on construction; re-run its checks after edits.
        cfg.model.__post_init__()
    except ValueError as err:  # a value of the file: say which file holds it
        raise InputError(f"{source}: {err}") from None
    return given


def load_yaml(path: str) -> Dict[str, Any]:
    """The settings of a YAML config file, read through the trust boundary (at most
    ``boundary.CONFIG_BYTES``, aliases expanded to at most ``boundary.YAML_NODES`` values);
    InputError naming it when it cannot be one. A config is the user's own text: no digest."""
    if not os.path.lexists(path):
        raise MissingInputError(f"config file {clip(path)} does not exist; each script's "
                                f"defaults are in examples/configs/")
    if os.path.isdir(path):
        raise InputError(f"config file {clip(path)} is a directory, not a file: give a YAML file "
                         f"such as examples/configs/00_single_device.yaml")
    boundary.regular_file(path, "config file", boundary.CONFIG_BYTES)
    try:
        with open(path, "rb") as f:
            data = f.read(boundary.CONFIG_BYTES)
        values = boundary.load_yaml(data.decode("utf-8"), f"config file {clip(path)}")
    except UnicodeDecodeError as err:
        raise InputError(f"config file {clip(path)} is not text (byte "
                         f"0x{err.object[err.start]:02x} at offset {err.start} is not UTF-8): "
                         f"give a YAML file") from None
    except OSError as err:  # e.g. no permission to read it
        raise InputError(f"config file {clip(path)} cannot be read ({err.strerror}): give a file "
                         f"you can read") from None
    if values is None:
        raise InputError(f"config file {clip(path)} holds no settings: give a YAML file of "
                         f"sections, as in examples/configs/")
    return values


def _cli_value(text: str, source: str) -> Any:
    """A command-line value as YAML reads it ("1e-3" -> 0.001, "[1, 3]" -> a list), through the
    same limits as a file's values, or the string as given when it is no YAML at all ("[",
    "a: b: c") or YAML's null (" ", "~"): the field's rule then judges it, in one line, instead
    of a YAML traceback. A tag the safe loader refuses (``!!python/...``) is an InputError
    naming the flag: it is YAML, asking for an object."""
    if text == "":
        return text
    try:
        value = boundary.load_yaml(text, source)
    except boundary.YamlSyntaxError:
        return text
    # YAML reads " " and "~" as null: the text stays (an Optional field's "null" is None still)
    return text if value is None else value


def check_given_once(overrides: List[Tuple[str, Any, str]]) -> None:
    """InputError when the command line gives one key in two spellings ((key, value, how)
    each: the flag that gave it): ``--set training.steps=3 --steps 2`` is ambiguous, so
    neither is taken. One flag repeated keeps its last value, the shell's convention that
    wrappers rely on to override; a config file's value may be overridden, by design."""
    first: Dict[str, Tuple[Any, str]] = {}
    for key, value, how in overrides:
        if key in first and first[key][1].rstrip("= ") != how.rstrip("= "):
            value0, how0 = first[key]
            raise InputError(f"{key} is given twice on the command line ({how0}{clip(value0)} "
                             f"and {how}{'' if how.endswith('=') else ' '}{clip(value)}): "
                             f"give it once")
        first[key] = (value, how if how.endswith("=") else how + " ")


def parse_args(argv: Optional[Sequence[str]] = None, default_config: Optional[str] = None,
               description: str = "", unread: Optional[Dict[str, str]] = None,
               config_class: Type[Config] = Config,
               options: Optional[argparse.ArgumentParser] = None) -> Config:
    """Build a Config from dataclass defaults, ``--config`` YAML and command-line overrides.

    ``unread``: {key or section prefix ("parallel."): why} of what the script never reads;
    such a key given (not its default) is refused like a value the layout ignores.
    ``config_class``: Config, or a subclass with a section of its own (chapter 12's).
    ``options``: the script's own parser (``add_help=False``), which has taken its flags out of
    ``argv`` already; ``--help`` lists them, under its argument groups' titles."""
    parser = OneLineParser(
        parents=[options] if options is not None else [], description=description,
        epilog="Any field can be overridden as --section.name VALUE or --set section.name=VALUE. "
        "--validate-only --world-size N: check the config for N ranks and exit (0: valid).")
    parser.add_argument("--config", default=default_config, help="YAML config file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one field, e.g. --set training.lr=1e-3")
    parser.add_argument("--resume", nargs="?", const="latest", default=None,
                        help="resume from the latest checkpoint (or the directory given)")
    boundary.add_trust_flag(parser)
    for flag, key in ALIASES.items():
        parser.add_argument(flag, dest=key, default=None, help=f"= {key}")
    for flag, key in FLAGS.items():
        parser.add_argument(flag, dest=key, action="store_true", default=None, help=f"= {key}")
    parser.add_argument("--activation-checkpointing", dest=RECOMPUTE, nargs="?", const="full",
                        default=None, help=f"= {RECOMPUTE}: none | selective | full (alone: full)")
    args, rest = parser.parse_known_args(argv)
    boundary.trust_unchecked(args.trust_unchecked)

    cfg = config_class()
    in_file: Dict[str, Any] = {}
    if args.config:
        in_file = apply_dict(cfg, load_yaml(args.config), source=args.config)
    overrides: List[tuple] = []
    i = 0
    while i < len(rest):  # --section.name VALUE or --section.name=VALUE
        token = rest[i]
        if not token.startswith("--") or "." not in token:
            raise ValueError(f"unrecognized argument {clip(token)}{_spelled(cfg, token)} "
                             f"(see --help)")
        if "=" in token:
            key, value = token[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(rest):
                raise ValueError(f"{clip(token)} needs a value")
            key, value = token[2:], rest[i + 1]
            i += 2
        overrides.append((key, value, f"--{key}"))
    for item in args.set:
        if "=" not in item:
            raise ValueError(f"--set takes KEY=VALUE, got {clip(item)}")
        key, value = item.split("=", 1)
        overrides.append((key, value, f"--set {key}="))
    named = {key: flag for flag, key in [*ALIASES.items(), *FLAGS.items()]}
    named[RECOMPUTE] = "--activation-checkpointing"
    for key in list(ALIASES.values()) + list(FLAGS.values()) + [RECOMPUTE]:
        value = getattr(args, key)
        if value == []:  # argparse drops the value "--" of "--name=--", leaving []
            value = "--"
        if value is not None:
            overrides.append((key, value, named[key]))
    check_given_once(overrides)
    given = {}
    for key, value, _ in overrides:
        if isinstance(value, str) and not is_text_field(cfg, key):
            value = _cli_value(value, f"--{key}" if len(key) <= 100 else clip(f"--{key}"))
        set_value(cfg, key, value)
        given[key] = value
    if args.resume is not None:
        cfg.checkpoint.resume = args.resume
    check_schema(cfg, given)
    check_read(cfg, given, unread or {})
    if args.config and args.config != default_config:  # the user's file (a script's own may
        try:  # set what a layout given on the command line then ignores, e.g. a schedule)
            mine = {k: v for k, v in in_file.items() if k not in given}
            check_given(cfg, mine)
            check_read(cfg, mine, unread or {})
        except ValueError as err:
            raise InputError(f"{args.config}: {err}") from None
    cfg.model.__post_init__()
    validate(cfg)
    return cfg


Limits = Callable[[Config, int], None]  # a script's own refusals: limits(cfg, world_size)
# the runs a script makes of one config, each in a directory of its own under the run's
# (06b: one per remedy); each resumes its own checkpoints: parts(cfg) -> their configs
Parts = Callable[[Config], List[Config]]


def load_config(default_config: str, description: str, limits: Optional[Limits] = None,
                argv: Optional[Sequence[str]] = None, resume_files: bool = False,
                unread: Optional[Dict[str, str]] = None, config_class: Type[Config] = Config,
                options: Optional[argparse.ArgumentParser] = None,
                parts: Optional[Parts] = None) -> Config:
    """A script's config, checked for the world it is launched into before anything starts.

    ``parse_args``, then ``validate(cfg, world_size)`` (the one layout check), the script's
    own ``limits(cfg, world_size)`` and ``check_inputs`` (the checkpoint to resume, a file too
    if ``resume_files``; the directories to write), with ``world_size`` from torchrun's
    WORLD_SIZE (1 without torchrun). A mistake is one line ``error: ...`` on stderr, printed by
    rank 0 only, and every rank exits with status 2: no traceback, not once per rank. An
    InputError raised later (a file's fault found only while it is read) ends the script the
    same way (``report_input_errors``); any other exception keeps its traceback.

    ``--validate-only --world-size N`` (scripts/launch.sh runs it before torchrun) checks the
    config for N ranks and exits: 0 if it can run, 2 with the error line if not. ``options``:
    the script's own parser, for ``--help`` (``parse_args``). ``parts``: the runs the script
    makes of ``cfg`` (``check_inputs`` checks their resumes, not the run's own).
    """
    pre = OneLineParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--validate-only", action="store_true")
    pre.add_argument("--world-size", type=int, default=None)
    known, rest = pre.parse_known_args(argv)
    world_size = known.world_size if known.world_size is not None else int(
        os.environ.get("WORLD_SIZE", "1"))
    try:
        if world_size < 1:  # scripts/launch.sh refuses it first; a direct call may not
            raise InputError(f"--world-size must be at least 1, got {world_size}")
        cfg = parse_args(rest, default_config, description, unread, config_class, options)
        validate(cfg, world_size)
        if limits is not None:
            limits(cfg, world_size)
        if config_class is Config:  # the planner models the Llama, not chapter 12's ResNet
            check_memory(cfg, world_size)  # the planner's estimate against the device
        check_inputs(cfg, world_size, resume_files, parts)
        if known.validate_only:
            sys.exit(0)
        # before any blocking setup: SIGTERM ends in one line, as Ctrl-C does, in every rank
        catch_stop_signals(cfg, note_for_launcher)  # (stops.py)
        sys.excepthook = report_input_errors
        # --overwrite: the old run is kept, renamed (rank 0, before any rank writes)
        lines = move_aside(cfg) if int(os.environ.get("RANK", "0")) == 0 else []
        # the settings this resume changes (checked above)
        notes = [resume_note(part) for part in (parts(cfg) if parts else [cfg])]
        lines += [n for n in notes if n] if int(os.environ.get("RANK", "0")) == 0 else []
        take_ownership(cfg)  # this run's lock on its directories, for its whole life
    except (ValueError, FileNotFoundError) as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {err}", file=sys.stderr, flush=True)
        else:  # torchrun stops every rank when one exits: let rank 0 print its line first
            time.sleep(5)
        sys.exit(2)
    for line in lines:
        print(line, flush=True)
    return cfg


def quiet_on_stop_signals() -> None:
    """While the error is reported, SIGTERM or SIGINT ends this process at once, with no more
    output: torchrun stops the other ranks once one rank has exited with its error, and the
    run's stop handler would raise a second exception inside this hook (a traceback)."""
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)


def report_input_errors(kind: Type[BaseException], err: BaseException,
                        tb: Optional[TracebackType]) -> None:
    """sys.excepthook of a script past load_config: an InputError that escapes it is printed
    as ``error: ...`` by one rank and the process exits with status 2; a RunStopped (Ctrl-C,
    a non-finite loss) is its one line and its exit status; anything else is a bug
    and gets Python's traceback. Rank 0 prints at once; another rank waits, so that when rank 0
    has the same error torchrun stops this rank before it repeats the line.

    Under torchrun with several ranks, a bug's traceback goes to torchrun's error file instead
    (``write_error_file``): scripts/torchrun.py then prints the traceback of the rank that
    failed first, once, and one line for every other rank."""
    if isinstance(err, KeyboardInterrupt) or is_output_failure(err):  # outside the loop: a
        err = stopped(err)  # Ctrl-C, SIGTERM, or stdout failing (| head, > /dev/full)
    quiet_on_stop_signals()
    if isinstance(err, RunStopped):  # a signal, a non-finite loss: one line, its own status
        rank = int(os.environ.get("RANK", "0"))
        if rank != 0 and err.exit_code in (INTERRUPTED, TERMINATED):
            note_for_launcher(err)
            os._exit(err.exit_code)
        if rank != 0:
            time.sleep(5)
        sys.stdout.flush()
        print(err, file=sys.__stderr__, flush=True)
        os._exit(err.exit_code)
    if not isinstance(err, InputError):
        error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if error_file and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            write_error_file(error_file, err, tb)
            return  # the process exits with status 1
        sys.__excepthook__(kind, err, tb)
        return
    remove_unused()  # a run directory this run made and never wrote to: nothing is left
    if int(os.environ.get("RANK", "0")) != 0:
        time.sleep(5)
    sys.stdout.flush()
    # sys.__stderr__: torch's init_process_group wraps this hook, with sys.stderr a buffer it
    # prints (prefixed "[rank0]:") when the hook returns, and this one exits first
    print(f"error: {err}", file=sys.__stderr__, flush=True)
    os._exit(2)  # the exit status of load_config's refusals (scripts/torchrun.py keeps it quiet)


def one_traceback(err: BaseException) -> str:
    """``err``'s traceback as one: a chain ("raise ... from err", as the trainer adds where a
    step failed) is Python's traceback per exception; here the frames of the whole chain come
    in one stack, down to where the first exception was raised, and its message, then the
    message of each exception that wrapped it."""
    chain = [err]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)  # type: ignore[arg-type]
    frames: List[traceback.FrameSummary] = []
    for i, e in enumerate(chain):
        stack = traceback.extract_tb(e.__traceback__)
        frames.extend(stack if i == len(chain) - 1 else stack[:-1])  # the last one re-raised
    lines = ["Traceback (most recent call last):\n", *traceback.format_list(frames)]
    lines += traceback.format_exception_only(type(chain[-1]), chain[-1])
    for e in reversed(chain[:-1]):
        lines.append(f"(raised again as {type(e).__name__}: {e})\n")
    return "".join(lines)


def note_for_launcher(stop: RunStopped) -> None:
    """A stop on a rank other than 0, for torchrun's error file. Rank 0 says it when every rank
    got the signal; when this rank alone got it (a scheduler's or an OOM handler's kill), rank
    0 may die blocked in a collective, so scripts/torchrun.py prints this once."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        with contextlib.suppress(OSError):
            write_error_file(error_file, stop, stop.__traceback__)


def write_error_file(path: str, err: BaseException, tb: Optional[TracebackType]) -> None:
    """torchrun's error file (the format of torch's ``@record``), plus the time in ns: the
    launcher tells which rank failed first, and the others failed because of it."""
    now = time.time()
    data = {
        "message": {
            "message": f"{type(err).__name__}: {err}",
            "extraInfo": {
                "py_callstack": one_traceback(err),
                "timestamp": str(int(now)),
            },
        },
        "scaletorch": {
            "rank": int(os.environ.get("RANK", "0")),
            "time": now
        },
    }
    # atomically: once one rank fails, torchrun stops the others (SIGTERM) and reads every
    # stopped rank's file at once; half a file, from a rank stopped while writing, would make
    # torchrun fail on it (a JSONDecodeError) instead of restarting the ranks
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def check_inputs(cfg: Config, world_size: int, resume_files: bool = False,
                 parts: Optional[Parts] = None) -> None:
    """What ``validate`` cannot see without touching the disk: the checkpoint to resume fits
    this run (``check_resume``), the run directory holds no other run (``check_run_dir``),
    and it (and checkpoint.dir when checkpoints are saved) can be created and written.
    ``parts``: each part's checkpoint instead (``check_part_resumes``). InputError naming the
    path."""
    check_run_dir(cfg)  # a live run's lock first: its line says why nothing else is checked
    if parts is not None:
        check_part_resumes(cfg, parts(cfg), world_size, resume_files)
    else:
        check_one_resume(cfg, world_size, resume_files)
    outputs = {"logging.run_dir": cfg.run_path}
    if cfg.checkpoint.every > 0:
        outputs["checkpoint.dir"] = cfg.checkpoint_path
    for key, path in outputs.items():
        check_writable(key, path)


def check_one_resume(cfg: Config, world_size: int, resume_files: bool = False,
                     finished_ok: bool = False) -> None:
    """The checkpoint ``cfg`` resumes fits it and (unless ``finished_ok``) leaves steps to
    train (InputError)."""
    check_resume(cfg, world_size, resume_files)
    if not finished_ok:
        check_resume_step(cfg)
    resume_note(cfg)  # the checkpoint's run against this one, field by field
    resumed = resumed_checkpoint(cfg)
    if resumed is not None and os.path.isdir(resumed):  # its values, before a directory is made
        check_rank_files(resumed)


def check_part_resumes(cfg: Config, parts: List[Config], world_size: int,
                       resume_files: bool = False) -> None:
    """``--resume`` of a run made of ``parts`` (Parts): each part that has a checkpoint (its
    ``checkpoint.resume`` set) must fit it; a part without one starts at step 0, a finished
    one trains nothing. InputError when no part has a checkpoint, or every part is finished."""
    resumed = [part for part in parts if part.checkpoint.resume]
    if cfg.checkpoint.resume and not resumed and restart_count() == 0:
        raise nothing_to_resume(cfg.run_path, [])
    for part in resumed:
        check_one_resume(part, world_size, resume_files, finished_ok=True)
    if len(resumed) == len(parts):  # every part finished: the first one's line
        for part in parts:
            if (resumed_step(part) or 0) < part.training.steps:
                return
        check_resume_step(parts[0])


def resumed_checkpoint(cfg: Config) -> Optional[str]:
    """The checkpoint ``--resume`` names ("latest": the newest that verifies), or None: no
    resume, none found, or a torchrun restart (which resumes whatever it finds, unchecked)."""
    resume = cfg.checkpoint.resume
    if resume is None or restart_count() > 0:
        return None
    return latest_valid_checkpoint(cfg.checkpoint_path)[0] if resume == "latest" else resume


def resume_note(cfg: Config) -> Optional[str]:
    """InputError when the resumed checkpoint's run differs from ``cfg`` in a field a resume
    may not change; else the line naming the changes it may make (None: none), which
    ``load_config`` prints (resume_check.py)."""
    path = resumed_checkpoint(cfg)
    if path is None or os.path.isfile(path):  # a consolidated file holds no config
        return None
    return check_resumed(path, read_manifest(path), cfg)


def check_resume_step(cfg: Config) -> None:
    """InputError when the checkpoint that ``--resume`` names (or the latest) is at or past
    ``training.steps``: nothing is left to train, and the run would end on a report of no
    steps. Both numbers are named. A torchrun restart resumes whatever it finds, unchecked."""
    path, step = resumed_checkpoint(cfg), resumed_step(cfg)
    if path is not None and step is not None and step >= cfg.training.steps:
        raise InputError(f"--resume {path} is at step {step}, and training.steps is "
                         f"{cfg.training.steps}: nothing is left to train; give --steps above "
                         f"{step} to continue it, or start a new run without --resume")


def resumed_step(cfg: Config) -> Optional[int]:
    """The step of the checkpoint ``--resume`` names (``resumed_checkpoint``), None if none."""
    path = resumed_checkpoint(cfg)
    if path is None:
        return None
    if os.path.isfile(path):  # a consolidated file (check_resume read it already)
        step = load_tensors_only(path, f"--resume {path}", mmap=True).get("step")
    else:
        step = read_manifest(path).get("step")
    return step if isinstance(step, int) else None


def check_writable(key: str, path: str) -> None:
    """InputError unless directory ``path`` exists or can be created, and can be written.

    Writes nothing that stays: the nearest existing ancestor is probed with an empty directory
    that is removed at once (permission bits do not tell: root writes through them, no one
    writes to a read-only filesystem)."""
    for attempt in range(3):  # rank 0's --overwrite may rename the directory meanwhile: again
        existing = os.path.abspath(path)
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            what = boundary.kind_of(os.stat(existing).st_mode)
            if existing == os.path.abspath(path):  # the run's own directory, the last name
                raise InputError(f"{key}: {clip(path)} is {what}, not a directory: the run "
                                 f"makes its directory there; nothing was written: give "
                                 f"another {other_option(key)}, or remove or rename it")
            raise InputError(
                f"{key}: cannot create {clip(path)}, since {clip(existing)} is {what}; "
                f"give a directory path with --{key}")
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".scaletorch-probe-", dir=existing))
            return
        except FileNotFoundError as err:
            if not os.path.isdir(existing):  # renamed meanwhile: probe again
                continue
            # still there: the filesystem refuses new entries (/proc answers "No such file")
            raise InputError(f"{key}: cannot write {clip(path)}: {clip(existing)} exists but "
                             f"refuses new entries (it answers {err.strerror!r}); give a "
                             f"directory you can write with --{key}") from None
        except OSError as err:
            raise InputError(
                f"{key}: cannot write {clip(path)} ({clip(existing)}: {err.strerror}); "
                f"give a directory you can write with --{key}") from None
    raise InputError(f"{key}: {clip(path)} was renamed or removed while it was probed, 3 times: "
                     f"is another run moving it?")


def schema(cfg: Config) -> Iterator[Tuple[str, Any, Any, Rule, Any]]:
    """(key, value, annotation, rule, default) of every field of ``cfg``, section by section,
    as the dataclasses in scaletorch/config.py declare them."""
    for section in ("", *sections(cfg)):
        obj = getattr(cfg, section) if section else cfg
        prefix = f"{section}." if section else ""
        for name, annotation, rule, default in rules_of(type(obj)):
            yield prefix + name, getattr(obj, name), annotation, rule, default


def setting(cfg: Config, key: str) -> Any:
    """The value of ``section.name`` (or a top-level name) in ``cfg``."""
    section, _, name = key.rpartition(".")
    return getattr(getattr(cfg, section) if section else cfg, name)


def check_schema(cfg: Config, given: Optional[Dict[str, Any]] = None) -> None:
    """Every value of ``cfg`` against its field's rule (type, range, choices), then every key
    the user ``given`` (a default is not given: a saved config.yaml lists them all) against
    the settings that make the run read it. InputError naming the key, the value and what is
    allowed. (Paths are checked on disk by ``validate`` and ``check_inputs``.)"""
    for key, value, annotation, rule, _ in schema(cfg):
        check_value(key, value, annotation, rule)
    check_given(cfg, given or {})


def check_read(cfg: Config, given: Dict[str, Any], unread: Dict[str, str]) -> None:
    """InputError for a key the user ``given`` (not its default) that the script never reads:
    ``unread`` maps keys or section prefixes to why (``load_config``'s argument)."""
    defaults = {key: default for key, _, _, _, default in schema(cfg)}
    for key, value in given.items():
        for prefix, why in unread.items():
            if key.startswith(prefix) and key in defaults and value != defaults[key]:
                raise InputError(f"{key} {setting(cfg, key)!r} is given, but this script does "
                                 f"not read {prefix.rstrip('.')}: {why}; remove {key}")


def check_given(cfg: Config, given: Dict[str, Any]) -> None:
    """InputError for a key the user ``given`` with a value other than its default that ``cfg``
    does not read: its rule's ``unless`` settings hold (``parallel.schedule`` at pp 1,
    ``training.fail_rank`` without ``training.fail_at_step``, ...). A default is not given: a
    saved config.yaml lists every key."""
    rules = {key: (rule, default) for key, _, _, rule, default in schema(cfg)}
    for key, value in given.items():
        if key in rules and value != rules[key][1]:
            check_applies(key, setting(cfg, key), rules[key][0], lambda other: setting(cfg, other))


def validate(cfg: Config, world_size: Optional[int] = None) -> None:
    """Raise ValueError for any value or layout that cannot work, naming the numbers.

    Without ``world_size`` only the checks that do not depend on it run.
    """
    check_schema(cfg)  # every field's type and range, as scaletorch/config.py declares them
    if world_size is not None and cfg.training.fail_rank >= world_size:
        raise ValueError(f"training.fail_rank ({cfg.training.fail_rank}) is not a rank of a "
                         f"world of {world_size}")
    precision_policy(cfg, "cuda" if torch.cuda.is_available() else "cpu")  # dtype names
    p = cfg.parallel
    if cfg.training.precision == "fp16" and p.impl == "torch":
        # our steps (step.py, the pipeline's schedules) scale the loss; torch's DDP, fully_shard
        # and pipelining schedules are not given our scaler
        raise ValueError(f"training.precision fp16 scales the loss in our steps only: not with "
                         f"impl {p.impl!r}; use bf16 or impl ours")
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise ValueError(f"data.seq_len ({cfg.data.seq_len}) exceeds model.max_seq_len "
                         f"({cfg.model.max_seq_len})")
    if cfg.data.dataset == "synthetic":
        check_synthetic_vocab(cfg.model.vocab_size)
    if cfg.data.dataset in ("text", "bin"):  # kind, format, length, vocabulary
        check_data_file(cfg.data.dataset, cfg.data.path, cfg.model.vocab_size, cfg.data.seq_len)
    if cfg.data.dataset == "text" and cfg.model.vocab_size < 256:
        raise ValueError(f"the byte-level text dataset needs model.vocab_size >= 256, "
                         f"got {cfg.model.vocab_size}")
    if cfg.logging.plan_cluster and not os.path.isfile(cfg.logging.plan_cluster):
        raise MissingInputError(f"logging.plan_cluster {cfg.logging.plan_cluster!r} is not a "
                                f"file: give a cluster file from scripts/plan.py --calibrate")
    if cfg.logging.plan_cluster:  # read now, through the boundary: not after the training
        try:
            load_cluster(cfg.logging.plan_cluster)
        except ValueError as err:
            raise InputError(f"logging.plan_cluster: {err}") from None
    if world_size is not None:
        validate_layout(cfg, world_size)


def save_config(cfg: Config, path: str) -> None:
    """Write the resolved config as YAML (atomically: a reader never sees half a file; a full
    disk is a WriteError naming it)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    values = cfg.to_dict()
    for key, _, _, rule, default in schema(cfg):  # what the run ignored is saved as a default,
        if ignored_by(key, rule, lambda other: setting(cfg, other)):  # so the file loads again
            section, _, name = key.rpartition(".")
            (values[section] if section else values)[name] = default
    write_atomic(path, boundary.dump_yaml(values).encode())
