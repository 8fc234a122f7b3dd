"""Where `bench local`'s time goes, step by step: for every policy x skew case of one shape, each timed
step's median (to the device sync and to the call's return), the kernels and torch ops it runs
(torch.profiler: device time and host time per op) and the host's Python functions (cProfile).

    python scripts/profile_local.py [--shape mixtral-8x22b] [--device cuda] [--reps 30] [--out DIR]
    python scripts/profile_local.py --plan-only [--reps 300] [--cold]   # the planning alone, host time

Writes DIR/profile.txt (the tables) and prints a one-line summary per case. A development tool:
the figures the issue asks for come from `megatron-rails bench local`.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron_rails.bench.local import POLICIES, SHAPES, SKEWS, _rounds, case  # noqa: E402


def _python_profile(fn, sync, calls: int = 100, rows: int = 16) -> str:
    """The host's Python functions under fn, per call of fn in microseconds: own time, with callees."""
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        fn()
    sync()
    pr.disable()
    st = pstats.Stats(pr).stats
    top = sorted(st.items(), key=lambda kv: -kv[1][2])[:rows]
    out = [f"{'own us':>8s} {'cum us':>8s} {'calls':>6s}  function"]
    for (path, line, name), (_, nc, tt, ct, _) in top:
        out.append(f"{tt / calls * 1e6:8.1f} {ct / calls * 1e6:8.1f} {nc / calls:6.1f}  "
                   f"{os.path.basename(path)}:{line}({name})")
    return "\n".join(out)


def plan_only(shape_name: str, policies, reps: int, cold: bool = False) -> None:
    """Per policy x skew, the median host time of what a dispatch computes before it can send:
    planner.plan, the plan's route and its split sizes (no tensors beyond the routing).

    cold: each call after a 64 MiB sweep that evicts the host's caches, as the local work between
    two plans does in a training step (and in `bench local`): there the same planning takes 5-10x
    its time in a loop, because its code and data come from memory again; what counts then is how
    much code and how many numpy calls a plan runs through, more than the arithmetic."""
    import time

    import numpy as np

    from megatron_rails.bench.local import routing
    from megatron_rails.core.planners import make_planner
    from megatron_rails.core.policy import PolicyConfig

    shape = SHAPES[shape_name]
    D, E = shape["ep"], shape["experts"]
    sweep = np.ones((64 << 20) // 8) if cold else None
    for skew, s in SKEWS.items():
        maps = [routing(shape, s, 1000 + d, "cpu") for d in range(D)]
        counts_DE = np.stack([m.sum(dim=0).numpy() for m, _ in maps]).astype(np.int64)
        for policy in policies:
            planner = make_planner(policy, PolicyConfig(policy=policy).planner_config(D, E))
            state = planner.initial_state()
            _, state = planner.plan(counts_DE, state)
            us = []
            for _ in range(reps):
                if sweep is not None:
                    sweep += 1.0
                t0 = time.perf_counter()
                plan, _ = planner.plan(counts_DE, state)
                plan.route, plan.send_DD
                us.append((time.perf_counter() - t0) * 1e6)
            print(f"{policy:8s} {skew:9s} plan + route + split sizes p50 {statistics.median(us):7.1f} us"
                  f"{' (cold caches)' if cold else ''}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="mixtral-8x22b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--out", default=".")
    ap.add_argument("--plan-only", action="store_true",
                    help="only the planning each dispatch starts with, on the host (no device, no profile)")
    ap.add_argument("--cold", action="store_true", help="--plan-only: every call after a sweep that evicts the "
                    "host's caches (as between a training step's plans)")
    a = ap.parse_args()
    if a.plan_only:
        plan_only(a.shape, a.policies, a.reps, a.cold)
        return
    dev = torch.device(a.device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    os.makedirs(a.out, exist_ok=True)
    rep = open(os.path.join(a.out, "profile.txt"), "w")

    def say(*xs):
        print(*xs, file=rep, flush=True)

    shape = SHAPES[a.shape]
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    for skew in SKEWS:  # warm every case (kernels compiled, clocks up)
        for policy in a.policies:
            _rounds(case(policy, skew, shape, torch.bfloat16, dev)[0], 2, sync)
    for skew in SKEWS:
        for policy in a.policies:
            line = [f"{policy:8s} {skew:9s}"]
            steps, facts, plan_us = case(policy, skew, shape, torch.bfloat16, dev)
            full, host = _rounds(steps, a.reps, sync)
            line.append(f"plan {statistics.median(plan_us[-a.reps:]):6.1f} (dispatch below includes it)")
            say(f"\n======== {policy} {skew} {facts}")
            for name, fn in steps.items():
                line.append(f"{name} {statistics.median(full[name]):6.1f}/{statistics.median(host[name]):5.1f}")
                say(f"\n---- {name}: full p50 {statistics.median(full[name]):.1f} us, "
                    f"host p50 {statistics.median(host[name]):.1f} us")
                with torch.profiler.profile(activities=acts) as prof:
                    for _ in range(10):
                        fn()
                    sync()
                say(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48))
                say(_python_profile(fn, sync))
            print("  ".join(line), flush=True)
            say("SUMMARY " + "  ".join(line))
    rep.close()


if __name__ == "__main__":
    main()
