"""The error of a user's mistake in a run's inputs, shared by every layer that reads one.

An ``InputError`` says what is wrong, with which file or value, and what to do. Scripts built
on ``scaletorch.trainer.load_config`` print it as one line ``error: ...`` from one rank and
exit with status 2, without a traceback; any other exception is a bug and keeps its traceback.
It is a ValueError, so code that catches a bad value catches it too.
"""

import argparse
import os
import re
import sys
import time
from typing import Any, NoReturn

__all__ = [
    "CLIP", "INTERRUPTED", "InputError", "MissingInputError", "NON_FINITE", "OneLineParser",
    "OUTPUT_FAILED", "PIPE_CLOSED", "RunStopped", "TERMINATED", "Terminated", "clip"
]

CLIP = 200  # characters of a value that an error message quotes


class InputError(ValueError):
    """A file, directory or value the user gave that the run cannot use. Its message is cut
    where a value was quoted without ``clip`` (a path inside an OSError's text, say): every
    word longer than CLIP_WORD characters keeps its first CLIP and says how long it was."""

    def __init__(self, message: Any = "", *args: Any) -> None:
        super().__init__(clip_words(message) if isinstance(message, str) else message, *args)


CLIP_WORD = 260  # longer than what clip leaves of a value without a space (CLIP + a few)


def clip_words(message: str) -> str:
    """``message`` with every run of non-space characters longer than CLIP_WORD cut to CLIP,
    saying how long it was: a path quoted in full is one such run."""
    return re.sub(r"\S{%d,}" % (CLIP_WORD + 1),
                  lambda m: f"{m.group()[:CLIP]}... ({len(m.group())} characters)", message)


def clip(value: Any, limit: int = CLIP) -> str:
    """``repr(value)`` cut to ``limit`` characters, saying how long it was: an error message
    quotes the value the user gave, never megabytes of it. Every message built from a user's
    value quotes it through here."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


class MissingInputError(InputError, FileNotFoundError):
    """An input file or directory that does not exist (also a FileNotFoundError)."""


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose own errors (an option given no value, ``--name -x``, a bad
    type or choice) are one line ``error: ...`` and exit status 2, as a refused value is,
    instead of the usage (20 lines and more); ``--help`` still prints it. Rank 0 prints; another
    rank waits, so that torchrun stops it before the line is repeated (as ``load_config``)."""

    def error(self, message: str) -> NoReturn:
        if message.endswith("expected one argument"):  # "argument --name: expected ..."
            flag = message.split()[1].rstrip(":").split("/")[0]
            message += (f": give {flag} a value (one that starts with '-' as {flag}=-x); "
                        f"--help lists the options")
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {message}", file=sys.stderr, flush=True)
        else:
            time.sleep(5)
        sys.exit(2)


INTERRUPTED = 130  # the shell's status for a process ended by SIGINT (128 + 2)
TERMINATED = 143  # ... by SIGTERM (128 + 15): torchrun's and a scheduler's way to stop a job
NON_FINITE = 3  # a run stopped by a non-finite loss or gradient norm
PIPE_CLOSED = 141  # ... by SIGPIPE (128 + 13): its output was a pipe whose reader ended (| head)
OUTPUT_FAILED = 74  # sysexits' EX_IOERR: its output could not be written (> /dev/full, EIO)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where it arrives as Ctrl-C's KeyboardInterrupt is: a subclass, so that
    every path Ctrl-C takes (a partial checkpoint removed, the one line) SIGTERM takes too."""


class RunStopped(Exception):
    """A run that stops on purpose, with one line and ``exit_code``: Ctrl-C (INTERRUPTED),
    SIGTERM (TERMINATED), a non-finite loss (NON_FINITE). The line says the step, the last
    complete checkpoint and what to run next; scripts print it once and exit with the code,
    without a traceback."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code
