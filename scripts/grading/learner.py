"""The learner's functions as the grader sees them: named, loaded, patched in, their errors told.

A function to grade is named by its ``Source``, (file or module, attribute), so that each spawned
rank loads it itself: ``examples/exercises/01_ddp.py`` is a file (its name starts with a digit,
no import reaches it), a planted variant is a module of the tests. What a learner's function
raises is told by ``failure``, at the learner's own line (``SOURCE_FILES``); ``is_hang`` tells a
collective that timed out (the world cannot go on) from an error of the job alone.
"""

import importlib
import importlib.util
import os
import re
import traceback
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from scripts.grading.job_state import GRADERS

Source = Tuple[str, str]  # (a .py file or a module name, the function's name in it)
SOURCE_FILES: Set[str] = set()  # inside a rank: the files of the functions graded
UNWRITTEN = "NotImplementedError"
# What a learner's function may raise, each a verdict of its job: sys.exit() and exit() raise
# SystemExit, which ``except Exception`` lets through to end the rank with no word of it
LEARNER_ERRORS = (Exception, SystemExit, KeyboardInterrupt)


def load(source: Source) -> Callable:
    """The function ``source`` names: from a file by its path, or from an importable module."""
    where, name = source
    if where.endswith(".py"):
        spec = importlib.util.spec_from_file_location(f"exercise_{abs(hash(where))}", where)
        if spec is None or spec.loader is None:
            raise ValueError(f"cannot load {where!r}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    return getattr(module, name)


@contextmanager
def patched(patches: Sequence[Tuple[object, str, object]]) -> Iterator[None]:
    """Set each (owner, attribute, value) for the block, then put the old values back (a job's
    end, job_state.py, leaves them: the grader's, not the learner's)."""
    with ExitStack() as stack:
        for owner, attr, value in patches:
            old = getattr(owner, attr)
            setattr(owner, attr, value)
            stack.callback(setattr, owner, attr, old)
            GRADERS.append((id(owner), attr))
            stack.callback(GRADERS.remove, (id(owner), attr))
        yield


def _chain(err: BaseException) -> List[BaseException]:
    """``err`` and what caused it (the Trainer re-raises a step's error as a RuntimeError)."""
    out: List[BaseException] = []
    while err is not None and err not in out:
        out.append(err)
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    return out


def innermost(err: BaseException) -> BaseException:
    """The first error of ``err``'s chain: the one raised where it went wrong."""
    return _chain(err)[-1]


def caused_by(err: BaseException, kind: type) -> Optional[BaseException]:
    """The first error of type ``kind`` in ``err``'s chain, or None."""
    return next((e for e in _chain(err) if isinstance(e, kind)), None)


def carried(err: BaseException) -> Dict[str, Any]:
    """What a grader's error of ``err``'s chain measured before it was raised: its ``result``
    dict (chapter 05's ring wait that gave up: {"stuck": ...}), else {}."""
    return next((e.result for e in _chain(err) if isinstance(getattr(e, "result", None), dict)), {})


def is_unwritten(err: BaseException) -> bool:
    return any(isinstance(e, NotImplementedError) for e in _chain(err))


# gloo's words for a wait that ran out or a peer that left ("Application timeout caused pair
# closure": a wait that ran out, as gloo tells it on a loaded machine)
_BACKEND = re.compile(r"imed out|peer|gloo|timeout caused pair closure")


def is_hang(err: BaseException) -> bool:
    """A collective that timed out, or whose peer left: the world cannot go on."""
    return not is_unwritten(err) and any(
        isinstance(e, dist.DistError) or _BACKEND.search(str(e)) is not None for e in _chain(err))


def failure(err: BaseException) -> str:
    """What a job's error was, for the parent: "NotImplementedError" for an unwritten stub,
    else the first exception's type, message and the line of the exercise that raised it."""
    if is_unwritten(err):
        return UNWRITTEN
    first = _chain(err)[-1]
    frames = traceback.extract_tb(first.__traceback__)
    mine = [f for f in frames if os.path.abspath(f.filename) in SOURCE_FILES]
    where = (mine or frames)[-1]
    line = f": {where.line}" if where.line else ""
    said = f"{type(first).__name__}: {_shortened(str(first))}" if str(first) else \
        type(first).__name__
    named = None if mine else _backward_named(str(first))
    if named is not None:  # autograd checked what a learner's backward returned, after it left
        return f"{said} (in {named})"
    return f"{said} (at {os.path.basename(where.filename)}:{where.lineno}{line})"


MESSAGE_LINES = 3  # of an error's message in a verdict; the rest counted
MESSAGE_CHARS = 600


def _shortened(message: str) -> str:
    """An error's message as a verdict shows it: its first MESSAGE_LINES lines (at most
    MESSAGE_CHARS characters), then how much more it said."""
    lines = message.splitlines()
    shown = " / ".join(lines[:MESSAGE_LINES])
    more = len(lines) - MESSAGE_LINES
    if len(shown) > MESSAGE_CHARS:
        shown = shown[:MESSAGE_CHARS] + "..."
    return shown + (f" ({more} more lines of the message)" if more > 0 else "")


def _backward_named(message: str) -> Optional[str]:
    """The learner's backward that torch's message names ("Function _GBBackward returned an
    invalid gradient": class _GB's backward, at any indent: a class made in a function too), as
    "_GB.backward at file:line: text", else None. No frame of it is on the stack: the engine
    checks its result once it has returned."""
    found = re.search(r"Function (\w+)Backward\b", message)
    if found is None:
        return None
    cls = found.group(1)
    for path in sorted(SOURCE_FILES):
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for start, text in enumerate(lines):
            head = re.match(rf"(\s*)class {cls}\b", text)
            if head is None:
                continue
            indent = len(head.group(1))
            for i in range(start + 1, len(lines)):
                body = lines[i]
                if body.strip() and len(body) - len(body.lstrip()) <= indent:
                    break  # the class ended
                if re.match(r"\s+def backward\b", body):
                    return f"{cls}.backward at {os.path.basename(path)}:{i + 1}: {body.strip()}"
    return None


def source_file(source: Source) -> str:
    """The file that holds ``source``'s function: a learner's .py, or a module's file."""
    where = source[0]
    if where.endswith(".py"):
        return os.path.abspath(where)
    spec = importlib.util.find_spec(where)
    return os.path.abspath(spec.origin) if spec is not None and spec.origin else where


def cloned(args: Sequence[Any]) -> Tuple[Any, ...]:
    """``args`` with each tensor cloned (in the autograd graph still, gradients flow back to
    the original): the function under test gets inputs of its own, so in-place work on them,
    wherever the contract allows it, cannot change what the library's call reads."""
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


class InPlace(TorchFunctionMode):
    """The in-place arithmetic (div_, mul_, /=, *=) called on ``target``'s storage while on."""

    def __init__(self, target: torch.Tensor) -> None:
        super().__init__()
        self.ptr, self.seen = target.untyped_storage().data_ptr(), []  # type: ignore[var-annotated]

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if getattr(func, "__name__", "") in ("div_", "mul_", "__itruediv__", "__imul__") and \
                args and args[0].untyped_storage().data_ptr() == self.ptr:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))
