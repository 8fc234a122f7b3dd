"""`megatron-rails bench rails`: direct (PXN) vs ecmp vs RailS all-to-all in the flow-level model.

Grid: topologies x nodes x traffic families (sim/traffic.py). Per case: every scheme's completion
(fluid and phased), the lower bound, bus bandwidth, RailS / lower bound, RailS's busbw gain over
direct and ecmp, and whether the target holds (RailS completion <= 1.03 x lower bound on every skewed
case, i.e. every family but uniform). JSON is written once at the end (progress in `--out`.partial
meanwhile, see planners.Results); a PNG goes next to it.

Token dedup across nodes (sim/dedup.py, issue #17), JSON key "dedup": DeepSeek-V3-like routing (top-8
of 256 experts, hidden 7168) sampled token by token on dgx-h100, stock EP and the default policy;
per case the inter-node bytes without and with dedup and every scheme's completion, lower bound and
end-to-end time (with the NVLink fan-out) on both.
"""
from __future__ import annotations

import platform
import sys
import time
from itertools import product

import numpy as np

from ..core.outfile import save_figure
from ..sim.dedup import simulate_dedup, token_traffic
from ..sim.rails import SCHEMES, simulate
from ..core.topology import load_topology
from ..sim.traffic import make_traffic

# what-if topologies (not presets): DGX H100 NVLink with 800 Gb/s NICs, where NVLink is only 4.5x a NIC
WHAT_IF = {"dgx-h100-800g": ("dgx-h100", dict(nic_gbps=800.0, description="what-if: DGX H100 with 800 Gb/s NICs"))}
FULL_GRID = dict(topologies=["dgx-h100", "dgx-a100", "dgx-h100-800g"], nodes=[2, 4, 8, 16, 32, 64, 128],
                 traffic=["uniform", "zipf:0.8", "zipf:1.0", "zipf:1.2", "zipf:1.5", "mixtral", "deepseek"])
QUICK_GRID = dict(topologies=["dgx-h100"], nodes=[2, 4], traffic=["uniform", "zipf:1.2", "mixtral"])
# token dedup: DeepSeek-V3-like routing, stock EP (`none`) and fsep (`deepseek` alone means fsep)
DEDUP_FULL = dict(topologies=["dgx-h100"], nodes=[2, 4, 8, 16, 32], traffic=["deepseek:none", "deepseek"])
DEDUP_QUICK = dict(topologies=["dgx-h100"], nodes=[8], traffic=["deepseek:none"])
DEDUP_KEEP = ("completion_us", "lower_bound_us", "ratio_to_lb", "phased_us", "fanout_us", "end_to_end_us",
              "phased_end_to_end_us", "lower_bound_end_to_end_us", "bottleneck", "hops")
TARGET_RATIO = 1.03
PAPER_GAIN = (0.20, 0.78)  # RailS paper (arXiv 2510.19262): bus bandwidth +20-78%
TOKENS_PER_RANK = 4096
KEEP = ("completion_us", "phased_us", "busbw_gbps", "busbw_GBps", "ratio_to_lb", "bottleneck", "hops",
        "rail_max_over_mean", "rail_node_max_over_mean", "nvlink_max_over_nic_max", "forwarded_frac")


def bench_topology(name: str):
    """A preset, or one of the WHAT_IF variants of a preset."""
    if name in WHAT_IF:
        import dataclasses

        base, changes = WHAT_IF[name]
        return dataclasses.replace(load_topology(base), name=name, **changes)
    return load_topology(name)


def run_case(topology: str, nodes: int, family: str, seed: int = 0) -> dict:
    topo = bench_topology(topology).with_nodes(nodes)
    t0 = time.perf_counter()
    tr = make_traffic(family, topo.world_size, topo.gpus_per_node, tokens_per_rank=TOKENS_PER_RANK, seed=seed)
    res = {r.scheme: r for r in simulate(tr.tokens_DD, topo, tr.bytes_per_token)}
    rails, direct, ecmp = res["rails"], res["direct"], res["ecmp"]
    skewed = family != "uniform"
    row = {"topology": topology, "what_if": topology in WHAT_IF, "nodes": nodes, "ranks": topo.world_size,
           "family": family} | tr.describe()
    row |= {"lower_bound_us": rails.lower_bound_us, "lb_term": rails.lb_term,
            "schemes": {s: {k: getattr(res[s], k) for k in KEEP} for s in SCHEMES},
            "rails_over_lb": rails.ratio_to_lb,
            "busbw_gain_over_direct": direct.completion_us / rails.completion_us - 1,
            "busbw_gain_over_ecmp": ecmp.completion_us / rails.completion_us - 1,
            "phased_gain_over_direct": direct.phased_us / rails.phased_us - 1,
            "skewed": skewed, "target_met": (rails.ratio_to_lb <= TARGET_RATIO) if skewed else None,
            "seconds": time.perf_counter() - t0}
    return row


def run_dedup_case(topology: str, nodes: int, family: str, seed: int = 0) -> dict:
    """One token-level case without and with dedup (sim/dedup.py): bytes, and per mode every scheme."""
    topo = bench_topology(topology).with_nodes(nodes)
    t0 = time.perf_counter()
    tt = token_traffic(family, topo.world_size, topo.gpus_per_node, tokens_per_rank=TOKENS_PER_RANK, seed=seed)
    res = simulate_dedup(tt, topo)
    modes = {m: {r["scheme"]: {k: r[k] for k in DEDUP_KEEP} for r in res if r["mode"] == m} for m in ("pairs", "dedup")}
    rails = {m: modes[m]["rails"] for m in modes}
    return {"topology": topology, "nodes": nodes, "ranks": topo.world_size, "family": family} | tt.describe() | {
        "modes": modes,
        "rails_over_lb_pairs": rails["pairs"]["ratio_to_lb"], "rails_over_lb_dedup": rails["dedup"]["ratio_to_lb"],
        "rails_speedup_from_dedup": rails["pairs"]["end_to_end_us"] / rails["dedup"]["end_to_end_us"] - 1,
        "rails_phased_speedup_from_dedup":
            rails["pairs"]["phased_end_to_end_us"] / rails["dedup"]["phased_end_to_end_us"] - 1,
        "seconds": time.perf_counter() - t0}


def summarize_dedup(rows: list[dict]) -> list[dict]:
    return [{k: r[k] for k in ("topology", "nodes", "family", "inter_node_bytes_pairs", "inter_node_bytes_dedup",
                               "dedup_saving", "rails_over_lb_pairs", "rails_over_lb_dedup",
                               "rails_speedup_from_dedup", "rails_phased_speedup_from_dedup")} for r in rows]


def summarize(rows: list[dict]) -> dict:
    """The target and the gains over the preset topologies; what-if topologies reported on their own."""
    what_if = [r for r in rows if r.get("what_if")]
    rows = [r for r in rows if not r.get("what_if")]
    skewed = [r for r in rows if r["skewed"]]
    fails = [r for r in skewed if not r["target_met"]]

    def stats(vals):
        vals = np.asarray(vals, dtype=np.float64)
        if not vals.size:
            return {}
        return {"min": float(vals.min()), "median": float(np.median(vals)), "max": float(vals.max())}

    by = {}
    for r in rows:
        key = f"{r['topology']} {r['family']}"
        by.setdefault(key, []).append(r)
    return {
        "target": f"rails completion <= {TARGET_RATIO} x lower bound on every skewed case",
        "skewed_cases": len(skewed), "failing": len(fails), "target_met": not fails,
        "failures": [{k: r[k] for k in ("topology", "nodes", "family", "rails_over_lb")} for r in fails],
        "worst_rails_over_lb": max((r["rails_over_lb"] for r in rows), default=None),
        "busbw_gain_over_direct_skewed": stats([r["busbw_gain_over_direct"] for r in skewed]),
        "busbw_gain_over_ecmp_skewed": stats([r["busbw_gain_over_ecmp"] for r in skewed]),
        "phased_gain_over_direct_skewed": stats([r["phased_gain_over_direct"] for r in skewed]),
        "paper_busbw_gain": {"min": PAPER_GAIN[0], "max": PAPER_GAIN[1], "source": "arXiv 2510.19262"},
        "by_family": {k: {"busbw_gain_over_direct": stats([r["busbw_gain_over_direct"] for r in v]),
                          "rails_over_lb_max": max(r["rails_over_lb"] for r in v)} for k, v in by.items()},
        "what_if": {t: {"skewed_cases": sum(r["skewed"] for r in what_if if r["topology"] == t),
                        "failing": sum(r["skewed"] and not r["target_met"] for r in what_if if r["topology"] == t),
                        "worst_rails_over_lb": max(r["rails_over_lb"] for r in what_if if r["topology"] == t),
                        "failures": [{k: r[k] for k in ("nodes", "family", "rails_over_lb")} for r in what_if
                                     if r["topology"] == t and r["skewed"] and not r["target_met"]],
                        "busbw_gain_over_direct_skewed": stats([r["busbw_gain_over_direct"] for r in what_if
                                                                if r["topology"] == t and r["skewed"]])}
                    for t in dict.fromkeys(r["topology"] for r in what_if)},
    }


def bench_rails(out: str, quick: bool = False, plot: str | bool | None = None) -> dict:
    grid = QUICK_GRID if quick else FULL_GRID
    dgrid = DEDUP_QUICK if quick else DEDUP_FULL
    cases = list(product(grid["topologies"], grid["nodes"], grid["traffic"]))
    dcases = list(product(dgrid["topologies"], dgrid["nodes"], dgrid["traffic"]))
    rows: list[dict] = []
    drows: list[dict] = []
    meta = {"command": "megatron-rails bench rails" + (" --quick" if quick else ""),
            "python": sys.version.split()[0], "machine": platform.machine(), "tokens_per_rank": TOKENS_PER_RANK,
            "model": "fluid pipelined (completion_us) and three-phase store-and-forward (phased_us); "
                     "see megatron_rails/sim/rails.py; dedup: megatron_rails/sim/dedup.py", "grid": grid,
            "dedup_grid": dgrid, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    result = {"meta": meta, "rows": rows, "dedup": drows}
    from ..sim.term import wrapped
    from .planners import Results, _progress

    saved = Results(out, result)

    with _progress() as prog:
        task = prog.add_task("rails grid", total=len(cases) + len(dcases))
        for topology, nodes, family in cases:
            prog.update(task, description=f"{topology} x{nodes:<3d} {family:9s}")
            row = run_case(topology, nodes, family)
            rows.append(row)
            prog.advance(task)
            prog.console.print(wrapped(f"{topology} x{nodes:<3d} {family:9s} rails/LB {row['rails_over_lb']:.4f} "
                                       f"vs direct {100 * row['busbw_gain_over_direct']:+6.1f}% "
                                       f"vs ecmp {100 * row['busbw_gain_over_ecmp']:+6.1f}% ({row['seconds']:.1f}s)"),
                               markup=False, highlight=False)
            saved.checkpoint()
        for topology, nodes, family in dcases:
            prog.update(task, description=f"{topology} x{nodes:<3d} {family} dedup")
            row = run_dedup_case(topology, nodes, family)
            drows.append(row)
            prog.advance(task)
            gib = (row["inter_node_bytes_pairs"] / 2**30, row["inter_node_bytes_dedup"] / 2**30)
            prog.console.print(wrapped(f"{topology} x{nodes:<3d} {family} dedup: inter-node {gib[0]:.1f} -> "
                                       f"{gib[1]:.1f} GiB, rails/LB {row['rails_over_lb_pairs']:.4f} -> "
                                       f"{row['rails_over_lb_dedup']:.4f}, rails "
                                       f"{100 * row['rails_speedup_from_dedup']:+.1f}% ({row['seconds']:.1f}s)"),
                               markup=False, highlight=False)
            saved.checkpoint()
    result["summary"] = summarize(rows) | {"dedup": summarize_dedup(drows)}
    meta["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    saved.finish(result["summary"], plot, plot_rails)
    return result


def _nodes_axis(ax, nodes) -> None:
    """Log-2 node axis with the node counts themselves as integer ticks (no 2^k labels, no minor ticks)."""
    from matplotlib.ticker import FixedLocator, NullLocator

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sorted(set(nodes))))
    ax.xaxis.set_major_formatter(lambda x, _: f"{x:.0f}")
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("nodes")


def _label_line(ax, y: float, text: str, color: str) -> None:
    """Write `text` on a horizontal target line, at the right end of the panel."""
    ax.annotate(text, xy=(1, y), xycoords=("axes fraction", "data"), xytext=(-4, 2), textcoords="offset points",
                ha="right", va="bottom", fontsize=7, color=color)


def plot_rails(result: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    if not rows:
        return
    drows = result.get("dedup") or []
    if drows:  # 2 x 2: four panels in a row are too small to read at a page's width
        fig, grid = plt.subplots(2, 2, figsize=(14, 10.5))
        axes = grid.ravel()
    else:
        fig, axes = plt.subplots(1, 3, figsize=(17, 5.6))
    _plot_busbw(axes[0], rows)
    _plot_gain(axes[1], rows)
    _plot_lb(axes[2], rows)
    if drows:
        _plot_dedup(axes[3], drows)
    fig.tight_layout()
    save_figure(fig, png, dpi=110)
    plt.close(fig)


def _first_topology(rows):
    topo0 = rows[0]["topology"]
    sel = [r for r in rows if r["topology"] == topo0]
    return topo0, sel, list(dict.fromkeys(r["family"] for r in sel))


def _plot_busbw(ax, rows) -> None:
    topo0, sel, fams = _first_topology(rows)
    skewed_fam = "zipf:1.2" if "zipf:1.2" in fams else fams[-1]
    for scheme, style in zip(SCHEMES, ("o-", "s--", "^-")):
        pts = sorted((r["nodes"], r["schemes"][scheme]["busbw_GBps"]) for r in sel if r["family"] == skewed_fam)
        ax.plot(*zip(*pts), style, label=f"{scheme} ({skewed_fam})")
    pts = sorted((r["nodes"], r["schemes"]["rails"]["busbw_GBps"]) for r in sel if r["family"] == "uniform")
    if pts:
        ax.plot(*zip(*pts), "k:", label="rails = direct (uniform)")
    _nodes_axis(ax, [r["nodes"] for r in sel])
    ax.set_ylabel("bus bandwidth (GB/s, nccl-tests definition)")
    ax.set_title(f"{topo0}: all-to-all bus bandwidth")
    ax.legend(fontsize=8)


def _plot_gain(ax, rows) -> None:
    topo0, sel, fams = _first_topology(rows)
    for fam in fams:
        pts = sorted((r["nodes"], 100 * r["busbw_gain_over_direct"]) for r in sel if r["family"] == fam)
        ax.plot(*zip(*pts), "o-", label=fam)
    ax.axhspan(100 * PAPER_GAIN[0], 100 * PAPER_GAIN[1], color="grey", alpha=0.2)
    # inside the band at its lower edge, on the right: the curves there are above the band or at 0
    _label_line(ax, 100 * PAPER_GAIN[0], f"RailS paper: +{100 * PAPER_GAIN[0]:.0f} to +{100 * PAPER_GAIN[1]:.0f}%",
                "dimgrey")
    _nodes_axis(ax, [r["nodes"] for r in sel])
    ax.set_ylim(bottom=-20)
    ax.set_ylabel("RailS busbw gain over direct (%)")
    ax.set_title(f"{topo0}: gain over rail-matched direct (PXN)")
    ax.legend(fontsize=7, ncol=2, title="traffic", title_fontsize=7)


def _plot_lb(ax, rows) -> None:
    """RailS / lower bound: colour = traffic family, line style = topology, each in its own legend."""
    from matplotlib.lines import Line2D

    fams = list(dict.fromkeys(r["family"] for r in rows))
    topos = list(dict.fromkeys(r["topology"] for r in rows))
    styles = dict(zip(topos, ("-", "--", ":", "-.")))
    for topo in topos:
        for k, fam in enumerate(fams):
            pts = sorted((r["nodes"], r["rails_over_lb"]) for r in rows if r["topology"] == topo and r["family"] == fam)
            if pts:
                ax.plot(*zip(*pts), styles[topo], marker="o", ms=3, color=f"C{k}")
    ax.axhline(TARGET_RATIO, color="red", ls=":", lw=1)
    _label_line(ax, TARGET_RATIO, f"target {TARGET_RATIO}", "red")
    _nodes_axis(ax, [r["nodes"] for r in rows])
    ax.set_ylim(0.998, max(TARGET_RATIO + 0.005, 1.005 * max(r["rails_over_lb"] for r in rows)))
    ax.set_ylabel("RailS completion / lower bound")
    ax.set_title("RailS distance from the lower bound")
    # the legends go below the panel: every corner of it holds a curve of the what-if topology
    by_fam = ax.legend(handles=[Line2D([], [], color=f"C{k}", marker="o", ms=3, label=f) for k, f in enumerate(fams)],
                       fontsize=7, ncol=4, title="traffic (colour)", title_fontsize=7, loc="upper left",
                       bbox_to_anchor=(0, -0.14))
    ax.add_artist(by_fam)
    ax.legend(handles=[Line2D([], [], color="grey", ls=styles[t], label=t) for t in topos], fontsize=7,
              title="topology (line)", title_fontsize=7, loc="upper right", bbox_to_anchor=(1, -0.14))


def _plot_dedup(ax, drows) -> None:
    """Token dedup: inter-node bytes saved and RailS's end-to-end speedup, per family, by nodes."""
    for k, fam in enumerate(dict.fromkeys(r["traffic"] for r in drows)):  # canonical: deepseek:fsep
        sel = sorted((r for r in drows if r["traffic"] == fam), key=lambda r: r["nodes"])
        x = [r["nodes"] for r in sel]
        ax.plot(x, [100 * r["dedup_saving"] for r in sel], "s--", color=f"C{k}", label=f"{fam}: inter-node bytes saved")
        ax.plot(x, [100 * r["rails_speedup_from_dedup"] for r in sel], "o-", color=f"C{k}",
                label=f"{fam}: RailS speedup from dedup (fluid)")
        ax.plot(x, [100 * r["rails_phased_speedup_from_dedup"] for r in sel], "^:", color=f"C{k}",
                label=f"{fam}: RailS speedup from dedup (phased)")
    _nodes_axis(ax, [r["nodes"] for r in drows])
    ax.axhline(0, color="black", lw=0.5)
    ax.set_ylabel("with dedup: inter-node bytes saved, RailS speedup (%)")
    r0 = drows[0]
    ax.set_title(f"{r0['topology']}: token dedup across nodes (top-{r0['topk']} of {r0['experts']})")
    ax.legend(fontsize=7)


