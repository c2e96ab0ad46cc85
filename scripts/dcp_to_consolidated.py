"""Convert a sharded (dcp) checkpoint into one consolidated file, on one process.

    python scripts/dcp_to_consolidated.py runs/run/checkpoints/step_0000040 --out full.pt

The sharded checkpoint is verified first (every file against its checksum). The file written
holds the full weights and AdamW state under chapter 00's names, with its checksum beside it:
chapter 07 resumes it at any layout (``--resume full.pt``). It holds the whole model in this
process's memory: a run resumes the sharded checkpoint itself, which needs no gather.
"""

import argparse
import os
import sys
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scaletorch.trainer.dcp_checkpoint import to_consolidated  # noqa: E402


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a sharded checkpoint directory (step_NNNNNNN)")
    parser.add_argument("--out", required=True, help="the consolidated file to write")
    args = parser.parse_args(argv)
    try:
        if os.path.exists(args.out):  # never overwrite what a run or a user left
            raise FileExistsError(f"--out {args.out} exists: give a new path")
        state = to_consolidated(args.checkpoint, args.out)
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{args.checkpoint} -> {args.out}: step {state['step']}, {len(state['model'])} tensors"
          f"{'' if state['optimizer'] is None else ' with their AdamW state'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
