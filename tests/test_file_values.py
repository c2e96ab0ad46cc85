"""The values inside the files our scripts read are checked, not only the files' types.

A reader that checks that a file is JSON (or YAML) holding an object, and then uses its fields
as they come, fails deep inside on a string where a number belongs, or divides by an inf. Here
hypothesis draws a file kind, one field of it, and a wrong-typed or non-finite value for that
field (null, a bool, text, a list, an object, nan, inf, -inf, an integer past float's range,
a fraction where an integer belongs), writes the file with that one value changed, and runs
the script that reads it in this process. The claim: exit status 2 and one line ``error: ...``
naming the file and the field, never a traceback.

The kinds: a profile trace (``scripts/plot.py profile``: an event's name, ts, dur, tid, the
event list itself), a cluster file (``scripts/plan.py --cluster``, JSON or YAML: each key, and
the entries of links, slowdown, issued, sources), a pipeline's timeline.json (``plot.py
timeline``: pp, micro_batches, virtual_stages, schedule, an event and each of its six entries)
a runs file (``plot.py plan-vs-measured``: a run and each of its keys), a run's metrics.jsonl
(``plot.py loss``: a record's step and loss; a nan, inf or null loss is a gap in the curve, as
fp16's skipped steps write such values) and a plan file (``plot.py plan-memory``: each memory_bytes
kind, the rank and the model's name). A flight-recorder directory with a rank's dump missing
names the missing ranks, whichever they are (FlightRecorderNamesTheMissingRanks); a chapter
picture's log that is a directory, a FIFO, too large or another text is one line
(ChapterPlotLogsAreOneLine); a safetensors index naming a shard that is no file name is one
line naming the tensor (HfIndexEntriesAreFileNames).

The suite runs 30 examples; SCALETORCH_LONG_TESTS=1 runs 500 (CI's long phase).
"""

import contextlib
import copy
import io
import json
import math
import os
import shutil
import tempfile
import unittest
from typing import Any, List, Tuple

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from scaletorch.rules import boundary
from scaletorch.schedule import analysis
from scripts import plan, plot, plot_profile
from scripts.plot_base import read_metrics, read_timeline
from tests.test_file_kinds import DUMP_ENTRY

LONG = os.environ.get("SCALETORCH_LONG_TESTS") == "1"

# one profiled step, a collective on its main thread and an event of another thread (a tid is
# an int or a string), as torch.profiler writes them: the trace of rank 0 and of rank 1 alike
TRACE = {
    "traceEvents": [
        {
            "ph": "X",
            "name": "ProfilerStep#1",
            "ts": 1000,
            "dur": 500,
            "tid": 1
        },
        {
            "ph": "X",
            "name": "aten::mm",
            "ts": 1010,
            "dur": 20.5,
            "tid": "gloo"
        },
        {
            "ph": "X",
            "name": "dp all_reduce",
            "ts": 1100,
            "dur": 30,
            "tid": 1
        },
    ]
}
EVENT_KEYS = ("name", "ts", "dur", "tid")
TRACE_FIELDS = [("traceEvents", ), ("traceEvents", 1)]
TRACE_FIELDS += [("traceEvents", i, key) for i in range(3) for key in EVENT_KEYS]

CLUSTER = {
    "name": "host",
    "gpus_per_node": 4,
    "peak_flops": 5e10,
    "hbm_bytes": 24e9,
    "intra_node_bandwidth": 1e9,
    "inter_node_bandwidth": 1e9,
    "intra_node_latency": 1e-4,
    "inter_node_latency": 1e-4,
    "compute_efficiency": 0.5,
    "cores": 2,
    "sms": 4,
    "layer_overhead_s": 1e-3,
    "slowdown": {
        "2": 1.5
    },
    "links": {
        "2": {
            "2": {
                "all_reduce": [1e-4, 1e9]
            }
        }
    },
    "issued": {
        "2": {
            "dp": 1e-3
        }
    },
    "sources": {
        "peak_flops": "measured"
    }
}
CLUSTER_FIELDS: List[Tuple[Any,
                           ...]] = [(k, ) for k in CLUSTER] + [("slowdown", "2"), ("links", "2"),
                                                               ("links", "2", "2"),
                                                               ("links", "2", "2", "all_reduce"),
                                                               ("links", "2", "2", "all_reduce", 0),
                                                               ("links", "2", "2", "all_reduce", 1),
                                                               ("issued", "2"),
                                                               ("issued", "2", "dp"),
                                                               ("sources", "peak_flops")]
INTEGERS = ("gpus_per_node", "cores", "sms")

# a pipeline's timeline.json (07_nd_parallel writes it): 1F1B over 2 stages, 2 micro-batches
TIMELINE = analysis.simulate("1f1b", 2, 2, 1, 1.0, 2.0, None).to_json()
EVENT_FIELDS = ("rank", "kind", "micro_batch", "chunk", "start", "end")
TIMELINE_FIELDS: List[Tuple[Any, ...]] = [
    (k, ) for k in ("pp", "micro_batches", "virtual_stages", "schedule", "events")
]
TIMELINE_FIELDS += [("events", 1)] + [("events", 1, j) for j in range(6)]

# scripts/plan_vs_tour.py's runs file (plot.py plan-vs-measured)
RUNS = [{
    "script": "00_single_device",
    "ranks": 1,
    "arguments": "",
    "measured_s": 0.02,
    "predicted_s": 0.025
}]
RUNS_FIELDS: List[Tuple[Any, ...]] = [(0, ), (0, "script"), (0, "ranks"), (0, "arguments"),
                                      (0, "measured_s"), (0, "predicted_s")]

# a run's metrics.jsonl, two records (plot.py loss reads step and loss)
METRICS = [{"step": 0, "loss": 4.2, "lr": 1e-3}, {"step": 1, "loss": 4.0, "lr": 1e-3}]
METRICS_FIELDS: List[Tuple[Any,
                           ...]] = [("metrics", i, k) for i in (0, 1) for k in ("step", "loss")]

# scripts/plan.py --json output as plot.py plan-memory reads it: the fields it uses
MEMORY_KINDS = ("params", "grads", "optimizer", "buffers", "activations", "total")
PLAN = {
    "layouts": [{
        "tp": 1,
        "pp": 1,
        "dp": 8,
        "seq_len": 8192,
        "model": "llama3-8b",
        "most_loaded_pp_rank": 0,
        "memory_bytes": {
            k: 1e9 * (i + 1)
            for i, k in enumerate(MEMORY_KINDS)
        }
    }]
}
PLAN_FIELDS: List[Tuple[Any, ...]] = [("layouts", 0, "model"),
                                      ("layouts", 0, "most_loaded_pp_rank")]
PLAN_FIELDS += [("layouts", 0, "memory_bytes", k) for k in MEMORY_KINDS]

BAD = st.one_of(st.none(), st.booleans(), st.text(max_size=4),
                st.lists(st.integers(0, 3), max_size=2),
                st.dictionaries(st.text("ab", max_size=2), st.integers(0, 3), max_size=1),
                st.sampled_from([math.nan, math.inf, -math.inf, 10**400]),
                st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: x != int(x)))


def _fits(path: Tuple[Any, ...], value: Any) -> bool:
    """Whether ``value`` has the type the field at ``path`` holds: then it is no bad value (the
    ranges, > 0 and such, are checked as they were, and are not this test's)."""
    last = path[-1]
    number = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and abs(value) < 1e300)  # nan and inf are not below it
    count = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63
    if path[0] == "metrics":  # a loss that is null or a non-finite float is a gap
        return count if last == "step" else number or value is None or (
            isinstance(value, float) and not math.isfinite(value))
    if path[0] == "layouts":
        return isinstance(value, str) if last == "model" else count if last == \
            "most_loaded_pp_rank" else number and value >= 0
    if path[0] == "events" and len(path) == 3:
        last = EVENT_FIELDS[path[2]]
    if path[0] in ("events", "schedule") and len(path) < 3:
        return isinstance(value, (list, str)[path[0] == "schedule"]) if len(path) == 1 else False
    if path[0] in ("pp", "micro_batches", "virtual_stages") or last in EVENT_FIELDS[:4]:
        if last == "kind":
            return value in ("F", "B", "W")
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if last in ("start", "end"):
        return number
    if path[0] == 0:
        if len(path) == 1:
            return False  # no drawn value holds a run's keys
        return isinstance(value, str) if last in ("script", "arguments") else number
    if path[0] == "traceEvents":
        if len(path) < 3:  # the list of events, an event
            return isinstance(value, list if len(path) == 1 else dict)
        if last == "name":
            return isinstance(value, str)
        return isinstance(value, (int, str)) and not isinstance(value, bool) if last == "tid" \
            else number
    if last == "name" or path[0] == "sources" and len(path) == 2:
        return isinstance(value, str)
    if last in INTEGERS:
        return isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**63
    if len(path) == 1 and last in ("slowdown", "links", "issued", "sources") or \
            len(path) < {"links": 4, "issued": 3}.get(path[0], 0):
        return value == {} and isinstance(value, dict)  # drawn mappings have no valid key
    if path[0] == "links" and len(path) == 4:
        return isinstance(value, list) and len(value) == 2 and all(
            _fits(path + (i, ), v) for i, v in enumerate(value))
    return number


def _replace(document: Any, path: Tuple[Any, ...], value: Any) -> Any:
    document = copy.deepcopy(document)
    inner = document
    for key in path[:-1]:
        inner = inner[key]
    inner[path[-1]] = value
    return document


def _names(path: Tuple[Any, ...]) -> List[str]:
    """What the error line must name of ``path``: its keys, an event's or a run's index, the
    name of an entry of a list (latency, bandwidth; a timeline event's rank, start ...)."""
    head, rest = path[0], path[1:]
    if head == "metrics":  # a record of metrics.jsonl, counted from 1
        return [f"record {rest[0] + 1}", repr(rest[1])]
    if head == "layouts":
        return ["layout 0", repr(rest[-1]) if rest[-1] != "model" else "'model'"]
    if head == 0:  # a run of a runs file
        return ["run 0"] + [repr(k) for k in rest]
    if head in ("traceEvents", "events") and rest:
        names = [EVENT_FIELDS[j] for j in rest[1:]
                 if j != 1] if head == "events" else [repr(k) for k in rest[1:]]
        return [f"event {rest[0]}"] + names
    names = [repr(k) if isinstance(k, str) else ("latency", "bandwidth")[k] for k in rest]
    return [head] + names


def _run(main: Any, argv: List[str]) -> Tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    return status, err.getvalue()


class WrongValuesInsideFilesAreOneLine(unittest.TestCase):

    def setUp(self):
        self.tmp = tempfile.mkdtemp()

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _refused(self, status: int, err: str, path: str, names: List[str],
                 quoted: bool = True) -> None:
        self.assertEqual(status, 2, err)
        self.assertNotIn("Traceback", err)
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertTrue(err.startswith("error: ") and (repr(path) if quoted else path) in err, err)
        for name in names:
            self.assertIn(name, err)

    @settings(max_examples=500 if LONG else 30, deadline=None, derandomize=not LONG,
              suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
    @given(
        kind=st.sampled_from(
            ["profile", "cluster.json", "cluster.yaml", "timeline", "runs", "metrics", "plan"]),
        data=st.data(), value=BAD)
    def test_a_wrong_type_or_a_non_finite_value_is_refused_naming_file_and_field(
            self, kind, data, value):
        fields = {
            "profile": TRACE_FIELDS,
            "timeline": TIMELINE_FIELDS,
            "runs": RUNS_FIELDS,
            "metrics": METRICS_FIELDS,
            "plan": PLAN_FIELDS
        }.get(kind, CLUSTER_FIELDS)
        path = data.draw(st.sampled_from(fields), label="field")
        assume(not _fits(path, value))
        if kind == "metrics":
            file = os.path.join(self.tmp, "metrics.jsonl")
            with open(file, "w") as f:
                for record in _replace({"metrics": METRICS}, path, value)["metrics"]:
                    f.write(json.dumps(record) + "\n")
            status, err = _run(plot.main, ["loss", file, "--out", self.tmp + "/p.png"])
            self._refused(status, err, file, _names(path))
            return
        if kind == "plan":
            file = os.path.join(self.tmp, "plan.json")
            with open(file, "w") as f:
                json.dump(_replace(PLAN, path, value), f)
            status, err = _run(plot.main, ["plan-memory", file, "--out", self.tmp + "/p.png"])
            self._refused(status, err, file, _names(path), quoted=False)
            return
        if kind in ("timeline", "runs"):
            file = os.path.join(self.tmp, kind + ".json")
            with open(file, "w") as f:
                json.dump(_replace(TIMELINE if kind == "timeline" else RUNS, path, value), f)
            command = "timeline" if kind == "timeline" else "plan-vs-measured"
            status, err = _run(plot.main, [command, file, "--out", self.tmp + "/p.png"])
            self._refused(status, err, file, _names(path))
            return
        if kind == "profile":
            profile = os.path.join(self.tmp, "profile")
            os.makedirs(profile, exist_ok=True)
            for rank in (0, 1):
                with open(os.path.join(profile, f"rank_{rank}.json"), "w") as f:
                    json.dump(_replace(TRACE, path, value) if rank == 0 else TRACE, f)
            status, err = _run(plot.main, ["profile", profile, "--out", self.tmp + "/p.png"])
            self._refused(status, err, os.path.join(profile, "rank_0.json"), _names(path))
            return
        file = os.path.join(self.tmp, "host." + kind.split(".")[1])
        document = _replace(CLUSTER, path, value)
        with open(file, "w") as f:
            f.write(
                json.dumps(document) if file.endswith(".json") else boundary.dump_yaml(document))
        status, err = _run(plan.main, ["--preset", "llama3-8b", "--gpus", "8", "--cluster", file])
        self._refused(status, err, file, _names(path))

    def test_the_values_drawn_from_are_accepted_as_they_are(self):
        """The documents the test changes are valid: each refusal is the changed value's."""
        profile = os.path.join(self.tmp, "profile")
        os.makedirs(profile)
        for rank in (0, 1):
            with open(os.path.join(profile, f"rank_{rank}.json"), "w") as f:
                json.dump(TRACE, f)
        steps = plot_profile.read_ranks(profile)  # plot.py profile's reading, without drawing
        self.assertEqual([(s.step, len(s.collectives)) for s in steps], [(1, 1), (1, 1)])
        for name, document in (("timeline.json", TIMELINE), ("runs.json", RUNS), ("plan.json",
                                                                                  PLAN)):
            with open(os.path.join(self.tmp, name), "w") as f:
                json.dump(document, f)
        self.assertEqual(plot.read_plans([os.path.join(self.tmp, "plan.json")]), PLAN["layouts"])
        with open(os.path.join(self.tmp, "metrics.jsonl"), "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in METRICS))
            f.write('{"step": 2, "loss": NaN}\n{"step": 3, "loss": null}\n'  # gaps
                    '{"step": 4, "loss": Infinity}\n{"step": 5, "loss": -Infinity}\n')
        curve = read_metrics(os.path.join(self.tmp, "metrics.jsonl"), "loss")
        self.assertEqual((curve["step"], curve["loss"][:2]), ([0, 1, 2, 3, 4, 5], [4.2, 4.0]))
        self.assertTrue(all(math.isnan(v) for v in curve["loss"][2:]))
        timeline = read_timeline(os.path.join(self.tmp, "timeline.json"))
        self.assertEqual(len(timeline.events), len(TIMELINE["events"]))
        self.assertEqual(plot.read_runs(os.path.join(self.tmp, "runs.json")), RUNS)
        for name in ("host.json", "host.yaml"):
            file = os.path.join(self.tmp, name)
            with open(file, "w") as f:
                f.write(
                    json.dumps(CLUSTER) if name.endswith(".json") else boundary.dump_yaml(CLUSTER))
            status, err = _run(plan.main,
                               ["--preset", "llama3-8b", "--gpus", "8", "--cluster", file])
            self.assertEqual(status, 0, err)

    def test_a_directory_named_as_a_rank_trace_is_said_to_be_one(self):
        for rank in (0, 1):
            os.makedirs(os.path.join(self.tmp, f"rank_{rank}.json"))
        status, err = _run(plot.main, ["profile", self.tmp])
        self._refused(status, err, os.path.join(self.tmp, "rank_0.json"), ["is a directory"])
        self.assertNotIn("--profile STEPS", err)


def _dump(world: int, calls: int, rank: int) -> dict:
    """Rank ``rank``'s flight-recorder dump (scaletorch.dist.flight_recorder's JSON): ``calls``
    all-reduces over the world group of ``world`` ranks, every rank alike."""
    entry = {**DUMP_ENTRY, "process_group": ["0", "world"]}
    ranks = ", ".join(map(str, range(world)))
    return {
        "entries": [{
            **entry, "collective_seq_id": i + 1
        } for i in range(calls)],
        "pg_config": {
            "0": {
                "name": "0",
                "desc": "world",
                "ranks": f"[{ranks}]"
            }
        },
        "rank": rank
    }


class FlightRecorderNamesTheMissingRanks(unittest.TestCase):
    """scripts/fr_analyze.py on a directory where some ranks wrote no dump (killed, or still
    hanging): the ranks of the groups the dumps name tell which are missing, whichever they are
    (the highest rank's dump alone, or the lowest's). A rank number no world has is refused."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp()

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    @settings(max_examples=60 if LONG else 8, deadline=None, derandomize=not LONG)
    @given(world=st.integers(2, 6), data=st.data(), calls=st.integers(1, 4))
    def test_the_missing_ranks_are_named_and_the_present_ones_said_to_agree(
            self, world, data, calls):
        from scaletorch.rules.safe_files import write_checksummed
        from scripts import fr_analyze
        present = data.draw(st.sets(st.integers(0, world - 1), min_size=1, max_size=world - 1))
        directory = os.path.join(self.tmp, f"fr{world}-{'-'.join(map(str, sorted(present)))}")
        for rank in present:
            write_checksummed(os.path.join(directory, f"rank_{rank}"),
                              json.dumps(_dump(world, calls, rank)).encode())
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            self.assertEqual(fr_analyze.main([directory]), 0)
        missing = sorted(set(range(world)) - present)
        self.assertIn(f"no dump from ranks {missing}", out.getvalue())
        self.assertIn(f"but ranks {missing} wrote none", out.getvalue())
        self.assertNotIn("the ranks agree", out.getvalue())

    def test_a_rank_above_any_world_is_refused(self):
        from scaletorch.rules.safe_files import write_checksummed
        from scripts import fr_analyze
        for name, world in (("rank_99999999999", 2), ("rank_0", 10**12)):
            directory = os.path.join(self.tmp, name + str(world))
            dump = _dump(2, 1, int(name[len("rank_"):]))
            dump["pg_config"]["0"]["ranks"] = f"[0, {world}]"
            write_checksummed(os.path.join(directory, name), json.dumps(dump).encode())
            status, err = _run(fr_analyze.main, [directory])
            self.assertEqual(status, 2, err)
            self.assertEqual(len(err.splitlines()), 1, err)
            self.assertIn(repr(os.path.join(directory, name)), err)

    @settings(max_examples=40 if LONG else 8, deadline=None, derandomize=not LONG)
    @given(world=st.integers(2, 6), data=st.data(),
           kind=st.sampled_from(["renamed", "copied", "outside", "other world", "no rank"]))
    def test_a_dump_under_another_ranks_name_is_refused_naming_it(self, world, data, kind):
        # the rank is the dump's own ("rank", written by flight_recorder.dump), not its file
        # name's: a renamed or copied dump would put one rank's collectives under another
        from scaletorch.rules.safe_files import write_checksummed
        from scripts import fr_analyze
        rank = data.draw(st.integers(0, world - 1))
        other = data.draw(st.integers(0, 2 * world).filter(lambda r: r != rank))
        dumps = {r: _dump(world, 2, r) for r in range(world)}
        if kind in ("renamed", "copied"):  # rank's dump under other's name
            if kind == "renamed":
                del dumps[rank]
            dumps[other] = _dump(world, 2, rank)
            bad = other
        elif kind == "outside":  # a world that does not hold the rank its dump names
            dumps[rank]["pg_config"]["0"]["ranks"] = str([r for r in range(world) if r != rank])
            bad = rank
        elif kind == "other world":  # another run's dump among this run's
            dumps[rank] = _dump(world + 1, 2, rank)
            bad = rank
        else:
            del dumps[rank]["rank"]
            bad = rank
        directory = os.path.join(self.tmp, f"{kind}-{world}-{rank}-{other}")
        for r, dump in dumps.items():
            write_checksummed(os.path.join(directory, f"rank_{r}"), json.dumps(dump).encode())
        status, err = _run(fr_analyze.main, [directory])
        self.assertEqual(status, 2, err)
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertIn(f"rank_{bad}", err)


LOG_PLOTS = ("ddp-buckets", "zero-memory", "tp-split", "zigzag", "experts", "rank-grid",
             "dtype-bytes")


class ChapterPlotLogsAreOneLine(unittest.TestCase):
    """plot.py's chapter pictures read a chapter's saved output: a directory, a FIFO, a file
    over the size limit (sparse: nothing is written), random bytes or text of another chapter
    is one ``error:`` line naming the file, exit 2, never a traceback or a hang on the FIFO."""

    def setUp(self):
        self.tmp = tempfile.mkdtemp()

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    @settings(max_examples=60 if LONG else 10, deadline=None, derandomize=not LONG)
    @given(command=st.sampled_from(LOG_PLOTS),
           kind=st.sampled_from(["directory", "fifo", "huge", "bytes",
                                 "text"]), content=st.binary(max_size=200))
    def test_a_wrong_log_is_one_line(self, command, kind, content):
        from scripts import chapter_plots
        log = os.path.join(self.tmp, f"{command}-{kind}.log")
        if kind == "directory":
            os.makedirs(log, exist_ok=True)
        elif kind == "fifo":
            if not os.path.exists(log):
                os.mkfifo(log)
        else:
            with open(log, "wb") as f:
                f.write(content if kind == "bytes" else b"step 1 | loss 4.2\n")
            if kind == "huge":
                os.truncate(log, chapter_plots.LOG_BYTES + 1)
        status, err = _run(plot.main, [command, log, "--out", self.tmp + "/p.png"])
        self.assertEqual(status, 2, err)
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertTrue(err.startswith("error: ") and log in err, err)


class HfIndexEntriesAreFileNames(unittest.TestCase):
    """A safetensors index whose weight_map gives a tensor a shard that is no file name (a
    number, null, a list, an object) is one InputError naming the tensor, not a TypeError's
    text from os.path.join."""

    @classmethod
    def setUpClass(cls):
        from scaletorch.models import build_model
        from scaletorch.models.hf import INDEX_FILE, export_hf_llama
        from scaletorch.models.llama import LlamaConfig
        cls.tmp = tempfile.mkdtemp()
        cls.path = os.path.join(cls.tmp, "hf")
        small = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, max_seq_len=32)
        export_hf_llama(build_model(small, seed=0), cls.path, max_shard_bytes=2_000)
        cls.index = os.path.join(cls.path, INDEX_FILE)
        with open(cls.index) as f:
            cls.document = json.load(f)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    @settings(max_examples=40 if LONG else 6, deadline=None, derandomize=not LONG)
    @given(data=st.data(), value=BAD)
    def test_a_shard_that_is_no_file_name_is_refused_naming_the_tensor(self, data, value):
        from scaletorch.models.hf import check_hf_llama
        from scaletorch.rules.errors import InputError
        from scaletorch.rules.safe_files import write_checksummed
        assume(not isinstance(value, str))  # a name: the shard checks' (outside, missing)
        tensor = data.draw(st.sampled_from(sorted(self.document["weight_map"])))
        document = _replace(self.document, ("weight_map", tensor), value)
        write_checksummed(self.index, json.dumps(document).encode())
        try:
            with self.assertRaises(InputError) as caught:
                check_hf_llama(self.path)
            self.assertIn(f"weight_map gives {tensor!r} the shard", str(caught.exception))
        finally:
            write_checksummed(self.index, json.dumps(self.document).encode())


if __name__ == "__main__":
    unittest.main()
