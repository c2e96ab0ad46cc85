"""torch's flight recorder: the last collectives of every rank, written down when a run hangs.

With ``TORCH_FR_BUFFER_SIZE=N`` set before the first process group exists, torch keeps the
last N collectives each rank issued (gloo and NCCL alike): op, process group, sequence number
in that group, tensor sizes and the Python stack that issued it. ``dump`` writes them to
``<dir>/rank_<r>`` as JSON with its ``.sha256`` beside it (data only: torch's own dumps are
pickles, which can run code when read, so these are not); ``load`` reads them through the trust
boundary and refuses a pickle; ``analyze`` names the first collective the ranks disagree on.
gloo has no watchdog, so the rank that catches the timeout calls ``dump``.

gloo leaves the dump's group table (``pg_config``) empty; ``dump`` fills it from the groups
this rank knows (torch's analyzer, ``torchfrtrace``, needs it). The groups' descriptions are the
ledger's names ("tp", "dp", ...): pg_manager creates each group with that ``group_desc``.
"""

import json
import os
import pickle
import re
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from scaletorch.rules import boundary
from scaletorch.rules.errors import InputError, clip
from scaletorch.rules.safe_files import write_checksummed

BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
PREFIX = "rank_"
MAX_RANK = 1 << 20  # a dump's rank, or a group's member: no world of ours is larger
# frames that are not ours (torch's), or only pass a call on (our collectives' wrappers, the
# device check's torch function mode)
SKIPPED = re.compile(r"[/\\](torch|contextlib|threading)[/\\.]|"
                     r"scaletorch[/\\]dist[/\\](comm|device_check)\.py")


def enable(entries: int = 2000) -> None:
    """Keep the last ``entries`` collectives of each rank; call before init_distributed (a
    value already in the environment wins). A few thousand entries cost a little host memory."""
    if dist.is_initialized():
        raise RuntimeError("the flight recorder must be enabled before the process group exists")
    os.environ.setdefault(BUFFER_ENV, str(entries))


# every group this process made through pg_manager, by torch's name: {"name", "desc", "ranks"}
# (a dump after the groups were destroyed, as a grader's rank tears down before it dumps, still
# names their ranks)
_SEEN: Dict[str, Dict[str, str]] = {}


def remember(group: Any, name: str) -> None:
    """Keep ``group``'s ranks and ``name`` for this process's dumps."""
    _SEEN[group.group_name] = {
        "name": group.group_name,
        "desc": name,
        "ranks": str(dist.get_process_group_ranks(group))
    }


def dump(directory: str, rank: int, groups: Iterable[Tuple[Any, str]] = ()) -> str:
    """Write this rank's flight-recorder entries to ``<directory>/rank_<rank>``; returns the path.

    ``groups``: (process group, name) pairs whose ranks go in the dump's group table, besides
    the default group (gloo leaves the table empty).
    """
    # Bytes torch's C++ made in this process, not a file: its JSON dump leaves out the stacks.
    # torch's stubs do not declare it (torch 2.13).
    trace = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())  # type: ignore[attr-defined]
    # a group of an earlier, larger world of this process is not this world's
    size = dist.get_world_size()
    table = {
        k: g
        for k, g in _SEEN.items() if max(_members({0: {
            "pg_config": {
                k: g
            }
        }})[k], default=0) < size
    }
    # every group this rank belongs to, by its ranks: without them the analysis would take a
    # group for the world's ranks and call each rank outside it "never issued it"
    # (torch keeps a marker, not a group, for the groups this rank is not in)
    known = [(g, getattr(g, "group_desc", "") or g.group_name)
             for g in dist.distributed_c10d._world.pg_group_ranks
             if isinstance(g, dist.ProcessGroup) and g is not dist.group.WORLD]
    for group, name in [(dist.group.WORLD, "world"), *known, *groups]:
        if group is None:
            continue
        table[group.group_name] = {
            "name": group.group_name,
            "desc": name,
            "ranks": str(dist.get_process_group_ranks(group)),
        }
    trace["pg_config"] = table
    trace["rank"] = rank  # ours: load() checks the file's name against it
    path = os.path.join(directory, f"{PREFIX}{rank}")
    # whole or absent, with its digest; default=str: a value JSON has no form for, as text
    write_checksummed(path, json.dumps(trace, default=str).encode())
    return path


# what calls() reads of each entry, and the type it must have
ENTRY_FIELDS = {
    "process_group": list,
    "collective_seq_id": int,
    "profiling_name": str,
    "input_sizes": list,
    "input_dtypes": list,
    "time_created_ns": int
}


def load(directory: str) -> Dict[int, dict]:
    """{rank: trace} of every ``rank_<r>`` file in ``directory``, each read through the trust
    boundary (a regular file, its digest, JSON of the fields ``calls`` reads); InputError
    naming the file otherwise. A pickle (an older dump, or torch's own) is refused unread."""
    if not os.path.isdir(directory):
        raise InputError(f"{clip(directory)} is not a directory of flight-recorder dumps")
    traces = {}
    for name in sorted(os.listdir(directory)):
        match = re.fullmatch(rf"{PREFIX}(\d+)", name)
        if match:
            if int(match.group(1)) > MAX_RANK:  # the analysis lists the ranks below it
                raise InputError(f"{clip(os.path.join(directory, name))}: rank "
                                 f"{clip(match.group(1), 40)} is above {MAX_RANK}, no world's")
            traces[int(match.group(1))] = _load_dump(os.path.join(directory, name),
                                                     int(match.group(1)))
    if not traces:
        raise InputError(f"no flight-recorder dumps ({PREFIX}<rank>) in {clip(directory)}")
    worlds = {rank: _world(trace) for rank, trace in traces.items()}
    first = min(worlds)
    for rank, world in worlds.items():
        if None not in (world, worlds[first]) and world != worlds[first]:
            raise InputError(f"{clip(directory)}: {PREFIX}{first}'s world is ranks "
                             f"{clip(worlds[first])} but {PREFIX}{rank}'s is {clip(world)}: "
                             f"dumps of different runs; analyze one run's dumps at a time")
    return traces


def _world(trace: dict) -> Optional[List[int]]:
    """The ranks of the dump's world group (its group table's "world" entry), if it has one."""
    for name, group in trace.get("pg_config", {}).items():
        if group.get("desc") == "world":
            return _members({0: {"pg_config": {name: group}}})[name]
    return None


def _load_dump(path: str, rank: int) -> dict:
    what = "flight-recorder dump"
    boundary.regular_file(path, what, boundary.JSON_BYTES)
    with open(path, "rb") as f:
        if f.read(1) == b"\x80":  # pickle's protocol mark
            raise InputError(f"{what} {clip(path)} is a pickle (torch's own format, or an older "
                             f"ScaleTorch's): it was not read, since unpickling can run code; "
                             f"dump again with this version")
    trace = boundary.load_json(path, what)
    try:  # the fields analyze reads, with their types: what calls() and _members() read
        if not isinstance(trace, dict) or any(
                not isinstance(e, dict) or not isinstance(e.get(k), t) for e in trace["entries"]
                for k, t in ENTRY_FIELDS.items()):
            raise TypeError
        calls(0, trace)
        _members({0: trace})
    except (KeyError, TypeError, AttributeError, ValueError):
        raise InputError(f"{what} {clip(path)} is JSON but not a flight-recorder dump (a "
                         f"mapping whose entries hold {', '.join(ENTRY_FIELDS)})") from None
    # The rank is the dump's own, not its file name's: a renamed or copied dump would put one
    # rank's collectives under another and name the wrong ranks missing
    own, world = trace.get("rank"), _world(trace)
    if type(own) is not int:
        raise InputError(f"{what} {clip(path)} records no rank of its own ('rank': "
                         f"{clip(own, 40)}): written by an older ScaleTorch, or edited; dump again")
    if own != rank:
        raise InputError(f"{what} {clip(path)} is rank {own}'s dump, not rank {rank}'s as its "
                         f"name says: a renamed or copied file; name it {PREFIX}{own}")
    if world is not None and rank not in world:
        raise InputError(f"{what} {clip(path)}: rank {rank} is not in its own world, ranks "
                         f"{clip(world)}")
    return trace


@dataclass(frozen=True)
class Call:
    """One collective as one rank issued it."""
    rank: int
    group_id: str  # torch's name of the group ("1"), with its ranks where the dump names them
    group: str  # the ledger's name ("dp"), or torch's description ("default_pg")
    seq: int  # its number among the group's collectives on this rank (1, 2, ...)
    op: str  # "all_reduce", ...
    sizes: str  # "[[82240]] Float"
    time_ns: int  # when it was issued
    stack: Tuple[str, ...]  # our frames (not torch's), innermost first: "file:line function"

    @property
    def where(self) -> str:
        return self.stack[0] if self.stack else "?"


def _ours(frames: Sequence[dict]) -> Tuple[str, ...]:
    out = []
    for f in frames:
        if not SKIPPED.search(f["filename"]):
            name = os.path.relpath(f["filename"]) if os.path.isabs(f["filename"]) else f["filename"]
            out.append(f"{name}:{f['line']} {f['name']}")
    return tuple(out)


def calls(rank: int, trace: dict) -> List[Call]:
    """A rank's collectives, in the order it issued them (p2p operations are left out)."""
    desc = {name: c["desc"] for name, c in trace.get("pg_config", {}).items()}
    ranks = _members({rank: trace})
    out = []
    for e in trace["entries"]:
        if e.get("is_p2p"):
            continue
        pg_name, pg_desc = e["process_group"]
        # a group is its name and its ranks, as this rank's own table gives them: two ranks'
        # groups of one name but other members (the dp group of tp rank 0 and of tp rank 1,
        # should torch name them alike) are different groups, never compared
        key = f"{pg_name} {ranks[pg_name]}" if pg_name in ranks else pg_name
        out.append(
            Call(rank, key, desc.get(pg_name, pg_desc or pg_name), e["collective_seq_id"],
                 e["profiling_name"].split(":", 1)[-1],
                 f"{e['input_sizes']} {','.join(e['input_dtypes'])}", e["time_created_ns"],
                 _ours(e.get("frames", []))))
    return out


def _members(traces: Dict[int, dict]) -> Dict[str, List[int]]:
    """{torch's group name: its ranks}, and {Call.group_id: its ranks}, from the dumps' tables."""
    members: Dict[str, List[int]] = {}
    for t in traces.values():
        for name, c in t.get("pg_config", {}).items():
            ranks = [int(r) for r in c["ranks"].strip("[]").split(",") if r.strip()]
            if any(not 0 <= r <= MAX_RANK for r in ranks):
                raise ValueError(f"group {name!r} names a rank outside 0..{MAX_RANK}")
            members[name] = members[f"{name} {ranks}"] = ranks
    return members


# ops whose ranks send and receive different sizes when right (uneven splits)
UNEVEN = ("all_to_all", "alltoall", "alltoall_base")


def _shape(c: Call) -> Tuple[str, str]:
    """What every rank of a collective must agree on: its op, and its sizes unless uneven."""
    return c.op, ("" if c.op in UNEVEN else c.sizes)


# [core: first-disagreement]
def disagreements(traces: Dict[int, dict]) -> List[Tuple[Call, Dict[int, Call], List[int]]]:
    """Per group, the first collective that some rank of the group did not issue as its call of
    the same number (another op, other sizes but an all-to-all's, or none): (call, {rank: its
    call}, group ranks).

    Collective n of a group on one rank meets collective n of the group on every other rank.
    Numbers older than a rank's oldest recorded one (its buffer wrapped) are not compared.
    Ordered by how many collectives the group had run in agreement before: a hang breaks an
    established pattern (the gradient all-reduces of every step), and the rank missing there
    is the one out of step; a group that has just started is where that rank went instead.
    """
    by_rank = {rank: calls(rank, t) for rank, t in traces.items()}
    members = _members(traces)
    table: Dict[Tuple[str, int], Dict[int, Call]] = {}
    oldest: Dict[Tuple[str, int], int] = {}
    for rank, cs in by_rank.items():
        for c in cs:
            table.setdefault((c.group_id, c.seq), {})[rank] = c
            oldest[(c.group_id, rank)] = min(oldest.get((c.group_id, rank), c.seq), c.seq)
    first: Dict[str, Tuple[Call, Dict[int, Call], List[int]]] = {}
    for cs in by_rank.values():
        for c in cs:
            ranks = [r for r in members.get(c.group_id, sorted(traces)) if r in traces]
            if any(c.seq < oldest.get((c.group_id, r), 0) for r in ranks):
                continue
            there = table[(c.group_id, c.seq)]
            if any(r not in there or _shape(there[r]) != _shape(c) for r in ranks):
                if c.group_id not in first or c.seq < first[c.group_id][0].seq:
                    first[c.group_id] = (c, there, ranks)
                break
    return sorted(first.values(), key=lambda f: (-f[0].seq, f[0].time_ns))


# [end: first-disagreement]
def analyze(traces: Dict[int, dict]) -> List[str]:
    """Lines naming the first collective the ranks disagree on, and where each rank stopped."""
    lines = []
    found = disagreements(traces)
    # the ranks of every group a dump names, not only those below the highest dump's: rank 1's
    # dump alone, in a world of 2, is missing rank 0's; rank 0's alone is missing rank 1's
    known = set(range(max(traces) + 1)).union(*_members(traces).values())
    missing = sorted(known - set(traces))
    n = sum(len(calls(r, t)) for r, t in traces.items())
    if not found and missing:
        lines.append(f"the dumps present agree on all {n} collectives recorded, but ranks "
                     f"{clip(missing)} wrote none: a hang's missing partner is often among them")
    elif not found:
        lines.append(f"the ranks agree on all {n} collectives recorded: look for a rank that "
                     f"stopped outside a collective")
    for i, (c, there, ranks) in enumerate(found):
        lines.append(f"{'first disagreement' if i == 0 else 'then'}: collective #{c.seq} of "
                     f"group '{c.group}' (ranks {ranks})")
        for r in ranks:
            x = there.get(r)
            lines.append(f"  rank {r}: {x.op} {x.sizes}, issued at {x.where}"
                         if x else f"  rank {r}: never issued it")
        for frame in c.stack[1:4]:
            lines.append(f"    called from {frame}")
    lines.append("where each rank stopped (its last collective):")
    for rank, t in sorted(traces.items()):
        cs = calls(rank, t)
        if not cs:
            lines.append(f"  rank {rank}: no collective recorded")
        else:
            last = cs[-1]
            lines.append(f"  rank {rank}: {last.op} #{last.seq} of group '{last.group}' "
                         f"{last.sizes}, issued at {last.where}")
    if missing:
        lines.append(f"no dump from ranks {clip(missing)} (killed, or still running)")
    return lines
