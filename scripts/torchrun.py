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
torchrun's own options are checked first (``parse_args``): a mistake (``--nproc-per-node abc``
or ``0``, a port past 65535, a script that is not a file) is one ``error:`` line, exit 2.
"""

import argparse
import logging
import math
import os
import signal
import sys
from typing import Dict, List, Optional, Tuple

import torch.distributed.run as torch_run
from torch.distributed.elastic.multiprocessing.api import SignalException, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.run import main

from scaletorch.rules.errors import INTERRUPTED, NON_FINITE, TERMINATED, OneLineParser

CONFIG_ERROR = 2  # load_config's exit status
# A node's ranks: more processes than a node could run would fork until the machine stops
MAX_NPROC = 4096
MAX_NNODES = 65536  # more than a rendezvous would ever gather: it would wait for ever
MAX_MONITOR_INTERVAL = 3600.0  # seconds between torchrun's looks at its ranks
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


def _count(value: str, name: str, low: int, high: Optional[int] = None) -> Optional[str]:
    """Why ``value`` is not an integer in [low, high] for option ``name``, or None."""
    try:
        number = int(value)
    except ValueError:
        return f"{name} must be an integer, got {value!r}"
    if high is not None and not low <= number <= high:
        return f"{name} must be in {low}..{high}, got {value}"
    return f"{name} must be at least {low}, got {value}" if number < low else None


def _problem(args: argparse.Namespace) -> Optional[str]:
    """What is wrong with torchrun's options ``args`` (one sentence), or None: every value
    torch would stop on with a traceback (a ValueError, an AssertionError in its agent) or
    would take and misuse (0 ranks, a port past 65535, an interval that never ends)."""
    nnodes = args.nnodes.split(":")
    if len(nnodes) > 2 or any(_count(n, "--nnodes", 1, MAX_NNODES) for n in nnodes):
        return f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX <= {MAX_NNODES}, got " \
            f"{args.nnodes!r}"
    low, high = int(nnodes[0]), int(nnodes[-1])
    if low > high:
        return f"--nnodes MIN:MAX needs MIN <= MAX, got {args.nnodes!r}"
    if args.nproc_per_node not in ("cpu", "auto"):
        why = _count(args.nproc_per_node, "--nproc-per-node", 1, MAX_NPROC)
        if why is not None:
            return f"{why} (the number of ranks on this node, or cpu or auto)"
    checks = [
        (args.node_rank, "--node-rank", 0, high - 1),
        (args.max_restarts, "--max-restarts", 0, None),
        (args.master_port, "--master-port", 1, 65535),  # None: torchrun picks one
        (args.shutdown_timeout, "--shutdown-timeout", 0, None),
    ]
    for value, name, lowest, highest in checks:
        why = None if value is None else _count(str(value), name, lowest, highest)
        if why is not None:
            return why
    if not (math.isfinite(args.monitor_interval)
            and 0 < args.monitor_interval <= MAX_MONITOR_INTERVAL):
        return (f"--monitor-interval must be a number of seconds in (0, "
                f"{MAX_MONITOR_INTERVAL:.0f}], got {args.monitor_interval}")
    backends = sorted(rendezvous_handler_registry._registry)  # static, c10d, etcd, ...
    if args.rdzv_backend not in backends and not args.standalone:
        return f"--rdzv-backend must be one of {', '.join(backends)}, got {args.rdzv_backend!r}"
    readers = [  # torch's own readers of these: each raises ValueError on a bad one
        ("--rdzv-endpoint", lambda: args.rdzv_endpoint and parse_rendezvous_endpoint(
            args.rdzv_endpoint, default_port=29400)),
        ("--rdzv-conf", lambda: torch_run._parse_rendezvous_config(args.rdzv_conf)),
        ("--redirects", lambda: Std.from_str(args.redirects)),
        ("--tee", lambda: Std.from_str(args.tee)),
        ("--logs-specs", lambda: torch_run._get_logs_specs_class(args.logs_specs)),
    ]
    for name, read in readers:
        try:
            read()
        except (ValueError, KeyError) as err:
            return f"{name}: {str(err).strip() or type(err).__name__}"
    for name in args.signals_to_handle.split(","):
        if name.strip() not in signal.Signals.__members__:
            return f"--signals-to-handle: {name!r} is not a signal name (SIGTERM, SIGINT, ...)"
    if args.local_ranks_filter:
        ranks = args.local_ranks_filter.split(",")
        if any(_count(r, "--local-ranks-filter", 0) for r in ranks):
            return f"--local-ranks-filter must be ranks 0, 1, ... separated by commas, got " \
                f"{args.local_ranks_filter!r}"
    if args.log_dir and os.path.exists(args.log_dir) and not os.path.isdir(args.log_dir):
        return f"--log-dir {args.log_dir!r} exists and is not a directory"
    if not (args.module or args.no_python) and not os.path.isfile(args.training_script):
        return f"the script {args.training_script!r} is not a file"
    return None


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    """torchrun's options, each checked (``_problem``): a mistake is one ``error:`` line and
    exit status 2 before any rank starts, as every script of scripts/ (doc/bad_inputs.md)."""
    parser = torch_run.get_args_parser()
    parser.__class__ = OneLineParser  # its errors one line too: a type, a choice, no value
    args = parser.parse_args(argv)
    why = _problem(args)
    if why is not None:
        parser.error(why)
    return args


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
    torch_run.parse_args = parse_args  # main() parses with it: the checks above, one line
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
