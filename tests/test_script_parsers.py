"""Every script's command-line mistake is one ``error:`` line and exit status 2 (doc/bad_inputs.md).

The scripts are found, not listed: every ``.py`` under scripts/ and examples/ that runs as
``__main__`` (``EXEMPT`` names the two that do not parse a command line of their own). Their
options are found too: each script runs once with ``--help`` in a process that records every
parser it asks to parse (a pre-parser, the script's own, each sub-command's). From those
come the bad arguments, by kind: an unknown option, an option given no value, a number option
given ``abc``, a choice that is not one, and a required argument left out. A parser that is
argparse's own prints its usage (3 to 25 lines) before its error; ``OneLineParser`` prints
one line.
"""

import json
import os
import sys
import tempfile
import unittest
from typing import Dict, List, Tuple

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.harness import run_forked
from tests.test_examples import ROOT

# Scripts run as __main__ that take no command line of their own
EXEMPT = {
    "scripts/calibrate.py":
    "a module of plan.py; run as a script it only says to run plan.py",
    "scripts/torchrun.py":
    "launch.sh's inner layer: torchrun's arguments, built and checked by launch.sh",
}
# A script's other command lines with parsers of their own: (script, words before the options)
ENTRIES = {"examples/07_nd_parallel.py": [["--dry-run", "--world-size", "1"]]}

# Runs in a forked process: for each script (argv[1:] as JSON), its parsers' actions as JSON
COLLECT = r"""
import argparse, contextlib, io, json, runpy, sys
entries = json.loads(sys.argv[1])
out, parsers = {}, {}
for script, prefix in entries:
    seen = []
    original = argparse.ArgumentParser.parse_known_args
    def record(self, args=None, namespace=None, _seen=seen, _prefix=prefix):
        _seen.append((self, _prefix))
        return original(self, args, namespace)
    argparse.ArgumentParser.parse_known_args = record
    sys.argv = [script, *prefix, "--help"]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            runpy.run_path(script, run_name="__main__")
    except BaseException:  # noqa: B902 - SystemExit, or a script that breaks on --help
        pass
    finally:
        argparse.ArgumentParser.parse_known_args = original
    cases, todo = [["unknown option", [*prefix, "--no-such-option"]]], list(seen)
    while todo:
        parser, words = todo.pop()
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo += [(sub, [*words, name]) for name, sub in a.choices.items()]
            valued = a.nargs is None or a.nargs == "+" or (isinstance(a.nargs, int) and a.nargs > 0)
            if a.required and a.default is None:
                cases.append(["missing", list(words)])
            if not a.option_strings or not valued:
                continue
            flag = a.option_strings[-1]
            cases.append(["no value", [*words, flag]])
            if a.type in (int, float):
                cases.append(["not a number", [*words, flag, "abc"]])
            if a.choices is not None and a.type is None:
                cases.append(["no such choice", [*words, flag, "no-such-choice"]])
        cases.append(["unknown option", [*words, "--no-such-option"]])
    found = []
    for kind, argv in map(json.loads, sorted(set(map(json.dumps, cases)))):
        sys.argv, said, code = [script, *argv], io.StringIO(), 0
        try:  # the script's parsing alone: a case it accepts runs the script here
            with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
                runpy.run_path(script, run_name="__main__")
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else 1
        except BaseException as err:
            code, said = 1, io.StringIO(f"{type(err).__name__}: {err}")
        found.append([kind, argv, code, said.getvalue()[-2000:]])
    out[" ".join([script, *prefix])] = found
    parsers[" ".join([script, *prefix])] = len(seen)
print(json.dumps([out, parsers]))
"""


def scripts() -> List[str]:
    """Every script under scripts/ and examples/ that runs as __main__, less EXEMPT."""
    found = []
    for folder in ("scripts", "examples"):
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            path = f"{folder}/{name}"
            if name.endswith(".py") and path not in EXEMPT:
                with open(os.path.join(ROOT, path)) as f:
                    if 'if __name__ == "__main__":' in f.read():
                        found.append(path)
    return found


Case = Tuple[str, List[str], int, str]  # kind, argv, exit status and output in the sweep
_CASES: Dict[str, List[Case]] = {}
_PARSERS: Dict[str, int] = {}  # parsers each script asked to parse its --help


def cases() -> Dict[str, List[Case]]:
    """{"script [words]": [(kind, argv, status, output), ...]}: every script's mistakes, each
    run once in one forked process (found and run: a few ms each after the script's imports)."""
    if not _CASES:
        entries = [[s, []] for s in scripts()] + [[s, p] for s, ps in ENTRIES.items() for p in ps]
        with tempfile.NamedTemporaryFile("w", suffix=".py") as f:
            f.write(COLLECT)
            f.flush()
            done = run_forked(f.name, json.dumps(entries), cwd=ROOT, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        found, parsers = json.loads(done.stdout.splitlines()[-1])
        _CASES.update(found)
        _PARSERS.update(parsers)
    return _CASES


def check(test: unittest.TestCase, what: str, status: int, out: str) -> None:
    test.assertEqual(status, 2, f"{what}:\n{out}")
    test.assertEqual(len(out.splitlines()), 1, f"{what}:\n{out}")
    test.assertTrue(out.startswith("error: "), f"{what}:\n{out}")


class EveryScriptsMistakeIsOneLine(unittest.TestCase):
    """Generated: every script under scripts/ and examples/ x every bad argument its parsers
    admit (kind x option): exactly one line ``error: ...`` and exit status 2. All of them in
    one process (the script's parsing, run by runpy); a sample as a user runs them (a process
    of its own each), which the sweep stands for."""

    def test_the_scripts_and_their_options_are_found(self):
        found = cases()
        self.assertEqual(len(found), len(scripts()) + sum(map(len, ENTRIES.values())))
        for name in found:  # each parses its command line with argparse
            self.assertGreater(_PARSERS[name], 0, f"{name} --help asked no parser")
        kinds = {m[0] for v in found.values() for m in v}
        self.assertEqual(
            kinds, {"unknown option", "no value", "not a number", "no such choice", "missing"})

    def test_every_mistake_of_every_script(self):
        for name, mistakes in cases().items():
            for kind, argv, status, out in mistakes:
                with self.subTest(script=name, kind=kind, argv=argv):
                    check(self, f"{name.split()[0]} {' '.join(argv)} ({kind})", status, out)

    @settings(max_examples=100 if os.environ.get("SCALETORCH_LONG_TESTS") == "1" else 10,
              deadline=None)
    @given(data=st.data())
    def test_as_a_process_of_its_own(self, data):
        found = cases()
        name = data.draw(st.sampled_from(sorted(found)), label="script")
        kind, argv, _, _ = data.draw(st.sampled_from(found[name]), label="mistake")
        script = name.split(" ")[0]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
        done = run_forked(script, *argv, env=env, cwd=ROOT, timeout=120)
        check(self, f"{script} {' '.join(argv)} ({kind})", done.returncode,
              done.stdout + done.stderr)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1])
