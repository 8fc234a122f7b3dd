"""`megatron-rails soak`: long-running checks that nothing drifts, leaks or silently diverges.

* planner soak: N planner calls per policy on a drifting random workload (hot set moving, bursts),
  every plan validated and its route recounted against the counts; peak RSS at start and end;
* dispatcher soak: S steps on W gloo ranks with random routings (skewed, uniform, all to one expert,
  a rank skipping its own experts), the balanced MoELayer compared every step with the stock
  allgather dispatcher built with identical weights (output and every gradient, 1e-5); the policy
  and comm rotate; RSS sampled every step.

Results as JSON; `failures` must be 0 and RSS flat (end within a small margin of the post-warm-up value).
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time

import numpy as np

POLICIES = ["none", "eplb", "ultraep", "lp", "fsep"]
CASES = [("ultraep", "direct"), ("fsep", "rails"), ("lp", "direct"), ("eplb", "rails"), ("fsep", "direct"),
         ("none", "direct"), ("ultraep", "rails")]


def rss_mb() -> float:
    """Current resident set size of this process, MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def planner_soak(calls: int = 2000, ranks: int = 32, experts: int = 64, seed: int = 0, progress=None) -> dict:
    from ..core.planners import PlannerConfig, make_planner
    from ..core.workloads import WorkloadSpec, counts as counts_at

    spec = WorkloadSpec(num_ranks=ranks, num_experts=experts, topk=6, tokens_per_rank=2048, skew="drift:1.2:25",
                        seed=seed)
    cfg = PlannerConfig(ranks, experts, 8, 2, window=4, interval=3)
    planners = {p: make_planner(p, cfg) for p in POLICIES}
    states = {p: pl.initial_state() for p, pl in planners.items()}
    rss0, failures, worst, rss_samples = rss_mb(), [], {p: 0.0 for p in POLICIES}, []
    rng = np.random.default_rng(seed)
    for i in range(calls):
        counts = counts_at(spec, step=i)
        if i % 7 == 3:  # a burst: one expert takes a large extra share on a few ranks
            counts = counts.copy()
            counts[rng.integers(ranks, size=4), rng.integers(experts)] += 4 * counts.sum() // ranks
        for p, pl in planners.items():
            try:
                plan, states[p] = pl.plan(counts, states[p])
                plan.validate()
                ptr, rep, tok = plan.route
                got = np.zeros_like(counts)
                np.add.at(got, (np.repeat(np.arange(ranks), np.diff(ptr)), plan.placement.replica_expert_R[rep]), tok)
                if not np.array_equal(got, counts):
                    raise AssertionError("route does not conserve the counts")
                worst[p] = max(worst[p], plan.max_over_mean)
            except Exception as err:  # recorded, not raised: the soak reports every failure
                failures.append({"call": i, "policy": p, "error": f"{type(err).__name__}: {err}"})
        if i == 0:
            rss0 = rss_mb()  # after the first call: imports, caches and solver set-up are done
        if (i + 1) % 200 == 0 or i + 1 == calls:
            rss_samples.append(round(rss_mb(), 1))
        if progress and (i + 1) % 200 == 0:
            progress(f"planner soak: {i + 1}/{calls} calls x {len(POLICIES)} policies, rss {rss_mb():.0f} MiB")
    return {"calls": calls, "policies": POLICIES, "ranks": ranks, "experts": experts, "failures": failures,
            "worst_max_over_mean": worst, "rss_mb_after_first_call": rss0, "rss_mb_every_200_calls": rss_samples, "rss_mb_end": rss_mb(), "peak_rss_mb": peak_rss_mb()}


def _layer_config(world, dispatcher, E=8, H=16, ffn=24):
    import torch

    from ..megatron import models

    return models.transformer_config(
        num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=E, moe_router_topk=2,
        moe_token_dispatcher_type=dispatcher, ffn_hidden_size=ffn, moe_ffn_hidden_size=ffn, add_bias_linear=False,
        expert_model_parallel_size=world, use_cpu_initialization=True, moe_aux_loss_coeff=0.0,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, bias_activation_fusion=False,
        moe_router_load_balancing_type="none", init_method_std=0.2)


def _dispatcher_worker(rank, world, store, steps, out, timeout_s):
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ..runtime.comm.base import leave

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))  # a file rendezvous: no port to race for
    from ..megatron import models
    from ..megatron.install import install, uninstall

    models.init_model_parallel(world, timeout_s)
    E, H, T = 8, 16, 12
    torch.manual_seed(1234)
    stock = models.build_moe_layer(_layer_config(world, "allgather"))
    layers = {}
    for case in CASES:
        install({"policy": case[0], "comm": case[1], "slots": 2, "ranks_per_node": 2,
                                "interval": 3, "window": 2, "check_plan": True})
        layers[case] = models.build_moe_layer(_layer_config(world, "alltoall"))
        uninstall()
        layers[case].load_state_dict(stock.state_dict())
    base = stock.router.weight.detach().clone()
    u = np.random.default_rng(99).standard_normal(H)
    u /= np.linalg.norm(u)
    rng, shared = np.random.default_rng(7919 * rank + 1), np.random.default_rng(11)
    failures, rss, t0 = [], [], time.perf_counter()
    for step in range(steps):
        case = CASES[step % len(CASES)]
        kind = ("zipf", "uniform", "one", "zipf")[step % 4]
        if kind == "uniform":
            alpha = np.zeros(E)
        elif kind == "one":
            alpha = np.zeros(E)
            alpha[shared.integers(E)] = 50.0
        else:
            alpha = shared.permutation(3.0 / np.arange(1, E + 1) ** shared.uniform(0.8, 1.5))
        x_np = rng.standard_normal((T, H)) * 0.5 + 2.0 * u * (3.0 if kind == "one" and rank == 1 else 1.0)
        router_w = base + torch.tensor(np.outer(alpha, u), dtype=torch.float32)
        got = []
        for layer in (stock, layers[case]):
            layer.zero_grad(set_to_none=True)
            with torch.no_grad():
                layer.router.weight.copy_(router_w)
            x = torch.tensor(x_np, dtype=torch.float32).view(-1, 1, H).requires_grad_(True)
            y, _ = layer(x)
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
            grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                     for n, p in layer.named_parameters()}
            store = getattr(layer.token_dispatcher, "store", None)
            if hasattr(store, "owner_layout_grads"):
                grads.update({f"experts.{k}": v for k, v in store.owner_layout_grads().items()})
            got.append((y.detach(), x.grad.clone(), grads))
        (y1, g1, w1), (y2, g2, w2) = got
        bad = [n for n in w1 if not torch.allclose(w2[n], w1[n], rtol=1e-5, atol=1e-5)]
        if not torch.allclose(y2, y1, rtol=1e-5, atol=1e-5):
            bad.insert(0, "output")
        if not torch.allclose(g2, g1, rtol=1e-5, atol=1e-5):
            bad.insert(0, "input grad")
        if bad:
            failures.append({"step": step, "case": "/".join(case), "routing": kind, "rank": rank, "mismatch": bad})
        rss.append(rss_mb())
        if rank == 0 and (step + 1) % 20 == 0:
            print(f"dispatcher soak: step {step + 1}/{steps}, rss {rss[-1]:.0f} MiB, "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    metrics_kept = {"/".join(c): len(layers[c].token_dispatcher.metrics) for c in CASES}
    res = {"rank": rank, "failures": failures, "rss_mb": rss, "peak_rss_mb": peak_rss_mb(),
           "metrics_kept": metrics_kept}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)
    dist.barrier()
    leave()  # ends the process: see runtime/comm/base.leave


def dispatcher_soak(steps: int = 200, world: int = 4, timeout_s: float = 300.0) -> dict:
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/soak"
        from ..sim.term import quiet_children

        with quiet_children():
            mp.start_processes(_dispatcher_worker, args=(world, f"{tmp}/store", steps, out, timeout_s), nprocs=world,
                               start_method="spawn")
        ranks = []
        for r in range(world):
            with open(f"{out}.{r}") as f:
                ranks.append(json.load(f))
    warm = min(len(CASES) * 2, steps - 1)  # every case has built its buffers and caches by then
    rss_warm = [r["rss_mb"][warm] for r in ranks]
    rss_end = [r["rss_mb"][-1] for r in ranks]
    return {"steps": steps, "world": world, "cases": ["/".join(c) for c in CASES],
            "failures": [f for r in ranks for f in r["failures"]],
            "rss_mb_after_warmup": rss_warm, "rss_mb_end": rss_end,
            "rss_growth_mb_max": max(e - w for e, w in zip(rss_end, rss_warm)),
            "peak_rss_mb": [r["peak_rss_mb"] for r in ranks]}


def run_soak(planner_calls: int, steps: int, world: int, out: str | None, json_out: bool) -> int:
    from ..sim.term import wrapped

    def say(msg):
        print(wrapped(msg), file=sys.stderr, flush=True)

    parts = ([f"{planner_calls} planner calls per policy"] if planner_calls else []) + \
        ([f"{steps} dispatcher steps on {world} gloo ranks"] if steps else [])
    say(f"soak: {', then '.join(parts) or 'nothing to run'}")
    t0 = time.perf_counter()
    res = {"planner": planner_soak(planner_calls, progress=say) if planner_calls else None,
           "dispatcher": dispatcher_soak(steps, world) if steps else None}
    res["seconds"] = time.perf_counter() - t0
    fails = sum(len(v["failures"]) for v in res.values() if isinstance(v, dict))
    res["ok"] = fails == 0
    from ..core.outfile import is_stdout, write_text

    if out:
        write_text(out, json.dumps(res, indent=1))
    if json_out and not (out and is_stdout(out)):  # `--out /dev/stdout --json`: one document, not two
        print(json.dumps(res))
    else:
        p, d = res["planner"], res["dispatcher"]
        if p:
            say(f"planner soak: {p['calls']} calls x {len(p['policies'])} policies, {len(p['failures'])} failures, "
                f"rss after the first call {p['rss_mb_after_first_call']:.0f} -> end {p['rss_mb_end']:.0f} MiB")
        if d:
            say(f"dispatcher soak: {d['steps']} steps on {d['world']} ranks, {len(d['failures'])} parity failures, "
                f"rss after warm-up {max(d['rss_mb_after_warmup']):.0f} MiB -> end {max(d['rss_mb_end']):.0f} MiB "
                f"(growth <= {d['rss_growth_mb_max']:.1f} MiB)")
    return 0 if res["ok"] else 1
