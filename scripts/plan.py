"""Chapter 09: plan a layout before running it: memory, traffic, bubble, step time.

    python scripts/plan.py examples/configs/07_nd_parallel.yaml --tp 2 --pp 2 --gpus 8
    python scripts/plan.py --preset llama3-8b --gpus 8 --tp 8 --cluster h100
    python scripts/plan.py --preset llama3-405b --gpus 16384 --cluster h100 --seq-len 8192 \\
        --search
    python scripts/plan.py --params 13e9 --gpus 64 --search --top 3 --json
    python scripts/plan.py examples/configs/07_nd_parallel.yaml --calibrate runs/host.json

A run's config comes as in the examples (a YAML file, then --tp, --pp, --zero-stage, ... and
--section.name VALUE overrides, scaletorch/trainer/config.py); --preset or --params replaces its
model. With the layout fixed it prints the breakdown of the most-loaded rank; --search tries
every layout that the trainer's layout check accepts (scaletorch/dist/layout_check.py) and
prints the --top fastest that fit in memory, and why each rejected family (tp, cp, pp) was
rejected. --json prints the same as one JSON object. Bad input: one "error:" line, exit 2.
"""

import json
import os
import sys
import time
from dataclasses import replace
from typing import Callable, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import scaletorch.plan.model as plan_model  # noqa: E402
from scaletorch.plan.cluster import load_cluster  # noqa: E402
from scaletorch.plan.layout import FP8, FRAMEWORKS, PRECISION_BYTES, PlanLayout  # noqa: E402
from scaletorch.plan.layout import from_config as layout_of  # noqa: E402
from scaletorch.plan.model import PRESETS, ModelSpec, from_config, from_params, preset  # noqa: E402
from scaletorch.plan.report import evaluate, format_breakdown  # noqa: E402
from scaletorch.plan.search import NOT_SEARCHED, search, with_split  # noqa: E402
from scaletorch.rules.errors import OneLineParser  # noqa: E402
from scaletorch.trainer.config import Config, parse_args  # noqa: E402
from scaletorch.trainer.dry_run import dry_run_text, stages  # noqa: E402
from scripts.plan_measure import checker, measure_rank, run_config  # noqa: E402, F401


def measured_report(cfg: Config, world: int, model: ModelSpec, layout: PlanLayout) -> str:
    """Run ``cfg`` here on ``world`` CPU ranks and print each rank's measurement beside the
    prediction: wire bytes per group, model-state bytes, activations."""
    from scaletorch.dist.spawn import run_distributed
    from scaletorch.plan.memory import activation_bytes, state_bytes
    from scaletorch.plan.traffic import wire_bytes_per_group

    results = run_distributed(measure_rank, world, {"run": cfg}, timeout=600)
    lines = [f"{'rank':<6}{'what':<22}{'predicted':>14}{'measured':>14}"]
    for rank, res in enumerate(results):
        got, r = res["run"], res["run"]["pp_rank"]
        wire: Dict[str, float] = {}
        for (_, group, _), value in got["wire"].items():
            wire[group] = wire.get(group, 0.0) + value
        rows = [(f"wire {g}", v, wire.get(g, 0.0))
                for g, v in sorted(wire_bytes_per_group(model, layout, r).items())]
        states = state_bytes(model, layout, r)
        rows += [(k, states[k], got["memory"][k]) for k in ("params", "grads", "optimizer")]
        saved = activation_bytes(model, layout, r)["saved"]  # the peak over the schedule
        rows.append(("activations (saved)", saved, got["saved"]))
        for what, predicted, measured in rows:
            mark = "=" if predicted == measured else f"{100 * (predicted / measured - 1):+.1f}%"
            lines.append(f"{rank:<6}{what:<22}{predicted:>14,.0f}{measured:>14,.0f}  {mark}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    epilog = ("Also every flag of the examples: --tp, --pp, --cp, --ep, --zero-stage, "
              "--micro-batches, --schedule, --virtual-stages, --sequence-parallel, "
              "--activation-checkpointing [MODE], --section.name VALUE.")
    parser = OneLineParser(usage="plan.py [CONFIG.yaml] [options]",
                           description=__doc__.splitlines()[0], epilog=epilog)
    parser.add_argument("--preset", help=f"a model instead of the config's: {', '.join(PRESETS)}")
    parser.add_argument("--params", type=float, help="a Llama of about this many parameters")
    parser.add_argument(
        "--exact-params", action="store_true",
        help="--params is exact: the nearest smaller Llama plus the remainder as "
        "extra parameters in the head's unit (formula work: ZeRO's Psi)")
    parser.add_argument(
        "--framework", choices=FRAMEWORKS,
        help="whose code runs the layout: scaletorch (default; this repository's "
        "trainer, ledger-exact) | torchtitan (FSDP2, SDPA, its recomputation)")
    parser.add_argument(
        "--recompute", metavar="MODE",
        help="torchtitan's recomputation beyond none | selective | full: op "
        "(per-op selective) or every-N (per-layer selective)")
    parser.add_argument("--compile", action="store_true",
                        help="torchtitan under torch.compile (fused elementwise kernels)")
    parser.add_argument("--fp8", choices=FP8, default="none",
                        help="torchao float8 linears (torchtitan): matmul, or matmul+all-gather")
    parser.add_argument("--gpus", type=int, help="world size (default: tp x pp x cp x --dp)")
    parser.add_argument("--cluster", default="h100",
                        help="h100 | a100 | b200 | FILE.yaml | FILE.json (--calibrate writes one)")
    parser.add_argument(
        "--calibrate", metavar="FILE.json",
        help="measure this host (matmul FLOP/s and per-op cost at the config's model sizes, "
        "gloo latency and bandwidth in worlds of 2-4; about two minutes) into a cluster file")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: the config's)")
    parser.add_argument("--global-batch-tokens", type=int,
                        help="tokens per step (default: the config's batch; presets 16M)")
    parser.add_argument("--precision", choices=tuple(PRECISION_BYTES),
                        help="fp32 (default for a config) | bf16 | bf16-fp32-grads (presets)")
    parser.add_argument("--attention", choices=("eager", "flash"),
                        help="eager keeps the s x s scores (this repo); flash (presets' default)")
    parser.add_argument(
        "--moe-imbalance", type=float, default=1.0, metavar="RHO",
        help="an MoE layout's max/mean rows per ep rank, measured (chapter 06b) or assumed: "
        "the hot rank's extra expert compute and all-to-all bytes join the step (default 1, "
        "a balanced router)")
    parser.add_argument("--search", action="store_true", help="rank every valid layout")
    parser.add_argument("--top", type=int, default=5, help="layouts --search prints")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    parser.add_argument(
        "--measure", action="store_true",
        help="also run the layout here (CPU, gloo, --gpus ranks, --steps steps) "
        "and print each rank's measurement beside the prediction")
    parser.add_argument(
        "--dry-run", nargs="?", const="heaviest", metavar="STAGES",
        help="also run the layout's real code as one rank of the world, here on the CPU (fake "
        "collectives, meta tensors; fp32, eager attention) and print it beside the plan; "
        "STAGES: heaviest (default), all, or pipeline ranks such as 0,15")
    argv = list(sys.argv[1:] if argv is None else argv)
    config = argv.pop(0) if argv and not argv[0].startswith("-") else None  # a run's YAML
    args, rest = parser.parse_known_args(argv)
    try:
        cfg = parse_args(rest + (["--config", config] if config else []))
        production = args.preset is not None or args.params is not None
        if args.preset is not None:
            model = preset(args.preset)
        elif args.params is not None:
            model = from_params(args.params)
            if args.exact_params:
                while model.num_parameters() > args.params and model.num_layers > 1:
                    model = replace(model, num_layers=model.num_layers - 1)
                model = plan_model.exact(model, args.params)
        elif args.exact_params:
            raise ValueError("--exact-params needs --params N")
        else:
            model = from_config(cfg.model)
        p = cfg.parallel
        default_gpus = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * \
            p.context_parallel_size * max(1, p.data_parallel_size)
        gpus = args.gpus if args.gpus is not None else default_gpus
        seq = args.seq_len if args.seq_len is not None else \
            (8192 if production else cfg.data.seq_len)
        tokens = args.global_batch_tokens if args.global_batch_tokens is not None else (
            2**24 if production else cfg.data.global_batch_size * seq)
        for name, value in (("--gpus", gpus), ("--seq-len", seq), ("--global-batch-tokens", tokens),
                            ("--top", args.top)):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if tokens % seq:
            raise ValueError(f"--global-batch-tokens {tokens} is not a multiple of the sequence "
                             f"length {seq}")
        if args.calibrate is not None:
            if not args.calibrate.endswith(".json"):
                raise ValueError(f"--calibrate {args.calibrate}: the cluster file must end .json")
            from scripts.calibrate import calibrate, summary

            host = calibrate(cfg, seq, args.calibrate, progress)
            if sys.stderr.isatty():
                print(file=sys.stderr)  # end the progress line
            print(summary(host))
            return 0
        dry = args.dry_run is not None  # the trainer's fp32 and eager attention
        precision = args.precision or ("bf16-fp32-grads" if production and not dry else "fp32")
        flash = (args.attention or ("flash" if production and not dry else "eager")) == "flash"
        if dry and (precision != "fp32" or flash or args.framework not in (None, "scaletorch")
                    or args.search):
            raise ValueError("--dry-run runs this repository's trainer on one layout: fp32 "
                             "(autocast has no meta device), eager attention (the trainer's), "
                             "no --search, --framework scaletorch")
        cluster = load_cluster(args.cluster)
        check = checker(cfg)
        if args.search and args.moe_imbalance != 1.0:
            raise ValueError("--moe-imbalance is one layout's (1 <= it <= its ep): plan that "
                             "layout without --search")
        if args.search:
            base = {
                "framework": args.framework or "scaletorch",
                "compiled": args.compile,
                "fp8": args.fp8
            }
            if base["framework"] == "torchtitan" and not args.precision:
                precision = "autocast"  # FSDP2's fp32 sharded states, bf16 compute
            best, rejected = search(model, gpus, cluster, tokens // seq, seq, precision, flash,
                                    check, args.top, base, search_progress())
            report(best, rejected, args.json)
            return 0
        cfg.data.seq_len, cfg.data.global_batch_size = seq, tokens // seq
        note = fill_pipeline(cfg, gpus, "--micro-batches" not in " ".join(rest), check, model)
        layout = layout_of(cfg, gpus, precision)
        framework = args.framework or "scaletorch"
        layout = with_split(
            PlanLayout(
                **{
                    **layout.as_dict(),
                    "flash_attention":
                    flash,
                    "framework":
                    framework,
                    "compiled":
                    args.compile,
                    "fp8":
                    args.fp8,
                    "moe_imbalance":
                    args.moe_imbalance,
                    "activation_checkpointing":
                    args.recompute or layout.activation_checkpointing,
                    # torchtitan's tensor parallel always shards the norms' sequence
                    "sequence_parallel":
                    layout.sequence_parallel or (framework == "torchtitan" and layout.tp > 1)
                }),
            model.num_layers)
        why = check(model, layout)
        if why is not None:
            raise ValueError(why)
        if dry:  # the ranks it names, before the plan is printed: one line, no plan above it
            stages(run_config(cfg, model, layout), gpus, args.dry_run)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    result = evaluate(model, layout, cluster)
    if note and not args.json:
        print(note)
    print(json.dumps({"layouts": [result]}, indent=1) if args.json else format_breakdown(result))
    if args.measure:
        print(measured_report(cfg, gpus, model, layout))
    if dry:
        try:
            print(
                dry_run_text(run_config(cfg, model, layout), gpus, args.dry_run,
                             moe_imbalance=args.moe_imbalance))
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    return 0


def fill_pipeline(cfg: Config, gpus: int, default: bool, check, model: ModelSpec) -> str:
    """With a pipeline and no --micro-batches: the fewest micro-batches that the layout check
    accepts (1F1B needs at least pp to fill the pipeline) and that divide the batch; returns
    the line that says so ("" if nothing was chosen)."""
    p = cfg.parallel
    pp = p.pipeline_model_parallel_size
    if not default or pp == 1 or cfg.data.num_micro_batches >= pp:
        return ""
    model_parallel = p.tensor_model_parallel_size * pp * p.context_parallel_size
    if gpus % model_parallel:
        return ""  # the layout check says why
    per_replica = cfg.data.global_batch_size // (gpus // model_parallel)
    for m in range(pp, per_replica + 1):
        if per_replica % m:
            continue
        cfg.data.num_micro_batches = m
        if check(model, with_split(layout_of(cfg, gpus), model.num_layers)) is None:
            return (f"micro-batches: {m}, the fewest that fill the {pp}-stage pipeline and "
                    f"divide the {per_replica} sequences of a replica (--micro-batches sets it)")
    cfg.data.num_micro_batches = 1
    return ""


def progress(line: str) -> None:
    """One line rewritten in place on a terminal, one line each in a log."""
    tty = sys.stderr.isatty()
    print(("\r\033[K" if tty else "") + line, end="" if tty else "\n", file=sys.stderr, flush=True)


def search_progress() -> Optional[Callable[[int, int], None]]:
    """On a terminal, a line every second once a search has run 10 s (a large world's search
    tries thousands of layouts); nothing in a log or a captured run, whose output stays the
    same from run to run."""
    if not sys.stderr.isatty():
        return None
    start = time.monotonic()
    last = [start + 9.0]

    def show(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] >= 1.0:
            last[0] = now
            progress(f"searching: {done:,} of {total:,} layouts, {now - start:.0f} s")
        if done == total - 1 and now - start >= 10.0:
            print(file=sys.stderr)  # end the progress line

    return show


def report(best: list, rejected: dict, as_json: bool) -> None:
    if as_json:
        print(
            json.dumps({
                "layouts": best,
                "rejected": rejected,
                "not_searched": NOT_SEARCHED
            }, indent=1))
        return
    layouts = [PlanLayout(**{k: r[k] for k in PlanLayout().as_dict()}) for r in best]
    width = max([56] + [len(lay.describe()) + 2 for lay in layouts])
    print(f"{'layout':<{width}}{'memory GB':>10}{'step s':>9}{'tokens/s/GPU':>14}{'MFU':>7}"
          f"{'bubble':>8}")
    for r, layout in zip(best, layouts):
        print(f"{layout.describe():<{width}}{r['memory_bytes']['total'] / 1e9:>10.1f}"
              f"{r['step_time_s']:>9.2f}{r['tokens_per_s_per_gpu']:>14,.0f}"
              f"{100 * r['mfu']:>6.1f}%{r['bubble']:>8.3f}")
    if not best:
        print("no layout fits")
    for family, why in rejected.items():
        print(f"rejected {family}: {why}")
    # on stderr: the table above stays one block (and doc/09's excerpts of it unchanged)
    print(
        f"not searched: the zero-bubble schedules ({', '.join(NOT_SEARCHED)}; their bubble is "
        f"simulated, up to seconds per layout): plan one with --schedule", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
