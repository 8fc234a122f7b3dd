"""`megatron-rails bench planners` and the planner demo.

Results are JSON (one row per grid point and policy) plus a PNG; targets are checked here and
reported in the JSON, never asserted in timed tests. --out is written once, whole, at the end; what
a long grid has measured so far is kept in `--out`.partial meanwhile (removed once --out is written).
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from itertools import product
from pathlib import Path

import numpy as np

from ..core.outfile import save_figure, summary_stream, write_text, writes_in_place
from ..core.planners import POLICIES, PlannerConfig, PlannerError
from ..core.planners.ultraep import _compiled
from .measure import BoundCache, measure, pin_one_core, stdout_to_stderr

FULL_GRID = dict(ranks=[8, 32, 64, 256, 1024], experts=[8, 64, 256], slots=[1, 2],
                 skews=["uniform", "zipf:0.8", "zipf:1.0", "zipf:1.2", "zipf:1.5"])
QUICK_GRID = dict(ranks=[8, 64], experts=[8, 64], slots=[1], skews=["uniform", "zipf:1.2"])
TOPK = {8: 2, 64: 6, 256: 8}  # Mixtral-like, a mid-size MoE, DeepSeek-like
TOKENS_PER_RANK = 4096
RANKS_PER_NODE = 8


def _counts(D, E, skew, seed=0):
    from ..core.workloads import WorkloadSpec, counts

    return counts(WorkloadSpec(num_ranks=D, num_experts=E, topk=TOPK.get(E, min(8, E)),
                               tokens_per_rank=TOKENS_PER_RANK, skew=skew, seed=seed))


def _progress():
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    con = Console(stderr=True)  # stdout: results only
    # piped, the bar is printed once, at the end, in box-drawing characters (3 bytes each in a log): the count says it
    bar = [BarColumn()] if con.is_terminal else []
    return Progress(TextColumn("{task.description}"), *bar, MofNCompleteColumn(), TimeElapsedColumn(),
                    transient=False, console=con)


class Results:
    """A benchmark's result dict and its --out file: `checkpoint()` keeps what is measured so far in a
    sibling `OUT.partial` (a crash loses at most one grid point; none for a pipe or device, which take
    one document), `write()` writes --out once and removes the sibling; `summary_file` is where the
    short summary goes: stdout, unless --out is stdout (then its one JSON document stays alone)."""

    def __init__(self, out: str, result: dict):
        self.out, self.result = out, result
        self.partial = None if writes_in_place(out) else f"{out}.partial"
        self.summary_file = summary_stream(out)

    def checkpoint(self) -> None:
        if self.partial:
            write_text(self.partial, json.dumps(self.result, indent=1))

    def write(self) -> None:
        write_text(self.out, json.dumps(self.result, indent=1))
        if self.partial:
            Path(self.partial).unlink(missing_ok=True)

    def figure(self, plot) -> str | None:
        """The figure's path: `plot`, else --out's name with .png; None for plot=False (no figure)."""
        return None if plot is False else plot or os.path.splitext(self.out)[0] + ".png"

    def finish(self, summary: dict, plot, draw) -> None:
        """Write --out, then print `summary` and draw the figure (draw(result, png)), in that order:
        a figure that fails loses none of the results."""
        self.write()
        print(json.dumps(summary, indent=1), file=self.summary_file)
        png = self.figure(plot)
        if png:
            draw(self.result, png)
        print(f"wrote {self.out}{f' and {png}' if png else ''}", file=sys.stderr)


def targets(rows: list[dict]) -> dict:
    """The foundation targets, evaluated on the measured rows."""
    ultra = [r for r in rows if r["policy"] == "ultraep" and "error" not in r]
    bal_fail = [r for r in ultra
                if r["max_over_mean_after"] > max(1.01, 1.005 * r["lower_bound_max_over_mean"]) + 1e-12]

    def p50(D, E=None):
        got = [r["plan_us_p50"] for r in ultra if r["ranks"] == D and E in (None, r["experts"])]
        return max(got) if got else None

    out = {
        "ultraep_balance": {"rows": len(ultra), "failing": len(bal_fail),
                            "rule": "max/mean <= max(1.01, 1.005 * lower bound)",
                            "failures": [{k: r[k] for k in ("ranks", "experts", "slots", "skew",
                                                            "max_over_mean_after", "lower_bound_max_over_mean")}
                                         for r in bal_fail]},
    }
    # a target's figure only where its grid point was measured (the --quick grid has neither): never null
    missing = []
    for key, (D, E), target_key, target in (("ultraep_p50_us_ep64_e256_worst", (64, 256), "target_p50_us_ep64_e256",
                                              100),
                                             ("ultraep_p50_us_ep1024_worst", (1024, None), "target_p50_us_ep1024",
                                              5000)):
        worst = p50(D, E)
        if worst is None:
            # short: the summary is printed as indented JSON, each string on a line of its own
            missing.append(f"{key}: EP{D}{f' E{E}' if E else ''} is only in the full grid")
        else:
            out[key] = worst
        out[target_key] = target
    if missing:
        out["not_measured"] = missing
    if ultra:
        w = max(ultra, key=lambda r: r["plan_us_p50"])
        out["ultraep_p50_us_worst_measured"] = {"us": w["plan_us_p50"], "ranks": w["ranks"], "experts": w["experts"],
                                                "slots": w["slots"], "skew": w["skew"]}
    return out


def bench_planners(out: str, quick: bool = False, plot: str | bool | None = None,
                   lp_instances: int | None = None) -> dict:
    """Run the planner grid; write JSON to `out` (progress in `out`.partial meanwhile), then a PNG."""
    pin_one_core()
    grid = QUICK_GRID if quick else FULL_GRID
    reps, budget = (5, 0.02) if quick else (30, 0.3)
    points = list(product(grid["ranks"], grid["experts"], grid["slots"], grid["skews"]))
    rows: list[dict] = []
    bounds = BoundCache({})
    meta = {"command": "megatron-rails bench planners" + (" --quick" if quick else ""),
            "python": sys.version.split()[0], "machine": platform.machine(), "cpu_pinned": 1,
            "tokens_per_rank": TOKENS_PER_RANK, "topk": TOPK, "ranks_per_node": RANKS_PER_NODE,
            "ultraep_kernel": "compiled" if _compiled() is not None else "python",
            "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    result = {"meta": meta, "rows": rows}
    saved = Results(out, result)
    with _progress() as prog:
        task = prog.add_task("planner grid", total=len(points) * len(POLICIES))
        for D, E, S, skew in points:
            counts = _counts(D, E, skew)
            cfg = PlannerConfig(D, E, min(RANKS_PER_NODE, D), S)
            for policy in POLICIES:
                prog.update(task, description=f"EP{D} E{E} S{S} {skew:9s} {policy:8s}")
                base = {"policy": policy, "ranks": D, "experts": E, "slots": S, "skew": skew}
                try:
                    row = measure(policy, cfg, counts, bounds=bounds, min_reps=reps, budget_s=budget)
                    row["skew"] = skew
                except PlannerError as err:
                    row = base | {"error": str(err)}
                rows.append(row)
                prog.advance(task)
            saved.checkpoint()
    from ..core.planners.lp import time_vs_oracle

    n_lp = lp_instances or (50 if quick else 500)
    print(f"lp vs pulp+HiGHS on {n_lp} random instances ...", file=sys.stderr)
    with stdout_to_stderr():  # HiGHS prints its banner on file descriptor 1
        result["lp_vs_highs"] = time_vs_oracle(n_lp, seed=0)
    result["targets"] = targets(rows)
    meta["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    saved.finish(result["targets"], plot, plot_planners)
    return result


def plot_planners(result: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (matplotlib.ticker below)

    rows = [r for r in result["rows"] if "error" not in r]
    if not rows:
        return
    D0 = 64 if any(r["ranks"] == 64 for r in rows) else max(r["ranks"] for r in rows)
    E0 = max(r["experts"] for r in rows)
    S0 = max(r["slots"] for r in rows)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    skews = list(dict.fromkeys(r["skew"] for r in rows))
    x = np.arange(len(skews))
    sel = [r for r in rows if r["ranks"] == D0 and r["experts"] == E0 and r["slots"] == S0]
    for k, pol in enumerate(POLICIES):
        ys = [next((r["max_over_mean_after"] for r in sel if r["policy"] == pol and r["skew"] == s), np.nan)
              for s in skews]
        ax1.bar(x + (k - 2) * 0.15, ys, width=0.15, label=pol)
    bound = [next((r["lower_bound_max_over_mean"] for r in sel if r["policy"] == "ultraep" and r["skew"] == s),
                  np.nan) for s in skews]
    ax1.plot(x, bound, "k_", markersize=30, mew=2, label="LP bound (owner + S redundant slots)")
    ax1.set_xticks(x, skews)
    ax1.set_yscale("log")
    # plain numbers on the log axis (not 6x10^0); minor ticks unlabelled
    top = np.nanmax([r["max_over_mean_after"] for r in sel] + [1.0])
    ticks = [t for t in (1, 1.25, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32) if t <= top * 1.05]
    ax1.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ax1.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax1.set_ylim(top=top * 2.2)  # headroom for the legend above the tallest bar
    ax1.set_ylabel("max / mean tokens per rank")
    ax1.set_title(f"balance after planning, EP{D0} E{E0} S{S0}")
    ax1.legend(fontsize=8, loc="upper left", ncol=2)  # above the uniform column, clear of the bars
    for pol in POLICIES:
        pts = sorted({(r["ranks"], r["plan_us_p50"]) for r in rows
                      if r["policy"] == pol and r["experts"] == E0 and r["slots"] == S0
                      and r["skew"] == skews[-1]})
        if pts:
            ax2.plot(*zip(*pts), marker="o", label=pol)
    ax2.axhline(100, color="grey", ls=":", lw=1)
    ax2.axhline(5000, color="grey", ls=":", lw=1)
    for y, text in ((100, "100 us"), (5000, "5 ms")):  # the latency lines docs/benchmarks.md names
        ax2.annotate(text, (0.01, y), xycoords=("axes fraction", "data"), va="bottom", fontsize=8, color="grey")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ranks = sorted({r["ranks"] for r in rows})
    ax2.set_xticks(ranks, [str(d) for d in ranks])  # 8, 32, 64 ... rather than 2^3, 2^5, 2^6
    ax2.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax2.set_xlabel("expert-parallel ranks")
    ax2.set_ylabel("plan latency p50 (us, one core)")
    ax2.set_title(f"planner latency, E{E0} S{S0} {skews[-1]}")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, png, dpi=110)
    plt.close(fig)


def planner_demo(json_out: bool = False) -> int:
    """Compare every policy on a Mixtral-like and a DeepSeek-like skewed step."""
    pin_one_core()
    cases = [("Mixtral-like EP8 E8 top-2, zipf 1.2", 8, 8, 1, "zipf:1.2"),
             ("DeepSeek-like EP64 E256 top-8, zipf 1.2", 64, 256, 2, "zipf:1.2")]
    bounds = BoundCache({})
    out = []
    for title, D, E, S, skew in cases:
        counts = _counts(D, E, skew)
        cfg = PlannerConfig(D, E, min(RANKS_PER_NODE, D), S)
        rows = []
        for policy in POLICIES:
            try:
                rows.append(measure(policy, cfg, counts, bounds=bounds, min_reps=20, budget_s=0.1))
            except PlannerError as err:
                rows.append({"policy": policy, "error": str(err)})
        out.append({"case": title, "rows": rows})
    if json_out:
        print(json.dumps(out))
        return 0
    from ..sim.term import console, table

    for case in out:
        # two-line headers: one word per line keeps the table within 80 columns without cutting any
        t = table(case["case"], ["policy", "max/mean\nbefore", "max/mean\nafter", "LP\nbound",
                                 "cross-\nnode\ntokens", "weight\nmoves", "plan\np50 us", "plan\np99 us"])
        for r in case["rows"]:
            if "error" in r:
                t.add_row(r["policy"], "-", "-", "-", "-", "-", "-", r["error"][:40])
                continue
            t.add_row(r["policy"], f"{r['max_over_mean_before']:.3f}", f"{r['max_over_mean_after']:.3f}",
                      f"{r['lower_bound_max_over_mean']:.3f}", str(r["cross_node_tokens"]), str(r["weight_moves"]),
                      f"{r['plan_us_p50']:.0f}", f"{r['plan_us_p99']:.0f}")
        console(t).print(t)
    return 0
