"""What the tests of ``parallelize`` share: the small model and config, a layout's parallel
config, training one layout inside a gloo world (the pg_manager rebuilt per layout), the
single-device references and the parity assertion.

Used by tests/test_nd_parallel.py (8 ranks, the composed layouts) and
tests/test_parallelize_chapters.py (2 ranks, each chapter's layout, ours and PyTorch's).
The chapter tests that build a strategy by hand (not through ``parallelize``) take its
clipping and its full weights from the library's one rule each: ``clip_fn``, ``full_state``.
"""

import dataclasses
import unittest
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from scaletorch.dist import destroy_pg_manager, init_pg_manager_from_config
from scaletorch.models import build_model
from scaletorch.parallel.activation_checkpointing import apply_activation_checkpointing
from scaletorch.parallel.grad_norm import clip_grads_, replica_count, world_grad_norm
from scaletorch.parallel.mixed_precision import precision_hooks
from scaletorch.parallel.parallelize import Parallelized, parallelize
from scaletorch.parallel.pipeline_parallel import PipelineModel
from scaletorch.parallel.tensor_layout import (TensorLayout, plain_entries, record_splits,
                                               tied_copies, zero_entries)
from scaletorch.parallel.tied_embeddings import TiedEmbeddings
from scaletorch.parallel.vocab_padding import apply_tensor_parallel_padded
from scaletorch.parallel.zero import ShardedDataParallel
from scaletorch.trainer import Config, Trainer, TrainResult
from scaletorch.trainer.consolidated import (consolidated_state, load_consolidated,
                                             resume_consolidated, save_consolidated)
from scaletorch.trainer.param_map import (DTensorParamMap, ParamMap, State, full_state_dict,
                                          param_map)
from scaletorch.trainer.parity import max_weight_diff
from scaletorch.trainer.plain_loop import plain_training
from tests.harness import value_error

TOL = 1e-5  # fp32, 5 AdamW steps: only the order of the reductions differs (doc/design.md)
STEPS = 5
CHECKPOINT_EVERY = 2  # train(..., checkpoint_dir) saves step 2 per rank: test_resume resumes it


def make_config(moe: bool = False, micro_batches: int = 2, **parallel) -> Config:
    """4 layers, hidden 32, 4 query / 2 key-value heads, 8 sequences of 16 tokens, 5 steps."""
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.hidden_size, m.intermediate_size, m.num_layers = 64, 32, 64, 4
    m.num_attention_heads, m.num_key_value_heads, m.max_seq_len = 4, 2, 32
    if moe:  # aux loss about 0.2 of the loss, so wrong statistics would show
        m.num_experts, m.moe_top_k, m.moe_aux_loss_coeff = 4, 2, 0.1
    cfg.data.seq_len, cfg.data.global_batch_size, cfg.data.num_micro_batches = 16, 8, \
        micro_batches
    t = cfg.training
    # lr 3e-3: AdamW turns rounding-level gradient differences of elements whose gradient is
    # near 0 into weight differences of up to ~lr; at 1e-2 two single-device runs that differ
    # only in micro-batching already differ by 9e-6 in the weights.
    t.steps, t.lr, t.warmup_steps, t.grad_clip = STEPS, 3e-3, 2, 0.5  # clipping is active
    cfg.logging.progress = False
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    return cfg


def layout(tp=1, pp=1, cp=1, ep=1, **rest) -> dict:
    """The parallel section of a config: sizes by their short names, the rest as given."""
    return dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                context_parallel_size=cp, expert_model_parallel_size=ep, **rest)


# Chapter 07's parity matrix on 8 ranks (test_nd_parallel.py; test_resume.py resumes each):
# name -> (moe, micro-batches, parallel config); MoE runs use 1 micro-batch (see parallelize.py)
ND_LAYOUTS = {
    "tp2_pp2_dp2": (False, 2, layout(tp=2, pp=2)),
    "tp2_cp2_dp2": (False, 2, layout(tp=2, cp=2)),
    "pp2_cp2_tp2": (False, 2, layout(tp=2, pp=2, cp=2)),
    "zero3_dp4_tp2": (False, 2, layout(tp=2, zero_stage=3)),
    "zero3_pp2_interleaved_dp4":
    (False, 2, layout(pp=2, zero_stage=3, schedule="interleaved", virtual_pipeline_stages=2)),
    "moe_ep2_dp4_tp2": (True, 1, layout(tp=2, ep=2)),
    "moe_pp2_dp4_ep2": (True, 1, layout(pp=2, ep=2, schedule="afab")),
    "ckpt_tp2_sp_pp2_dp2":
    (False, 2, layout(tp=2, pp=2, sequence_parallel=True, activation_checkpointing=True)),
    "ckpt_zero2_cp2_dp4":  # selective: only the attention core (here the cp ring) recomputed
    (False, 2, layout(cp=2, zero_stage=2, activation_checkpointing="selective")),
    # the zero-bubble schedules (chapter 04) under tp and dp: zbv with m = 2 < 2p (rank 0's
    # warm-up cut short), dualpipev at its least, m = 2p = 4
    "zb_h1_tp2_pp2_dp2": (False, 2, layout(tp=2, pp=2, schedule="zb-h1")),
    "zbv_tp2_pp2_dp2": (False, 2, layout(tp=2, pp=2, schedule="zbv", virtual_pipeline_stages=2)),
    "dualpipev_tp2_pp2_dp2":
    (False, 4, layout(tp=2, pp=2, schedule="dualpipev", virtual_pipeline_stages=2)),
}


def config_of(layouts: Dict[str, Tuple[bool, int, dict]], name: str) -> Config:
    """The config of ``layouts[name]`` = (moe, micro-batches, parallel config)."""
    moe, m, parallel = layouts[name]
    return make_config(moe, m, **parallel)


def pg_manager_for(cfg: Config):
    return init_pg_manager_from_config(cfg.parallel)


def clip_fn(model: nn.Module, pgm, copies: Optional[int] = None) -> Callable[[float], torch.Tensor]:
    """The Trainer's ``clip_grad_norm`` for a model built by hand: grad_norm.py's one rule
    (one all-reduce over the world), each parameter counted ``copies`` times in the world
    (ZeRO's shards: 1), by default as its tags say (``replica_count``)."""
    params = list(model.parameters())
    replicas = [(p, copies or replica_count(p, pgm) * tied_copies(p)) for p in params]
    return lambda max_norm: clip_grads_(params, max_norm, world_grad_norm(
        replicas, params[0].device))


def full_state(model: nn.Module, pgm) -> Optional[State]:
    """Collective: the reference-keyed full weights of a model built by hand on global rank 0
    (None elsewhere), through the one consolidation routine, ``ParamMap.gather``: tp / ep shards
    by their tags (inside data-parallel wrappers or not), a ZeRO wrapper's units, a
    PipelineModel's stages; a model of DTensors (FSDP2, DTensor tp) through ``DTensorParamMap``."""
    pipe = model if isinstance(model, PipelineModel) else None
    modules = list(model.chunks) if pipe is not None else [model]
    if isinstance(model, ShardedDataParallel):  # ZeRO over dp_cp alone (chapter 02)
        names = [n for unit in model.units for names in unit.names for n in names]
        splits = dict.fromkeys(names, (None, False))
        by_hand: Union[ParamMap,
                       DTensorParamMap] = ParamMap(TensorLayout(pgm, splits, zero_entries([model])))
    elif any(isinstance(p, DTensor) for p in model.parameters()):
        by_hand = DTensorParamMap(TensorLayout(pgm, {}, [], dtensor_model=model))
    else:
        splits = {k: v for m in modules for k, v in record_splits(m).items()}
        by_hand = ParamMap(TensorLayout(pgm, splits, plain_entries(modules), pipe))
    return by_hand.gather(lambda p: p.detach())


def build(cfg: Config, pgm, state=None) -> Tuple[Parallelized, Trainer]:
    """Chapter 00's model (optionally loaded with ``state``), parallelized, and its Trainer."""
    model = build_model(cfg.model, seed=cfg.training.model_seed)
    if state is not None:
        model.load_state_dict(state)
    hooks = precision_hooks(cfg, "cpu")
    par = parallelize(model, cfg, pgm, torch.device("cpu"), hooks, tied=TiedEmbeddings(),
                      recompute=apply_activation_checkpointing,
                      tensor_parallel=apply_tensor_parallel_padded)
    return par, Trainer.from_parallelized(cfg, par, pgm, verbose=False, scaler=hooks.scaler)


def train(cfg: Config, checkpoint_dir: Optional[str] = None,
          consolidated_at: Optional[Tuple[int, str]] = None, checkpoint_at: int = CHECKPOINT_EVERY,
          pgm=None) -> dict:
    """Inside a world: train ``cfg``'s layout; losses, grad norms, full weights (rank 0). With
    ``checkpoint_dir``, also a per-rank checkpoint there of step ``checkpoint_at`` (the one
    ``resumed`` resumes: later steps write none) and the final weights and AdamW state (rank 0,
    "consolidated"); with ``consolidated_at = (step, path)``, a consolidated checkpoint of that
    step at ``path`` (``resume_at`` resumes it at other layouts). Both are written before
    ``train()`` goes on. In its own pg_manager unless ``pgm`` is given."""
    saves = {}
    if checkpoint_dir is not None:
        # the cadence train() would save at; a resume may change it (resume_check: PRINTED)
        cfg.checkpoint.every, cfg.checkpoint.dir = checkpoint_at, checkpoint_dir
        saves[checkpoint_at] = "per-rank"
    if consolidated_at is not None:
        saves[consolidated_at[0]] = saves.get(consolidated_at[0], "") + "consolidated"
    own = pgm is None
    pgm = pg_manager_for(cfg) if own else pgm
    par, trainer = build(cfg, pgm)
    losses: List[float] = []
    norms: List[float] = []
    for _ in range(max(saves, default=0)):  # train()'s steps one by one (its schedule reads
        loss, norm = trainer.train_step()  # t.steps)
        losses.append(loss)
        norms.append(norm)
        if "per-rank" in saves.get(trainer.step, ""):
            trainer.save()  # as train() would at this step
        if "consolidated" in saves.get(trainer.step, ""):
            save_consolidated(consolidated_at[1], trainer, par)
    if checkpoint_dir is not None:
        cfg.checkpoint.every = 0  # no more per-rank checkpoints: nothing resumes them
    result = trainer.train()
    out = {
        "losses": losses + result.losses,
        "grad_norms": norms + result.grad_norms,
        "param_map": type(param_map(par)).__name__,
    }
    if checkpoint_dir is not None:  # its weights are the full state: one gather, not two
        out["consolidated"] = consolidated_state(trainer, par)
        out["state"] = None if out["consolidated"] is None else out["consolidated"]["model"]
    else:
        out["state"] = full_state_dict(par)
    if own:
        destroy_pg_manager()
    return out


def resumed(cfg: Config, resume: Optional[str] = None,
            pgm=None) -> Tuple[TrainResult, Optional[State]]:
    """Inside a world: train ``cfg`` (from ``resume``, a per-rank checkpoint directory, if
    given) with a new model and strategy (what a restarted process does), in a fresh
    pg_manager unless ``pgm`` is given; (its TrainResult, the consolidated state: rank 0, None
    elsewhere)."""
    cfg.checkpoint.resume = resume
    if resume is not None:  # its own checkpoints would not be read (resume_check: PRINTED)
        cfg.checkpoint.every = 0
    own = pgm is None
    pgm = pg_manager_for(cfg) if own else pgm
    par, trainer = build(cfg, pgm)
    result = trainer.train()
    state = consolidated_state(trainer, par)
    if own:
        destroy_pg_manager()
    return result, state


def differences(want: dict, got: dict) -> List[str]:
    """Names of the tensors of two consolidated states (weights and AdamW moments) that are not
    bit-identical."""
    pairs = [(k, want["model"][k], got["model"][k]) for k in want["model"]]
    for key in ("exp_avg", "exp_avg_sq"):
        pairs += [(f"{key} of {k}", want["optimizer"][key][k], got["optimizer"][key][k])
                  for k in want["optimizer"][key]]
    return [name for name, a, b in pairs if not a.equal(b)]


def save_and_resume(saved: Config, resumes: Dict[str, Config], path: str,
                    save_at: int) -> Dict[str, dict]:
    """Inside a world: train ``saved`` for ``save_at`` steps, write a consolidated checkpoint to
    ``path``, resume it at each layout of ``resumes``; ``resume_at``'s {name: losses, state}."""
    pgm = pg_manager_for(saved)
    par, trainer = build(saved, pgm)
    for _ in range(save_at):
        trainer.train_step()
    save_consolidated(path, trainer, par)
    destroy_pg_manager()
    return resume_at(path, resumes)


def resume_at(path: str, resumes: Dict[str, Config], pgm=None) -> Dict[str, dict]:
    """Inside a world: resume the consolidated checkpoint at ``path`` at each layout of
    ``resumes``; {name: {"losses": of the remaining steps, "state": the final full weights
    (global rank 0; None elsewhere)}}. The losses of the steps after the save see the saved
    weights; the final weights also see the saved AdamW state, which the first step uses.
    Each in its own pg_manager unless ``pgm`` (of every layout's sizes) is given."""
    state = load_consolidated(path)
    out = {}
    for name, cfg in resumes.items():
        own = pgm is None
        run_pgm = pg_manager_for(cfg) if own else pgm
        par, trainer = build(cfg, run_pgm, state["model"])  # the weights before parallelize
        resume_consolidated(trainer, par, state)  # then each rank's part of the AdamW state
        out[name] = {"losses": trainer.train().losses, "state": full_state_dict(par)}
        if own:
            destroy_pg_manager()
    return out


def parallelize_error(cfg: Config, pgm=None) -> str:
    """Inside a world: the ValueError ``parallelize`` raises for ``cfg`` (its own pg_manager
    unless one is given)."""
    own = pgm is None
    pgm = pg_manager_for(cfg) if own else pgm
    try:
        return value_error(lambda: parallelize(build_model(cfg.model, 0), cfg, pgm,
                                               torch.device("cpu"), precision_hooks(cfg, "cpu")))
    finally:
        if own:
            destroy_pg_manager()


class WorldSize:
    """A stand-in pg_manager that holds the world's size alone: all ``parallelize`` reads before
    its layout check (validate_layout) refuses a config. A refusal moved past that check ends in
    an AttributeError (a group size read here), not in the expected ValueError."""

    def __init__(self, world_size: int):
        self.world_size = world_size


def layout_refusal(cfg: Config, world_size: int) -> str:
    """Outside any world: the ValueError ``parallelize`` raises for ``cfg`` at ``world_size``
    ranks before it reads a process group. In a world of 8, the pg_manager that
    ``parallelize_error`` builds for a refused layout costs each rank about as much CPU as a
    layout's training (tests/test_nd_parallel.py's six refusals: 3.5 s a rank, at a load of 30)."""
    return parallelize_error(cfg, WorldSize(world_size))


def references(configs: Iterable[Config]) -> Dict[Tuple[int, int, int], tuple]:
    """Outside the world: one single-device run per reference_key of ``configs``, by the plain
    PyTorch loop (scaletorch/trainer/plain_loop.py, which tests/test_trainer.py holds equal to
    the Trainer): (losses, grad norms, final weights)."""
    out: Dict[Tuple[int, int, int], tuple] = {}
    for cfg in configs:
        key = reference_key(cfg)
        if key not in out:
            out[key] = reference(cfg)
    return out


_REFERENCES: Dict[str, tuple] = {}


def reference(cfg: Config) -> tuple:
    """The plain loop's (losses, grad norms, final weights) of ``cfg`` on one device, computed
    once per model, data and training section in this process (the suite's modules share the
    same few runs; callers only read them)."""
    key = repr((dataclasses.asdict(cfg.model), dataclasses.asdict(cfg.data),
                dataclasses.asdict(cfg.training)))
    if key not in _REFERENCES:
        losses, norms, model = plain_training(cfg)
        _REFERENCES[key] = losses, norms, model.state_dict()
    return _REFERENCES[key]


def reference_key(cfg: Config) -> Tuple[int, int, int]:
    """What the single-device run depends on among the layouts: experts, micro-batches and
    the vocabulary (which also picks the data: a synthetic chain or a .bin above 4096)."""
    return cfg.model.num_experts, cfg.data.num_micro_batches, cfg.model.vocab_size


# A grad norm sums the squares of every gradient (10^6 and more) in another order than one
# device: rounding reached 2.5e-5 relative (vocab 50257, tp2 x dp2, step 4) while the losses
# and weights stayed within 1e-5. A gradient scaled by 1.001 moves the norm by 1e-3 relative.
NORM_TOL = 1e-4


def assert_matches(test: unittest.TestCase, runs: List[dict], reference: tuple, label: str,
                   weights: str = "state", tol: float = TOL, norm_tol: float = NORM_TOL,
                   loss_tol: Optional[float] = None) -> None:
    """The one parity assertion. ``runs``: each rank's {"losses", "grad_norms", ``weights``
    (the full state dict on rank 0)}; ``reference``: (losses, grad norms, state) of one device.

    Every rank's losses within ``loss_tol`` (default ``tol``), grad norms within ``norm_tol``
    relative (above 1), rank 0's weights within ``tol``: a constant scale on the gradients
    passes the losses (AdamW normalizes it) but not the norms (tests/test_planted_bugs.py)."""
    losses, norms, state = reference
    loss_tol = tol if loss_tol is None else loss_tol
    for rank, run in enumerate(runs):
        where = f"{label} rank {rank}"
        test.assertEqual(len(run["losses"]), len(losses), where)
        test.assertEqual(len(run["grad_norms"]), len(norms), where)
        for step, (a, b) in enumerate(zip(run["losses"], losses)):
            test.assertLessEqual(abs(a - b), loss_tol, f"{where} step {step}: loss {a} vs {b}")
        for step, (a, b) in enumerate(zip(run["grad_norms"], norms)):
            test.assertLessEqual(abs(a - b), norm_tol * max(1.0, b),
                                 f"{where} step {step}: grad norm {a} vs {b}")
    test.assertLessEqual(max_weight_diff(runs[0][weights], state), tol, f"{label} weights")


def assert_run_matches(test: unittest.TestCase, results: List[dict], name: str, reference: tuple,
                       weights: str = "state") -> None:
    """Run ``name`` of ``results[r]["parity"]`` against ``reference`` (``assert_matches``)."""
    assert_matches(test, [res["parity"][name] for res in results], reference, name, weights)


def assert_parity(test: unittest.TestCase, results: List[dict], name: str,
                  reference: tuple) -> None:
    """Run ``name`` of ``results[r]`` against ``reference`` (``assert_matches``); the full
    weights are on rank 0 only."""
    for res in results[1:]:
        test.assertIsNone(res[name]["state"])
    assert_matches(test, [res[name] for res in results], reference, name)
