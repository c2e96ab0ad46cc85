"""The hardware a plan runs on: per-GPU peak, memory and links, and how much of them is reached.

Presets from the vendors' spec sheets (dense bf16, per GPU, 8 GPUs per node); the link
bandwidths are per direction (NVLink is quoted bidirectional: half of it each way; a NIC is
quoted in bits). Real kernels and collectives reach a fraction of the peaks:
``compute_efficiency`` (a large bf16 matmul: about 0.7 of peak on H100) and
``comm_efficiency`` (NCCL's bus bandwidth: about 0.75 of the link) are parameters of the
cluster, so a measured host (``scripts/plan.py --calibrate``) or a better guess replaces them.
A cluster file is YAML (or JSON) with every required key of ``Cluster``.

A measured host adds what a GPU spec sheet leaves out, since a CPU run of a small model is
bound by them (``scripts/plan.py --calibrate`` measures each; scaletorch/plan/time.py uses them):
``cores`` (ranks beyond them share a core; ``slowdown``: how much longer a rank's step takes
when the whole world runs at once), ``layer_overhead_s``, ``moe_layer_overhead_s`` and
``micro_batch_overhead_s`` (the fixed cost of a dense block's, an MoE block's and the
embedding + head + loss's forward and backward per micro-batch: the dispatch of their many
small ops), ``step_overhead_s`` (clipping, optimizer step), ``score_element_s`` (per
attention score: the softmax and masks over b x heads x s x s elements) and ``links`` (per
world size and group size, per collective: latency in seconds and bandwidth in wire bytes/s,
measured with every group of the world busy at once) and ``issued`` (per world size, per
strategy: the seconds one of its calls adds to a training step as the strategy issues it,
measured within the cores by training the config with that strategy alone, past them a
measured share of that; see scripts/calibrate.py).
"""

import json
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Dict, List, Optional

from scaletorch.rules import boundary
from scaletorch.rules.errors import InputError, clip


@dataclass(frozen=True)
class Cluster:
    name: str
    gpus_per_node: int
    peak_flops: float  # dense bf16 FLOP/s per GPU
    hbm_bytes: float
    intra_node_bandwidth: float  # bytes/s one GPU sends to its node's others (one direction)
    inter_node_bandwidth: float  # bytes/s one GPU sends off the node (its NIC)
    intra_node_latency: float  # seconds per message hop
    inter_node_latency: float
    compute_efficiency: float = 0.7
    comm_efficiency: float = 0.75
    # measured hosts only (0 / empty: a GPU per rank, overheads hidden by asynchronous launches)
    cores: int = 0
    layer_overhead_s: float = 0.0
    moe_layer_overhead_s: float = 0.0  # an MoE block's (0: as a dense block's)
    micro_batch_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    # seconds per attention score (b x heads x s x s of a block's forward, its backward
    # included): the softmax and masks over them cost more than their FLOPs say
    score_element_s: float = 0.0
    # {world: how much longer a rank's step takes in a world of that size than with a core of
    # its own (within the cores: compute with every rank computing / alone; past them: a
    # data-parallel training step, scripts/calibrate.py)}; without it world / cores
    slowdown: Dict[str, float] = field(default_factory=dict)
    # {world: {group size: {op: [latency s, bandwidth wire bytes/s]}}}, keys as strings (JSON)
    links: Dict[str, Dict[str, Dict[str, List[float]]]] = field(default_factory=dict)
    # {world: {strategy: seconds a call adds to a step}}, strategies in ISSUED; replaces the
    # bare call's latency of ``links`` for that strategy's calls
    issued: Dict[str, Dict[str, float]] = field(default_factory=dict)
    # GPUs, what a datasheet's peak leaves out (scaletorch/plan/kernels.py; hbm_bandwidth 0:
    # the flat roofline compute / (peak x compute_efficiency) of a cluster file without them)
    hbm_bandwidth: float = 0.0  # bytes/s of HBM (datasheet)
    hbm_efficiency: float = 0.8  # fraction of it an elementwise kernel streams at
    attention_efficiency: float = 0.35  # flash attention's FLOP/s (forward + backward) / peak
    sms: int = 0  # streaming multiprocessors: a GEMM's tiles run in waves of this many
    kernel_overhead_s: float = 0.0  # the gap one kernel adds after the one before it
    overlap_cost: float = 0.0  # of each second of communication hidden behind compute, what
    # the compute loses (NCCL's kernels take SMs and HBM bandwidth from it)
    fp8_flops: float = 0.0  # dense fp8 FLOP/s (0: 2 x peak_flops)
    fp8_efficiency: float = 0.0  # of fp8_flops, what a large fp8 GEMM sustains (0: as bf16)
    sources: Dict[str, str] = field(default_factory=dict)  # {key: where its value comes from}

    def __post_init__(self) -> None:
        optional = ("cores", "layer_overhead_s", "moe_layer_overhead_s", "micro_batch_overhead_s",
                    "step_overhead_s", "score_element_s", "hbm_bandwidth", "sms",
                    "kernel_overhead_s", "overlap_cost", "fp8_flops", "fp8_efficiency")
        bad = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("name", "links", "slowdown", "issued", "sources") and not (
                getattr(self, f.name) >= 0 if f.name in optional else getattr(self, f.name) > 0)
        }
        if bad:
            raise ValueError("cluster " + ", ".join(f"{k} {v}" for k, v in bad.items()) +
                             ": must be positive (the overheads and cores: not negative)")
        for key in ("compute_efficiency", "comm_efficiency", "hbm_efficiency",
                    "attention_efficiency", "fp8_efficiency"):
            if getattr(self, key) > 1:
                raise ValueError(f"cluster {key} {getattr(self, key)} must be at most 1")

    def time_slicing(self, world: int) -> float:
        """How much longer a rank's step takes when ``world`` ranks share the ``cores``:
        measured (``slowdown``, the nearest world measured not above it, scaled by world / that
        world beyond the cores) or world / cores."""
        if not self.cores:
            return 1.0
        measured = [int(w) for w in self.slowdown if int(w) <= world]
        if not measured:
            return max(1.0, world / self.cores)
        w = max(measured)
        return self.slowdown[str(w)] * max(1.0, world / max(w, self.cores))

    def issued_latency(self, strategy: str, world: int) -> Optional[float]:
        """Seconds one call of ``strategy`` (one of ISSUED) adds to a step in a world of
        ``world``, from ``issued`` (the nearest measured world not above it if possible), or
        None when it was not measured."""
        worlds = [int(w) for w, kinds in self.issued.items() if strategy in kinds]
        if not worlds:
            return None
        below = [w for w in worlds if w <= world]
        return self.issued[str(max(below) if below else min(worlds))][strategy]

    def link(self, op: str, group_size: int, world: int) -> List[float]:
        """[latency s, bandwidth wire bytes/s] of ``op`` over ``group_size`` ranks of a world of
        ``world``, from ``links`` (the nearest measured world, then group size, not above them
        if possible). A reduce-scatter is timed as an all-gather, a broadcast as an all-reduce."""
        op = {"reduce_scatter": "all_gather", "broadcast": "all_reduce", "recv": "send"}.get(op, op)

        def nearest(sizes: List[int], want: int) -> str:
            below = [k for k in sorted(sizes) if k <= want]
            return str(below[-1] if below else min(sizes))

        worlds = [
            int(w) for w, groups in self.links.items() if any(op in ops for ops in groups.values())
        ]
        if not worlds:
            raise ValueError(f"cluster {self.name}: no measured {op} in links")
        groups = self.links[nearest(worlds, world)]
        return groups[nearest([int(n) for n, ops in groups.items() if op in ops], group_size)][op]


# the strategies whose calls ``issued`` times: tensor parallel without and with sequence
# parallel, context, pipeline and expert parallel (per call), data parallel (DDP, ZeRO-1/2:
# per step, its sync at the end of the backward, and per micro-batch, its gradient hooks)
# and ZeRO-3 (per block and micro-batch: a unit's gather, free and reduce-scatter)
ISSUED = ("tp", "sp", "cp", "pp", "ep", "dp", "dp_micro_batch", "zero3")

# Where the GPU presets' values come from. The peaks, HBM sizes and bandwidths, NVLink and NIC
# rates, SM counts: the vendors' datasheets (dense, per GPU). The rest are this chapter's
# assumptions, stated here and in doc/09_planning.md, and checked against published runs in
# doc/09_appendix_validation.md (scripts/plan_validate.py), not measured on these GPUs by us.
GPU_SOURCES = {
    "peak_flops":
    "vendor datasheet, dense bf16",
    "hbm_bandwidth":
    "vendor datasheet",
    "sms":
    "vendor datasheet (H100 SXM 132, A100 108, B200 148)",
    "compute_efficiency":
    "assumption: a large bf16 GEMM (cuBLAS) sustains about 0.75 of the "
    "datasheet peak at 700 W, about 0.6 at torchtitan's 500 W cap (lower clocks)",
    "attention_efficiency":
    "assumption: FlashAttention-2 (PyTorch SDPA) reaches about 0.35 of "
    "peak forward + backward on H100 at 700 W, counting the causal half it computes; 0.25 at "
    "500 W (attention draws the most power)",
    "fp8_efficiency":
    "assumption: an fp8 GEMM sustains about 0.85 of the fraction of its (2x) "
    "peak that a bf16 GEMM sustains of its own",
    "hbm_efficiency":
    "assumption: an elementwise kernel streams at about 0.8 of HBM bandwidth",
    "kernel_overhead_s":
    "assumption: 3 us between dependent kernels (launch and tail)",
    "overlap_cost":
    "assumption: hidden NCCL traffic slows compute by 0.1 of its duration",
    "comm_efficiency":
    "assumption: NCCL bus bandwidth about 0.75 of the link",
}


def _gpu(name: str, peak: float, hbm: float, nvlink: float, nic: float, hbm_bw: float, sms: int,
         efficiency: float = 0.75, attention: float = 0.35) -> Cluster:
    return Cluster(name, 8, peak, hbm, nvlink, nic, 5e-6, 10e-6, compute_efficiency=efficiency,
                   hbm_bandwidth=hbm_bw, attention_efficiency=attention, sms=sms,
                   fp8_efficiency=round(0.85 * efficiency, 4), kernel_overhead_s=3e-6,
                   overlap_cost=0.1, sources=GPU_SOURCES)


CLUSTERS: Dict[str, Cluster] = {
    "a100":
    _gpu("a100", 312e12, 80e9, 300e9, 25e9, 2.0e12, 108),
    "h100":
    _gpu("h100", 989e12, 80e9, 450e9, 50e9, 3.35e12, 132),
    # torchtitan's benchmark GPUs (benchmarks/llama3_h100_202412_torchtitan.md): H100 SXM with
    # 96 GB of HBM (95 GiB usable is their footnote's; we take 96e9 bytes) capped at 500 W
    "h100-500w":
    _gpu("h100-500w", 989e12, 96e9, 450e9, 50e9, 2.4e12, 132, efficiency=0.6, attention=0.25),
    "b200":
    _gpu("b200", 2.25e15, 180e9, 900e9, 50e9, 8e12, 148),
}


def load_cluster(name_or_path: str) -> Cluster:
    """A preset by name, or a YAML (or JSON) file with every required key of ``Cluster``."""
    if name_or_path in CLUSTERS:
        return CLUSTERS[name_or_path]
    if not name_or_path.endswith((".yaml", ".yml", ".json")):
        raise ValueError(f"unknown cluster {clip(name_or_path)}: use one of "
                         f"{', '.join(CLUSTERS)} or a .yaml / .json file")
    # a file the user may write by hand, as a config: read through the trust boundary (a
    # regular file within the config limit; YAML's limited safe loader), without a digest
    what = "cluster file"
    # JSON apart: YAML 1.1 reads 5e-05 as a string. Either fails as one InputError
    values: Any = (boundary.load_json(name_or_path, what, boundary.CONFIG_BYTES, digest=False,
                                      kind=None) if name_or_path.endswith(".json") else
                   boundary.load_yaml(boundary.read_text(name_or_path, what, boundary.CONFIG_BYTES),
                                      f"{what} {clip(name_or_path)}")) or {}
    if not isinstance(values, dict):
        raise InputError(f"cluster file {clip(name_or_path)} must be a mapping of keys")
    keys = [f.name for f in fields(Cluster)]
    required = [
        f.name for f in fields(Cluster) if f.default is MISSING and f.default_factory is MISSING
    ]
    missing = [k for k in required if k not in values]
    unknown = [k for k in values if k not in keys]
    if missing or unknown:
        raise ValueError(f"cluster file {clip(name_or_path)}: " +
                         (f"missing keys {', '.join(missing)}" if missing else "") +
                         ("; " if missing and unknown else "") +
                         (f"unknown keys {', '.join(map(str, unknown))}" if unknown else ""))
    where = f"cluster file {clip(name_or_path)}"
    typed = {k: _field(k, v, f"{where} {k!r}") for k, v in values.items()}
    try:  # the ranges (positive, efficiencies at most 1) are the dataclass's own
        return Cluster(**typed)
    except ValueError as err:
        raise InputError(f"{where}: {err}") from None


INTS = ("gpus_per_node", "cores", "sms")


def _world(key: Any, where: str, low: int) -> str:
    """A world or group size key of ``slowdown``, ``links``, ``issued``: an int >= ``low``
    (YAML reads ``2:`` as an int, JSON as a string), returned as the string the lookups use."""
    value = int(key) if isinstance(key, str) and key.isdigit() else key
    return str(boundary.number(value, f"{where} key {clip(key)}", integer=True, low=low))


def _mapping(value: Any, where: str) -> Dict[Any, Any]:
    if not isinstance(value, dict):
        raise InputError(f"{where} is {clip(value, 60)}, not a mapping")
    return value


def _field(key: str, value: Any, where: str) -> Any:
    """One key of a cluster file, checked for its type and finiteness (``where`` names the
    file and key): InputError naming the entry at fault; the ranges are Cluster's checks."""
    if key == "name":
        if not isinstance(value, str):
            raise InputError(f"{where} is {clip(value, 60)}, not a string")
        return value
    if key == "sources":
        for k, v in _mapping(value, where).items():
            if not isinstance(v, str):
                raise InputError(f"{where} {clip(k)} is {clip(v, 60)}, not a string (where the "
                                 f"value of {clip(k)} comes from)")
        return value
    if key == "slowdown":
        return {
            _world(w, where, 1): boundary.number(f, f"{where} {w!r}", low=1)
            for w, f in _mapping(value, where).items()
        }
    if key == "issued":
        out: Dict[str, Dict[str, float]] = {}
        for w, kinds in _mapping(value, where).items():
            out[_world(w, where, 2)] = {}
            for kind, seconds in _mapping(kinds, f"{where} {w!r}").items():
                if kind not in ISSUED:
                    raise InputError(f"{where} {w!r} key {clip(kind)} is no strategy: use one of "
                                     f"{', '.join(ISSUED)}")
                out[str(w)][kind] = boundary.number(seconds, f"{where} {w!r} {kind!r}", low=0)
        return out
    if key == "links":
        links: Dict[str, Dict[str, Dict[str, List[float]]]] = {}
        for w, groups in _mapping(value, where).items():
            world = _world(w, where, 2)
            links[world] = {}
            for n, ops in _mapping(groups, f"{where} {w!r}").items():
                size = _world(n, f"{where} {w!r}", 2)
                if int(size) > int(world):
                    raise InputError(f"{where} {w!r} key {clip(n)}: a group larger than its world")
                links[world][size] = {}
                for op, pair in _mapping(ops, f"{where} {w!r} {n!r}").items():
                    at = f"{where} {w!r} {n!r} {op!r}"
                    if not isinstance(pair, list) or len(pair) != 2:
                        raise InputError(f"{at} is {clip(pair, 60)}, not [latency s, bandwidth "
                                         f"bytes/s]")
                    links[world][size][str(op)] = [
                        boundary.number(pair[0], f"{at} latency", low=0),
                        boundary.number(pair[1], f"{at} bandwidth", positive=True)
                    ]
        return links
    return boundary.number(value, where, integer=key in INTS)


def save_cluster(cluster: Cluster, path: str) -> None:
    """Write ``cluster`` as ``load_cluster`` reads it: JSON for a .json path, else YAML."""
    values = {f.name: getattr(cluster, f.name) for f in fields(cluster)}
    with open(path, "w") as f:
        if path.endswith(".json"):
            json.dump(values, f, indent=1)
            f.write("\n")
        else:
            f.write(boundary.dump_yaml(values))
