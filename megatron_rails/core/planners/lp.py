"""`lp`: MicroMoE-style exact token scheduling on top of a placement.

The placement comes from `cfg.placement`: "static" (owner layout with a fixed, load-oblivious spread
of the R redundant slots, see `static_placement`) or another policy's placement ("eplb", "ultraep",
"fsep"; that planner runs first and its state is threaded through). Every step the tokens of each
expert are then split over its replicas to minimize the most loaded rank, exactly, by max-flow
(planners/flow.py), unless the placement's own quotas already reach a lower bound (then they are
kept: info solver "bound"). With solver="highs" (or MEGATRON_RAILS_LP_SOLVER=highs), or if the flow solver
fails, the pulp/HiGHS LP and its integral re-solve at ceil(LP optimum) are used instead.

Legend: D ranks, E experts, R replicas, L owner slots per rank (ceil(E/D)), S redundant slots.
"""
from __future__ import annotations

import math
import os

import numpy as np

from ..oracle import lp_integer_quotas, lp_min_max, time_vs_oracle  # noqa: F401 (re-export for the CLI)
from ..plan import Placement, Plan, PlanError, owner_slots_needed
from .base import PlannerBase, PlannerError
from .eplb import EplbPlanner
from .flow import min_max_quotas, optimal_as_is
from .fsep import FsepPlanner
from .ultraep import UltraEPPlanner

PLACEMENTS = ("static", "eplb", "ultraep", "fsep")
# the planners whose placement lp schedules on ("static" needs none)
PLACEMENT_PLANNERS = {"eplb": EplbPlanner, "ultraep": UltraEPPlanner, "fsep": FsepPlanner}
SOLVERS = ("flow", "highs")
SOLVER_ENV = "MEGATRON_RAILS_LP_SOLVER"


def static_placement(num_experts: int, num_ranks: int, ranks_per_node: int, slots: int) -> Placement:
    """Owner layout whose S redundant slots are filled independently of load.

    Slot j of rank d targets the (j mod L)-th expert of the block owned by rank d + 1 + j // L
    (mod D): every slot index j places one replica on each of D different experts, and the slot
    indices walk through all positions of the blocks, so replica counts over experts differ by at
    most one when E % D == 0 (and S <= (D-1)L). A target the rank already hosts (or, with unequal
    blocks, a short block) moves on to the next expert id it does not host. A rank that already hosts
    all E experts leaves its remaining slots empty.
    """
    E, D, S = int(num_experts), int(num_ranks), int(slots)
    L = owner_slots_needed(E, D)
    # rank t owns experts first[t]:first[t+1], first[t] = ceil(t*E/D) (see owner_of_experts)
    first = ((np.arange(D + 1, dtype=np.int64) * E + D - 1) // D).tolist()
    rows = []
    for d in range(D):
        hosted = set(range(first[d], first[d + 1]))
        row: list[int] = []
        for j in range(S):
            if len(hosted) == E:
                break
            e = (first[(d + 1 + j // L) % D] + j % L) % E
            while e in hosted:  # membership only: set order never matters
                e = (e + 1) % E
            hosted.add(e)
            row.append(e)
        rows.append(row)
    return Placement.owner(E, D, ranks_per_node, rows, slots=S)


class LpPlanner(PlannerBase):
    name = "lp"

    def __init__(self, cfg, solver: str | None = None):
        self.solver = solver or os.environ.get(SOLVER_ENV, "flow")
        super().__init__(cfg)

    def check_config(self) -> None:
        cfg = self.cfg
        if cfg.placement not in PLACEMENTS:
            raise PlannerError(f"lp: placement must be one of {', '.join(PLACEMENTS)}, got {cfg.placement!r}")
        if self.solver not in SOLVERS:
            raise PlannerError(f"lp: solver must be one of {', '.join(SOLVERS)} (env {SOLVER_ENV}), "
                               f"got {self.solver!r}")
        self._base = None
        self._static = (static_placement(cfg.num_experts, cfg.num_ranks, cfg.ranks_per_node, cfg.slots)
                        if cfg.placement == "static" else None)

    def base_planner(self) -> PlannerBase:
        """The planner whose placement is scheduled on (built on first use)."""
        if self._base is None:
            self._base = PLACEMENT_PLANNERS[self.cfg.placement](self.cfg)
        return self._base

    def initial_state(self):
        return None if self._static is not None else self.base_planner().initial_state()

    def plan(self, counts_DE, state=None):
        """counts_DE: int64 [D, E]. Returns (Plan, state of the placement's planner)."""
        if self._static is not None:
            counts, load_E = self.counts_and_load(counts_DE)
            placement, next_state, base_info = self._static, None, {}
        else:
            base_plan, next_state = self.base_planner().plan(counts_DE, state)  # it checks the counts
            placement, base_info = base_plan.placement, base_plan.info
            t, optimal = optimal_as_is(placement, base_plan.quota_R, base_plan.load_E)
            if optimal:  # no solver can do better on this placement: its quotas stand
                info = {"t_int": t, "solver": "bound", "flows": 0, "placement": self.cfg.placement,
                        "placement_info": base_info}
                return Plan.trusted(placement, base_plan.counts_DE, base_plan.quota_R, self.name, info), next_state
            counts, load_E = base_plan.counts_DE, base_plan.load_E
        quota, info = self.schedule(load_E, placement)
        info.update(placement=self.cfg.placement, placement_info=base_info)
        return Plan.from_quotas(placement, counts, quota, policy=self.name, info=info), next_state

    def schedule(self, load_E: np.ndarray, placement: Placement) -> tuple[np.ndarray, dict]:
        """Optimal integer quotas (int64 [R]) for load_E (int64 [E]) on `placement`, and diagnostics."""
        fallback = None
        if self.solver == "flow":
            try:
                res = min_max_quotas(load_E, placement)
            except PlanError:
                raise  # the input is invalid (an expert with tokens and no replica): no solver helps
            except Exception as err:  # pragma: no cover - a solver bug; keep training on the LP path
                fallback = f"{type(err).__name__}: {err}"
            else:
                return res.quota_R, {"t_int": res.t_int, "t_frac": float(res.t_frac), "solver": "flow",
                                     "flows": res.flows}
        quota, t_int, t_lp = highs_quotas(load_E, placement)
        info = {"t_int": t_int, "t_frac": t_lp, "solver": "highs"}
        if fallback is not None:
            info["fallback_reason"] = fallback
        return quota, info


def highs_quotas(load_E: np.ndarray, placement: Placement) -> tuple[np.ndarray, int, float]:
    """Optimal integer quotas from HiGHS alone: the LP optimum t_lp, then the integral solution at
    the smallest integer T it allows. The scheduling LP's matrix is totally unimodular, so integer
    quotas exist at T exactly when T >= t_lp; starting at floor(t_lp) absorbs the LP's float error.
    Returns (quota_R int64 [R], t_int, t_lp)."""
    t_lp, _ = lp_min_max(load_E, placement)
    D = placement.num_ranks
    t = max(math.floor(t_lp), -(-int(np.sum(load_E)) // D))
    for t_try in range(t, t + 3):
        try:
            return lp_integer_quotas(load_E, placement, t_try), t_try, t_lp
        except PlanError:
            continue
    raise PlannerError(f"lp: no integer quotas found at T in [{t}, {t + 2}] although the LP optimum is {t_lp}")
