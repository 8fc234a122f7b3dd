"""`megatron-rails simulate run CONFIG [KEY=VALUE ...]`: iteration time per policy x comm (docs/simulator.md)."""
from __future__ import annotations

import dataclasses
import json
import sys

from ..core.errors import InputError
from .args import Default, float_range, in_file, int_range, plot_file
from .config import override_help
from ..core.policy import MAX_SLOTS
from ..sim.model import A2A_MODELS, MIN_MFU, OVERLAPS, WEIGHT_SYNCS
from ..sim.run import MAX_STEPS




def register_run(subparsers) -> None:
    from ..core.planners import POLICIES
    from ..core.policy import COMMS
    from ..core.workloads import COUNTS_FILES, SKEW_FORMS

    p = subparsers.add_parser(
        "run", help="iteration time of a run config per policy x comm (compute, all-to-all, weights, planner)",
        description="Simulate training iterations of a run config under each balancing policy and comm scheme: "
                    "expert compute on the busiest rank, token all-to-all, weight movement, measured planner "
                    "time and the dense part, on the config's topology (analytic; see docs/simulator.md).")
    p.add_argument("config", metavar="CONFIG", help="run config YAML, e.g. configs/mixtral/mixtral-8x7b.yaml")
    p.add_argument("overrides", nargs="*", default=[], metavar="KEY=VALUE",
                   help=override_help("topology=dgx-a100") + "; after the config (--set KEY=VALUE: anywhere)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a run-config override, as KEY=VALUE after the config (repeatable; default: none)")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"comma-separated policies ({', '.join(POLICIES)})")
    p.add_argument("--comm", default=",".join(COMMS), help=f"comma-separated comm schemes ({', '.join(COMMS)})")
    p.add_argument("--steps", type=int_range("--steps", 1, MAX_STEPS), default=5, help="simulated iterations")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--skew", default="zipf:1.2", help=f"synthetic routing: {SKEW_FORMS} (PATH: {COUNTS_FILES})")
    src.add_argument("--trace", type=in_file("--trace", f"a trace file ({COUNTS_FILES})"),
                     help=f"replay a counts trace ({COUNTS_FILES}) instead of the --skew workload (default: none)")
    p.add_argument("--trace-tokens", choices=("scale", "raw"), default=Default("scale"),
                   help="with --trace: scale: rescale each trace row to the config's tokens per rank; raw: as "
                        "recorded")
    p.add_argument("--seed", type=int_range("--seed", 0, 2**32 - 1), default=Default(0),
                   help="seed of the --skew workload (a --trace has its own counts)")
    p.add_argument("--slots", type=int_range("--slots", 0, MAX_SLOTS),
                   help="redundant slots per rank for every policy (default: the config's balancer)")
    p.add_argument("--mfu", type=float_range("--mfu", MIN_MFU, 1.0), default=0.5,
                   help="GEMM efficiency: achieved / peak gpu_tflops")
    p.add_argument("--overlap", choices=OVERLAPS, default="none",
                   help="none: everything in sequence; weights: weight movement hidden behind dense compute")
    p.add_argument("--weight-sync", choices=WEIGHT_SYNCS, default="iteration",
                   help="iteration: weights move once per iteration and stay for all its microbatches, as the "
                        "dispatcher does; microbatch: they move every microbatch (no resident slots)")
    p.add_argument("--a2a-model", choices=A2A_MODELS, default="fluid",
                   help="all-to-all time: fluid (pipelined) or phased (store-and-forward per phase)")
    p.add_argument("--dedup", choices=("on", "off"),
                   help="on: a token crosses to a remote node once, then fans out over NVLink to the ranks "
                        "serving its experts there; off: once per token-expert pair (matters only when the EP "
                        "group spans nodes; default: the config's balancer.dedup, true unless it is set)")
    p.add_argument("--json", action="store_true", help="print one JSON object (setup, options, assumptions, rows)")
    p.add_argument("--wide", action="store_true", help="every column of the table (wider than 80 characters)")
    p.add_argument("--plot", type=plot_file("--plot"), metavar="FILE",
                   help="write a figure of stacked bars per policy x comm, its format from the suffix (.png "
                        "without one; .pdf, .svg, ...) (default: no plot)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=cmd_run)


def run(args) -> dict:
    from ..config.run import load_run_config
    from ..sim.model import Setup, SimOptions
    from ..sim.run import Workload, check_names, planners_for, simulate_run

    if args.trace is None and "trace_tokens" not in args.unset:
        raise InputError("--trace-tokens says how to replay a --trace: give --trace FILE, or drop --trace-tokens")
    if args.trace is not None and "seed" not in args.unset:
        raise InputError("--seed draws the --skew workload; a --trace replays its own counts: drop --seed")
    if args.trace is None and "seed" not in args.unset:
        from ..core.workloads import parse_skew

        if parse_skew(args.skew).kind == "file":  # a malformed --skew is left to the workload's own message
            raise InputError(f"--skew {args.skew} fixes the routing, so --seed would change nothing (only a "
                             "generated --skew workload reads it): drop --seed")
    policies, comms = check_names(args.policies, args.comm)  # fail before loading anything
    if args.slots is not None and set(policies) == {"none"}:
        raise InputError(f"--slots {args.slots} would change nothing with --policies none (it keeps the stock "
                         "layout, no redundant slots); drop --slots")
    SimOptions(mfu=args.mfu, overlap=args.overlap, a2a_model=args.a2a_model, weight_sync=args.weight_sync)
    rc = load_run_config(args.config, [*args.overrides, *args.set])
    setup = Setup.from_run_config(rc, args.slots)
    # each policy can run on the slots (--slots, else the config's): said before any output
    planners_for(setup, policies, slots_flag=args.slots is not None)
    dedup = args.dedup == "on" if args.dedup else bool(getattr(setup.policy, "dedup", True))
    opts = SimOptions(mfu=args.mfu, overlap=args.overlap, a2a_model=args.a2a_model, weight_sync=args.weight_sync,
                      dedup=dedup)
    if args.trace:
        from ..core.trace import load_trace

        counts, _ = load_trace(args.trace)
        wl = Workload(setup, trace=counts, trace_path=args.trace, raw=args.trace_tokens == "raw", seed=args.seed)
    else:
        wl = Workload(setup, skew=args.skew, seed=args.seed)

    def progress(done, total, elapsed, layers=None):
        if not args.quiet:
            where = (f"step {done}/{total}" if layers is None else
                     f"step {done + 1}/{total}: layer {layers}/{setup.layers}")
            print(f"simulate run: {where} ({setup.layers} layers x {len(policies)} policies), "
                  f"{elapsed:.1f} s", file=sys.stderr, flush=True)

    if not args.quiet:
        import shutil
        import textwrap

        head = (f"simulate run: {args.config}: EP{setup.ep} on {setup.ep_topo.nodes} node(s) of "
                f"{setup.topology.name}, {setup.layers} layers, {args.steps} step(s), workload {wl.describe()}"
                + (f", dedup {'on' if dedup else 'off'}" if setup.ep_topo.nodes > 1 else ""))
        width = shutil.get_terminal_size((80, 24)).columns  # COLUMNS, else the terminal's, else 80
        print(textwrap.fill(head, max(width, 40), subsequent_indent="  ", break_on_hyphens=False),
              file=sys.stderr, flush=True)
    result = simulate_run(setup, opts, policies, comms, args.steps, wl, progress)
    from ..sim.memory import memory_rows

    result["memory"] = memory_rows(rc, {p: dataclasses.replace(setup.policy, policy=p) for p in policies})
    return result


def cmd_run(args) -> int:
    from ..sim.report import plot, print_memory, print_table
    from .args import no_table_with_json

    no_table_with_json(args)
    result = run(args)
    if args.plot:
        result["plot"] = args.plot
    if args.json:  # the results first: a figure that fails loses none of them
        print(json.dumps(result), flush=True)
    else:
        print_table(result, wide=args.wide)
        print_memory(result)
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
