"""Reports of `simulate run`: a table on the terminal, JSON, and a PNG of stacked bars."""
from __future__ import annotations

from ..core.outfile import save_figure
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
    ms = (lambda v: f"{v:.1f}") if wide else _ms
    for r in result["rows"]:
        b = r["breakdown"]
        head = [r["policy"], r["comm"], ms(r["iteration_ms"]), f"{r['speedup']:.3f}x"]
        if wide:
            t.add_row(*head, *(f"{b[c]:.1f}" for c in COMPONENTS), f"{100 * r['of_force_balanced']:.1f}%",
                      f"{r['max_over_mean']:.3f}", f"{r['planner_us_median']:.0f}")
        else:
            t.add_row(*head, ms(b["expert_compute_ms"]), ms(b["token_a2a_ms"]),
                      ms(b["weights_ms"] + b["planner_ms"]), f"{r['max_over_mean']:.3f}")
    con = console(t, wide)
    con.print(t)
    ideal = ", ".join(f"{r['comm']} {ms(r['iteration_ms'])} ms" for r in result["force_balanced"])
    o = result["options"]
    note(con, f"force-balanced ideal (router spreads tokens evenly, nothing moves): {ideal}"
              + ("; of ideal: ideal / iteration time with the same comm" if wide else ""))
    if not wide:
        note(con, "iter ms = dense + experts + a2a + weights + planner + pipeline bubble, in ms per iteration "
                  "(--wide: a column for each, of ideal, planner us per call)")
    note(con, f"speedup: over none/direct; max/mean: tokens on the busiest EP rank / mean (stock placement: "
              f"{result['rows'][0]['max_over_mean_stock']:.3f}); mfu {o['mfu']}, a2a model {o['a2a_model']}, "
              f"weight sync {o['weight_sync']}, overlap {o['overlap']}: {result['assumptions']['overlap']}")
    if s["ep_nodes"] > 1:
        note(con, dedup_note(result))
    comms = {r["comm"] for r in result["rows"]}
    if s["ep_nodes"] == 1 and {"direct", "rails"} <= comms:
        note(con, f"direct and rails rows are the same: the EP group of {s['ep']} ranks fits in one node, so no "
                  f"token crosses a NIC and rail routing has nothing to change (rails differs once EP spans nodes)")


def print_memory(result: dict) -> None:
    """The busiest GPU's memory per policy (sim/memory.py), in GiB, when the result has it."""
    from .term import console, note, table

    rows = result.get("memory")
    if not rows:
        return
    cap = rows[0]["gpu_memory_gib"]
    t = table(f"memory of the busiest GPU (first pipeline stage), GiB; {result['setup']['topology']}: {cap:g} GiB",
              ["policy", "experts\nw + g", "experts\noptim", "slots", "rest", "activ-\nations", "total",
               "experts\nvs stock", "fits"], left=("policy",))
    for r in rows:
        t.add_row(r["policy"], *(f"{r[k] / 2**30:.2f}" for k in ("expert_weights_grads", "expert_optimizer", "slots",
                                                                  "dense", "activations", "total")),
                  f"{r['expert_over_stock']:.2f}x", "yes" if r["fits"] else "NO")
    con = console(t)
    con.print(t)
    note(con, "experts w + g: expert weights and gradients; slots: the policy's replica / FSEP slots (weights and "
              "gradient accumulators) at a skewed step's peak; rest: other parameters with gradients and optimizer "
              "state; activations: Megatron-LM's estimate; experts vs stock: (experts w + g + slots) over stock's"
              + ("; slots as the dispatcher holds them (resident for the step), not as --weight-sync microbatch's "
                 "what-if would" if result["options"].get("weight_sync") == "microbatch" else ""))


def _ms(v: float) -> str:
    """Milliseconds in at most 7 characters below 10^100, so that eight columns fit 80: a tenth below
    10^5, whole below 10^7, then three digits and an exponent (1.64e12; --wide prints every digit)."""
    if v < 1e5:
        return f"{v:.1f}"
    if v < 1e7:
        return f"{v:.0f}"
    mantissa, _, exp = f"{v:.2e}".partition("e")
    return f"{mantissa}e{int(exp)}"


def dedup_note(result: dict) -> str:
    """The inter-node token bytes of one layer's dispatch, per policy, without and with node dedup."""
    on = result["options"]["dedup"]
    seen = {}
    for r in [*result["rows"], *result["force_balanced"]]:
        name = "ideal" if r["policy"] == "force-balanced" else r["policy"]
        seen.setdefault(name, (r["internode_bytes_per_layer"], r["internode_bytes_dedup_per_layer"]))
    top = max((a for a, _ in seen.values()), default=0.0)
    # three significant digits or so at any size (a tiny run's MB would print "0 -> 0")
    scale, unit, digits = (1e9, "GB", 1) if top >= 10e9 else (1e6, "MB", 0) if top >= 10e6 else (1e3, "kB", 1)
    parts = [f"{name} {a / scale:.{digits}f} -> {b / scale:.{digits}f} ({100 * (b / a - 1):+.0f}%)" if a
             else f"{name} 0" for name, (a, b) in seen.items()]
    head = ("dedup on (priced): a token crosses to a remote node once, then fans out over NVLink"
            if on else "dedup off (priced): one network row per token-expert pair (--dedup on: a token once per remote "
               "node)")
    return f"{head}; inter-node token {unit} per layer dispatch, without -> with dedup: {', '.join(parts)}"


SHADES = {"direct": 1.0, "rails": 0.55}  # a comm's bars: the component colours, lighter for rails
HATCH = {"direct": "", "rails": "//"}


def plot(result: dict, png: str) -> list[str]:
    """Stacked bars of the iteration breakdown, one group per policy (a bar per comm, rails hatched),
    the speedup over none/direct on top, the force-balanced ideal as a labelled line per comm (one line
    for comms whose ideal is the same). Legend: only the parts some bar has, top of the stack first.
    Returns the legend's labels."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter

    rows = result["rows"]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    comms = list(dict.fromkeys(r["comm"] for r in rows))
    tops = [r["iteration_ms"] for r in rows] + [r["iteration_ms"] for r in result["force_balanced"]]
    scale, unit = (1e3, "s") if max(tops, default=0.0) >= 20_000 else (1.0, "ms")
    width, gap = 0.8 / len(comms), 0.35
    x_of = {}
    for i, pol in enumerate(policies):
        for j, c in enumerate(comms):
            x_of[pol, c] = i * (1 + gap) + (j - (len(comms) - 1) / 2) * width
    shown = [c for c in COMPONENTS if any(r["breakdown"][c] > 0 for r in rows)]  # no empty legend entries
    colours = dict(zip(COMPONENTS, plt.get_cmap("tab10").colors))
    fig, ax = plt.subplots(figsize=(max(7.0, 3.6 + 0.55 * len(rows) + 0.3 * len(policies)), 4.8))
    for r in rows:
        x, bottom = x_of[r["policy"], r["comm"]], 0.0
        for c in shown:
            v = r["breakdown"][c] / scale
            rgb = to_rgb(colours[c])
            shade = SHADES.get(r["comm"], 1.0)
            face = tuple(1 - shade * (1 - ch) for ch in rgb)  # mixed with white
            ax.bar(x, v, width=width * 0.92, bottom=bottom, color=face, edgecolor=colours[c], linewidth=0.6,
                   hatch=HATCH.get(r["comm"], ""))
            bottom += v
        ax.annotate(f"{r['speedup']:.2f}x", (x, bottom), xytext=(0, 2), textcoords="offset points",
                    ha="center", va="bottom", fontsize=7.5, bbox=dict(facecolor="white", edgecolor="none", pad=0.3))
    ideal = {}
    for r in result["force_balanced"]:
        ideal.setdefault(round(r["iteration_ms"], 6), []).append(r["comm"])
    decimals = 1 if unit == "s" else 0
    styles = iter([("--", "0.25"), (":", "0.45"), ("-.", "0.6")])
    handles = []
    for v, cs in ideal.items():
        ls, col = next(styles, ("--", "0.3"))
        handles.append(ax.axhline(v / scale, color=col, lw=1.0, ls=ls, zorder=0.5,
                                  label=f"force-balanced ideal ({', '.join(cs)}): {v / scale:,.{decimals}f} {unit}"))
    ax.set_xticks([i * (1 + gap) for i in range(len(policies))])
    ax.set_xticklabels(policies)
    if len(comms) > 1:
        for (pol, c), x in x_of.items():
            ax.annotate(c, (x, 0), xytext=(0, -3), textcoords="offset points", ha="center", va="top", fontsize=7,
                        color="0.35", annotation_clip=False)
        ax.tick_params(axis="x", pad=14, length=0)
    ax.set_ylabel(f"iteration time ({unit})")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 10 or v == 0 else f"{v:g}"))
    ax.set_ylim(0, max(tops, default=1.0) / scale * 1.1)
    ax.set_xlim(-0.5 - gap / 2, (len(policies) - 1) * (1 + gap) + 0.5 + gap / 2)
    ax.spines[["top", "right"]].set_visible(False)
    s = result["setup"]
    nodes = f"{s['ep_nodes']} node{'s' if s['ep_nodes'] > 1 else ''}"
    dedup = f", dedup {'on' if result['options']['dedup'] else 'off'}" if s["ep_nodes"] > 1 else ""
    about = (f"E{s['experts']} top-{s['topk']}, EP{s['ep']} over {nodes} of {s['topology']}, {result['workload']}"
             f"{dedup}; bar labels: speedup over none/direct")
    chars = int(fig.get_figwidth() * 13)  # characters of 8.5-point text per line of the figure's width
    fig.suptitle("\n".join([s["name"], *textwrap.wrap(about, chars)]), fontsize=8.5)
    parts = [Patch(facecolor=colours[c], edgecolor=colours[c], label=LABELS[c]) for c in reversed(shown)]
    comm_keys = [Patch(facecolor=tuple(1 - SHADES.get(c, 1.0) * (1 - ch) for ch in to_rgb("0.5")),
                       edgecolor="0.3", hatch=HATCH.get(c, ""), label=f"comm {c}") for c in comms]
    legend = ax.legend(handles=parts + (comm_keys if len(comms) > 1 else []) + handles, fontsize=7.5,
                       loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    save_figure(fig, png, dpi=120, bbox_inches="tight")  # the legend outside the axes is kept whole
    plt.close(fig)
    return [t.get_text() for t in legend.get_texts()]
