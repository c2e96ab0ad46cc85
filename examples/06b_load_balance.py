"""Chapter 06b: load balance. A router that sends most tokens to two experts, what it costs
under expert parallel, and three remedies measured on the same run.

    scripts/launch.sh examples/06b_load_balance.py --nproc-per-node 2 -- --check
    scripts/launch.sh examples/06b_load_balance.py --nproc-per-node 4 -- --ep 4 --check

Chapter 06's model and step, with a router that starts collapsed (``skew_router``: experts 0
and 1 get a logit offset) and a ``LoadMeter`` that times each rank's experts and its wait at
the combine. Then the same run once per remedy: none, the auxiliary loss (two coefficients),
the bias of DeepSeek-V3 (``BiasBalancer``) and capacity with dropping on global statistics
(``apply_global_capacity``). One table compares them. ``--check``: each run against the
single device built the same way (the bias and dropping too). Each remedy is a run of its own
in ``runs/NAME/<remedy>/`` (config, metrics, log, checkpoints; "capacity 1.0": capacity_1.0),
and ``--resume`` continues each from its own checkpoints.
"""

import copy
import math
import os
import statistics
import sys

import torch

from scaletorch.data import local_batch, split_micro_batches
from scaletorch.dist import (comm, destroy_distributed, destroy_pg_manager, get_ledger,
                             init_distributed, init_pg_manager_from_config)
from scaletorch.models import build_model, loss_fn, moe_aux_loss
from scaletorch.parallel.expert_parallel import (ExpertParallel, expert_parallel_clip_grad_norm,
                                                 gather_expert_parallel_state_dict, shard_experts)
from scaletorch.parallel.grad_norm import clip_replicated
from scaletorch.parallel.moe_balance import BiasBalancer, apply_global_capacity, skew_router
from scaletorch.parallel.moe_load import LoadMeter, format_load, imbalance
from scaletorch.rules.errors import OneLineParser
from scaletorch.trainer import build_optimizer, load_config, start_run
from scaletorch.trainer.checkpoint import latest_valid_checkpoint
from scaletorch.trainer.parity import report_norm_parity, report_parity, report_weight_parity
from scaletorch.trainer.precision import autocast
from scaletorch.trainer.trainer import build_loader

# name -> (aux loss coefficient, bias update rate, capacity factor): the default runs
REMEDIES = {
    "none": (0.0, 0.0, 0.0),
    "aux 0.01": (0.01, 0.0, 0.0),
    "aux 0.1": (0.1, 0.0, 0.0),
    "bias": (0.0, 0.02, 0.0),
    "capacity 1.0": (0.0, 0.0, 1.0),
}
FORMS = "none, aux C, bias, capacity F"  # what --remedies takes (C, F: numbers > 0)
# the model's settings each remedy sets: key -> the remedy that takes its value
PER_REMEDY = {"moe_aux_loss_coeff": "aux", "moe_capacity_factor": "capacity"}

PICTURES = ("png", "pdf", "svg", "jpg", "jpeg")  # what matplotlib's savefig writes here


def remedy_settings(name: str) -> tuple:
    """(aux loss coefficient, bias update rate, capacity factor) of one --remedies entry:
    "none", "bias", "aux C" or "capacity F" (C, F finite numbers > 0). ValueError otherwise."""
    if name in ("none", "bias"):
        return REMEDIES[name]
    kind, _, value = name.partition(" ")
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if kind not in ("aux", "capacity") or not 0 < number < float("inf"):
        raise ValueError(f"--remedies: {name!r} is none of {FORMS} (C and F finite numbers "
                         f'> 0), e.g. --remedies "none,capacity 1.25"')
    return (number, 0.0, 0.0) if kind == "aux" else (0.0, 0.0, number)


def remedy_config(cfg, remedy: str):
    """``cfg`` for one remedy's run: its settings, and its own directory ``runs/NAME/<slug>``
    (checkpoints in it, or in ``checkpoint.dir/<slug>``); ``--resume`` continues the latest
    checkpoint there, and a remedy with none (it never saved one) starts at step 0."""
    part, slug = copy.deepcopy(cfg), remedy.replace(" ", "_")
    part.model.moe_aux_loss_coeff, _, part.model.moe_capacity_factor = remedy_settings(remedy)
    part.logging.run_dir, part.logging.name = cfg.run_path, slug
    if cfg.checkpoint.dir:
        part.checkpoint.dir = os.path.join(cfg.checkpoint.dir, slug)
    if cfg.checkpoint.resume == "latest" and latest_valid_checkpoint(
            part.checkpoint_path)[0] is None:
        part.checkpoint.resume = None
    return part


def remedy_configs(args):
    """load_config's ``parts``: each remedy's run of the config (its resume is checked)."""
    return lambda cfg: [remedy_config(cfg, remedy) for remedy in args.remedies.split(",")]


def chapter_args() -> tuple:
    """This chapter's own flags and its parser (for --help); the rest go to load_config."""
    parser = OneLineParser(add_help=False)
    mine = parser.add_argument_group("chapter 06b's options")
    mine.add_argument("--remedies", default=",".join(REMEDIES), metavar="LIST",
                      help=f"comma-separated, of: {FORMS}")
    mine.add_argument("--hot-offset", type=float, default=3.0, metavar="X",
                      help="router logit offset of experts 0 and 1 at init")
    mine.add_argument("--plot", default=None, metavar="PNG",
                      help="draw tokens per expert and time per rank to PNG")
    args, rest = parser.parse_known_args()
    return args, rest, parser


def limits(args):

    def check(cfg, world_size: int) -> None:
        p = cfg.parallel
        tp, pp, cp = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                      p.context_parallel_size)
        if tp > 1 or pp > 1 or cp > 1 or p.impl != "ours":
            raise ValueError(f"06b_load_balance runs ep with data parallel, impl ours (got tp "
                             f"{tp}, pp {pp}, cp {cp}, impl {p.impl}); examples/07_nd_parallel.py "
                             f"composes --model.moe_bias_rate (pp 1) and --model.moe_capacity_"
                             f"factor (cp 1) with them")
        if cfg.model.moe_bias_rate > 0:  # start_run would add a second bias to the runs
            raise ValueError(f"model.moe_bias_rate {cfg.model.moe_bias_rate}: 06b sets each "
                             f"remedy's own (--remedies bias); that flag is chapter 07's")
        remedies = args.remedies.split(",")
        settings = [remedy_settings(name) for name in remedies]
        if len(set(settings)) < len(settings):  # "capacity 1" and "capacity 1.0" are one
            raise ValueError(f"--remedies {args.remedies}: each remedy once")
        resume = cfg.checkpoint.resume
        if resume not in (None, "latest") and len(remedies) > 1:
            raise ValueError(f"--resume {resume} is one remedy's checkpoint, and --remedies names "
                             f"{len(remedies)}: give --resume alone (each remedy continues its "
                             f"own, in runs/NAME/<remedy>/checkpoints)")
        for key, kind in PER_REMEDY.items():  # the config's 0 is overwritten by each remedy's
            value = getattr(cfg.model, key)
            if value != 0:
                raise ValueError(f"model.{key} {value:g} would be ignored: each remedy sets its "
                                 f'own; use --remedies "{kind} {value:g}" instead (with '
                                 f'others: --remedies "none,{kind} {value:g}")')
        if not math.isfinite(args.hot_offset):
            raise ValueError(f"--hot-offset must be a finite number, got {args.hot_offset}")
        if cfg.training.steps < 2:  # step 1 warms up: the times are of the steps after it
            raise ValueError(f"06b_load_balance times the steps after the first: "
                             f"--steps must be at least 2, got {cfg.training.steps}")
        if args.plot and not {"none", "bias"} <= set(remedies):
            raise ValueError(f"--plot draws 'none' against 'bias': --remedies {args.remedies} "
                             f"lacks {' and '.join(sorted({'none', 'bias'} - set(remedies)))}")
        if args.plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
            raise ValueError(f"--plot {args.plot}: its directory does not exist")
        suffix = os.path.splitext(args.plot or "x.png")[1].lower().lstrip(".")
        if suffix not in PICTURES:
            raise ValueError(f"--plot {args.plot}: a picture is one of "
                             f"{', '.join('.' + k for k in PICTURES)}")

    return check


def build(cfg, remedy: str, device, hot_offset: float, pgm=None):
    """The model of ``remedy`` on ep (``pgm``) or on one device (None, the reference), and what
    its step calls: (model, clip(max_norm) -> norm, LoadMeter or None, BiasBalancer or None)."""
    aux, rate, factor = remedy_settings(remedy)
    cfg.model.moe_aux_loss_coeff, cfg.model.moe_capacity_factor = aux, factor
    model = build_model(cfg.model, seed=cfg.training.model_seed).to(device)
    skew_router(model, {0: hot_offset, 1: hot_offset})  # the collapse, same on every rank
    # the bias: a buffer of each MoE layer, so checkpoints save it and a resume loads it
    balancer = BiasBalancer(model, rate) if rate else None
    if pgm is None:
        params = list(model.parameters())  # every gradient whole here: chapter 01's norm
        return model, lambda max_norm: clip_replicated(params, max_norm), None, balancer
    shard_experts(model, pgm)
    if factor:
        apply_global_capacity(model, pgm)  # drop what the single device drops
    meter = LoadMeter(model, pgm)
    model = ExpertParallel(model, pgm)
    return model, expert_parallel_clip_grad_norm(model, pgm), meter, balancer


def train(cfg, model, pgm, clip, meter, balancer):
    """Chapter 06's step with the remedy's calls; ``pgm`` None: on one device, no collective
    (the reference, which writes nothing). Returns the run's result: losses, grad norms, step
    seconds. The remedy's run writes its directory and prints nothing (the table does)."""
    device = next(model.parameters()).device
    optimizer = build_optimizer(cfg, model.parameters())
    rank, n = (pgm.data_parallel_rank, pgm.data_parallel_world_size) if pgm else (0, 1)
    m, max_norm = cfg.data.num_micro_batches, cfg.training.grad_clip or math.inf  # 0: no clip
    # [core: step]
    # its run directory, resume and checkpoints, nothing printed; the reference (pgm None) none
    with start_run(cfg, model, optimizer, pgm, verbose=pgm is not None, quiet=True) as run:
        for inputs, targets in run.batches():  # this step's batch (b, s)
            optimizer.zero_grad(set_to_none=True)
            inputs, targets, _ = local_batch(inputs, targets, rank, n)
            loss = torch.zeros((), device=device)
            with autocast(cfg, device):
                for x, y in split_micro_batches(inputs, targets, m):
                    micro_loss = (loss_fn(model(x), y) + moe_aux_loss(model)) / m
                    micro_loss.backward()
                    loss += micro_loss.detach()
            if pgm is not None:  # ep: chapter 06's gradient sync and loss average
                model.finish_grad_sync()
                loss = comm.average_over_group(loss, pgm.gradient_sync_group)
            if meter is not None:
                meter.after_step()  # this step's rows, expert and wait times, bytes per rank
            grad_norm = clip(max_norm)
            run.record(loss, grad_norm)
            optimizer.step()
            if balancer is not None:
                balancer.update()  # the next step's bias, from this step's load
    # [end: step]
    return run.result


def held_out_loss(cfg, model, pgm, device) -> float:
    """The language-model loss (no aux term) on a batch no run trains on, averaged over dp."""
    inputs, targets = build_loader(cfg).get_batch(10**6)
    n, r = pgm.data_parallel_world_size, pgm.data_parallel_rank
    rows = slice(r * len(inputs) // n, (r + 1) * len(inputs) // n)
    with torch.no_grad(), get_ledger().paused():
        loss = loss_fn(model(inputs[rows].to(device)), targets[rows].to(device))
        moe_aux_loss(model)  # discard this forward's aux term
        comm.all_reduce(loss, pgm.gradient_sync_group)
    return float(loss) / n


def draw(every: torch.Tensor, balanced: torch.Tensor, num_experts: int, path: str,
         title: str) -> None:
    """Tokens per expert over steps (layer 0) without a remedy (solid) and with the bias
    (``balanced``, dashed), and each rank's expert and wait time without a remedy."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot needs matplotlib: pip install -e '.[plot]'")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for e in range(num_experts):
        line, = left.plot(every[0, :, 0, e].tolist(), label=f"expert {e}")
        left.plot(balanced[0, :, 0, e].tolist(), "--", color=line.get_color())
    left.set(xlabel="step", ylabel="tokens (layer 0, global batch)",
             title=f"{title}: none (solid), bias (dashed)")
    left.legend()
    e = num_experts
    ranks = range(every.shape[0])
    later = every[:, 1:] if every.shape[1] > 1 else every  # after the warm-up step, if any
    compute = later[..., e + 1].sum(-1).median(-1).values * 1e3  # (ranks,) ms per step
    wait = later[..., e + 2].sum(-1).median(-1).values * 1e3
    right.bar(ranks, compute.tolist(), label="experts")
    right.bar(ranks, wait.tolist(), bottom=compute.tolist(), label="wait at the combine")
    right.set(xlabel="rank", ylabel="ms per step (median, all layers)",
              title="time per rank, no remedy", xticks=list(ranks))
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> int:
    args, rest, options = chapter_args()
    cfg = load_config("examples/configs/06b_load_balance.yaml",
                      "Chapter 06b: load balance in a mixture of experts", limits(args), argv=rest,
                      options=options, parts=remedy_configs(args))
    env = init_distributed(cfg.training.timeout_seconds)
    pgm = init_pg_manager_from_config(cfg.parallel, cfg.training.timeout_seconds)
    pgm.log_topology(experts=True)
    e = cfg.model.num_experts
    rows, ok, measured, notes = [], True, {}, []
    for remedy in args.remedies.split(","):
        run_cfg = remedy_config(cfg, remedy)
        model, clip, meter, balancer = build(run_cfg, remedy, env.device, args.hot_offset, pgm)
        result = train(run_cfg, model, pgm, clip, meter, balancer)
        start, trained = result.start_step, len(result.losses)  # the same on every rank
        if trained == 0:  # finished by an earlier run: its numbers are in its metrics
            notes.append(f"{remedy}: finished at step {start} by an earlier run (its metrics: "
                         f"{os.path.join(run_cfg.run_path, 'metrics.jsonl')})")
            continue
        every = meter.gather()  # (world, steps trained here, layers, E + columns) on rank 0
        loss = held_out_loss(run_cfg, model, pgm, env.device)
        full = gather_expert_parallel_state_dict(model, pgm) if cfg.check else None
        if pgm.rank != 0:
            continue
        if remedy == "none":  # the problem, measured
            print(format_load(every, e, start))
        if start > 0 or trained < 2:
            notes.append(f"{remedy}: measured over the {trained} step{'s' * (trained > 1)} "
                         f"this run trained" + (f", resumed at step {start}" if start else "") +
                         ("; step_ms needs 2 (the first warms up)" if trained < 2 else ""))
        measured[remedy] = every
        tail = every[:, -10:]  # the last 10 steps
        share = imbalance(tail[..., e].permute(1, 2, 0))  # (steps, layers): max/mean over ranks
        dropped = tail[..., e + 5].sum((0, 1)) / tail[0, :, :, :e].sum((0, 2))  # (layers,)
        wait = statistics.median(tail[..., e + 2].sum(-1).max(0).values.tolist()) * 1e3
        hot_rows = float(tail[..., e].max(0).values.mean())  # the busiest rank's, per layer
        step_ms = statistics.median(result.step_seconds[1:]) * 1e3 if trained > 1 else math.nan
        first = float(imbalance(every[:, 0, :, e].t()).max())  # this run's first step
        rows.append(
            (remedy, first, float(share.mean()), hot_rows, dropped.tolist(), loss, step_ms, wait))
        if cfg.check:
            print(f"{remedy}: ", end="")
            ref_cfg = copy.deepcopy(run_cfg)
            ref_cfg.checkpoint.every, ref_cfg.checkpoint.resume = 0, None
            ref_model, ref_clip, _, ref_balancer = build(ref_cfg, remedy, env.device,
                                                         args.hot_offset)
            reference = train(ref_cfg, ref_model, None, ref_clip, None, ref_balancer)
            ok &= report_parity(result.losses, reference.losses[start:])  # resumed: the rest
            ok &= report_weight_parity(full, ref_model.state_dict(), cfg.training.steps)
            ok &= report_norm_parity(result.grad_norms, reference.grad_norms[start:])
    if pgm.rank == 0 and args.plot and {"none", "bias"} <= set(measured):
        draw(measured["none"], measured["bias"], e, args.plot,
             f"ep {pgm.expert_model_parallel_world_size}")
    if pgm.rank == 0:
        print(f"\nremedies on one run: ep {pgm.expert_model_parallel_world_size}, {e} experts, "
              f"top-{cfg.model.moe_top_k}, router offset {args.hot_offset:g} on experts 0 1, "
              f"{cfg.training.steps} steps")
        w = max([13] + [len(row[0]) for row in rows])  # "capacity 1.25" and longer
        print(f"{'remedy':<{w}} {'imbalance':>9} {'last10':>6} {'hot_rows':>8} "
              f"{'dropped%':>9} {'heldout_loss':>12} {'step_ms':>7} {'wait_ms':>7}")
        for name, first, tail_mean, hot_rows, dropped, loss, ms, wait in rows:
            drops = "/".join(f"{100 * d:.1f}" for d in dropped)  # per layer
            print(f"{name:<{w}} {first:>9.2f} {tail_mean:>6.2f} {hot_rows:>8.0f} {drops:>9} "
                  f"{loss:>12.4f} {'-' if math.isnan(ms) else f'{ms:.1f}':>7} {wait:>7.1f}")
        print("\n".join(
            notes +
            [f"each remedy's config, metrics and checkpoints: "
             f"{cfg.run_path}/<remedy>/"]))
    destroy_pg_manager()
    destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
