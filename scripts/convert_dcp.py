"""Convert a sharded (DCP) checkpoint offline, on one process: to a Hugging Face Llama
directory, to one consolidated file, or both.

    python scripts/convert_dcp.py runs/07_nd_parallel/checkpoints/step_0000010 \\
        --config runs/07_nd_parallel/config.yaml --hf converted/07_hf
    python scripts/convert_dcp.py runs/07_nd_parallel/checkpoints/step_0000010 \\
        --consolidated converted/07_consolidated.pt

The checkpoint is checked as ``--resume`` checks it first: complete (its manifest), every file
matching its checksum. The outputs go outside any run's or checkpoint's directory. ``--hf``
reads only the weights (the run's config.yaml gives the model: its RoPE theta and norm epsilon
are not in the tensors' shapes) and writes config.json and the safetensors, each with a
``.sha256``. ``--consolidated`` writes weights and AdamW state, which any layout resumes
(chapter 07's ``--resume FILE``). Both hold the whole model in this process's memory.
"""

import os
import sys
from typing import List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scaletorch.rules.errors import OneLineParser  # noqa: E402
from scaletorch.trainer.config import Config, apply_dict, load_yaml  # noqa: E402
from scaletorch.trainer.dcp_checkpoint import check_output, to_consolidated  # noqa: E402
from scaletorch.trainer.dcp_export import to_hf  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv: Optional[List[str]] = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a sharded checkpoint directory (with .metadata)")
    parser.add_argument("--hf", default=None, help="write a Hugging Face Llama directory here")
    parser.add_argument("--config", default=None, help="the run's config.yaml (for --hf)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="--hf's stored dtype (default: the checkpoint's, fp32)")
    parser.add_argument("--consolidated", default=None, help="write one consolidated file here")
    args = parser.parse_args(argv)
    try:
        if args.hf is None and args.consolidated is None:
            raise ValueError("nothing to write: give --hf DIR, --consolidated FILE or both")
        if args.hf is not None:
            check_output("--hf", args.hf)
            if os.path.isdir(args.hf) and os.listdir(args.hf):
                raise FileExistsError(f"--hf {args.hf} is a directory that holds files: give "
                                      f"a new or empty directory")
        if args.consolidated is not None:
            check_output("--consolidated", args.consolidated)
        if args.consolidated is not None and os.path.exists(args.consolidated):
            raise FileExistsError(f"--consolidated {args.consolidated} exists: give a new path "
                                  f"(a file a run or a user left is never overwritten)")
        if args.hf is not None:
            if args.config is None:
                raise ValueError("--hf needs --config (the run's config.yaml): the RoPE theta "
                                 "and norm epsilon of config.json are not in the checkpoint")
            cfg = Config()
            apply_dict(cfg, load_yaml(args.config), source=args.config)
            dtype = DTYPES[args.dtype] if args.dtype else None
            for file in to_hf(args.checkpoint, args.hf, cfg.model, dtype):
                print(f"wrote {file} (and its .sha256)")
        if args.consolidated is not None:
            state = to_consolidated(args.checkpoint, args.consolidated)
            print(f"wrote {args.consolidated} (and its .sha256), step {state['step']}")
    except (OSError, ValueError, ImportError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
