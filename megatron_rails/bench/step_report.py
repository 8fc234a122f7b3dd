"""docs/benchmarks.md's training-step tables from several `bench step` runs of the same code: one
row per (workload, policy) with every run's median ratio to stock and share of the ideal, each
target counted met where at least two thirds of the runs meet it (two of three), and per workload
the median over the runs of each policy's median.

    python -m megatron_rails.bench.step_report bench/step-runs/run1.json bench/step-runs/run2.json ...
"""
from __future__ import annotations

import json
import sys


def load(paths: list[str]) -> list[dict]:
    runs = []
    for p in paths:
        with open(p) as f:
            runs.append(json.load(f))
    return runs


def rows_table(runs: list[dict]) -> str:
    """Markdown: per (workload, policy), each run's ratio_vs_stock and of_ideal (medians), then the
    first run's stock max/mean, max/mean after, weight MB per step and re-layouts per step."""
    n = len(runs)
    head = ("| workload | policy | vs stock, run " + " / ".join(str(i + 1) for i in range(n)) + " | of ideal, run "
            + " / ".join(str(i + 1) for i in range(n)) + " | max/mean stock → after | weight MB/step | "
            "re-layouts/step |\n|---|---|---|---|---|---|---|")
    by = [{(r["workload"], r["policy"]): r for r in run["rows"]} for run in runs]
    lines = [head]
    for key, r in by[0].items():
        vs = " / ".join(f"{b[key]['ratio_vs_stock']:.3f}" for b in by)
        ideal = " / ".join(f"{b[key]['of_ideal']:.3f}" for b in by)
        lines.append(f"| {key[0]} | {key[1]} | {vs} | {ideal} | {r['stock_max_over_mean']:.2f} → "
                     f"{r['max_over_mean_after']:.2f} | {r['weight_bytes_per_step'] / 1e6:.1f} | "
                     f"{r['relayouts_per_step']:.1f} |")
    return "\n".join(lines)


POOLED = ("none", "eplb", "ultraep", "lp", "fsep", "default")


def pooled_table(runs: list[dict]) -> str:
    """Markdown: per workload, the median over the runs that have it of each run's median
    ratio_vs_stock per policy, and the default's of_ideal the same way (runs of different days may
    be pooled where the code timed is the same)."""
    by = [{(r["workload"], r["policy"]): r for r in run["rows"]} for run in runs]
    workloads = list(dict.fromkeys(w for b in by for (w, _) in b))
    lines = ["| workload | stock max/mean | " + " | ".join(POOLED) + " | default of ideal | runs |",
             "|---|---|" + "---|" * (len(POOLED) + 2)]
    for w in workloads:
        have = [b for b in by if (w, "stock") in b]

        def med(policy, key="ratio_vs_stock"):
            v = sorted(b[(w, policy)][key] for b in have if (w, policy) in b)
            return (v[(len(v) - 1) // 2] + v[len(v) // 2]) / 2 if v else float("nan")

        cells = " | ".join(f"{med(p):.3f}" for p in POOLED)
        lines.append(f"| {w} | {have[0][(w, 'stock')]['stock_max_over_mean']:.2f} | {cells} | "
                     f"{med('default', 'of_ideal'):.3f} | {len(have)} |")
    return "\n".join(lines)


def targets_over_runs(runs: list[dict]) -> dict:
    """{target: {"cases": {case: (runs meeting it, runs)}, "all_met": bool}}: a target with yes/no per
    case (a dict in the JSON) or one yes/no (case None); all_met where every case is met in at least
    two thirds of the runs. A case a run lacks counts as not met there."""
    out = {}
    for name, first in runs[0]["targets"].items():
        def met(run, case):
            v = run["targets"].get(name)
            return (v.get(case) if isinstance(v, dict) else v) is True

        cases = list(first) if isinstance(first, dict) else [None]
        counted = {case: (sum(met(run, case) for run in runs), len(runs)) for case in cases}
        out[name] = {"cases": counted, "all_met": all(3 * k >= 2 * n for k, n in counted.values())}
    return out


def targets_table(runs: list[dict]) -> str:
    lines = ["| target | met in ≥ 2/3 of the runs | missed |", "|---|---|---|"]
    for name, t in targets_over_runs(runs).items():
        missed = [f"{c or name} ({k}/{n})" for c, (k, n) in t["cases"].items() if 3 * k < 2 * n]
        met = len(t["cases"]) - len(missed)
        lines.append(f"| {name} | {met} of {len(t['cases'])} | {', '.join(missed) or '—'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python -m megatron_rails.bench.step_report RUN.json ...", file=sys.stderr)
        return 2
    runs = load(paths)
    walls = ", ".join(f"{run['meta']['wall_s'] / 60:.1f}" for run in runs)
    print(f"{len(runs)} runs ({walls} min)\n\n{rows_table(runs)}\n\n{targets_table(runs)}\n\n"
          f"medians over the runs:\n\n{pooled_table(runs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
