"""torchrun, with one error report: the traceback of the rank that failed first, once.

scripts/launch.sh runs this with torchrun's arguments (``python -m torch.distributed.run``
does the same work). When ranks fail, torchrun raises ChildFailedError with every failed
rank; here that becomes:

    error: rank 0 failed first:
    Traceback (most recent call last):
      ...
    RuntimeError: injected error on rank 0 at step 3
    rank 1: stopped because rank 0 failed (torchrun ended it: SIGTERM)

A rank killed by a signal other than torchrun's SIGTERM (a lost machine, an abort) failed
first; otherwise the first is the earliest time in the ranks' error files, which the scripts
write (``scaletorch.trainer.config.write_error_file``) instead of printing their traceback.
A script that refused its configuration printed ``error: ...`` once and every rank exited
with status 2: that case exits 2 quietly. So does a run that stopped itself with its one line
(a non-finite loss: 3). Ctrl-C reaches torchrun and every rank: rank 0 prints the step, the
last checkpoint and the command to resume, and this exits 130 without torchrun's traceback.
A signal that reaches one rank other than 0 alone (a scheduler's kill) ends that rank, which
writes its line to its error file: this prints it once (``stop_line``), and exits 143 or 130.
"""

import logging
import signal
import sys
from typing import Dict, Tuple

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import main

from scaletorch.rules.errors import INTERRUPTED, NON_FINITE, TERMINATED

CONFIG_ERROR = 2  # load_config's exit status
QUIET = (CONFIG_ERROR, NON_FINITE, INTERRUPTED, TERMINATED)  # a rank printed its one line already
STOPPED = ("SIGTERM", "SIGINT")  # how torchrun ends the other ranks when one fails


def _time(f: ProcessFailure) -> float:
    data = f.error_file_data.get("scaletorch") if isinstance(f.error_file_data, dict) else None
    return float(data["time"]) if data else float(f.timestamp)


def _crashed(f: ProcessFailure) -> bool:
    return f.exitcode < 0 and f.signal_name() not in STOPPED


def first_failure(failures: Dict[int, ProcessFailure]) -> Tuple[int, ProcessFailure]:
    """(rank, failure) of the rank that failed first (see the module's docstring)."""
    crashed = [(r, f) for r, f in failures.items() if _crashed(f)]
    written = [(r, f) for r, f in failures.items() if isinstance(f.message, dict)]
    pool = crashed or written or list(failures.items())
    return min(pool, key=lambda item: (_time(item[1]), item[0]))


def _summary(f: ProcessFailure) -> str:
    if isinstance(f.message, dict):
        first = f.message["message"].strip().splitlines()[0]
        return first if len(first) <= 240 else first[:237] + "..."
    if f.exitcode < 0:
        return f"torchrun ended it: {f.signal_name()}" if not _crashed(
            f) else f"killed by {f.signal_name()}"
    return f"exit code {f.exitcode}"


def report(failures: Dict[int, ProcessFailure]) -> str:
    """The traceback of the first failure once, then one line for each other failed rank."""
    rank, first = first_failure(failures)
    if isinstance(first.message, dict):
        lines = [
            f"error: rank {rank} failed first:",
            first.message["extraInfo"]["py_callstack"].rstrip()
        ]
    elif _crashed(first):
        lines = [
            f"error: rank {rank} failed first: killed by {first.signal_name()} "
            f"(a killed process leaves no traceback; see its output above)"
        ]
    else:
        lines = [
            f"error: rank {rank} failed first (exit code {first.exitcode}; no error file: "
            f"see its output above)"
        ]
    for r, f in sorted(failures.items()):
        if r != rank:
            lines.append(f"rank {r}: stopped because rank {rank} failed ({_summary(f)})")
    return "\n".join(lines)


def stop_line(failures: Dict[int, ProcessFailure]) -> Tuple[str, int]:
    """(line, exit status) of a stop that reached a rank other than 0 alone (a scheduler's
    kill): that rank wrote its line to its error file (``report_input_errors``), and rank 0,
    blocked in a collective with it, was ended by torchrun without a line. ('', 0) when rank 0
    stopped with its own line (130, 143): the signal reached it, and it printed; and when a rank
    failed with a status of its own (1): the SIGTERM was torchrun's, after that failure."""
    if failures.get(0) is not None and failures[0].exitcode in (INTERRUPTED, TERMINATED):
        return "", 0
    if any(f.exitcode > 0 and f.exitcode not in (INTERRUPTED, TERMINATED)
           for f in failures.values()):
        # a rank failed on its own (a raise: exit 1): torchrun then sent the others its own
        # SIGTERM, and one between two steps stopped with its line; the failure is the news
        return "", 0
    for rank, f in sorted(failures.items()):
        message = f.message.get("message", "") if isinstance(f.message, dict) else ""
        if f.exitcode in (INTERRUPTED, TERMINATED) and message.startswith("RunStopped: "):
            return f"{message.removeprefix('RunStopped: ')} (rank {rank} got the signal)", \
                f.exitcode
    return "", 0


class _NoRepeatedNotes(logging.Filter):
    """Drops torchrun's notes that would repeat a rank's one line: passing Ctrl-C on to the
    ranks, stopping the other ranks (``report`` names each stopped rank, and after a quiet
    failure there is nothing to add), and the failure of a rank that printed its line already
    (an exit status in QUIET: a refused config, a full disk, a non-finite loss)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        quiet = isinstance(record.msg, str) and record.msg.startswith("failed (exitcode: %s)") \
            and isinstance(record.args, tuple) and record.args[0] in QUIET
        return not (f"Received {int(signal.SIGINT)} death signal" in text
                    or "no error file defined for parent" in text  # a stop line's file
                    or f"Received {int(signal.SIGTERM)} death signal" in text
                    or "closing signal SIG" in text or quiet)


if __name__ == "__main__":
    for name in ("torch.distributed.elastic.agent.server.api",
                 "torch.distributed.elastic.multiprocessing.api",
                 "torch.distributed.elastic.multiprocessing.errors.error_handler"):
        logging.getLogger(name).addFilter(_NoRepeatedNotes())
    try:
        main()
    except SignalException as err:  # Ctrl-C (or a SIGTERM from a scheduler) reached torchrun
        sys.exit(INTERRUPTED if err.sigval == signal.SIGINT else 128 + int(err.sigval))
    except ChildFailedError as err:
        line, status = stop_line(err.failures)
        if line:
            print(line, file=sys.stderr, flush=True)
            sys.exit(status)
        _, first = err.get_first_failure()
        if first.exitcode in QUIET:
            sys.exit(first.exitcode)
        print(report(err.failures), file=sys.stderr, flush=True)
        code = first_failure(err.failures)[1].exitcode
        sys.exit(code if code > 0 else 1)
