"""`megatron-rails` command line: plan, bench, simulate, trace, soak, demo, config.

Every command checks its arguments before it works: a bad one exits 2 with one line naming it and what
is allowed (`main` turns the package's input errors into that line; anything else is a bug and keeps its
traceback). An option that would have no effect is refused too, where it was typed (args.unset: the
options left at their default)."""
from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import warnings

from ..core.errors import ChildFailed, InputError, PlanError
from ..core.limits import MAX_RANKS
from ..core.outfile import WriteError
from ..core.step_workloads import WORKLOADS as STEP_WORKLOADS
from .args import (CliParser, Default, discard, divisor_of, error_text, escaped, fill_defaults, flag_error, float_range,
                   in_file, int_range, out_file, plot_file, workload_list)

# bounds far beyond real expert parallelism, there so that a typo fails here and not in numpy
MAX_TOKENS = 1 << 20     # tokens per rank per step
MAX_SEED = 2**32 - 1
DEFAULT_RANKS, DEFAULT_EXPERTS = 8, 8
DEMO_EXPERTS = 8         # the demo and soak models' experts: their EP size must divide them
STEP_EXPERTS = 8         # bench step's layers' experts (bench/step.py's SHAPE, which a test compares)
DEMO_STEPS, DEMO_MICROBATCHES, DEMO_PLOT = 20, 4, "demo-imbalance.png"
BENCH_SHAPES = ("mixtral-8x7b", "mixtral-8x22b", "tiny")  # bench/local.py SHAPES (not imported: torch)
BENCH_DTYPES = ("bfloat16", "float16", "float32")         # bench/local.py DTYPES
# the errors a user can fix from the message alone; OSError subclasses: paths given on the command line
USER_ERRORS = (InputError, PlanError, ChildFailed, FileNotFoundError, IsADirectoryError, NotADirectoryError,
               PermissionError)
BAD_NAME_ERRNOS = (errno.ENAMETOOLONG, errno.ELOOP)  # OSErrors that say a path itself is wrong


def _add_workload_args(p) -> None:
    from ..core.policy import MAX_EXPERTS, MAX_SLOTS
    from ..core.workloads import COUNTS_FILES, SKEW_FORMS

    p.add_argument("--ranks", type=int_range("--ranks", 1, MAX_RANKS),
                   help=f"expert-parallel size D (default: {DEFAULT_RANKS}; with --counts: the file's)")
    p.add_argument("--experts", type=int_range("--experts", 1, MAX_EXPERTS),
                   help=f"number of experts E (default: {DEFAULT_EXPERTS}; with --counts: the file's)")
    # Default(...): these shape a generated workload only; typed beside --counts they are refused
    p.add_argument("--topk", type=int_range("--topk", 1, MAX_EXPERTS), default=Default(2), help="experts per token")
    p.add_argument("--tokens-per-rank", type=int_range("--tokens-per-rank", 1, MAX_TOKENS), default=Default(4096),
                   help="tokens each rank routes per step")
    p.add_argument("--slots", type=int_range("--slots", 0, MAX_SLOTS), default=Default(1),
                   help="R: expert slots per rank beyond ceil(E/D) (redundant replicas; fsep uses ceil(E/D)+R; "
                        "eplb, ultraep and lp need >= 1; none places none)")
    p.add_argument("--ranks-per-node", type=int_range("--ranks-per-node", 1, MAX_RANKS), default=Default(8),
                   help="ranks sharing a node (G): a divisor of D, or >= D for one node")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--skew", default="zipf:1.2", help=f"synthetic routing: {SKEW_FORMS} (PATH: {COUNTS_FILES})")
    src.add_argument("--counts", type=in_file("--counts", f"a counts file ({COUNTS_FILES})"),
                     help=f"a saved counts matrix instead of a generated one: {COUNTS_FILES}; [D,E], or the first "
                          "of [steps,D,E], [steps,layers,D,E] (default: none, the --skew workload)")
    p.add_argument("--seed", type=int_range("--seed", 0, MAX_SEED), default=Default(0), help="workload seed")


def _counts_from_args(args):
    from ..core.workloads import WorkloadSpec, counts

    if args.counts is not None:
        return _counts_file(args)
    E, D = args.experts or DEFAULT_EXPERTS, args.ranks or DEFAULT_RANKS
    if args.topk > E:
        raise InputError(f"--topk {args.topk}: more than the {E} experts (--experts)")
    _megatron_shape(D, E, f"--experts {E}", f"--ranks {D}")
    spec = WorkloadSpec(num_ranks=D, num_experts=E,
                        topk=args.topk, tokens_per_rank=args.tokens_per_rank, skew=args.skew, seed=args.seed)
    return counts(spec)


def _megatron_shape(D: int, E: int, experts: str, ranks: str) -> None:
    """Refuse a shape no Megatron run has: Megatron-Core gives every expert-parallel rank the same
    number of experts (num_moe_experts % expert_model_parallel_size == 0; run configs refuse it
    alike). The planners themselves take any shape (the simulator lays Mixtral's 8 experts over
    16 GPUs)."""
    if E % D:
        raise InputError(f"{experts} is not divisible by {ranks}: Megatron-Core splits the experts evenly "
                         f"over the expert-parallel ranks; use a multiple of {D} experts or a divisor of {E} ranks")


def _counts_file(args):
    """The first [D, E] matrix of --counts (the loaders say what is wrong with a missing, directory,
    pipe or malformed file); --ranks / --experts, if given, must agree with it."""
    from ..core.policy import MAX_EXPERTS
    from ..core.trace import load_trace

    c = load_trace(args.counts)[0][0, 0]  # every counts format and the trace .npz, as [steps, layers, D, E]
    for flag, n, most in (("ranks", c.shape[0], MAX_RANKS), ("experts", c.shape[1], MAX_EXPERTS)):
        if n > most:  # the bounds --ranks and --experts have
            raise InputError(f"--counts {args.counts}: {n} {flag}; at most {most}")
    for flag, given, got in (("--ranks", args.ranks, c.shape[0]), ("--experts", args.experts, c.shape[1])):
        if given is not None and given != got:
            raise InputError(f"{flag} {given} disagrees with --counts {args.counts}, which is [D={c.shape[0]}, "
                             f"E={c.shape[1]}]; drop {flag} or give a matching file")
    _megatron_shape(c.shape[0], c.shape[1], f"--counts {args.counts} has E={c.shape[1]} experts, which",
                    f"its D={c.shape[0]} ranks")
    if not c.any():  # every figure would compare idle ranks (simulate run --trace refuses it alike)
        raise InputError(f"--counts {args.counts}: every count is 0 (in the first [D, E] matrix, the one plan "
                         "reads); there are no tokens to plan")
    return c


# which policies read each of plan's policy options (core/planners/base.py PlannerConfig):
# policy, placement -> whether it does
_HISTORY_USERS = ("eplb, and lp on --placement eplb", lambda p, pl: p == "eplb" or (p == "lp" and pl == "eplb"))
PLAN_OPTION_USERS = {
    "slots": ("eplb, ultraep, lp and fsep", lambda p, pl: p != "none"),  # none keeps the stock layout
    "window": _HISTORY_USERS,  # eplb's history
    "interval": _HISTORY_USERS,
    "placement": ("lp", lambda p, pl: p == "lp"),
    "tolerance": ("eplb, ultraep, fsep and lp (not on --placement static)",
                  lambda p, pl: p not in ("none", "lp") or (p == "lp" and pl != "static")),
}


def _plan_ignored_options(args) -> None:
    """Refuse a typed option the plan would not use: the workload's shape beside --counts (the file
    fixes it), a policy option the chosen policy does not read."""
    from ..core.workloads import parse_skew

    typed = [k for k in ("topk", "tokens_per_rank", "seed") if k not in args.unset]
    skew = getattr(args, "skew", None)
    fixed = (f"--counts {args.counts}" if args.counts is not None else
             f"--skew {skew}" if isinstance(skew, str) and parse_skew(skew).kind == "file" else None)
    if fixed and typed:
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in typed)
        them = "them" if len(typed) > 1 else "it"
        raise InputError(f"{fixed} fixes the routing, so {flags} would change nothing (only a "
                         f"generated --skew workload reads {them}): drop {flags}")
    for key, (users, uses) in PLAN_OPTION_USERS.items():
        if key not in args.unset and not uses(args.policy, args.placement):
            raise InputError(f"--{key} would change nothing with --policy {args.policy}{_placement(args)}: only "
                             f"{users} use it; drop --{key}")


def _placement(args) -> str:
    return f" --placement {args.placement}" if args.policy == "lp" else ""


def _plan_policy_check(args) -> None:
    """The rules a policy file would get (slots a policy needs, placement, tolerance), as flag errors."""
    from ..core.policy import ConfigError, PolicyConfig

    try:
        PolicyConfig(policy=args.policy, slots=args.slots, window=args.window, interval=args.interval,
                     placement=args.placement, tolerance=args.tolerance)
    except ConfigError as err:
        raise InputError(flag_error(err)) from None


def _node_size_check(G: int, D: int, typed: bool) -> None:
    """G ranks per node must divide the D ranks, or hold them all (G >= D: one node). Said of the
    default 8 as the default, with what to pass, when --ranks-per-node was not typed."""
    if G < D and D % G:
        fits = ", ".join(str(g) for g in range(1, D) if D % g == 0)
        what = f"--ranks-per-node {G}" if typed else f"--ranks-per-node is {G} by default, which"
        raise InputError(f"{what} must divide the {D} ranks or be >= {D} (one node): pass --ranks-per-node "
                         f"{fits} or {D}")


def cmd_plan(args) -> int:
    from ..core.planners import PlannerConfig
    from ..bench.measure import measure, pin_one_core

    _plan_ignored_options(args)
    _plan_policy_check(args)
    counts = _counts_from_args(args)
    D, E = counts.shape
    _node_size_check(args.ranks_per_node, D, "ranks_per_node" not in args.unset)
    pin_one_core()
    cfg = PlannerConfig(D, E, args.ranks_per_node, args.slots, window=args.window, interval=args.interval,
                        placement=args.placement, tolerance=args.tolerance)
    row = measure(args.policy, cfg, counts, min_reps=args.repeats, budget_s=args.budget)
    if args.json:
        print(json.dumps(row))
        return 0
    from ..sim.term import console, table

    t = table(f"megatron-rails plan: {args.policy}, D={D}, E={E}, R={args.slots}", ["figure", "value"],
              left=("figure",))
    for k, v in row.items():
        t.add_row(k, f"{v:.4f}" if isinstance(v, float) else str(v))
    console(t).print(t)
    return 0


# what each benchmark measures, in a phrase (bench --help)
BENCH_MEASURES = {"planners": "plan() time and balance of every policy over EP sizes, experts, skews",
                  "dispatcher": "one MoE layer's forward+backward per policy on gloo ranks",
                  "rails": "direct vs ecmp vs RailS all-to-all time in the flow model",
                  "local": "one rank's local token work vs Megatron-Core's permute/unpermute",
                  "step": "training-step time per policy against stock, on routing workloads"}
# the options each benchmark takes beyond --out and --quick (an option it would ignore is refused)
BENCH_OPTIONS = {"planners": ("plot",), "dispatcher": (), "rails": ("plot",),
                 "local": ("device", "shape", "dtype", "rounds"), "step": ("plot", "ranks", "microbatches", "rounds", "workloads",
                                                                   "trace", "record")}


def _bench_args(args) -> None:
    """Refuse options the chosen benchmark does not take, and a figure that would overwrite --out;
    fill in the defaults of those it takes. A figure's default name is --out's with .png; where --out
    is no file (/dev/stdout, a pipe), there is no default figure (plot False) unless --plot names one."""
    ignored = [f"--{k}" for k in ("plot", "device", "shape", "dtype", "ranks", "microbatches", "rounds", "workloads",
                                  "trace", "record")
               if getattr(args, k) is not None and k not in BENCH_OPTIONS[args.what]]
    if ignored:
        takes = ", ".join(f"--{k}" for k in BENCH_OPTIONS[args.what]) or "no options but --out and --quick"
        raise InputError(f"bench {args.what} does not take {', '.join(ignored)} (it takes {takes})")
    if "plot" in BENCH_OPTIONS[args.what]:
        from ..core.outfile import writes_in_place

        if args.plot is None and writes_in_place(args.out):
            args.plot = False
            print(f"bench {args.what}: no figure (--out {args.out} is no file to put one beside; give --plot FILE "
                  "for one)", file=sys.stderr)
            return _bench_defaults(args)
        png = args.plot or os.path.splitext(args.out)[0] + ".png"
        if os.path.abspath(png) == os.path.abspath(args.out):
            raise InputError(f"--out {args.out}: the figure would overwrite the results; give --out a .json "
                             "name, or --plot another file")
        if args.plot is None:  # the default figure: checked before the work, as a given --plot is
            try:
                args.plot = plot_file("--plot")(png)
            except argparse.ArgumentTypeError as err:
                raise InputError(f"{err} (the figure's default, beside --out; give --plot elsewhere)") from None
    if args.what in ("planners", "rails"):
        from ..core.outfile import writes_in_place

        if not writes_in_place(args.out):  # the results so far are kept beside --out while it runs
            try:
                out_file(f"--out {args.out}: the copy of the results so far,")(f"{args.out}.partial")
            except argparse.ArgumentTypeError as err:
                raise InputError(str(err)) from None
    _bench_defaults(args)


def _bench_defaults(args) -> None:
    for k, default in (("device", "cpu"), ("shape", "tiny" if args.quick else "mixtral-8x7b"), ("dtype", "bfloat16"),
                       ("ranks", 2), ("microbatches", 4 if args.quick else 8)):
        if getattr(args, k) is None:
            setattr(args, k, default)


def cmd_bench(args) -> int:
    from ..bench import planners as benchmarks

    _bench_args(args)
    if args.what == "planners":
        benchmarks.bench_planners(args.out, quick=args.quick, plot=args.plot)
        return 0
    if args.what == "dispatcher":
        from ..bench.dispatcher import bench_dispatcher

        bench_dispatcher(args.out, **(dict(reps=2, warmup=1, quick=True) if args.quick else {}))
        return 0
    if args.what == "rails":
        from ..bench.rails import bench_rails

        bench_rails(args.out, quick=args.quick, plot=args.plot)
        return 0
    if args.what == "local":
        from ..bench.local import bench_local

        bench_local(args.out, shape_name=args.shape, device=args.device,
                    dtype=args.dtype, reps=args.rounds or (5 if args.quick else 200))
        return 0
    if args.what == "step":
        _cores_check(args.ranks)  # before importing Megatron, whose import warnings would bury the message
        from ..bench.step import BenchError, bench_step

        try:
            bench_step(args.out, ranks=args.ranks, microbatches=args.microbatches, quick=args.quick, plot=args.plot,
                       reps=args.rounds, workloads=args.workloads, trace=args.trace, record=bool(args.record))
        except BenchError as err:  # bad arguments, found before any rank starts
            raise InputError(str(err)) from None
        return 0
    raise AssertionError(f"unknown benchmark {args.what!r}")  # argparse's choices make this unreachable


def _cores_check(ranks: int) -> None:
    from ..core.limits import cores_for_ranks

    try:
        cores_for_ranks(ranks)
    except ValueError as e:
        raise InputError(str(e)) from None


def cmd_demo(args) -> int:
    training = {"--config": args.config, "--steps": args.steps, "--microbatches": args.microbatches,
                "--ranks": args.ranks, "--plot": args.plot}
    if args.planners:
        given = [flag for flag, v in training.items() if v is not None]
        if given:
            raise InputError(f"--planners compares planners without training: drop {', '.join(given)}")
        from ..bench.planners import planner_demo

        return planner_demo(json_out=args.json)
    from ..demo.run import run_demo

    if args.config is not None:  # read as `config validate` reads a policy file: the same words for its errors
        from ..config.run import load_policy

        load_policy(args.config)
    png = args.plot
    if png is None:  # the default, in the working directory: checked as a given --plot would be
        try:
            png = plot_file("--plot")(DEMO_PLOT)
        except argparse.ArgumentTypeError as err:
            raise InputError(f"{err} (the default; give --plot elsewhere)") from None
    return run_demo(args.config, steps=args.steps or DEMO_STEPS, ranks=args.ranks, json_out=args.json, png=png,
                    microbatches=args.microbatches or DEMO_MICROBATCHES)


def _version() -> str:
    from .. import __version__

    return f"megatron-rails {__version__}"


def _add_plan(sub) -> None:
    from ..core.planners import POLICIES
    from ..core.planners.lp import PLACEMENTS

    p = sub.add_parser("plan", help="plan one counts matrix with one policy and report balance and latency")
    p.add_argument("--policy", required=True, choices=POLICIES, help="the planner")
    _add_workload_args(p)
    # Default(...): each is refused where typed for a policy that does not read it (PLAN_OPTION_USERS)
    p.add_argument("--window", type=int_range("--window", 1, 1 << 20), default=Default(10),
                   help="eplb: moving-average window (steps)")
    p.add_argument("--interval", type=int_range("--interval", 1, 1 << 20), default=Default(10),
                   help="eplb: re-plan period (steps)")
    p.add_argument("--placement", default=Default("ultraep"), choices=PLACEMENTS,
                   help="lp: the placement it schedules on")
    p.add_argument("--tolerance", type=float_range("--tolerance", 0.0, 1.0), default=Default(0.0),
                   help="owner-layout policies keep the stock layout while its max/mean is <= 1 + this "
                        "(0 here: the planner's exact behaviour; policy configs default to 0.05)")
    p.add_argument("--repeats", type=int_range("--repeats", 1, 2000), default=50,
                   help="minimum timed plan() calls (a plan makes as many as fit in --budget, up to 2000)")
    p.add_argument("--budget", type=float_range("--budget", 0.0, 3600.0), default=0.5,
                   help="seconds spent timing (at least --repeats calls)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan)


def _add_bench(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks; results as JSON (+ PNG)")
    b.add_argument("what", choices=list(BENCH_MEASURES),
                   help="which benchmark: " + "; ".join(f"{k}: {v}" for k, v in BENCH_MEASURES.items()))
    b.add_argument("--out", required=True, type=out_file("--out"),
                   help="JSON output file, written when the run ends (planners and rails keep what they have "
                        "measured in OUT.partial meanwhile)")
    b.add_argument("--plot", type=plot_file("--plot"),
                   help="planners, rails, step: the figure (default: --out's name with .png; none where --out is "
                        "a device such as /dev/stdout)")
    b.add_argument("--quick", action="store_true", help="a small grid for smoke runs")
    b.add_argument("--device", help="local: torch device of the timed work (cpu, cuda, cuda:N; default: cpu)")
    b.add_argument("--shape", choices=BENCH_SHAPES, help="local: the layer shape (default: mixtral-8x7b, tiny with "
                   "--quick)")
    b.add_argument("--dtype", choices=BENCH_DTYPES, help="local: dtype of the hidden states (default: bfloat16)")
    b.add_argument("--ranks", type=divisor_of("--ranks", STEP_EXPERTS, "the step bench's experts"),
                   help="step: gloo ranks, one core each (= expert-parallel size, over the layers' 8 experts; at "
                        "most the cores; default: 2)")
    b.add_argument("--microbatches", type=int_range("--microbatches", 1, 1024),
                   help="step: microbatches per optimizer step (default: 8, 4 with --quick)")
    b.add_argument("--rounds", type=int_range("--rounds", 1, 1000), default=None,
                   help="step: timed rounds per workload (default 4, 1 with --quick); local: rounds per case "
                        "(default 200, 5 with --quick); more rounds, tighter medians")
    b.add_argument("--workloads", type=workload_list,
                   help=f"step: routing workloads, comma-separated (default: all: {', '.join(STEP_WORKLOADS)})")
    b.add_argument("--trace", type=in_file("--trace", "a trace (megatron-rails trace) or counts file"),
                   help="step: replay this recorded trace as the workload 'trace' (its proportions at the bench's "
                        "tokens; alone unless --workloads names others; default: none, the named workloads only)")
    b.add_argument("--record", action="store_const", const=True, default=None,
                   help="step: also time the default with the routing recorder on (policy key trace; the case "
                        "default+trace, the recorder's own ms per step; default: off)")
    b.set_defaults(func=cmd_bench)


def _run_soak(args) -> int:
    from ..reliability.soak import run_soak

    if args.planner_calls == 0 and args.steps == 0:  # "ok" after checking nothing would mislead
        raise InputError("--planner-calls 0 and --steps 0 skip both parts: nothing to soak")
    if args.steps == 0 and "ranks" not in args.unset:
        raise InputError(f"--ranks {args.ranks} sets the dispatcher soak's ranks, which --steps 0 skips: drop --ranks")
    return run_soak(args.planner_calls, args.steps, args.ranks, args.out, args.json)


def _add_soak(sub) -> None:
    k = sub.add_parser("soak", help="long-running reliability soak: planner calls and dispatcher parity steps")
    k.add_argument("--planner-calls", type=int_range("--planner-calls", 0, 10**7), default=2000,
                   help="planner calls per policy on a drifting workload (0: skip)")
    k.add_argument("--steps", type=int_range("--steps", 0, 10**6), default=200,
                   help="dispatcher steps compared with stock (0: skip)")
    k.add_argument("--ranks", type=divisor_of("--ranks", DEMO_EXPERTS, "the soak layer's experts"), default=Default(4),
                   help="gloo ranks of the dispatcher soak (= expert-parallel size, over the soak layer's 8 "
                        "experts)")
    k.add_argument("--out", type=out_file("--out"), help="write the result JSON here (default: not written)")
    k.add_argument("--json", action="store_true", help="print the result as one JSON object")
    k.set_defaults(func=_run_soak)


def _add_demo(sub) -> None:
    from ..core import presets

    d = sub.add_parser("demo", help="train a tiny Mixtral-shaped model on CPU ranks, one core each: stock "
                                    "Megatron-Core vs the configured policy")
    d.add_argument("--config", type=in_file("--config", "a policy YAML or a preset name"),
                   help="policy YAML or preset name (" + ", ".join(presets.names(presets.POLICY_DIR))
                   + "; default: the shipped default policy)")
    # defaults None (said in the help) so that --planners can tell what was given
    d.add_argument("--steps", type=int_range("--steps", 1, 10000), help=f"optimizer steps (default: {DEMO_STEPS})")
    d.add_argument("--microbatches", type=int_range("--microbatches", 1, 1024),
                   help=f"microbatches per optimizer step (accumulated; default: {DEMO_MICROBATCHES})")
    d.add_argument("--ranks", type=divisor_of("--ranks", DEMO_EXPERTS, "the demo model's experts"),
                   help="CPU ranks (= expert-parallel size, over the model's 8 experts; default: the cores, at "
                        "least 2 and at most 4; every rank on a core of its own where the cores suffice)")
    d.add_argument("--plot", type=plot_file("--plot"),
                   help=f"figure of imbalance per step, its format from the suffix (.png without one; .pdf, "
                        f".svg, ...) (default: {DEMO_PLOT})")
    d.add_argument("--planners", action="store_true", help="instead: compare every planner on skewed steps "
                   "(planning only: takes none of the training options)")
    d.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    d.set_defaults(func=cmd_demo)


def build_parser() -> CliParser:
    parser = CliParser(prog="megatron-rails", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_plan(sub)
    _add_bench(sub)
    s = sub.add_parser("simulate", help="simulators: all-to-all on a rail topology (a2a), iteration time (run)")
    from . import sim as cli_sim

    cli_sim.register(s.add_subparsers(dest="what", required=True, metavar="SIMULATOR"))
    cli_sim.register_trace(sub)
    _add_soak(sub)
    _add_demo(sub)
    from .config import register as register_config

    register_config(sub)
    return parser


def report(prog: str, err: BaseException, args=None) -> None:
    """The one place input errors become `PROG: error: ...` lines on stderr: one per problem (a config
    file lists each of its problems on its own line; a failed run adds its output's tail). An argument
    with a newline or other control character in it (a path) is shown escaped, as Python writes it in
    quotes, so that it cannot split its line."""
    text = escaped("\n".join(getattr(err, "errors", None) or [str(err)]), _typed_strings(args))
    lines = text.splitlines() or [type(err).__name__]
    print(error_text(prog, lines[0]), file=sys.stderr)
    for line in lines[1:]:  # a failed run's output tail as it came
        print(line if isinstance(err, ChildFailed) else error_text(prog, line), file=sys.stderr)


def _typed_strings(args) -> list[str]:
    """Every string argument of the command (lists of them too)."""
    found = []
    for v in vars(args).values() if args is not None else ():
        found += [x for x in (v if isinstance(v, list) else [v]) if isinstance(x, str)]
    return found


def _named_by(args, typed: list, filename) -> str | None:
    """'--flag ' (or 'KEY=' for an override, '' for a positional argument) of the argument that
    named `filename`, or None where no argument did (a file named after another, as OUT.partial);
    typed: the command line as given (a flag abbreviated as argparse allows counts; an option left
    at its default is named too)."""
    from ..core.workloads import WorkloadError, parse_skew

    if args is None or not filename:
        return None
    for k, v in vars(args).items():
        for x in (v if isinstance(v, list) else [v]):
            if not isinstance(x, str):
                continue
            try:
                skew = parse_skew(x) if k == "skew" else None
            except WorkloadError:
                skew = None
            same = x == filename or os.path.abspath(x) == os.path.abspath(filename)
            if same or (skew is not None and skew.kind == "file" and skew.path == filename):
                flag = f"--{k.replace('_', '-')}"
                said = any(t.startswith("--") and len(t) > 2 and flag.startswith(t.split("=", 1)[0]) for t in typed)
                return f"{flag} " if said or k in getattr(args, "unset", ()) else ""
            key, eq, val = x.partition("=")
            if eq and val == filename:
                return f"{key}="
    return None


def main(argv=None) -> int:
    # Megatron-Core says at import which GPU extras (Apex, Transformer Engine) it falls back from and
    # which of its config fields are deprecated: noise beside these tools' own CPU models
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron(\.core|_fsdp)")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    prog = getattr(args, "command_prog", parser.prog)
    if extra:
        if isinstance(getattr(args, "overrides", None), list):
            # KEY=VALUE overrides after an option, which argparse leaves over: only the rest is unknown
            override = {a: "=" in a and not a.startswith("-") for a in extra}
            args.overrides += [a for a in extra if override[a]]
            extra = [a for a in extra if not override[a]]
        if extra:  # the subcommand's own name and --help, not the top level's
            print(error_text(prog, f"unrecognized arguments: {' '.join(extra)} (see {prog} --help)"), file=sys.stderr)
            return 2
    args.unset = fill_defaults(args)
    typed = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C: the user knows why; a traceback would only bury the prompt
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except WriteError as err:  # a result file could not be written (what was there before is kept)
        named = _named_by(args, typed, err.filename) or ""  # none for a file named after another
        report(prog, InputError(f"{named}{err.filename}: {err.strerror}"), args)
        return 1
    except USER_ERRORS as err:
        if isinstance(err, OSError) and err.filename and err.strerror:  # "FILE: reason", and which flag named it
            err = InputError(f"{_named_by(args, typed, err.filename) or ''}{err.filename}: {err.strerror}")
        report(prog, err, args)
        return 2
    except MemoryError as err:  # sizes within every flag's bounds can still outgrow this machine together
        report(prog, InputError(f"out of memory ({str(err) or 'an allocation failed'}); try smaller sizes"))
        return 2
    except BrokenPipeError:
        discard(sys.stdout)  # the reader left (`... | head`): stop quietly
        return 1
    except OSError as err:
        named = _named_by(args, typed, err.filename)
        if err.errno in BAD_NAME_ERRNOS and named is not None:  # a path no file can have: bad input
            report(prog, InputError(f"{named}{err.filename}: {err.strerror}"), args)
            return 2
        # the machine refused a write or read the arguments could not foresee (disk full, a device
        # file): one line, as for bad input, with the operating system's reason
        where = f": {err.filename}" if err.filename else ""
        report(prog, OSError(f"{err.strerror or err}{where}"), args)
        return 1


if __name__ == "__main__":
    sys.exit(main())
