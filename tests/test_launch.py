"""scripts/launch.sh gives every rank NCCL's fail-fast environment, and keeps the user's values."""

import os
import subprocess
import tempfile
import unittest

from tests.test_examples import ROOT

NCCL = ("TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
SHOW = "import os\nprint('rank env', *(os.environ.get(k) for k in {names!r}))\n"


class LauncherSetsNcclErrorHandling(unittest.TestCase):

    def test_ranks_see_the_variables_and_a_value_already_set_wins(self):
        with tempfile.TemporaryDirectory() as tmp:
            script = os.path.join(tmp, "show_env.py")
            with open(script, "w") as f:
                f.write(SHOW.format(names=NCCL))
            env = {k: v for k, v in os.environ.items() if k not in NCCL}
            env["TORCH_NCCL_BLOCKING_WAIT"] = "0"  # the user's choice; the other one is unset
            proc = subprocess.run(["bash", "scripts/launch.sh", script, "--nproc-per-node", "1"],
                                  cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        ranks = [line for line in proc.stdout.splitlines() if line.startswith("rank env")]
        self.assertEqual(ranks, ["rank env 0 1"])  # kept 0; set the unset one to 1
        command = next(line for line in proc.stdout.splitlines() if line.startswith("+ "))
        self.assertIn("TORCH_NCCL_BLOCKING_WAIT=0 TORCH_NCCL_ASYNC_ERROR_HANDLING=1", command)


if __name__ == "__main__":
    unittest.main()
