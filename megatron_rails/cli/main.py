"""`megatron-rails` command line: plan, bench, demo, config."""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from ..core.plan import PlanError


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=8, help="expert-parallel size D")
    p.add_argument("--experts", type=int, default=8, help="number of experts E")
    p.add_argument("--topk", type=int, default=2, help="experts per token")
    p.add_argument("--tokens-per-rank", type=int, default=4096, help="tokens each rank routes per step")
    p.add_argument("--slots", type=int, default=1,
                   help="R: expert slots per rank beyond ceil(E/D) (redundant replicas; fsep uses ceil(E/D)+R)")
    p.add_argument("--ranks-per-node", type=int, default=8, help="ranks sharing a node (G)")
    p.add_argument("--skew", default="zipf:1.2",
                   help="uniform | zipf:S | drift:S[:P] | bursty:S[:F] | one | file:PATH")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--counts", help="a saved counts matrix (.npy/.json, [D,E]) instead of a generated one")


def _counts_from_args(args) -> np.ndarray:
    from ..core.workloads import WorkloadSpec, counts, load_counts

    if args.counts:
        c = load_counts(args.counts)
        while c.ndim > 2:  # a trace: plan its first step and layer
            c = c[0]
        return c
    spec = WorkloadSpec(num_ranks=args.ranks, num_experts=args.experts, topk=args.topk,
                        tokens_per_rank=args.tokens_per_rank, skew=args.skew, seed=args.seed)
    return counts(spec)


def cmd_plan(args) -> int:
    from ..core.planners import PlannerConfig
    from ..bench.measure import measure, pin_one_core

    pin_one_core()
    counts = _counts_from_args(args)
    D, E = counts.shape
    cfg = PlannerConfig(D, E, args.ranks_per_node, args.slots, window=args.window, interval=args.interval,
                        placement=args.placement, tolerance=args.tolerance)
    row = measure(args.policy, cfg, counts, min_reps=args.repeats, budget_s=args.budget)
    if args.json:
        print(json.dumps(row))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"megatron-rails plan: {args.policy}, D={D}, E={E}, R={args.slots}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for k, v in row.items():
        table.add_row(k, f"{v:.4f}" if isinstance(v, float) else str(v))
    Console().print(table)
    return 0


def cmd_bench(args) -> int:
    from ..bench import planners as benchmarks

    if args.what == "planners":
        benchmarks.bench_planners(args.out, quick=args.quick, plot=args.plot)
        return 0
    if args.what == "dispatcher":
        from ..bench.dispatcher import bench_dispatcher

        bench_dispatcher(args.out, **(dict(reps=2, warmup=1) if args.quick else {}))
        return 0
    if args.what == "rails":
        from ..bench.rails import bench_rails

        bench_rails(args.out, quick=args.quick, plot=args.plot)
        return 0
    if args.what == "local":
        from ..bench.local import bench_local

        bench_local(args.out, shape_name="tiny" if args.quick else args.shape, device=args.device,
                    dtype=args.dtype, reps=5 if args.quick else 50)
        return 0
    if args.what == "step":
        from ..bench.step import BenchError, bench_step

        try:
            bench_step(args.out, ranks=args.ranks, microbatches=args.microbatches, quick=args.quick, plot=args.plot)
        except BenchError as err:
            raise SystemExit(f"megatron-rails bench step: {err}") from None
        return 0
    raise SystemExit(f"unknown benchmark {args.what!r}")


def cmd_demo(args) -> int:
    if args.planners:
        from ..bench.planners import planner_demo

        return planner_demo(json_out=args.json)
    from ..demo.run import run_demo

    return run_demo(args.config, steps=args.steps, ranks=args.ranks, json_out=args.json, png=args.plot,
                    microbatches=args.microbatches)


def build_parser() -> argparse.ArgumentParser:
    from ..core.planners import POLICIES

    parser = argparse.ArgumentParser(prog="megatron-rails", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="plan one counts matrix with one policy and report balance and latency")
    p.add_argument("--policy", required=True, choices=POLICIES)
    _add_workload_args(p)
    p.add_argument("--window", type=int, default=10, help="eplb: moving-average window (steps)")
    p.add_argument("--interval", type=int, default=10, help="eplb: re-plan period (steps)")
    p.add_argument("--placement", default="ultraep", help="lp: placement to schedule on (static|eplb|ultraep|fsep)")
    p.add_argument("--tolerance", type=float, default=0.0,
                   help="owner-layout policies keep the stock layout while its max/mean is <= 1 + this "
                        "(default 0 here: the planner's exact behaviour; policy configs default to 0.05)")
    p.add_argument("--repeats", type=int, default=50, help="minimum timed plan() calls")
    p.add_argument("--budget", type=float, default=0.5, help="seconds spent timing (at least --repeats calls)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan)

    b = sub.add_parser("bench", help="benchmarks; results as JSON (+ PNG)")
    b.add_argument("what", choices=["planners", "dispatcher", "rails", "local", "step"])
    b.add_argument("--out", required=True, help="JSON output file")
    b.add_argument("--plot", help="PNG output (default: next to --out)")
    b.add_argument("--quick", action="store_true", help="a small grid for smoke runs")
    b.add_argument("--device", default="cpu", help="local: torch device of the timed work (cpu, cuda)")
    b.add_argument("--shape", default="mixtral-8x7b", help="local: mixtral-8x7b | mixtral-8x22b | tiny")
    b.add_argument("--dtype", default="bfloat16", help="local: dtype of the hidden states")
    b.add_argument("--ranks", type=int, default=2, help="step: gloo ranks, one core each (at most the cores)")
    b.add_argument("--microbatches", type=int, default=8, help="step: microbatches per optimizer step")
    b.set_defaults(func=cmd_bench)

    s = sub.add_parser("simulate", help="simulators: all-to-all on a rail topology (a2a), iteration time (run)")
    from . import sim as cli_sim

    cli_sim.register(s.add_subparsers(dest="what", required=True))
    cli_sim.register_trace(sub)

    k = sub.add_parser("soak", help="long-running reliability soak: planner calls and dispatcher parity steps")
    k.add_argument("--planner-calls", type=int, default=2000, help="planner calls per policy (drifting workload)")
    k.add_argument("--steps", type=int, default=200, help="dispatcher steps compared with stock (0: skip)")
    k.add_argument("--ranks", type=int, default=4)
    k.add_argument("--out", help="write the result JSON here")
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=lambda a: __import__("megatron_rails.reliability.soak", fromlist=["run_soak"]).run_soak(
        a.planner_calls, a.steps, a.ranks, a.out, a.json))
    d = sub.add_parser("demo", help="train a tiny Mixtral-shaped model on CPU ranks, one core each: none vs the "
                                    "configured policy")
    d.add_argument("--config", help="policy YAML or preset name (default: the shipped default policy)")
    d.add_argument("--steps", type=int, default=20, help="optimizer steps")
    d.add_argument("--microbatches", type=int, default=4, help="microbatches per optimizer step (accumulated)")
    d.add_argument("--ranks", type=int, help="CPU ranks (= expert-parallel size; divides 8 experts; default: "
                                             "min(4, cores), every rank on a core of its own)")
    d.add_argument("--plot", default="demo-imbalance.png", help="PNG of imbalance per step")
    d.add_argument("--planners", action="store_true", help="instead: compare every planner on skewed steps")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_demo)

    from .config import register as register_config

    register_config(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (PlanError, ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"megatron-rails {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
