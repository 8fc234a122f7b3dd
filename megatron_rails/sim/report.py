"""Reports of `simulate run`: a table on the terminal, JSON, and a PNG of stacked bars."""
from __future__ import annotations

from .run import COMPONENTS

LABELS = {"dense_ms": "dense", "expert_compute_ms": "experts", "token_a2a_ms": "token a2a",
          "weights_ms": "weights", "planner_ms": "planner", "pipeline_bubble_ms": "bubble"}


def print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    s = result["setup"]
    title = (f"iteration time: {s['name']} - {s['layers']} layers, E{s['experts']} top-{s['topk']}, "
             f"TP{s['tp']} PP{s['pp']} EP{s['ep']} on {s['topology']} ({s['ep_nodes']} node(s) per EP group), "
             f"{s['microbatches']} microbatches x {s['tokens_per_rank']} tokens/rank, workload {result['workload']}")
    t = Table(title=title)
    for col in ("policy", "comm", "iteration ms", "speedup", *(LABELS[c] + " ms" for c in COMPONENTS),
                "of ideal", "max/mean", "plan us"):
        t.add_column(col, justify="left" if col in ("policy", "comm") else "right")
    for r in result["rows"]:
        b = r["breakdown"]
        t.add_row(r["policy"], r["comm"], f"{r['iteration_ms']:.1f}", f"{r['speedup']:.3f}x",
                  *(f"{b[c]:.1f}" for c in COMPONENTS), f"{100 * r['of_force_balanced']:.1f}%",
                  f"{r['max_over_mean']:.3f}", f"{r['planner_us_median']:.0f}")
    con = Console()
    if not con.is_terminal:
        con = Console(width=max(con.width, 160))
    con.print(t)
    ideal = ", ".join(f"{r['comm']} {r['iteration_ms']:.1f} ms" for r in result["force_balanced"])
    o = result["options"]
    print(f"force-balanced ideal (router spreads tokens evenly, nothing moves): {ideal}; of ideal: ideal / "
          f"iteration time with the same comm")
    print(f"speedup: over none/direct; max/mean: tokens on the busiest EP rank / mean (stock placement: "
          f"{result['rows'][0]['max_over_mean_stock']:.3f}); mfu {o['mfu']}, a2a model {o['a2a_model']}, "
          f"weight sync {o['weight_sync']}, overlap {o['overlap']}: {result['assumptions']['overlap']}")


def plot(result: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) + 2), 4.5))
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for c in COMPONENTS:
        vals = [r["breakdown"][c] for r in rows]
        ax.bar(x, vals, bottom=bottom, label=LABELS[c])
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, r in enumerate(rows):
        ax.text(i, bottom[i], f"{r['speedup']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{r['policy']}\n{r['comm']}" for r in rows], fontsize=8)
    ax.set_ylabel("iteration time (ms)")
    s = result["setup"]
    ax.set_title(f"{s['name']}: EP{s['ep']} on {s['topology']}, {result['workload']}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
