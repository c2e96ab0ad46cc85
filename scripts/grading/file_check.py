"""Whether the learner's exercise file imports, asked before any rank starts.

The file is imported in a forked child (it has torch and the library already, so it costs
milliseconds): a file that ends its process as it is imported (``sys.exit(0)``, ``os._exit``,
a signal) or never finishes would otherwise end or hang the grader itself, with no verdict and
possibly exit status 0. Every way it can stop is named: an exception of any kind
(``SystemExit`` and ``KeyboardInterrupt`` too), an exit of the process, a limit of time.
"""

import importlib.util
import os
import select
import signal
import sys
import time
import traceback
from typing import Optional

# seconds to import the file in the child: torch and the library are imported already (a forked
# child), so only the learner's own lines run; within the grader's 30 s of waiting at most
IMPORT_LIMIT = 25.0
MESSAGE_LIMIT = 2000  # characters of the child's answer: the pipe never fills


def _why(path: str, shown: str) -> Optional[str]:
    """In the child: why ``path`` does not compile or import (``FILE:LINE: Type: message: the
    line``, FILE as ``shown``), or None."""
    try:
        spec = importlib.util.spec_from_file_location(f"exercise_{abs(hash(path))}", path)
        if spec is None or spec.loader is None:
            return f"{shown}: not a Python file"
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except SyntaxError as err:  # IndentationError, TabError: the compiler names the line
        line, text, message, kind = err.lineno, err.text, err.msg, type(err).__name__
    except BaseException as err:  # noqa: B902 - SystemExit, KeyboardInterrupt too: a verdict
        mine = [
            f for f in traceback.extract_tb(err.__traceback__)
            if os.path.abspath(f.filename) == os.path.abspath(path)
        ]
        line, text = (mine[-1].lineno, mine[-1].line) if mine else (None, None)
        kind = type(err).__name__
        if isinstance(err, SystemExit):  # str() is its bare code: "0", "" for None
            message = f"the file exits as it is imported (exit code {err.code!r})"
        else:
            message = str(err) or "raised as the file is imported"
    else:
        return None
    where = f"{shown}:{line}" if line else shown
    quoted = f": {text.strip()}" if text and text.strip() else ""
    return f"{where}: {kind}: {message}{quoted}"


def _ended(status: int) -> str:
    """What a child's wait status says ended it."""
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit status {os.WEXITSTATUS(status)}" if os.WIFEXITED(status) else str(status)


def import_error(path: str, shown: str = "") -> Optional[str]:
    """Why the learner's file ``path`` does not compile or import, as one line naming it
    (``shown``, else ``path``), or None when it imports: each rank would stop on it."""
    shown = shown or path
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: answer on the pipe, then leave without the parent's exit handlers
        os.close(read)
        try:
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # a file that reads its input at
            sys.stdin = open(os.devnull)  # noqa: SIM115 - import gets none, never waits
            said = _why(path, shown)
            answer = "ok" if said is None else "error " + said[:MESSAGE_LIMIT]
            os.write(write, answer.encode("utf-8", "replace"))
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(0)
    os.close(write)
    chunks, deadline = [], time.monotonic() + IMPORT_LIMIT
    with os.fdopen(read, "rb") as pipe:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([pipe], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return f"{shown}: importing the file did not finish within {IMPORT_LIMIT:.0f} s"
            chunk = os.read(pipe.fileno(), 65536)
            if not chunk:
                break
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    answer = b"".join(chunks).decode("utf-8", "replace")
    if answer == "ok":
        return None
    if answer.startswith("error "):
        return answer[len("error "):]
    return f"{shown}: the file ended the process as it was imported ({_ended(status)})"
