"""Measure one planner on one counts matrix: balance before/after, the slot-budget lower bound,
cross-node tokens, weight moves and plan latency. Shared by `megatron-rails plan`, `bench planners`
and the planner demo.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from ..core.plan import SHARDED, imbalance, stock_load_D
from ..core.planners import PlannerConfig, make_planner


def pin_one_core() -> None:
    """Plan latency targets are for one CPU core: pin this process to the first allowed core."""
    if hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        except OSError:
            pass


@contextlib.contextmanager
def stdout_to_stderr():
    """Send what native code (HiGHS' banner, ...) writes to file descriptor 1 to stderr, so stdout keeps
    only a command's results."""
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # a captured stdout (pytest): nothing to redirect
        yield
        return
    saved = os.dup(fd)
    try:
        os.dup2(sys.stderr.fileno(), fd)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, fd)
        os.close(saved)


def time_planner(planner, counts_DE: np.ndarray, min_reps: int = 20, max_reps: int = 2000,
                 budget_s: float = 0.25) -> np.ndarray:
    """float64 [reps]: wall microseconds of successive plan() calls, state carried between calls
    (so eplb's re-plan steps show up in the tail)."""
    state = planner.initial_state()
    times = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter_ns()
        _, state = planner.plan(counts_DE, state)
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return np.asarray(times)


@dataclass
class BoundCache:
    """Lower bounds depend on loads and slot budget only; the grid reuses them across policies."""

    store: dict

    def get(self, load_E, num_ranks, slots, ranks_per_node, layout):
        from ..core.oracle import slot_budget_lower_bound

        key = (load_E.tobytes(), num_ranks, slots, layout)
        if key not in self.store:
            self.store[key] = slot_budget_lower_bound(load_E, num_ranks, slots, ranks_per_node, layout=layout)
        return self.store[key]


def measure(policy: str, cfg: PlannerConfig, counts_DE: np.ndarray, *, bounds: BoundCache | None = None,
            time_it: bool = True, min_reps: int = 20, budget_s: float = 0.25) -> dict:
    """One row of the planner report (JSON-ready)."""
    planner = make_planner(policy, cfg)
    plan, _ = planner.plan(counts_DE, planner.initial_state())
    D = cfg.num_ranks
    load_E = counts_DE.sum(axis=0)
    total = int(load_E.sum())
    mean = total / D if total else 1.0
    layout = plan.placement.layout
    slots = cfg.total_slots if layout == SHARDED else cfg.slots
    bound = (bounds or BoundCache({})).get(load_E, D, slots, cfg.ranks_per_node, layout)
    row = {
        "policy": policy,
        "ranks": D,
        "experts": cfg.num_experts,
        "slots": cfg.slots,
        "ranks_per_node": cfg.ranks_per_node,
        "layout": layout,
        "tokens": total,
        "max_over_mean_before": imbalance(stock_load_D(counts_DE, D)),
        "max_over_mean_after": plan.max_over_mean,
        "lower_bound_max_over_mean": (bound / mean) if total else 1.0,
        "cross_node_tokens": plan.cross_node_tokens,
        "weight_moves": plan.weight_moves,
        "replicas": plan.placement.num_replicas,
        "plan_digest": plan.digest()[:16],
    }
    if time_it:
        t = time_planner(planner, counts_DE, min_reps=min_reps, budget_s=budget_s)
        row.update(plan_us_p50=float(np.percentile(t, 50)), plan_us_p99=float(np.percentile(t, 99)),
                   plan_reps=int(t.size))
    return row
