"""How much a dedup-aware token fill would save over the runtime's token-order fill.

The plan fixes how many of rank s's tokens of expert e go to each replica; which tokens go where is
the runtime's choice (runtime/local.py: in token order, the route's runs in replica order). With
token dedup a pair costs the network nothing when its token already crosses to that node, so a fill
could prefer those tokens. This script compares, on the simulator's token-level DeepSeek-V3-like
sample (sim/dedup.py), the distinct (token, remote node) pairs of

    order   the runtime's fill, and
    greedy  experts with one destination first; then each replicated expert's runs in route order,
            each taking first the still-free tokens that already cross to the run's node

and prints one line per case. Usage: python scripts/dedup_fill.py [--tokens-per-rank T]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from megatron_rails.core.planners import PlannerConfig, make_planner
from megatron_rails.sim import dedup as sd
from megatron_rails.sim.traffic import family

CASES = [("deepseek:none", 8), ("deepseek:fsep", 4), ("deepseek:fsep", 8), ("deepseek:ultraep", 8),
         ("deepseek:ultraep", 32)]


def greedy_destinations(picks_DTK: np.ndarray, plan, G: int) -> np.ndarray:
    """int64 [D, T, k]: each pair's rank under `plan` with the greedy fill (same runs, same counts)."""
    D, T, k = picks_DTK.shape
    ptr, rep_M, tok_M = plan.route
    rank_R = plan.placement.replica_rank_R
    dest_DTK = np.empty((D, T, k), dtype=np.int64)
    for s in range(D):
        flat = picks_DTK[s].reshape(-1)
        order = np.argsort(flat, kind="stable")  # pairs by expert, token order kept (as the runtime)
        reps, n_M = rep_M[ptr[s]:ptr[s + 1]], tok_M[ptr[s]:ptr[s + 1]]
        start_M = np.cumsum(n_M) - n_M
        expert_M = flat[order][start_M]
        experts, first, runs = np.unique(expert_M, return_index=True, return_counts=True)
        crosses_TV = np.zeros((T, D // G), dtype=bool)  # the token already goes to that node
        dest = np.empty(T * k, dtype=np.int64)
        for j in np.argsort(runs, kind="stable"):  # one-destination experts first
            lo, c = first[j], runs[j]
            pos = order[start_M[lo]:start_M[lo] + n_M[lo:lo + c].sum()]
            tok = pos // k
            free = np.ones(pos.size, dtype=bool)
            for m in range(lo, lo + c):
                r = int(rank_R[reps[m]])
                cand = np.flatnonzero(free)
                there = crosses_TV[tok[cand], r // G]
                pick = np.concatenate([cand[there], cand[~there]])[:n_M[m]]
                free[pick] = False
                dest[pos[pick]] = r
                crosses_TV[tok[pick], r // G] = True
        dest_DTK[s] = dest.reshape(T, k)
    return dest_DTK


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens-per-rank", type=int, default=1024)
    T = ap.parse_args().tokens_per_rank
    for text, nodes in CASES:
        G = 8
        D = nodes * G
        fam = family(text, D)
        planner = make_planner(fam.policy, PlannerConfig(D, fam.experts, G, 1))
        p_E, hot, frac = sd.routing_weights(fam.skew, fam.experts, fam.topk, 0)
        picks = sd.sample_routing(p_E, D, T, fam.topk, 0, hot, frac)
        plan, _ = planner.plan(sd.counts_of(picks, fam.experts))
        now = sd.dedup_traffic(sd.pair_destinations(picks, plan), G)
        t0 = time.perf_counter()
        dest = greedy_destinations(picks, plan, G)
        ms = (time.perf_counter() - t0) / D * 1e3
        greedy = sd.dedup_traffic(dest, G)
        assert (greedy.tokens_DD == now.tokens_DD).all()  # the same plan: the same pair traffic
        print(f"{text:17s} {nodes:2d} nodes  inter-node pairs {now.inter_pairs:8d}  units: order "
              f"{now.inter_units:8d}  greedy {greedy.inter_units:8d} ({greedy.inter_units / now.inter_units - 1:+.2%})"
              f"  greedy fill {ms:.1f} ms/rank (numpy)")


if __name__ == "__main__":
    main()
