"""`megatron-rails demo`: train the tiny Mixtral-shaped model on CPU ranks twice in one run, with stock
Megatron-Core (its alltoall dispatcher, on CPU through megatron_rails.megatron.cpu_shims' stand-ins)
and with the configured balancing policy, from the same weights and step by step in turns (stock
first on even steps, so a slow spell of the machine hits both alike), under skewed routing, with
gradient accumulation over microbatches; every rank on a core of its own (ranks sharing a core cannot show stragglers, so step
times would not compare). Prints loss parity against stock by the long-run rule (equal until the
first near-tie routing flip; the flips counted), per-layer balance, traffic, plan time and step
time; plots imbalance.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from ..core.errors import ChildFailed
from ..core.outfile import save_figure
from ..core.presets import POLICY_DIR

DEFAULT_CONFIG = POLICY_DIR / "default.yaml"  # the shipped preset (package data)
VIRTUAL_NODE = 2  # ranks per virtual node on CPU, so RailS and same-node routing have nodes to work with


def _run(policy_args: list[str], label: str, steps: int, ranks: int, out: str, quiet: bool,
         microbatches: int, pin: bool, shape: str) -> tuple[dict, dict]:
    """One training run (torchrun) of the policy and stock beside it, step by step in turns; their
    JSON (stock's, the policy's), each with "routing": its routing log (bool [Y, C, D, T, E])."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
           "--standalone", "-m", "megatron_rails.demo.train", "--shape", shape, "--against-stock",
           *policy_args, "--steps", str(steps), "--microbatches", str(microbatches), "--out", out,
           "--routing", f"{out}.routing.npz", *(["--pin"] if pin else [])]
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    tail = []
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        if line.startswith("[") and " step " in line and not quiet:
            who, rest = line[1:].split("] ", 1)
            print(f"  {'stock' if who == 'stock' else label}: {rest.rstrip()}", file=sys.stderr, flush=True)
    if proc.wait() != 0:
        raise ChildFailed(f"training run '{label}' failed (exit {proc.returncode}):\n{''.join(tail)}")
    with open(out) as f:
        res = json.load(f)
    with np.load(f"{out}.routing.npz") as z:
        res["stock"]["routing"], res["policy"]["routing"] = z["maps_stock"], z["maps"]
    return res["stock"], res["policy"]


def parity(base: dict, bal: dict) -> dict:
    """Loss parity of `bal` against `base` by the long-run rule: per step, the tokens routed
    differently (routing flips), and the largest relative loss difference before the first one."""
    from ..megatron.routing_log import flips_per_forward

    lb, lr = np.array(base["losses"]), np.array(bal["losses"])
    flips_I = flips_per_forward(bal["routing"], base["routing"]).reshape(len(lr), -1).sum(axis=1)
    flipped = np.flatnonzero(flips_I)
    first = int(flipped[0]) if flipped.size else len(lr)
    rel = np.abs(lb - lr) / np.abs(lb)
    Y, C, D, T, E = base["routing"].shape
    return {"loss_max_abs_diff": float(np.max(np.abs(lb - lr))), "loss_max_rel_diff": float(np.max(rel)),
            "loss_max_rel_diff_before_flip": float(np.max(rel[:first], initial=0.0)),
            "first_flip_step": first, "routing_flips_per_step": [int(f) for f in flips_I],
            "routings_per_step": Y * (C // len(lr)) * D * T}


def summarize(base: dict, bal: dict) -> dict:
    lr = np.array(bal["losses"])
    n_steps = max(1, len(lr))

    def layer_stats(run):
        out = []
        for i, steps in enumerate(run["layers"]):
            out.append({
                "layer": i,
                "max_over_mean_before": float(np.mean([m["max_over_mean_before"] for m in steps])),
                "max_over_mean_after": float(np.mean([m["max_over_mean_after"] for m in steps])),
                # records are per microbatch; per optimizer step: their sum over the step
                "token_bytes_per_step": float(np.sum([m["token_bytes_sent"] for m in steps]) / n_steps),
                "weight_bytes_per_step": float(np.sum([m["weight_bytes_sent"] for m in steps]) / n_steps),
                "plan_us_p50": float(np.median([m["plan_us"] for m in steps])),
            })
        return out

    layers = layer_stats(bal)
    plan_us = [m["plan_us"] for steps in bal["layers"] for m in steps]
    return {
        "policy": bal["policy"], "steps": len(lr), "ranks": bal["world"],
        **parity(base, bal),
        "loss_first": float(lr[0]), "loss_last": float(lr[-1]),
        "imbalance_before": float(np.mean([x["max_over_mean_before"] for x in layers])),
        "imbalance_after": float(np.mean([x["max_over_mean_after"] for x in layers])),
        "plan_us_p50": float(np.median(plan_us)),
        "step_ms_stock": float(np.median(base["step_s"]) * 1e3),
        "step_ms_policy": float(np.median(bal["step_s"]) * 1e3),
        "layers": layers,
    }


def plot(bal: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4))
    n_steps = max(1, len(bal.get("losses", [])) or 1)
    colors = plt.get_cmap("tab10").colors
    for i, recs in enumerate(bal["layers"]):
        # one record per microbatch: microbatch j of step s sits at s + j / microbatches (steps from 1)
        per = max(1, len(recs) // n_steps)
        x = 1 + np.arange(len(recs)) / per
        c = colors[i % len(colors)]  # a layer's stock and policy lines share its colour
        ax.plot(x, [m["max_over_mean_before"] for m in recs], ls="--", color=c, label=f"layer {i}: stock placement")
        ax.plot(x, [m["max_over_mean_after"] for m in recs], color=c, label=f"layer {i}: {bal['policy']}")
    ax.axhline(1.0, color="grey", ls=":", lw=1, label="perfect balance (1.0)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("training step (points: its microbatches)")
    ax.set_ylabel("max / mean tokens per rank")
    ax.set_title(f"expert load imbalance per microbatch: stock placement (dashed) vs {bal['policy']} (solid)",
                 fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    save_figure(fig, png, dpi=110)
    plt.close(fig)


def print_report(summary: dict, policy: str, comm: str, ranks: int, G: int, steps: int, microbatches: int,
                 pin: bool) -> None:
    """The demo's table and notes, fitting the terminal (80 columns when not a terminal)."""
    from ..sim.term import console, note, table

    # the setup is in the demo's first line; a title wider than the table would wrap mid-phrase
    t = table(f"stock vs {policy}, comm {comm}: {steps} steps",
              ["layer", "max/mean\nstock", f"max/mean\n{policy}", "token\nMB/step", "weight\nMB/step",
               "plan us\np50"])
    for x in summary["layers"]:
        t.add_row(str(x["layer"]), f"{x['max_over_mean_before']:.3f}", f"{x['max_over_mean_after']:.3f}",
                  f"{x['token_bytes_per_step'] / 1e6:.3f}", f"{x['weight_bytes_per_step'] / 1e6:.3f}",
                  f"{x['plan_us_p50']:.0f}")
    con = console(t)
    con.print(t)
    note(con, f"max/mean: tokens on the busiest rank / mean, stock placement and {policy}; "
              f"MB/step: bytes sent per optimizer step; plan us p50: median planner time per call")
    first, flips = summary["first_flip_step"], sum(summary["routing_flips_per_step"])
    until = "every step" if first == steps else f"the {first} steps before the first routing flip"
    note(con, f"loss parity against stock Megatron-Core (alltoall dispatcher): {until} within "
              f"{summary['loss_max_rel_diff_before_flip']:.1e} relative; {flips} of "
              f"{summary['routings_per_step'] * steps} token routings flipped over the run (near-tie router "
              f"scores, then the runs part: max relative loss difference {summary['loss_max_rel_diff']:.1e}); "
              f"loss {summary['loss_first']:.4f} -> {summary['loss_last']:.4f}")
    note(con, f"step time (median, {microbatches} microbatches): stock {summary['step_ms_stock']:.0f} ms, {policy} "
              f"{summary['step_ms_policy']:.0f} ms ({summary['step_ms_policy'] / summary['step_ms_stock']:.2f}x; "
              f"CPU gloo{', one core per rank' if pin else ', ranks sharing cores: not comparable'}; "
              f"not a GPU timing)")
    w = sum(x["weight_bytes_per_step"] for x in summary["layers"])
    tok = sum(x["token_bytes_per_step"] for x in summary["layers"])
    if summary["step_ms_policy"] > summary["step_ms_stock"] and w > tok:
        note(con, f"{policy} moved {w / max(tok, 1):.0f}x more weight bytes than token bytes per step, and here "
                  f"nothing overlaps that traffic: at this toy scale the re-layout costs more than the imbalance "
                  f"it removes (docs/benchmarks.md)")


def run_demo(config: str | None = None, steps: int = 20, ranks: int | None = None, json_out: bool = False,
             png: str = "demo-imbalance.png", microbatches: int = 4, shape: str = "compute") -> int:
    config = str(config or DEFAULT_CONFIG)
    from ..core.policy import as_policy

    pcfg = as_policy(config)  # fail fast, before launching anything
    if os.path.isfile(config) is False and (POLICY_DIR / f"{config}.yaml").is_file():
        config = str(POLICY_DIR / f"{config}.yaml")  # a preset name: the training script takes a path
    cores = len(os.sched_getaffinity(0))
    ranks = ranks or max(2, min(4, cores))  # one rank has nothing to balance
    pin = ranks <= cores  # more ranks than cores still runs, but step times then do not compare
    G = VIRTUAL_NODE if ranks % VIRTUAL_NODE == 0 else ranks  # an odd rank count: one node
    from ..sim.term import wrapped

    with tempfile.TemporaryDirectory() as tmp:
        print(wrapped(f"megatron-rails demo: {ranks} CPU ranks (gloo{', one core each' if pin else ', sharing cores'}) "
                      f"as {ranks // G} virtual node(s) x {G}, {steps} steps x {microbatches} microbatches, "
                      f"skewed routing; stock Megatron-Core and {pcfg.policy} (comm: {pcfg.comm}, from {config}) "
                      f"from the same weights, step by step in turns"),
              file=sys.stderr)
        node = ["--ranks-per-node", str(G)]
        base, bal = _run(["--config", config, *node], pcfg.policy, steps, ranks, f"{tmp}/run.json", json_out,
                         microbatches, pin, shape)
    bal["policy"] = pcfg.policy
    summary = summarize(base, bal)
    del base["routing"], bal["routing"]
    summary.update(comm=pcfg.comm, ranks_per_node=G, microbatches=microbatches, pinned=pin, plot=png)
    if json_out:  # the results first: a figure that fails loses none of them
        print(json.dumps(summary), flush=True)
    else:
        print_report(summary, pcfg.policy, pcfg.comm, ranks, G, steps, microbatches, pin)
    plot(bal, png)
    print(f"wrote {png}", file=sys.stderr)
    return 0
