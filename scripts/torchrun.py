"""torchrun, except when the ranks refused their configuration: then no traceback.

scripts/launch.sh runs this with torchrun's arguments (``python -m torch.distributed.run``
does the same work). A script built on ``scaletorch.trainer.load_config`` that refuses its
config prints ``error: ...`` once (rank 0) and every rank exits with status 2; torchrun would
add its own traceback and failure table to that line. Here that case exits 2 quietly; any
other failure gets torchrun's usual report.
"""

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main

CONFIG_ERROR = 2  # load_config's exit status

if __name__ == "__main__":
    try:
        main()
    except ChildFailedError as err:
        _, first = err.get_first_failure()
        if first.exitcode != CONFIG_ERROR:
            raise
        sys.exit(CONFIG_ERROR)
