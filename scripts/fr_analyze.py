"""Name the first collective the ranks disagree on, from the flight recorder's dumps of a run.

    python scripts/fr_analyze.py runs/11_debugging/flight_recorder

Each rank of a run that failed in a collective wrote ``rank_<r>`` there (examples/11_debugging.py,
``scaletorch.dist.flight_recorder.dump``). The answer: the group (by the ledger's name: "tp",
"dp", ...), the collective's number in it, each rank's op and tensor sizes or "never issued
it", the line of our code that issued it, and where each rank stopped. The dumps are JSON,
each with its ``.sha256``; a pickle dump is refused unread, since unpickling can run code.
"""

import sys
from typing import List, Optional

from scaletorch.dist import flight_recorder
from scaletorch.rules import boundary
from scaletorch.rules.errors import InputError, OneLineParser


def main(argv: Optional[List[str]] = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="the run's flight_recorder directory")
    boundary.add_trust_flag(parser)
    args = parser.parse_args(argv)
    boundary.trust_unchecked(args.trust_unchecked)
    try:
        traces = flight_recorder.load(args.directory)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{len(traces)} dumps: ranks {sorted(traces)}")
    print("\n".join(flight_recorder.analyze(traces)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
