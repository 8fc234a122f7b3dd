"""`megatron-rails simulate a2a`: all-to-all completion of direct, ecmp and RailS on a rail topology.

`register(subparsers)` adds the `a2a` command (and `run`, the iteration-time simulator of cli/sim_run.py)
to the `simulate` group's sub-parsers (cli.py); `register_trace` adds the top-level `trace` command.
"""
from __future__ import annotations

import json

from ..core.errors import InputError
from ..core.policy import MAX_SLOTS
from .args import Default, divisor_of, fill_defaults, int_range, no_table_with_json, out_file

MAX_WORLD = 2048  # GPUs of one simulated all-to-all: its flow model holds [D, D] matrices per rail


def register(subparsers) -> None:
    from ..core.planners import POLICIES
    from ..core.policy import PolicyConfig
    from ..core.topology import presets
    from ..sim.dedup import DEDUP_MODES
    from ..sim.traffic import DEFAULT_SKEW, SKEW_HERE, TRAFFIC_FORMS

    p = subparsers.add_parser(
        "a2a", help="flow-level all-to-all completion of direct (PXN), ecmp and rails on a topology",
        description="Simulate one dispatch all-to-all under three routing schemes (fluid model, see docs/rails.md).")
    p.add_argument("--topology", default="dgx-h100", help=f"preset name ({', '.join(presets())}) or a YAML path")
    p.add_argument("--nodes", type=int_range("--nodes", 1, MAX_WORLD), required=True,
                   help=f"number of nodes; at most {MAX_WORLD} GPUs in all")
    p.add_argument("--traffic", default="zipf:1.2",
                   help=f"traffic family: {TRAFFIC_FORMS}; SKEW: {SKEW_HERE} ({DEFAULT_SKEW} if left out); "
                        f"POLICY: {', '.join(POLICIES)} ({PolicyConfig().policy} if left out) (default: %(default)s)")
    p.add_argument("--tokens-per-rank", type=int_range("--tokens-per-rank", 1, 1 << 20), default=4096,
                   help="tokens each rank routes (before top-k)")
    p.add_argument("--hidden", type=int_range("--hidden", 1, 1 << 16), help="hidden size (default: the family's)")
    p.add_argument("--experts", type=int_range("--experts", 1, 4096), help="number of experts (default: the family's)")
    p.add_argument("--topk", type=int_range("--topk", 1, 4096), help="experts per token (default: the family's)")
    p.add_argument("--dtype-bytes", type=int_range("--dtype-bytes", 1, 8), default=2, help="bytes per element (bf16: 2)")
    p.add_argument("--slots", type=int_range("--slots", 0, MAX_SLOTS), default=Default(1),
                   help="R for the planner of plan/mixtral/deepseek traffic (a policy other than none)")
    p.add_argument("--seed", type=int_range("--seed", 0, 2**32 - 1), default=0, help="workload seed")
    p.add_argument("--dedup", choices=DEDUP_MODES, default="off",
                   help="token dedup across nodes: off = the family's pair traffic (count-level); on = a token-level "
                        "sample of the family, each token sent once to every remote node holding one of its experts "
                        "(to the rank with its local index there), then fanned out over NVLink; both = that sample "
                        "without and with dedup. Any policy (its plan routes each pair); at most 2^26 token-expert "
                        "pairs (docs/rails.md)")
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per scheme (and mode)")
    p.add_argument("--wide", action="store_true", help="every column of the table (wider than 80 characters)")
    p.set_defaults(func=cmd_a2a)

    from .sim_run import register_run

    register_run(subparsers)


def register_trace(subparsers) -> None:
    """The top-level `megatron-rails trace` command (megatron_rails/demo/trace.py does the work)."""
    from ..core.planners import POLICIES

    p = subparsers.add_parser("trace", help="record per-layer routing counts of the CPU demo for simulate run --trace",
                              description="Train the tiny CPU demo model on gloo ranks with the routing recorder on and "
                                          "save counts [steps, layers, ranks, experts] (docs/simulator.md).")
    p.add_argument("--out", required=True, type=out_file("--out"),
                   help="trace file: .npz (counts + metadata), .npy or .json")
    p.add_argument("--steps", type=int_range("--steps", 1, 10000), default=10, help="training steps to record")
    p.add_argument("--policy", default="none", choices=POLICIES, help="policy the demo trains with")
    p.add_argument("--ranks", type=divisor_of("--ranks", 8, "the demo model's experts"), default=4,
                   help="gloo ranks = expert-parallel size, over the demo model's 8 experts")
    p.add_argument("--slots", type=int_range("--slots", 0, MAX_SLOTS), default=Default(2),
                   help="redundant slots per rank for the policy (not for none)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=_cmd_trace)


def _cmd_trace(args) -> int:
    from ..demo.trace import cmd_trace

    if not hasattr(args, "unset"):  # parsed without main(): defaults still wrapped
        args.unset = fill_defaults(args)
    if args.policy == "none" and "slots" not in args.unset:
        raise InputError(f"--slots {args.slots} would change nothing with --policy none (it keeps the stock "
                         "layout, no redundant slots); drop --slots")

    return cmd_trace(args)


def run_a2a(args) -> tuple[dict, list[dict]]:
    from ..sim.rails import simulate
    from ..core.topology import load_topology
    from ..sim.traffic import make_traffic

    if not hasattr(args, "unset"):  # parsed without main() (a script, a test): defaults still wrapped
        args.unset = fill_defaults(args)
    _slots_used(args)
    topo = load_topology(args.topology).with_nodes(args.nodes)
    D = topo.world_size
    if D > MAX_WORLD:
        raise InputError(f"--nodes must be >= 1 and <= {MAX_WORLD // topo.gpus_per_node} on {topo.name} "
                         f"({topo.gpus_per_node} GPUs per node, at most {MAX_WORLD} GPUs), got {args.nodes}")
    shape = dict(tokens_per_rank=args.tokens_per_rank, hidden=args.hidden, dtype_bytes=args.dtype_bytes,
                 experts=args.experts, topk=args.topk, seed=args.seed, slots=args.slots)
    mode = getattr(args, "dedup", "off")
    if mode != "off" and topo.nodes < 2:
        raise InputError(f"--dedup {mode} would change nothing with --nodes {topo.nodes}: dedup skips repeated "
                         "rows to another node, and one node has none; give --nodes 2 or more")
    if mode != "off":
        return _run_dedup(args, topo, shape, mode)
    tr = make_traffic(args.traffic, D, topo.gpus_per_node, **shape)
    head = {"topology": topo.name, "nodes": topo.nodes} | tr.describe()
    rows = [head | r.to_dict() for r in simulate(tr.tokens_DD, topo, tr.bytes_per_token)]
    direct = next(r for r in rows if r["scheme"] == "direct")
    for r in rows:
        r["busbw_gain_over_direct"] = r["busbw_gbps"] / direct["busbw_gbps"] - 1 if direct["busbw_gbps"] else 0.0
    return head, rows


def _slots_used(args) -> None:
    """Refuse a typed --slots that no planner reads: a traffic family without a plan, or planned by none."""
    from ..sim.traffic import parse_traffic

    if "slots" in getattr(args, "unset", ("slots",)):
        return
    kind, _, policy = parse_traffic(args.traffic)
    if kind in ("uniform", "zipf") or policy == "none":
        raise InputError(f"--slots {args.slots} would change nothing with --traffic {args.traffic}: only a "
                         "traffic planned by a policy other than none (plan:POLICY, mixtral:POLICY, "
                         "deepseek:POLICY) places slots; drop --slots")


def _run_dedup(args, topo, shape: dict, mode: str) -> tuple[dict, list[dict]]:
    """`--dedup on|both`: the token-level sample's rows (sim/dedup.py), end-to-end gains over direct per mode."""
    from ..sim.dedup import simulate_dedup, token_traffic

    tt = token_traffic(args.traffic, topo.world_size, topo.gpus_per_node, **shape)
    head = {"topology": topo.name, "nodes": topo.nodes} | tt.describe()
    rows = [head | r for r in simulate_dedup(tt, topo, modes=("dedup",) if mode == "on" else ("pairs", "dedup"))]
    for r in rows:
        direct = next(x for x in rows if x["scheme"] == "direct" and x["mode"] == r["mode"])
        t_us = r["end_to_end_us"]
        r["end_to_end_gain_over_direct"] = direct["end_to_end_us"] / t_us - 1 if t_us else 0.0
    return head, rows


def _print_dedup(head: dict, rows: list[dict], wide: bool) -> None:
    from ..sim.term import console, note, table

    gib = 2**30

    def size(b: int) -> str:
        return f"{b / gib:.1f} GiB" if b >= gib else f"{b / 2**20:.1f} MiB"

    title = (f"all-to-all on {head['topology']} x {head['nodes']} nodes ({head['ranks']} GPUs), "
             f"{head['traffic']} token-level sample: inter-node {size(head['inter_node_bytes_pairs'])}, "
             f"{size(head['inter_node_bytes_dedup'])} with dedup (-{100 * head['dedup_saving']:.1f}%)")
    both = len({r["mode"] for r in rows}) > 1
    cols = ["scheme", *(["traffic"] if both else []), *(["inter\nGiB"] if wide else []), "t us", "LB us", "t/LB",
            *(["phased us", "fan-out\nus", "phased\n+fan us", "LB\n+fan us"] if wide else []), "+fan\nus",
            "speedup", *(["rail\nmax/mean", "hops"] if wide else []), "bottleneck"]
    t = table(title, cols, left=("scheme", "traffic", "bottleneck"))
    for r in rows:
        t.add_row(r["scheme"], *([r["mode"]] if both else []),
                  *([f"{r['inter_node_bytes'] / gib:.1f}"] if wide else []),
                  f"{r['completion_us']:.1f}", f"{r['lower_bound_us']:.1f}", f"{r['ratio_to_lb']:.3f}",
                  *([f"{r['phased_us']:.1f}", f"{r['fanout_us']:.1f}", f"{r['phased_end_to_end_us']:.1f}",
                     f"{r['lower_bound_end_to_end_us']:.1f}"] if wide else []),
                  f"{r['end_to_end_us']:.1f}", f"{1 + r['speedup_over_pairs']:.2f}x",
                  *([f"{r['rail_max_over_mean']:.2f}", str(r["hops"])] if wide else []), r["bottleneck"])
    con = console(t, wide)
    con.print(t)
    note(con, ("inter: bytes crossing nodes; " if wide else "")
              + "t: fluid completion of what crosses first (dedup: each token once per remote node, to the rank "
              "with its local index there; intra-node pairs as before); LB: its lower bound; +fan: t with the "
              "dedup fan-out inside the receiving nodes over NVLink (pipelined); speedup: the same scheme's +fan without "
              "dedup over this row's, above 1 where dedup is faster"
              + ("; phased: three store-and-forward phases, +fan: and the fan-out as a fourth (fan-out us alone); "
                 "LB +fan: the bound of both stages" if wide else " (--wide: phased times, fan-out alone, hops)"))


def cmd_a2a(args) -> int:
    no_table_with_json(args)
    head, rows = run_a2a(args)
    if args.json:
        print(json.dumps(rows))
        return 0
    if getattr(args, "dedup", "off") != "off":
        _print_dedup(head, rows, args.wide)
        return 0
    from ..sim.term import console, note, table

    mib = head["total_bytes"] / head["ranks"] / 2**20
    title = (f"all-to-all on {head['topology']} x {head['nodes']} nodes ({head['ranks']} GPUs), "
             f"traffic {head['traffic']}, {mib:.1f} MiB/rank mean")
    cols = ["scheme", "t us", *(["phased us"] if args.wide else []), "LB us", "t/LB", "busbw\nGB/s", "vs\ndirect",
            "rail\nmax/mean", *(["in-node", "hops"] if args.wide else []), "bottleneck"]
    t = table(title, cols, left=("scheme", "bottleneck"))
    for r in rows:
        t.add_row(r["scheme"], f"{r['completion_us']:.1f}", *([f"{r['phased_us']:.1f}"] if args.wide else []),
                  f"{r['lower_bound_us']:.1f}", f"{r['ratio_to_lb']:.3f}", f"{r['busbw_GBps']:.2f}",
                  f"{100 * r['busbw_gain_over_direct']:+.1f}%", f"{r['rail_max_over_mean']:.2f}",
                  *([f"{r['rail_node_max_over_mean']:.3f}", str(r["hops"])] if args.wide else []), r["bottleneck"])
    con = console(t, args.wide)
    con.print(t)
    note(con, "t: fluid completion; LB: lower bound; busbw in GB/s (nccl-tests all-to-all definition, S = mean bytes "
              "per rank); vs direct: busbw gain; rail max/mean: busiest NIC port / mean over all ports"
              + ("; phased: three store-and-forward phases; in-node: the worst node's busiest rail / its mean rail"
                 if args.wide else " (--wide: phased time, in-node rail balance, hops)"))
    return 0
