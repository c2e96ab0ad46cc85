"""The hardware a plan runs on: per-GPU peak, memory and links, and how much of them is reached.

Presets from the vendors' spec sheets (dense bf16, per GPU, 8 GPUs per node); the link
bandwidths are per direction (NVLink is quoted bidirectional: half of it each way; a NIC is
quoted in bits). Real kernels and collectives reach a fraction of the peaks:
``compute_efficiency`` (a large bf16 matmul: about 0.7 of peak on H100) and
``comm_efficiency`` (NCCL's bus bandwidth: about 0.75 of the link) are parameters of the
cluster, so a measured host (``scripts/plan.py --calibrate``) or a better guess replaces them.
A cluster file is YAML with every key of ``Cluster``.
"""

from dataclasses import MISSING, dataclass, fields
from typing import Any, Dict

import yaml


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

    def __post_init__(self) -> None:
        bad = {
            f.name: getattr(self, f.name)
            for f in fields(self) if f.name != "name" and not getattr(self, f.name) > 0
        }
        if bad:
            raise ValueError("cluster " + ", ".join(f"{k} {v}"
                                                    for k, v in bad.items()) + ": must be positive")
        for key in ("compute_efficiency", "comm_efficiency"):
            if getattr(self, key) > 1:
                raise ValueError(f"cluster {key} {getattr(self, key)} must be at most 1")


CLUSTERS: Dict[str, Cluster] = {
    "a100": Cluster("a100", 8, 312e12, 80e9, 300e9, 25e9, 5e-6, 10e-6),
    "h100": Cluster("h100", 8, 989e12, 80e9, 450e9, 50e9, 5e-6, 10e-6),
    "b200": Cluster("b200", 8, 2.25e15, 180e9, 900e9, 50e9, 5e-6, 10e-6),
}


def load_cluster(name_or_path: str) -> Cluster:
    """A preset by name, or a YAML file with every key of ``Cluster``."""
    if name_or_path in CLUSTERS:
        return CLUSTERS[name_or_path]
    if not name_or_path.endswith((".yaml", ".yml")):
        raise ValueError(f"unknown cluster {name_or_path!r}: use one of "
                         f"{', '.join(CLUSTERS)} or a .yaml file")
    try:
        with open(name_or_path) as f:
            values: Any = yaml.safe_load(f) or {}
    except OSError as err:
        raise ValueError(f"cluster file {name_or_path!r}: {err.strerror}") from None
    if not isinstance(values, dict):
        raise ValueError(f"cluster file {name_or_path!r} must be a mapping of keys")
    keys = [f.name for f in fields(Cluster)]
    required = [f.name for f in fields(Cluster) if f.default is MISSING]
    missing = [k for k in required if k not in values]
    unknown = [k for k in values if k not in keys]
    if missing or unknown:
        raise ValueError(f"cluster file {name_or_path!r}: " +
                         (f"missing keys {', '.join(missing)}" if missing else "") +
                         ("; " if missing and unknown else "") +
                         (f"unknown keys {', '.join(unknown)}" if unknown else ""))
    try:
        typed: Dict[str, Any] = {
            k: (v if k == "name" else float(v) if k != "gpus_per_node" else int(v))
            for k, v in values.items()
        }
        return Cluster(**typed)
    except (TypeError, ValueError) as err:
        raise ValueError(f"cluster file {name_or_path!r}: {err}") from None


def save_cluster(cluster: Cluster, path: str) -> None:
    with open(path, "w") as f:
        yaml.safe_dump({f.name: getattr(cluster, f.name)
                        for f in fields(cluster)}, f, sort_keys=False)
