"""`megatron-rails bench local`: the dispatcher's local work on one device, against Megatron-Core's
own permute/unpermute for the same tokens.

One EP rank's share of a layer step, without the collectives: the plan from the exact counts (with
its token route and split sizes, which every rank derives from it), the pairs put in send order
(dispatch_preprocess), the received rows grouped by slot (dispatch_postprocess), and the way back
(combine_preprocess and combine_postprocess). The stock
side is what Megatron-Core's alltoall dispatcher does locally: permute, sort_chunks_by_idxs twice
when a rank holds more than one expert, unpermute. Excluded on both sides: the count exchange, the
all-to-alls, expert compute and weight movement. Each side is timed on its busiest rank (the most
rows received: the rank a step waits for), with that rank's own routing. Rows another rank would
have sent are random tensors of the right size; this rank's routing comes from a softmax top-k over random logits with a
zipf popularity bias per expert (s = 0: uniform).

Runs on CPU (a smoke test) or CUDA (`--device cuda`: the figures the issue asks for).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np
import torch

from ..core.errors import InputError
from ..core.outfile import summary_stream, write_text
from ..core.policy import PolicyConfig
from ..runtime.local import pairs_per_token_range, send_order, send_order_path, sum_pairs, token_rows
from ..runtime.receive import rows, rows_back
from ..runtime.staging import STAGING_ENV
from ..core.planners import make_planner

# Mixtral 8x7B / 8x22B: hidden 4096 / 6144, 8 experts top-2; a 4096-token sequence per rank, EP 8
SHAPES = {
    "mixtral-8x7b": dict(hidden=4096, experts=8, topk=2, tokens=4096, ep=8),
    "mixtral-8x22b": dict(hidden=6144, experts=8, topk=2, tokens=4096, ep=8),
    "tiny": dict(hidden=64, experts=8, topk=2, tokens=256, ep=4),
}
DTYPES = ("bfloat16", "float16", "float32")  # hidden-state dtypes the timed kernels take
POLICIES = ["none", "eplb", "ultraep", "lp", "fsep"]
SKEWS = {"uniform": 0.0, "zipf:1.2": 1.2}
# the GPU issue's targets: (plan + local) / Megatron-Core's permute-unpermute, every policy, on CUDA
TARGETS = {"uniform": 1.2, "zipf:1.2": 1.6}


def routing(shape: dict, s: float, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """routing_map bool [T, E] and probs [T, E] (zero where not routed) of one rank's tokens."""
    T, E, k = shape["tokens"], shape["experts"], shape["topk"]
    g = torch.Generator().manual_seed(seed)
    bias = -s * torch.log(torch.arange(1, E + 1, dtype=torch.float32))
    bias = bias[torch.randperm(E, generator=torch.Generator().manual_seed(7))]  # one popularity order for all ranks
    logits = torch.randn(T, E, generator=g) + bias
    top_p, top_e = torch.softmax(logits, dim=-1).topk(k, dim=-1)
    probs = torch.zeros(T, E).scatter(1, top_e, top_p)
    return (probs > 0).to(device), probs.to(device)


def case(policy: str, skew: str, shape: dict, dtype, device) -> tuple:
    """One policy x skew case, ready to time: the six timed steps by name (this project's dispatch,
    which plans first as the dispatcher does, regroup, combine; Megatron-Core's), facts of the case
    for the JSON row, and the list every dispatch appends its planning microseconds to. Checks that
    the send order holds exactly the routed pairs."""
    from ..megatron.models import stock_local_ops

    stock_permute, sort_chunks_by_idxs, unpermute = stock_local_ops()

    D, E, H, T = shape["ep"], shape["experts"], shape["hidden"], shape["tokens"]
    L = E // D
    maps = [routing(shape, SKEWS[skew], 1000 + d, device) for d in range(D)]
    counts_DE = np.stack([m.sum(dim=0).cpu().numpy() for m, _ in maps]).astype(np.int64)
    x = torch.randn(T, H, dtype=dtype, device=device)
    planner = make_planner(policy, PolicyConfig(policy=policy).planner_config(D, E))
    state = planner.initial_state()
    plan, state = planner.plan(counts_DE, state)
    plan_us: list = []  # every dispatch's planning time (host only)

    # -- this project's dispatcher: the same functions RailsTokenDispatcher calls
    me = int(np.argmax(plan.send_DD.sum(axis=0)))
    rmap, probs = maps[me]
    P = int(counts_DE[me].sum())
    Q = int(plan.send_DD[:, me].sum())
    L_own = plan.placement.owner_slots
    x_recv = torch.randn(Q, H, dtype=dtype, device=device)
    pr_recv = torch.rand(Q, dtype=torch.float32, device=device)
    y_back = torch.randn(P, H, dtype=dtype, device=device)
    state_ours = {}
    # what the runtime learns with the count all-gather (outside the timed work, as that gather is)
    lo, hi = pairs_per_token_range(rmap).tolist()

    def ours_dispatch():
        # as the dispatcher: the plan right after the counts arrive (with its route and split
        # sizes, before any rank can send), then the send order, the receive order made (and on a
        # GPU copied) with it
        t0 = time.perf_counter()
        fresh, _ = planner.plan(counts_DE, state)
        fresh.route, fresh.send_DD
        plan_us.append((time.perf_counter() - t0) * 1e6)
        so = send_order(fresh, me, rmap, probs, uniform=lo == hi, receive=True)
        state_ours["sent"] = so
        return token_rows(x, so), so.probs_P

    def ours_regroup():
        order, inverse, per_slot = state_ours["sent"].receive
        state_ours["order"] = order  # combine puts the rows back with it
        state_ours["n_owner"] = int(per_slot[:L_own].sum())
        return rows(x_recv, order, inverse), rows(pr_recv, order, inverse)

    def ours_combine():
        y_Q, n = x_recv, state_ours["n_owner"]  # expert outputs in slot order: owner slots', replica slots'
        parts = [y_Q[:n], y_Q[n:]] if n < Q else [y_Q]
        return rows_back(parts, state_ours["order"]), sum_pairs(y_back, state_ours["sent"], T)

    # -- Megatron-Core's alltoall dispatcher, local part
    stock_me = int(np.argmax(counts_DE.sum(axis=0).reshape(D, L).sum(axis=1)))
    local = slice(stock_me * L, (stock_me + 1) * L)
    s_rmap, s_probs = maps[stock_me]
    P_stock = int(counts_DE[stock_me].sum())
    per_local_DL = torch.from_numpy(counts_DE[:, local].copy())
    Q_stock = int(per_local_DL.sum())
    xs_recv = torch.randn(Q_stock, H, dtype=dtype, device=device)
    ps_recv = torch.rand(Q_stock, dtype=torch.float32, device=device)
    sort_in = torch.arange(D * L).reshape(D, L).T.ravel()
    sort_back = torch.arange(D * L).reshape(L, D).T.ravel()
    ys_back = torch.randn(P_stock, H, dtype=dtype, device=device)
    state_stock = {}

    def stock_dispatch():
        out, pprobs, idx = stock_permute(x, s_rmap, s_probs, P_stock)
        state_stock["idx"] = idx
        return out, pprobs

    def stock_regroup():
        if L > 1:
            return sort_chunks_by_idxs(xs_recv, per_local_DL.ravel(), sort_in, probs=ps_recv)
        return xs_recv, ps_recv

    def stock_combine():
        y = xs_recv
        if L > 1:
            y, _ = sort_chunks_by_idxs(y, per_local_DL.T.ravel(), sort_back)
        return y, unpermute(ys_back, state_stock["idx"], restore_shape=x.shape, routing_map=s_rmap)

    # the dispatcher sends exactly the routed token-expert pairs
    ours_dispatch()
    if not torch.equal(torch.sort(state_ours["sent"].token_P).values, rmap.nonzero()[:, 0]):
        raise RuntimeError(f"{policy}/{skew}: the dispatcher's send order is not a permutation of the routed pairs")

    steps = {"dispatch": ours_dispatch, "regroup": ours_regroup, "combine": ours_combine,
             "stock_dispatch": stock_dispatch, "stock_regroup": stock_regroup, "stock_combine": stock_combine}
    facts = {"rank": me, "pairs_sent": P, "rows_received": Q, "rank_stock": stock_me, "rows_received_stock": Q_stock}
    return steps, facts, plan_us


def _rounds(steps: dict, reps: int, sync) -> tuple[dict, dict]:
    """Per step, microseconds of every round (after 3 warm-up rounds): from a synced device to the
    sync after the call, and to the call's return (the host's share: queuing the work; on a GPU the
    rest is waiting for it). Every round calls every step once, starting one step later than the
    round before, so that drift (clocks, the host's other work) falls on both sides alike."""
    names = list(steps)
    full = {n: [] for n in names}
    host = {n: [] for n in names}
    for r in range(reps + 3):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            sync()
            t0 = time.perf_counter()
            steps[name]()
            t1 = time.perf_counter()
            sync()
            if r >= 3:
                full[name].append((time.perf_counter() - t0) * 1e6)
                host[name].append((t1 - t0) * 1e6)
    return full, host


def _rows_for(policy: str, skew: str, shape: dict, dtype, device, reps: int, sync) -> dict:
    steps, facts, plan_us = case(policy, skew, shape, dtype, device)
    full, host = _rounds(steps, reps, sync)
    plan_R = plan_us[-reps:]  # the timed rounds' plans; the dispatch step's own time is the rest
    full["dispatch"] = [f - p for f, p in zip(full["dispatch"], plan_R)]
    host["dispatch"] = [h - p for h, p in zip(host["dispatch"], plan_R)]
    seg = {}
    for name in steps:
        seg[name], seg[name + "_host"] = statistics.median(full[name]), statistics.median(host[name])
    plan_p50 = statistics.median(plan_R)
    ours = seg["dispatch"] + seg["regroup"] + seg["combine"]
    stock = seg["stock_dispatch"] + seg["stock_regroup"] + seg["stock_combine"]
    # paired: each round's plan + local over the same round's Megatron-Core local work
    paired = [(plan_R[r] + full["dispatch"][r] + full["regroup"][r] + full["combine"][r])
              / (full["stock_dispatch"][r] + full["stock_regroup"][r] + full["stock_combine"][r]) for r in range(reps)]
    local_only = [(full["dispatch"][r] + full["regroup"][r] + full["combine"][r])
                  / (full["stock_dispatch"][r] + full["stock_regroup"][r] + full["stock_combine"][r]) for r in range(reps)]
    return {"policy": policy, "skew": skew, "plan_us_p50": plan_p50,
            "dispatch_us_p50": seg["dispatch"], "regroup_us_p50": seg["regroup"], "combine_us_p50": seg["combine"],
            "local_us_p50": ours, "plan_plus_local_us_p50": plan_p50 + ours,
            "megatron_dispatch_us_p50": seg["stock_dispatch"], "megatron_regroup_us_p50": seg["stock_regroup"],
            "megatron_combine_us_p50": seg["stock_combine"], "megatron_local_us_p50": stock,
            # until each call returned: the host's share (equal to the above on CPU)
            "dispatch_host_us_p50": seg["dispatch_host"], "regroup_host_us_p50": seg["regroup_host"],
            "combine_host_us_p50": seg["combine_host"], "megatron_dispatch_host_us_p50": seg["stock_dispatch_host"],
            "megatron_regroup_host_us_p50": seg["stock_regroup_host"],
            "megatron_combine_host_us_p50": seg["stock_combine_host"],
            "ratio_vs_megatron": statistics.median(paired), "ratio_local_only": statistics.median(local_only),
            "ratio_of_medians": (plan_p50 + ours) / stock, **facts}


def targets(rows: list[dict]) -> dict:
    """The issue's targets on the rows (True: met): ratio_vs_megatron at most TARGETS[skew], per
    policy. They are set for CUDA; on CPU they are reported all the same, as a smoke check."""
    return {f"{skew}_ratio_le_{limit}": {r["policy"]: r["ratio_vs_megatron"] <= limit for r in rows
                                         if r["skew"] == skew} for skew, limit in TARGETS.items()}


def markdown_table(rows: list[dict]) -> str:
    """The rows as a markdown table (docs/benchmarks.md): medians in microseconds."""
    lines = ["| routing | policy | plan | dispatch | regroup | combine | plan + local | Megatron-Core | ratio "
             "| rows received (ours / stock busiest) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['skew'].replace(':', ' ')} | {r['policy']} | {r['plan_us_p50']:.0f} | "
                     f"{r['dispatch_us_p50']:.0f} | {r['regroup_us_p50']:.0f} | {r['combine_us_p50']:.0f} | "
                     f"{r['plan_plus_local_us_p50']:.0f} | {r['megatron_local_us_p50']:.0f} | "
                     f"{r['ratio_vs_megatron']:.2f} | {r['rows_received']} / {r['rows_received_stock']} |")
    return "\n".join(lines)


def bench_local(out: str, shape_name: str = "mixtral-8x7b", device: str = "cpu", dtype: str = "bfloat16",
                reps: int = 200) -> dict:
    if shape_name not in SHAPES:
        raise InputError(f"--shape: unknown shape {shape_name!r}; choose one of {', '.join(SHAPES)}")
    if dtype not in DTYPES:
        raise InputError(f"--dtype: unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA device is visible to torch here")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise InputError(f"--device: {device!r} is not a torch device (cpu, cuda, cuda:N)") from None
    if dev.type not in ("cpu", "cuda"):  # meta holds no data, others run neither path
        raise InputError(f"--device {device!r}: the benchmark times work on cpu or cuda (cuda:N)")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise InputError(f"--device {device!r}: torch sees {torch.cuda.device_count()} CUDA device(s) here")
    shape, dt = SHAPES[shape_name], getattr(torch, dtype)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    from ..megatron.models import MCORE_VERSION

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    from ..sim.term import wrapped

    print(wrapped(f"local-work bench on {name}: {shape_name} ({', '.join(f'{k} {v}' for k, v in shape.items())}), "
                  f"{dtype}, each side's busiest rank; send order: "
                  f"{send_order_path(torch.zeros(1, 1, dtype=torch.bool, device=dev))}"), file=sys.stderr)
    # untimed, every case once: first-use costs (CUDA context, kernels, the Triton kernel's variants)
    # and a GPU's clocks, which ran the first timed cases slow after one warm-up case on an H200
    for skew in SKEWS:
        for policy in POLICIES:
            _rows_for(policy, skew, shape, dt, dev, 2, sync)
    rows = []
    for skew in SKEWS:
        for policy in POLICIES:
            r = _rows_for(policy, skew, shape, dt, dev, reps, sync)
            rows.append(r)
            print(f"  {policy:7s} {skew:8s} plan {r['plan_us_p50']:6.0f} + local {r['local_us_p50']:7.0f} us vs "
                  f"megatron {r['megatron_local_us_p50']:7.0f} us: {r['ratio_vs_megatron']:.2f}x", file=sys.stderr)
    res = {"meta": {"command": "megatron-rails bench local", "device": name, "shape": shape_name, **shape,
                    "dtype": dtype, "reps": reps, "torch": torch.__version__,
                    "megatron_core": MCORE_VERSION,
                    "send_order_path": send_order_path(torch.zeros(1, 1, dtype=torch.bool, device=dev)),
                    "h2d_staging": os.environ.get(STAGING_ENV, "pinned"),
                    "note": "per-call medians in microseconds over rounds that call every step once (in "
                            "rotating order); local work only (no collectives, no expert compute), on each "
                            "side's busiest rank (most rows received); plan: the planner, the route and the "
                            "split sizes; megatron_*: moe_utils.permute/sort_chunks_by_idxs/unpermute, "
                            "unfused; ratio_vs_megatron: median over rounds of (plan + local) / megatron "
                            "(paired), ratio_of_medians: the same from the medians; *_host_us_p50: until the "
                            "call returned (the host's share), the others to the sync after it"},
           "rows": rows, "targets": targets(rows)}
    write_text(out, json.dumps(res, indent=1))
    # stdout: the summary, as every bench (stderr where --out is stdout); stderr: progress and where the
    # results went
    print(json.dumps({"ratio_vs_megatron": {f"{r['policy']} {r['skew']}": r["ratio_vs_megatron"] for r in rows}},
                     indent=1), file=summary_stream(out))
    print(f"wrote {out}", file=sys.stderr)
    return res
