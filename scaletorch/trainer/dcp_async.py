"""Async sharded checkpoints: ``--checkpoint.async_save true`` with ``--checkpoint.format dcp``.

A save copies this rank's pieces (dcp_checkpoint.py's ``sharded_state``) into fresh host
memory, then hands them to ``dcp.async_save``, whose thread plans and writes them while
training goes on. At most one save is in flight: the next save, and the end of the run, wait
for it. Only then come the checksums and the manifest, on the training thread::

    step 4: copy pieces -> thread writes step_4/__<rank>_0.distcp, .metadata
    step 5, 6, 7, 8: train (the write overlaps them)
    step 8: wait for step_4's write -> checksums, manifest: step_4 counts -> copy step 8 ...

A kill before the manifest leaves ``step_4`` without one: ``--resume latest`` skips it and
takes the checkpoint before. The thread's collectives (DCP's plan gather, its final
all-reduce) run over a gloo group of their own: two threads never share a process group, and
on NCCL the pieces stay on the host.
"""

import copy
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter
from torch.distributed.tensor import DTensor

from scaletorch.trainer.checkpoint import step_dir
from scaletorch.trainer.dcp_checkpoint import (checksum_sharded, clear_step_dir, commit_sharded,
                                               sharded_state)
from scaletorch.trainer.dcp_pieces import Pieces, _SavePlanner

if TYPE_CHECKING:
    from scaletorch.parallel.parallelize import Parallelized


def host_copy(state: Dict[str, Any]) -> Dict[str, Any]:
    """``state`` (``sharded_state``'s) with every tensor copied to fresh CPU memory: the
    optimizer step that follows a save changes the parameters and moments in place, while the
    write thread still reads the copy. Plain values are deep-copied."""

    def tensor(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", copy=True)

    out: Dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, Pieces):
            out[key] = Pieces(value.size(), [(at, tensor(t)) for at, t in value.pieces])
        elif isinstance(value, DTensor):  # impl torch: same placements, a copied local shard
            out[key] = DTensor.from_local(tensor(value.to_local()), value.device_mesh,
                                          value.placements, run_check=False, shape=value.shape,
                                          stride=value.stride())
        else:
            out[key] = copy.deepcopy(value)
    return out


class _Copied(AsyncStager):
    """A stager for a state already in host memory (``host_copy``): DCP's default one would
    copy its tensors a second time, and skip ``Pieces``, which it does not know."""

    _synchronize_after_execute = False

    def stage(self, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        return None

    def close(self) -> None:
        return None


class AsyncSaver:
    """A Trainer's async DCP saves: ``start`` one (after waiting for the one in flight),
    ``finish`` the one in flight (the end of the run calls it)."""

    def __init__(self) -> None:
        self.group: Optional[dist.ProcessGroup] = None
        self.writer: Callable[[str], StorageWriter] = dcp.FileSystemWriter  # a test holds it
        # (future of DCP's metadata, root, checkpoint directory, step, keep_last, layout)
        self.pending: Optional[Tuple[Future, str, str, int, int, Dict[str, Any]]] = None

    def start(self, root: str, step: int, trainer: Any, par: "Parallelized", keep_last: int,
              layout: Dict[str, Any]) -> str:
        """Collective over the world: finish the save in flight, copy this rank's pieces and
        start writing them to ``step_<step>`` under ``root``. Returns that directory."""
        self.finish()
        if self.group is None and dist.is_initialized():  # all ranks, at their first save
            self.group = dist.new_group(backend="gloo")
        path = step_dir(root, step)
        clear_step_dir(path)  # a write a killed run left unsealed, say
        future = dcp.async_save(host_copy(sharded_state(trainer, par)),
                                storage_writer=self.writer(path), planner=_SavePlanner(),
                                process_group=self.group, async_stager=_Copied())
        if not isinstance(future, Future):  # a stager that does not stage: DCP's plain Future
            raise TypeError(f"dcp.async_save returned {type(future).__name__}, not a Future: "
                            f"this torch's async_save stages differently")
        self.pending = (future, root, path, step, keep_last, layout)
        return path

    def finish(self) -> Optional[str]:
        """Collective over the world: wait for the write in flight, then its checksums and
        manifest (it counts from now on). Returns its directory, None when none was in flight."""
        if self.pending is None:
            return None
        future, root, path, step, keep_last, layout = self.pending
        self.pending = None
        metadata = future.result()
        commit_sharded(root, path, step, checksum_sharded(path, metadata), keep_last, layout)
        return path
