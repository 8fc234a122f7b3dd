"""Planners: turn exact per-rank token counts into a placement of expert replicas and a token route.

`make_planner(name, cfg)` builds one by policy name; see docs/policies.md for when to choose which.
"""
from __future__ import annotations

from ..errors import shown
from .base import MAX_RANKS, Planner, PlannerBase, PlannerConfig, PlannerError
from .eplb import EplbPlanner
from .fsep import FsepPlanner
from .lp import LpPlanner
from .none import NonePlanner
from .ultraep import UltraEPPlanner

PLANNERS: dict[str, type[PlannerBase]] = {
    cls.name: cls for cls in (NonePlanner, EplbPlanner, FsepPlanner, UltraEPPlanner, LpPlanner)
}
POLICIES = tuple(PLANNERS)


def make_planner(name: str, cfg: PlannerConfig) -> PlannerBase:
    """The planner of policy `name` (one of POLICIES) for cfg; PlannerError for another name."""
    if not isinstance(name, str):  # a list or None: unhashable or no name at all
        raise PlannerError(f"policy name must be a string, one of {', '.join(POLICIES)}; got {shown(name)}")
    try:
        cls = PLANNERS[name]
    except KeyError:
        raise PlannerError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None
    if not isinstance(cfg, PlannerConfig):  # a PolicyConfig lacks the shape: it becomes one with D and E
        hint = (" (a PolicyConfig gives one: policy.planner_config(num_ranks, num_experts))"
                if type(cfg).__name__ == "PolicyConfig" else "")
        raise TypeError(f"make_planner takes a PlannerConfig, got {type(cfg).__name__}{hint}")
    return cls(cfg)


__all__ = ["MAX_RANKS", "Planner", "PlannerBase", "PlannerConfig", "PlannerError", "PLANNERS", "POLICIES",
           "make_planner"]
