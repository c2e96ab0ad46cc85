"""The rank grid and the process-group manager: which ranks talk to which.

Every rank of the world gets one coordinate per parallel axis. The attention (dense) layers
see the world as four axes, listed fastest-varying first (Megatron's order string):

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))     # "tp-cp-dp-pp"

so tensor-parallel peers are neighbours (one node), and pipeline stages are far apart.
A group of kind "tp" holds the ranks that differ only in tp_rank, and so on. "dp_cp" holds
the ranks that differ in dp_rank or cp_rank: gradients are averaged over it, because with
context parallel every rank of it holds a different slice of the global batch.

Expert parallel is not a fifth multiplicative axis ("MoE parallel folding", as in Megatron
and torchtitan): the expert layers see the same world as tp x ep x edp x pp, with
ep * edp = dp * cp. Within one pipeline stage and tensor rank, take the dp_cp group (its
ranks in increasing order; position = gradient_sync_rank) and cut it into
consecutive blocks of ep ranks: each block is an "ep" group, and the ranks at the same
position of every block form an "edp" group (strided). Example, world 8, tp 2, dp 4, ep 2:

    dp_cp groups  [0 2 4 6]      [1 3 5 7]
    ep groups     [0 2] [4 6]    [1 3] [5 7]      (consecutive)
    edp groups    [0 4] [2 6]    [1 5] [3 7]      (strided)

``RankGrid`` is plain Python (unit-tested without a process group); ``ProcessGroupManager``
creates the torch.distributed groups from it once and exposes them with Megatron names.

Kinds often have the same ranks: with cp = 1 a "dp" group is its "dp_cp" group, with ep = 1
an "edp" group is too, with pp = 2 the embedding group is the pipeline group, and a kind of
size 1 is the rank alone. Each distinct set of ranks gets one torch.distributed group, which
serves every kind with those ranks (``RankGrid.distinct_groups``): on GPUs one NCCL
communicator, with its buffers, instead of one per kind. The communication ledger knows a
shared group by one name (``ledger_name``: "dp" for the dp and dp_cp kinds at cp = 1); a
collective issued for another of its kinds names it at the call (comm.py's ``name``).
"""

import datetime
import gc
import numbers
from typing import Any, Dict, List, Optional, Tuple, Union

import torch.distributed as dist

from scaletorch.dist import flight_recorder
from scaletorch.dist.ledger import forget_group, name_group
from scaletorch.rules.group_names import ledger_name

AXES = ("tp", "cp", "dp", "pp")
KINDS = ("tp", "cp", "dp", "dp_cp", "pp", "ep", "edp")
DEFAULT_ORDER = "tp-cp-dp-pp"


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


class RankGrid:
    """Rank <-> coordinate arithmetic for tp, cp, dp, pp and the folded ep, edp; no comms.

    ``groups(kind)`` lists every group of a kind, each sorted by rank, the groups sorted by
    their first rank. Kinds: "tp", "cp", "dp" (data parallel without cp), "dp_cp" (data
    parallel with cp folded in), "pp", "ep", "edp".
    """

    def __init__(self, world_size: int, tensor_model_parallel_size: int = 1,
                 pipeline_model_parallel_size: int = 1, context_parallel_size: int = 1,
                 expert_model_parallel_size: int = 1, order: str = DEFAULT_ORDER) -> None:
        _check_positive("world_size", world_size)
        _check_positive("tensor_model_parallel_size", tensor_model_parallel_size)
        _check_positive("pipeline_model_parallel_size", pipeline_model_parallel_size)
        _check_positive("context_parallel_size", context_parallel_size)
        _check_positive("expert_model_parallel_size", expert_model_parallel_size)
        tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
        if world_size % (tp * pp * cp) != 0:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor_model_parallel_size ({tp}) "
                f"x pipeline_model_parallel_size ({pp}) x context_parallel_size ({cp})")
        dp = world_size // (tp * pp * cp)
        ep = expert_model_parallel_size
        if (dp * cp) % ep != 0:
            raise ValueError(
                f"expert_model_parallel_size ({ep}) does not divide data_parallel_size ({dp}) "
                f"x context_parallel_size ({cp}) = {dp * cp}")
        axes = tuple(order.split("-")) if isinstance(order, str) else ()
        if sorted(axes) != sorted(AXES):
            raise ValueError(f"order {order!r} must list each of tp, cp, dp, pp exactly once, "
                             f"fastest-varying first, joined by '-' (e.g. {DEFAULT_ORDER!r})")

        self.world_size = world_size
        self.tensor_model_parallel_size = tp
        self.pipeline_model_parallel_size = pp
        self.context_parallel_size = cp
        self.data_parallel_size = dp
        self.expert_model_parallel_size = ep
        self.expert_data_parallel_size = dp * cp // ep
        self.order = order
        self._sizes = {
            "tp": tp,
            "cp": cp,
            "dp": dp,
            "pp": pp,
            "dp_cp": dp * cp,
            "ep": ep,
            "edp": dp * cp // ep
        }
        self._strides: Dict[str, int] = {}
        stride = 1
        for axis in axes:  # fastest-varying first
            self._strides[axis] = stride
            stride *= self._sizes[axis]
        self._groups = self._build_groups()
        # rank -> index of its group, per kind, for group_of() and coordinates()
        self._index = {
            kind: {
                r: i
                for i, g in enumerate(groups)
                for r in g
            }
            for kind, groups in self._groups.items()
        }

    def _axis_rank(self, axis: str, rank: int) -> int:
        return rank // self._strides[axis] % self._sizes[axis]

    def _build_groups(self) -> Dict[str, List[List[int]]]:
        groups: Dict[str, List[List[int]]] = {}
        ranks = range(self.world_size)
        for axis in AXES:
            stride, size = self._strides[axis], self._sizes[axis]
            groups[axis] = [[base + i * stride for i in range(size)] for base in ranks
                            if self._axis_rank(axis, base) == 0]
        s_cp, s_dp = self._strides["cp"], self._strides["dp"]
        groups["dp_cp"] = [
            sorted(base + c * s_cp + d * s_dp for c in range(self._sizes["cp"])
                   for d in range(self._sizes["dp"])) for base in ranks
            if self._axis_rank("dp", base) == self._axis_rank("cp", base) == 0
        ]
        ep = self.expert_model_parallel_size
        ep_groups = [g[i:i + ep] for g in groups["dp_cp"] for i in range(0, len(g), ep)]
        edp_groups = [g[i::ep] for g in groups["dp_cp"] for i in range(ep)]
        groups["ep"] = sorted(ep_groups)
        groups["edp"] = sorted(edp_groups)
        return groups

    def _check_kind(self, kind: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown group kind {kind!r}; expected one of {KINDS}")

    def size(self, kind: str) -> int:
        """Number of ranks in each group of ``kind``."""
        self._check_kind(kind)
        return self._sizes[kind]

    def groups(self, kind: str) -> List[List[int]]:
        """Every group of ``kind`` (partition of the world), sorted by their first rank."""
        self._check_kind(kind)
        return [list(g) for g in self._groups[kind]]

    def group_of(self, kind: str, rank: int) -> List[int]:
        """The ranks of the ``kind`` group that ``rank`` belongs to, in increasing order."""
        self._check_kind(kind)
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) \
                or not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} is outside world size {self.world_size}")
        return list(self._groups[kind][self._index[kind][rank]])

    def embedding_groups(self) -> List[List[int]]:
        """Megatron's embedding groups: the first and the last rank of every pipeline group,
        i.e. one pair per (tp, cp, dp) coordinate; none when pp is 1.

        With tied embeddings under pipeline parallel the first stage holds the embedding and
        the last stage a copy of it as the output layer; the two copies' gradients are summed
        over this group after backward so that both stay equal (pipeline_parallel.py). Not a
        partition of the world (middle stages are in no group), hence not one of ``KINDS``.
        """
        if self._sizes["pp"] == 1:
            return []
        return [[g[0], g[-1]] for g in self._groups["pp"]]

    def distinct_groups(self) -> List[Tuple[List[int], List[str]]]:
        """Every distinct set of ranks among the groups of all kinds and the embedding groups,
        once, with the kinds it is a group of ("embd" for an embedding group), in the order
        the manager creates them: by kind in ``KINDS`` order, then the embedding groups, each
        set where it first appears. One torch.distributed group serves each."""
        roles: Dict[Tuple[int, ...], List[str]] = {}  # insertion order = creation order
        kinds = [(kind, self._groups[kind]) for kind in KINDS]
        for kind, groups in kinds + [("embd", self.embedding_groups())]:
            for ranks in groups:
                roles.setdefault(tuple(ranks), []).append(kind)
        return [(list(ranks), kinds_of) for ranks, kinds_of in roles.items()]

    def coordinates(self, rank: int) -> Dict[str, int]:
        """``rank``'s position in every kind of group: tp, cp, dp, pp, dp_cp, ep, edp."""
        return {kind: self.group_of(kind, rank).index(rank) for kind in KINDS}

    def describe(self, experts: bool = False) -> str:
        """A short table of the grid for logging: one line per pipeline stage.

        Each ``[..]`` is one tensor-parallel group; the brackets after ``dp d:`` are the
        context-parallel ranks 0, 1, ... of data-parallel rank d. The expert split (ep x edp)
        is shown when the model has ``experts``, the key to the brackets when tp or cp > 1.
        """
        width = len(str(self.world_size - 1))
        s = self._sizes
        lines = [
            f"rank grid: world {self.world_size} = tp {s['tp']} x cp {s['cp']} x dp {s['dp']} "
            f"x pp {s['pp']}, order {self.order} (fastest first)"
        ]
        notes = [f"experts: ep {s['ep']} x edp {s['edp']}"] if experts else []
        if s["tp"] > 1 or s["cp"] > 1:
            notes.append("[..] = one tp group, cp ranks side by side")
        if notes:
            lines.append("; ".join(notes))
        for p in range(s["pp"]):
            cells = []
            for d in range(s["dp"]):
                blocks = []
                for c in range(s["cp"]):
                    tp_ranks = [self._rank_at(t, c, d, p) for t in range(s["tp"])]
                    blocks.append("[" + " ".join(f"{r:>{width}}" for r in tp_ranks) + "]")
                cells.append(f"dp {d}: " + " ".join(blocks))
            lines.append(f"pp {p} | " + " | ".join(cells))
        return "\n".join(lines)

    def _rank_at(self, tp_rank: int, cp_rank: int, dp_rank: int, pp_rank: int) -> int:
        coords = {"tp": tp_rank, "cp": cp_rank, "dp": dp_rank, "pp": pp_rank}
        return sum(coords[a] * self._strides[a] for a in AXES)


# Processes start seconds apart (importing torch on a busy host): joining the world and its
# groups may take this long even when a short collective timeout is asked for (chapter 11's
# hangs use 3 s). A group is created with it, then given the asked timeout.
STARTUP_TIMEOUT_SECONDS = 120.0


def startup_timeout(timeout: datetime.timedelta) -> datetime.timedelta:
    """How long joining a group may take: ``timeout``, or STARTUP_TIMEOUT_SECONDS if longer."""
    return max(timeout, datetime.timedelta(seconds=STARTUP_TIMEOUT_SECONDS))


class ProcessGroupManager:
    """Creates every torch.distributed group of a ``RankGrid`` once and names them.

    Needs ``dist.init_process_group`` first, except for world size 1 without a process group:
    then every group is None, every rank 0 and every size 1, so single-device code runs.
    """

    def __init__(self, grid: RankGrid, timeout: Optional[Union[datetime.timedelta,
                                                               float]] = None) -> None:
        self.grid = grid
        if dist.is_initialized():
            self.rank = dist.get_rank()
            self.world_size = dist.get_world_size()
            if self.world_size != grid.world_size:
                raise ValueError(f"the grid is for world size {grid.world_size} but "
                                 f"torch.distributed has world size {self.world_size}")
        elif grid.world_size == 1:
            self.rank, self.world_size = 0, 1
        else:
            raise RuntimeError(f"torch.distributed is not initialized, so only world size 1 "
                               f"can run; the grid has world size {grid.world_size}")
        self._coords = grid.coordinates(self.rank)
        if isinstance(timeout, (int, float)):
            timeout = datetime.timedelta(seconds=timeout)
        self._groups: Dict[str, Optional[dist.ProcessGroup]] = {kind: None for kind in KINDS}
        self._groups["embd"] = None  # the embedding group (not a kind: see embedding_groups)
        self._roles: Dict[dist.ProcessGroup, List[str]] = {}  # this rank's groups -> kinds
        if dist.is_initialized():
            # new_group is collective over the whole world: every rank creates every group,
            # in the same order, and keeps the ones it belongs to; one per distinct set of
            # ranks, serving every kind with those ranks. Its description is the ledger's
            # name, which the flight recorder's dumps and NCCL's logs show.
            startup = None if timeout is None else startup_timeout(timeout)
            for ranks, kinds in grid.distinct_groups():
                group = dist.new_group(ranks, timeout=startup, group_desc=ledger_name(kinds))
                if self.rank in ranks:
                    if timeout is not None and startup != timeout:  # joined: the asked timeout
                        dist.distributed_c10d._set_pg_timeout(timeout, group)
                    self._roles[group] = kinds
                    for kind in kinds:
                        self._groups[kind] = group
                    name_group(group, ledger_name(kinds))  # how the ledger labels it
                    flight_recorder.remember(group, ledger_name(kinds))

    # -- generic access ---------------------------------------------------------------------
    def get_group(self, kind: str) -> Optional[dist.ProcessGroup]:
        """This rank's group of ``kind`` (None without a process group)."""
        self.grid.size(kind)  # validates kind
        return self._groups[kind]

    def group_ranks(self, kind: str) -> List[int]:
        """Global ranks of this rank's group of ``kind``, in increasing order."""
        return self.grid.group_of(kind, self.rank)

    def _rank_in(self, kind: str) -> int:
        return self._coords[kind]

    @property
    def group_names(self) -> Dict[dist.ProcessGroup, str]:
        """{group: short name} for this rank's groups ("tp", "cp", "dp", ...): a group that
        serves several kinds has the ledger's name for them (``ledger_name``)."""
        return {g: ledger_name(kinds) for g, kinds in self._roles.items()}

    def kinds_of(self, group: dist.ProcessGroup) -> List[str]:
        """The kinds ``group`` serves on this rank (e.g. ["dp", "dp_cp", "edp"] with cp = ep =
        1), "embd" for the embedding group; [] for a group this manager did not create."""
        return list(self._roles.get(group, []))

    def name_of(self, group: Optional[dist.ProcessGroup]) -> str:
        """Short label of a group for the communication ledger: "tp", "dp", ..., "world".

        None and the default group are "world"; a group this manager did not create is a
        ValueError (a collective on an unexpected group is a bug worth seeing).
        """
        if group is None or group is dist.GroupMember.WORLD:
            return "world"
        name = self.group_names.get(group)
        if name is None:
            raise ValueError(f"group {group!r} was not created by this ProcessGroupManager")
        return name

    def log_topology(self, experts: bool = False) -> None:
        """Print the grid once, from rank 0 (with the expert split if the model has
        ``experts``)."""
        if self.rank == 0:
            print(self.grid.describe(experts), flush=True)

    def destroy(self) -> None:
        """Destroy every subgroup this rank holds, each once (the default group stays), and
        drop their ledger names: nothing keeps a destroyed group, or its gloo threads, alive."""
        for group in self._roles:
            forget_group(group)
            if dist.is_initialized():
                dist.destroy_process_group(group)
        self._roles = {}
        self._groups = {kind: None for kind in KINDS}
        self._groups["embd"] = None

    # -- tensor parallel --------------------------------------------------------------------
    @property
    def tensor_model_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self._groups["tp"]

    @property
    def tensor_model_parallel_rank(self) -> int:
        return self._rank_in("tp")

    @property
    def tensor_model_parallel_world_size(self) -> int:
        return self.grid.tensor_model_parallel_size

    # -- pipeline parallel ------------------------------------------------------------------
    @property
    def pipeline_model_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self._groups["pp"]

    @property
    def pipeline_model_parallel_rank(self) -> int:
        return self._rank_in("pp")

    @property
    def pipeline_model_parallel_world_size(self) -> int:
        return self.grid.pipeline_model_parallel_size

    @property
    def is_pipeline_first_stage(self) -> bool:
        return self.pipeline_model_parallel_rank == 0

    @property
    def is_pipeline_last_stage(self) -> bool:
        return self.pipeline_model_parallel_rank == self.pipeline_model_parallel_world_size - 1

    @property
    def pipeline_next_rank(self) -> Optional[int]:
        """Global rank of the next stage (None on the last stage)."""
        if self.is_pipeline_last_stage:
            return None
        return self.group_ranks("pp")[self.pipeline_model_parallel_rank + 1]

    @property
    def pipeline_prev_rank(self) -> Optional[int]:
        """Global rank of the previous stage (None on the first stage)."""
        if self.is_pipeline_first_stage:
            return None
        return self.group_ranks("pp")[self.pipeline_model_parallel_rank - 1]

    @property
    def pipeline_first_rank(self) -> int:
        return self.group_ranks("pp")[0]

    @property
    def pipeline_last_rank(self) -> int:
        return self.group_ranks("pp")[-1]

    @property
    def embedding_group(self) -> Optional[dist.ProcessGroup]:
        """Megatron's embedding group: this pipeline's first and last rank (the holders of a
        tied embedding and of its copy as the output layer, ``RankGrid.embedding_groups``).
        None on a middle stage, with pp 1, or without a process group: callers that hold no
        tied copy must not use it (None means the world to a collective)."""
        return self._groups["embd"]

    @property
    def is_rank_in_embedding_group(self) -> bool:
        return self._groups["embd"] is not None

    # -- context parallel -------------------------------------------------------------------
    @property
    def context_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self._groups["cp"]

    @property
    def context_parallel_rank(self) -> int:
        return self._rank_in("cp")

    @property
    def context_parallel_world_size(self) -> int:
        return self.grid.context_parallel_size

    # -- data parallel (without and with context parallel folded in) ------------------------
    @property
    def data_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self._groups["dp"]

    @property
    def data_parallel_rank(self) -> int:
        return self._rank_in("dp")

    @property
    def data_parallel_world_size(self) -> int:
        return self.grid.data_parallel_size

    @property
    def gradient_sync_group(self) -> Optional[dist.ProcessGroup]:
        """The group gradients are averaged over, "dp_cp" in the ledger: the data-parallel ranks
        (dp), and once chapter 05 splits sequences, dp x cp (every rank that sees different
        tokens). Megatron's ``get_data_parallel_group(with_context_parallel=True)``."""
        return self._groups["dp_cp"]

    @property
    def gradient_sync_rank(self) -> int:
        """This rank's place in ``gradient_sync_group``."""
        return self._rank_in("dp_cp")

    @property
    def gradient_sync_world_size(self) -> int:
        """The size of ``gradient_sync_group``: dp, or dp x cp under context parallel."""
        return self.grid.data_parallel_size * self.grid.context_parallel_size

    # -- expert parallel (folded into dp x cp) ----------------------------------------------
    @property
    def expert_model_parallel_group(self) -> Optional[dist.ProcessGroup]:
        return self._groups["ep"]

    @property
    def expert_model_parallel_rank(self) -> int:
        return self._rank_in("ep")

    @property
    def expert_model_parallel_world_size(self) -> int:
        return self.grid.expert_model_parallel_size

    @property
    def expert_data_parallel_group(self) -> Optional[dist.ProcessGroup]:
        """Ranks holding the same experts: expert gradients are averaged over it."""
        return self._groups["edp"]

    @property
    def expert_data_parallel_rank(self) -> int:
        return self._rank_in("edp")

    @property
    def expert_data_parallel_world_size(self) -> int:
        return self.grid.expert_data_parallel_size


_PG_MANAGER: Optional[ProcessGroupManager] = None


def init_pg_manager(
        tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
        context_parallel_size: int = 1, expert_model_parallel_size: int = 1,
        order: str = DEFAULT_ORDER, timeout: Optional[Union[datetime.timedelta,
                                                            float]] = None) -> ProcessGroupManager:
    """Build the manager for the current world (1 without a process group) and register it.

    Call once, after ``init_distributed``, on every rank; ``destroy_pg_manager`` undoes it.
    """
    global _PG_MANAGER
    if _PG_MANAGER is not None:
        raise RuntimeError("pg_manager is already initialized; call destroy_pg_manager() first")
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    grid = RankGrid(world_size, tensor_model_parallel_size, pipeline_model_parallel_size,
                    context_parallel_size, expert_model_parallel_size, order)
    _PG_MANAGER = ProcessGroupManager(grid, timeout=timeout)
    return _PG_MANAGER


def init_pg_manager_from_config(parallel: Any,
                                timeout_seconds: Optional[float] = None) -> ProcessGroupManager:
    """``init_pg_manager`` with the sizes of a config's ``parallel`` section (cfg.parallel):
    how every script and test builds its process groups, with the run's timeout on each."""
    return init_pg_manager(parallel.tensor_model_parallel_size,
                           parallel.pipeline_model_parallel_size, parallel.context_parallel_size,
                           parallel.expert_model_parallel_size, timeout=timeout_seconds)


def get_pg_manager() -> ProcessGroupManager:
    """The manager registered by ``init_pg_manager``."""
    if _PG_MANAGER is None:
        raise RuntimeError("pg_manager is not initialized; call init_pg_manager(...) first")
    return _PG_MANAGER


def destroy_pg_manager() -> None:
    """Destroy the registered manager's subgroups and unregister it (no-op when unset).

    ``gc.collect()`` first, as ``destroy_distributed`` does: what still holds a subgroup (a
    finished work handle, a hook) is freed while the group exists (doc/cpu_and_gloo.md)."""
    global _PG_MANAGER
    if _PG_MANAGER is not None:
        gc.collect()
        _PG_MANAGER.destroy()
        _PG_MANAGER = None
