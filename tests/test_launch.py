"""scripts/launch.sh gives every rank NCCL's fail-fast environment, and keeps the user's values;
it checks its own arguments before torchrun (or any Python) starts, one error line each."""

import os
import socket
import subprocess
import tempfile
import unittest
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Tuple

from tests.harness import free_port
from tests.test_bad_inputs import run_in_process
from tests.test_examples import ROOT

NCCL = ("TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
# The threads launch.sh sets on a machine without a GPU, set beforehand: launch.sh then keeps
# them and does not start a Python that imports torch to ask for a GPU (1.5 s of a core), which
# the NCCL variables and the port check do not depend on.
NO_PROBE = {"OMP_NUM_THREADS": "1"}
SHOW = "import os\nprint('rank env', *(os.environ.get(k) for k in {names!r}))\n"


def launch_show_env(*launcher: str, **user: str) -> subprocess.CompletedProcess:
    """``scripts/launch.sh show_env.py --nproc-per-node 1 LAUNCHER``, the user having set
    ``user`` and nothing else of NCCL's: its rank prints what it sees of NCCL's variables."""
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "show_env.py")
        with open(script, "w") as f:
            f.write(SHOW.format(names=NCCL))
        env = {k: v for k, v in os.environ.items() if k not in NCCL}
        env.update(user, **NO_PROBE)
        return subprocess.run(
            ["bash", "scripts/launch.sh", script, "--nproc-per-node", "1", *launcher], cwd=ROOT,
            env=env, capture_output=True, text=True, timeout=120)


_DEFAULT: Dict[str, Tuple[str, subprocess.CompletedProcess]] = {}


def default_launch() -> Tuple[str, subprocess.CompletedProcess]:
    """(port, the launch): ``launch_show_env`` with nothing of NCCL's set and a free
    ``--master-port``, run once per process for both classes below (each torchrun is a new
    Python that imports torch: seconds of a core)."""
    if not _DEFAULT:
        port = str(free_port())  # the suite's rule: below the ephemeral range
        # --max-restarts: passed on to torchrun (test_resume's kill runs torchrun.py itself)
        _DEFAULT["run"] = (port, launch_show_env("--master-port", port, "--max-restarts", "1"))
    return _DEFAULT["run"]


class LauncherSetsNcclErrorHandling(unittest.TestCase):

    def _seen(self, proc: subprocess.CompletedProcess) -> tuple:
        """What the rank saw of NCCL's variables, and the command line printed."""
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        ranks = [line for line in proc.stdout.splitlines() if line.startswith("rank env")]
        command = next(line for line in proc.stdout.splitlines() if line.startswith("+ "))
        return ranks, command

    def test_async_error_handling_without_blocking_waits_and_a_value_already_set_wins(self):
        with ThreadPoolExecutor(max_workers=1) as pool:  # both launches at once
            users = pool.submit(launch_show_env, TORCH_NCCL_BLOCKING_WAIT="1",
                                TORCH_NCCL_ASYNC_ERROR_HANDLING="3")
            # blocking waits would hold the host at every wait(): no overlap
            # (doc/fault_tolerance.md)
            ranks, command = self._seen(default_launch()[1])
            self.assertEqual(ranks, ["rank env None 1"])
            self.assertIn("+ TORCH_NCCL_ASYNC_ERROR_HANDLING=1 ",
                          command.replace("OMP_NUM_THREADS=1 ", ""))
            self.assertNotIn("BLOCKING_WAIT", command)
            # the user's choices are kept, and printed
            ranks, command = self._seen(users.result())
        self.assertEqual(ranks, ["rank env 1 3"])
        self.assertIn("TORCH_NCCL_BLOCKING_WAIT=1 TORCH_NCCL_ASYNC_ERROR_HANDLING=3", command)


# (launcher arguments, the option the error line names, a fragment of it)
BAD_ARGUMENTS = [
    (["--nproc-per-node", "0"], "--nproc-per-node", "must be at least 1, got 0"),
    (["--nproc-per-node"], "--nproc-per-node", "needs a value"),
    (["--nproc-per-node", "--nnodes", "2"], "--nproc-per-node", "needs a value"),
    (["--nproc-per-node", "1", "--master-port"], "--master-port", "needs a value"),
    (["--nproc-per-node", "two"], "--nproc-per-node", "'two' is not a non-negative integer"),
    (["--nnodes", "0"], "--nnodes", "must be at least 1, got 0"),
    (["--nnodes", "2", "--node-rank", "2"], "--node-rank", "is not a node of --nnodes 2"),
    (["--max-restarts", "-1"], "--max-restarts", "'-1' is not a non-negative integer"),
    (["--master-port", "0"], "--master-port", "must be in 1..65535, got 0"),
    (["--master-port", "65536"], "--master-port", "must be in 1..65535, got 65536"),
    (["--master-port", "x"], "--master-port", "'x' is not a non-negative integer"),
    # past 64 bits, bash's arithmetic would wrap around to another number of ranks
    (["--nproc-per-node", "99999999999999999999"], "--nproc-per-node", "is too large"),
    (["--nnodes", "18446744073709551618"], "--nnodes", "is too large"),
]


class LauncherChecksItsArguments(unittest.TestCase):
    """Each mistake in the launcher's own options is one line ``error: ...`` naming the option,
    exit status 2, before torchrun starts: no command printed, nothing written."""

    def _run(self, *args: str) -> tuple:
        with tempfile.TemporaryDirectory() as tmp:
            runs = os.path.join(tmp, "runs")
            proc = subprocess.run([
                "bash", "scripts/launch.sh", "examples/00_single_device.py", *args, "--",
                "--logging.run_dir", runs
            ], cwd=ROOT, capture_output=True, text=True, timeout=120, env={
                **os.environ, "PYTHONPATH": ROOT
            })
            written = os.path.exists(runs)
        return proc.returncode, proc.stdout, proc.stderr, written

    def _assert_refused(self, args: list, option: str, fragment: str) -> None:
        code, out, err, written = self._run(*args)
        self.assertEqual(code, 2, out + err)
        self.assertEqual(out, "")  # no "+ torchrun ..." line: nothing was started
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertTrue(err.startswith(f"error: {option}"), err)
        self.assertIn(fragment, err)
        self.assertFalse(written)

    def test_each_bad_option_is_one_line_naming_it_before_torchrun(self):
        for args, option, fragment in BAD_ARGUMENTS:
            with self.subTest(args=args):
                self._assert_refused(args, option, fragment)

    def test_a_master_port_in_use_here_is_refused_and_a_free_one_launches(self):
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            port = str(busy.getsockname()[1])
            self._assert_refused(["--master-port", port], "--master-port",
                                 f"--master-port {port} is in use on this host (127.0.0.1)")
        # a free port launches: the default launch above, with its --master-port
        port, proc = default_launch()
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertIn("rank env", proc.stdout)  # the rank ran
        self.assertIn(f"--master-port {port}", proc.stdout)
        self.assertIn("torchrun.py --nproc-per-node 1 --max-restarts 1 ", proc.stdout)

    def test_the_pre_flight_refuses_a_world_of_no_ranks(self):
        # launch.sh never asks for it now; a script called directly may be: the script as
        # `python examples/00_single_device.py --validate-only --world-size 0` runs it, in this
        # process (the last --world-size is the one read); its whole output is the error line
        self.assertEqual(run_in_process("examples/00_single_device.py", ["--world-size", "0"]),
                         (2, "error: --world-size must be at least 1, got 0\n"))


if __name__ == "__main__":
    unittest.main()
