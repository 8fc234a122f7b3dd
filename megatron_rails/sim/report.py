"""Reports of `simulate run`: a table on the terminal, JSON, and a PNG of stacked bars."""
from __future__ import annotations

from .run import COMPONENTS

LABELS = {"dense_ms": "dense", "expert_compute_ms": "experts", "token_a2a_ms": "token a2a",
          "weights_ms": "weights", "planner_ms": "planner", "pipeline_bubble_ms": "bubble"}


def print_table(result: dict, wide: bool = False) -> None:
    """The rows as a table fitting the terminal: policy, comm, iteration time, speedup and the parts that
    differ between rows; `wide`: every component, of ideal and planner time (the console widens to fit)."""
    from .term import console, note, table

    s = result["setup"]
    title = (f"iteration time: {s['name']} - {s['layers']} layers, E{s['experts']} top-{s['topk']}, "
             f"TP{s['tp']} PP{s['pp']} EP{s['ep']} on {s['nodes']} x {s['topology']} ({s['ep_nodes']} node(s) per "
             f"EP group), {s['microbatches']} microbatches x {s['tokens_per_rank']} tokens/rank, workload "
             f"{result['workload']}")
    if wide:
        cols = ["policy", "comm", "iteration ms", "speedup", *(LABELS[c] + " ms" for c in COMPONENTS),
                "of ideal", "max/mean", "plan us"]
    else:
        cols = ["policy", "comm", "iter ms", "speedup", "experts\nms", "a2a ms", "weights\n+ plan\nms", "max/mean"]
    t = table(title, cols, left=("policy", "comm"))
    for r in result["rows"]:
        b = r["breakdown"]
        head = [r["policy"], r["comm"], f"{r['iteration_ms']:.1f}", f"{r['speedup']:.3f}x"]
        if wide:
            t.add_row(*head, *(f"{b[c]:.1f}" for c in COMPONENTS), f"{100 * r['of_force_balanced']:.1f}%",
                      f"{r['max_over_mean']:.3f}", f"{r['planner_us_median']:.0f}")
        else:
            t.add_row(*head, f"{b['expert_compute_ms']:.1f}", f"{b['token_a2a_ms']:.1f}",
                      f"{b['weights_ms'] + b['planner_ms']:.1f}", f"{r['max_over_mean']:.3f}")
    con = console(t, wide)
    con.print(t)
    ideal = ", ".join(f"{r['comm']} {r['iteration_ms']:.1f} ms" for r in result["force_balanced"])
    o = result["options"]
    note(con, f"force-balanced ideal (router spreads tokens evenly, nothing moves): {ideal}"
              + ("; of ideal: ideal / iteration time with the same comm" if wide else ""))
    if not wide:
        note(con, "iter ms = dense + experts + a2a + weights + planner + pipeline bubble, in ms per iteration "
                  "(--wide: a column for each, of ideal, planner us per call)")
    note(con, f"speedup: over none/direct; max/mean: tokens on the busiest EP rank / mean (stock placement: "
              f"{result['rows'][0]['max_over_mean_stock']:.3f}); mfu {o['mfu']}, a2a model {o['a2a_model']}, "
              f"weight sync {o['weight_sync']}, overlap {o['overlap']}: {result['assumptions']['overlap']}")
    comms = {r["comm"] for r in result["rows"]}
    if s["ep_nodes"] == 1 and {"direct", "rails"} <= comms:
        note(con, f"direct and rails rows are the same: the EP group of {s['ep']} ranks fits in one node, so no "
                  f"token crosses a NIC and rail routing has nothing to change (rails differs once EP spans nodes)")


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
