"""A breakpoint on a chapter's first collective of step 1 lands a few frames below its script.

Chapters 00-06 write their training step in the script (issue 53), so a learner who stops in
the debugger at the first collective of a step sees the script's line that caused it and the
strategy's code under it, not a shared training loop. For the scripts of 01-06, at 2 ranks and
their config's layout, the test runs each script in one world and records on rank 0 the stack
of the first ``torch.distributed`` call issued after the first optimizer step (the warm-up and
the setup's broadcasts are over). It holds that:

- the stack has at most ``MAX_FRAMES`` frames of this repository below the script's own, in at
  most ``MAX_FILES`` files counting the script (the model's file may be one of them);
- chapter 06's first collective is its dispatch all-to-all (expert_parallel.py), not the
  load-balancing statistics' all-reduce that used to come first (models/moe.py).

    python -m tests.test_first_collective   # prints each chapter's stack
"""

import contextlib
import io
import os
import runpy
import sys
import tempfile
import traceback
import unittest
from typing import Any, Dict

from tests.harness import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_FRAMES, MAX_FILES = 10, 5
SCRIPTS = [
    "01_ddp", "02_fsdp", "03_tensor_parallel", "04_pipeline_parallel", "05_context_parallel",
    "06_expert_parallel"
]
# the calls a breakpoint would catch: every collective and point-to-point call
CALLS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
         "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast", "reduce",
         "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv")


def _installed(path: str) -> bool:
    """Whether ``path`` is an installed package's file, not the repository's (CI installs torch
    into ``.venv`` inside the checkout: its frames are PyTorch's, not ours)."""
    parts = os.path.relpath(path, ROOT).split(os.sep)
    return "site-packages" in parts or "dist-packages" in parts


def _first_collectives(rank: int, world_size: int, run_dir: str) -> Dict[str, Any]:
    """In each rank: run every script of ``SCRIPTS`` for 2 steps; rank 0 returns, per script,
    (the call's name, the repository's frames of its stack as "file:line function")."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d
    from torch.optim.optimizer import register_optimizer_step_post_hook

    import scaletorch.dist
    state: Dict[str, Any] = {}

    def traced(name: str, call: Any) -> Any:

        def inner(*args: Any, **kwargs: Any) -> Any:
            if state.get("armed") and "stack" not in state and dist.get_rank() == 0:
                frames = [
                    f for f in traceback.extract_stack()[:-1]
                    if f.filename.startswith(ROOT + os.sep) and not _installed(f.filename)
                ]
                # from the script's first frame down (the harness and runpy called it)
                script = [i for i, f in enumerate(frames) if f.filename == state["script"]]
                frames = frames[script[0]:] if script else frames
                state["op"] = name
                state["stack"] = [
                    f"{os.path.relpath(f.filename, ROOT)}:{f.lineno} {f.name}" for f in frames
                ]
            return call(*args, **kwargs)

        return inner

    for name in CALLS:
        wrapped = traced(name, getattr(dist, name))
        setattr(dist, name, wrapped)
        if hasattr(distributed_c10d, name):  # P2POp compares isend/irecv with these
            setattr(distributed_c10d, name, wrapped)
    # the scripts end with destroy_distributed: keep the world for the next one
    scaletorch.dist.destroy_distributed = lambda: None
    found: Dict[str, Any] = {}
    for script in SCRIPTS:
        path = os.path.join(ROOT, "examples", script + ".py")
        state.clear()
        state["script"] = path
        hook = register_optimizer_step_post_hook(lambda *_: state.update(armed=True))
        sys.argv = [path, "--steps", "2", "--logging.run_dir", os.path.join(run_dir, script)]
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(
                    io.StringIO()):
                runpy.run_path(path, run_name="__main__")
        except SystemExit as stop:
            if stop.code:
                raise RuntimeError(f"{script} exited with {stop.code}") from None
        finally:
            hook.remove()
        found[script] = (state.get("op"), state.get("stack", []))
    return found if rank == 0 else {}


class AChaptersFirstCollectiveIsAFewFramesBelowItsScript(unittest.TestCase):

    @classmethod
    def setUpClass(cls) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            cls.found = run_distributed(_first_collectives, 2, tmp, timeout=300)[0]

    def test_at_most_10_frames_below_the_script_in_at_most_5_files(self) -> None:
        for script in SCRIPTS:
            op, stack = self.found[script]
            with self.subTest(script=script):
                self.assertIsNotNone(op, f"{script}: no collective in step 1")
                own = f"examples/{script}.py:"
                below = [f for f in stack if not f.startswith(own)]
                files = {f.split(":")[0] for f in stack}
                self.assertTrue(stack and stack[0].startswith(own), stack)  # the script called
                self.assertLessEqual(len(below), MAX_FRAMES, "\n".join(stack))
                self.assertLessEqual(len(files), MAX_FILES, "\n".join(stack))

    def test_expert_parallels_first_collective_is_its_dispatch_all_to_all(self) -> None:
        op, stack = self.found["06_expert_parallel"]
        self.assertIn("all_to_all", op, "\n".join(stack))
        self.assertTrue(any(f.startswith("scaletorch/parallel/expert_parallel.py") for f in stack),
                        "\n".join(stack))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        for name, (call, frames) in run_distributed(_first_collectives, 2, tmp)[0].items():
            print(f"{name}: first {call}, {len(frames)} frames (the script's included)")
            print("\n".join("    " + f for f in frames))
