"""scripts/launch.sh gives every rank NCCL's fail-fast environment, and keeps the user's values."""

import os
import subprocess
import tempfile
import unittest

from tests.test_examples import ROOT

NCCL = ("TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
SHOW = "import os\nprint('rank env', *(os.environ.get(k) for k in {names!r}))\n"


class LauncherSetsNcclErrorHandling(unittest.TestCase):

    def _launch(self, **user: str) -> tuple:
        """What a rank sees of NCCL's variables, and the command line printed, when the user
        has set ``user`` and nothing else of NCCL's."""
        with tempfile.TemporaryDirectory() as tmp:
            script = os.path.join(tmp, "show_env.py")
            with open(script, "w") as f:
                f.write(SHOW.format(names=NCCL))
            env = {k: v for k, v in os.environ.items() if k not in NCCL}
            env.update(user)
            proc = subprocess.run(["bash", "scripts/launch.sh", script, "--nproc-per-node", "1"],
                                  cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        ranks = [line for line in proc.stdout.splitlines() if line.startswith("rank env")]
        command = next(line for line in proc.stdout.splitlines() if line.startswith("+ "))
        return ranks, command

    def test_async_error_handling_without_blocking_waits_and_a_value_already_set_wins(self):
        # blocking waits would hold the host at every wait(): no overlap (doc/fault_tolerance.md)
        ranks, command = self._launch()
        self.assertEqual(ranks, ["rank env None 1"])
        self.assertIn("+ TORCH_NCCL_ASYNC_ERROR_HANDLING=1 ",
                      command.replace("OMP_NUM_THREADS=1 ", ""))
        self.assertNotIn("BLOCKING_WAIT", command)
        # the user's choices are kept, and printed
        ranks, command = self._launch(TORCH_NCCL_BLOCKING_WAIT="1",
                                      TORCH_NCCL_ASYNC_ERROR_HANDLING="3")
        self.assertEqual(ranks, ["rank env 1 3"])
        self.assertIn("TORCH_NCCL_BLOCKING_WAIT=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=3", command)


if __name__ == "__main__":
    unittest.main()
