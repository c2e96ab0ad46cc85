"""The error of a user's mistake in a run's inputs, shared by every layer that reads one.

An ``InputError`` says what is wrong, with which file or value, and what to do. Scripts built
on ``scaletorch.trainer.load_config`` print it as one line ``error: ...`` from one rank and
exit with status 2, without a traceback; any other exception is a bug and keeps its traceback.
It is a ValueError, so code that catches a bad value catches it too.
"""

__all__ = ["InputError", "MissingInputError"]


class InputError(ValueError):
    """A file, directory or value the user gave that the run cannot use."""


class MissingInputError(InputError, FileNotFoundError):
    """An input file or directory that does not exist (also a FileNotFoundError)."""
