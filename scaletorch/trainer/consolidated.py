"""Consolidated checkpoints: full weights and full AdamW state, from any layout to any layout.

The Trainer's own checkpoints are per rank (each rank's shards): exact and fast, but they
resume only at the same layout. A consolidated file holds what one device would hold, keyed
like chapter 00's model: ``save_consolidated`` gathers it through the layout (collective) and
writes it from global rank 0; to continue at another layout (or on one device) load its weights
into the full model *before* ``parallelize`` shards it, then ``resume_consolidated`` gives each
rank its part of the AdamW state (param_map.py: ``scatter``), the schedule and the step.

    {"step", "model": {name: tensor}, "optimizer": {"step", "exp_avg", "exp_avg_sq"} or None,
     "scheduler": LambdaLR state, "schedule": {steps, lr, min_lr, warmup_steps},
     "moe_bias": (MoE layers, E), only with model.moe_bias_rate > 0}
"""

import io
import os
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Union

import torch

from scaletorch.config import Config
from scaletorch.dist import comm, get_ledger
from scaletorch.models import Llama
from scaletorch.parallel.moe_balance import bias_state, load_bias_state
from scaletorch.parallel.parallelize import Parallelized
from scaletorch.rules import boundary
from scaletorch.rules.errors import clip
from scaletorch.rules.safe_files import write_checksummed
from scaletorch.trainer.checkpoint import load_tensors_only, tensor_bytes
from scaletorch.trainer.param_map import param_map

if TYPE_CHECKING:  # only the type: chapter 07's script hands its Trainer in
    from scaletorch.trainer.trainer import Trainer

# A layout's gather: value_of(parameter) -> chapter 00's {name: full tensor} (on global rank 0
# at least): a param map's ``gather`` (chapter 07), ZeRO's or FSDP2's ``full_state_dict``
# (chapter 02).
Gather = Callable[[Callable[[torch.Tensor], torch.Tensor]], Optional[Dict[str, torch.Tensor]]]


def consolidated_state(trainer: "Trainer", par: Union[Parallelized,
                                                      Gather]) -> Optional[Dict[str, Any]]:
    """Collective. The dict of the module docstring, with full reference-keyed tensors, on
    global rank 0 (None elsewhere); "optimizer" is None before AdamW's first step. ``par``:
    what ``parallelize`` returned, or a strategy's own gather (chapter 02)."""
    gather = param_map(par).gather if isinstance(par, Parallelized) else par
    opt = trainer.optimizer
    # AdamW has state once it stepped; every rank must agree before the collective gathers
    params = [p for group in opt.param_groups for p in group["params"]]
    have_state = torch.tensor([float(all(p in opt.state for p in params))], device=params[0].device)
    with get_ledger().paused():
        comm.all_reduce(have_state, op=torch.distributed.ReduceOp.MIN)
    optim: Optional[Dict[str, Any]] = None
    if have_state.item():
        first = opt.state[params[0]]
        optim = {"step": float(first["step"])}
        for key in ("exp_avg", "exp_avg_sq"):
            # gather calls the lambda at once, so its ``key`` is this iteration's
            optim[key] = gather(lambda p: opt.state[p][key])
    model = gather(lambda p: p.detach())
    if comm.group_rank() != 0:
        return None
    state: Dict[str, Any] = {
        "step": trainer.step,
        "model": model,
        "optimizer": optim,
        "scheduler": trainer.scheduler.state_dict(),
        "schedule": _schedule(trainer.cfg),
    }
    if trainer.balancer is not None:  # model.moe_bias_rate's bias, the same on every rank
        state["moe_bias"] = bias_state(trainer.balancer)
    return state


SCHEDULE = ("steps", "lr", "min_lr", "warmup_steps")


def _schedule(cfg: Config) -> Dict[str, float]:
    """The training fields the learning-rate schedule is a function of."""
    return {key: getattr(cfg.training, key) for key in SCHEDULE}


def save_consolidated(path: str, trainer: "Trainer", par: Union[Parallelized,
                                                                Gather]) -> Optional[str]:
    """Gather (collective) and write one file from global rank 0, atomically, with its checksum
    beside it (``<path>.sha256``, verified before every load)."""
    state = consolidated_state(trainer, par)
    if state is not None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        write_checksummed(path, buffer.getvalue())
    comm.barrier()
    return path


def consolidated_bytes(model_cfg: Any) -> int:
    """The tensor bytes of the file ``save_consolidated`` writes for a model of ``model_cfg``
    (once AdamW has stepped): its weights, exp_avg and exp_avg_sq, full and fp32, keyed like
    chapter 00's model. Counted on the meta device from the reference's parameters: nothing is
    gathered (a dry run's: ``consolidated_state`` reads a value, every rank's AdamW state)."""
    with torch.device("meta"):
        params = list(Llama(model_cfg).parameters())  # a tied weight once, as in the file
    return 3 * tensor_bytes(params)


def load_consolidated(path: str) -> Dict[str, Any]:
    """Read a consolidated checkpoint (every rank reads the whole file, on CPU). Its bytes must
    match its checksum file before they are unpickled (CorruptFileError naming it); a file that
    holds anything but tensors and plain values is refused (``load_tensors_only``)."""
    what = "consolidated checkpoint"
    return load_tensors_only(boundary.read_bytes(path, what, boundary.UNLIMITED),
                             f"{what} {clip(path)}")


def resume_consolidated(trainer: "Trainer", par: Parallelized, state: Dict[str, Any]) -> None:
    """Continue a consolidated checkpoint at this layout. The weights must already be in the
    model that ``parallelize`` sharded (``model.load_state_dict(state["model"])`` on the full
    model first); this sets each rank's part of the AdamW state, the schedule and the step."""
    opt = trainer.optimizer
    if state["optimizer"] is not None:
        scatter = param_map(par).scatter
        exp_avg = scatter(state["optimizer"]["exp_avg"])
        exp_avg_sq = scatter(state["optimizer"]["exp_avg_sq"])
        for param in exp_avg:
            opt.state[param] = {
                "step": torch.tensor(state["optimizer"]["step"]),
                "exp_avg": exp_avg[param],
                "exp_avg_sq": exp_avg_sq[param],
            }
    trainer.load_schedule(state["scheduler"])  # at this run's lr (the note below says so)
    if trainer.balancer is not None and "moe_bias" in state:  # else it starts at 0
        load_bias_state(trainer.balancer, state["moe_bias"], "the consolidated checkpoint")
    trainer.step = state["step"]
    saved, now = state.get("schedule"), _schedule(trainer.cfg)
    if saved is not None and saved != now and par.layout.pgm.rank == 0:
        differ = ", ".join(f"{k} {saved[k]} -> {now[k]}" for k in SCHEDULE if saved[k] != now[k])
        print(
            f"note: resuming a run whose schedule was {differ}: from step {trainer.step} the "
            f"learning rate follows this run's schedule, so the result differs from one "
            f"uninterrupted run of either config (and --check compares with this config's)",
            flush=True)
