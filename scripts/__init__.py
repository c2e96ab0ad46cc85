"""The repository's scripts (``python scripts/NAME.py``); a few are modules of the others."""

import argparse
from typing import NoReturn


def module_only(doc: str, run: str) -> NoReturn:
    """A module of other scripts, run as a script itself: ``--help`` prints its docstring and
    the command to run instead; anything else (no arguments too) is one ``error:`` line naming
    that command, exit status 2 (doc/bad_inputs.md)."""
    from scaletorch.rules.errors import OneLineParser

    parser = OneLineParser(description=doc, epilog=f"run: {run}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.parse_args()
    parser.error(f"{parser.prog} is a module of other scripts, with no command line of its own; "
                 f"run: {run}")
