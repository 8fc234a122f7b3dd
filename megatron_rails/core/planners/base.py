"""The planner protocol and its configuration.

A planner is a pure, deterministic function of (counts_DE, state, config): no communication, no
randomness, integer arithmetic for every decision, stable sorts for every tie. Every rank calls it
with the same all-gathered counts and gets a bit-identical Plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

from ..compiled import compiled
from ..errors import is_integer
from ..limits import MAX_EXPERTS, MAX_RANKS, MAX_SLOTS, MAX_WINDOW  # every [D, E] and [D, S] table bounded
from ..plan import Plan, PlanError, c_order, check_counts, counts_and_load, owner_slots_needed


class PlannerError(PlanError):
    """A planner cannot serve this configuration or input."""


def valid_tolerance(t) -> bool:
    """A tolerance is a number (not a bool) in [0, 1]."""
    return not isinstance(t, bool) and isinstance(t, (int, float, np.integer, np.floating)) and 0 <= t <= 1


@dataclass(frozen=True)
class PlannerConfig:
    """What every planner needs to know about the expert-parallel group.

    num_ranks:      D, ranks of the expert-parallel group.
    num_experts:    E.
    ranks_per_node: G, ranks sharing a node; must divide D (D < G means one node of D ranks).
    slots:          R, expert-sized slots per rank beyond the ceil(E/D) a rank stores in stock EP.
                    Owner-layout policies (eplb, ultraep, lp) use them as redundant replica slots;
                    fsep materializes C = ceil(E/D) + R slots per rank. Every policy therefore gets
                    the same memory budget.
    window, interval: eplb's moving-average window and re-planning period, in steps.
    placement:      lp only: the placement it schedules tokens on (static, eplb, ultraep, fsep).
    tolerance:      owner-layout policies (ultraep, eplb, lp on those) keep the stock layout, moving
                    no weights, while the stock max/mean tokens per rank is at most 1 + tolerance;
                    above it they balance as far as the slots allow (a trigger, not a target).
                    fsep uses one replica per loaded expert if that keeps max/mean within
                    1 + tolerance, else all its slots. 0: balance whenever any rank is above the mean.
    """

    num_ranks: int
    num_experts: int
    ranks_per_node: int = 8
    slots: int = 1
    window: int = 10
    interval: int = 10
    placement: str = "ultraep"
    tolerance: float = 0.0

    def __post_init__(self):
        if not valid_tolerance(self.tolerance):
            raise PlannerError(f"tolerance must be a number in [0, 1], got {self.tolerance!r}")
        for name, most in (("num_ranks", MAX_RANKS), ("num_experts", MAX_EXPERTS), ("window", MAX_WINDOW),
                           ("interval", MAX_WINDOW)):
            v = getattr(self, name)
            if not is_integer(v) or v < 1:
                raise PlannerError(f"{name} must be a positive integer, got {v!r}")
            if v > most:
                raise PlannerError(f"{name} must be at most {most}, got {v}")
        if not is_integer(self.slots) or self.slots < 0:
            raise PlannerError(f"slots must be a non-negative integer, got {self.slots!r}")
        if self.slots > MAX_SLOTS:
            raise PlannerError(f"slots must be at most {MAX_SLOTS} redundant slots per rank, got {self.slots}")
        g = self.ranks_per_node
        if not is_integer(g) or g < 1:
            raise PlannerError(f"ranks_per_node must be a positive integer, got {g!r}")
        if self.num_ranks < g:
            object.__setattr__(self, "ranks_per_node", int(self.num_ranks))
        elif self.num_ranks % g:
            raise PlannerError(f"ranks_per_node={g} does not divide num_ranks={self.num_ranks}")

    @property
    def owner_slots(self) -> int:
        return owner_slots_needed(self.num_experts, self.num_ranks)

    @property
    def total_slots(self) -> int:
        """Expert-sized slots per rank: ceil(E/D) + R."""
        return self.owner_slots + self.slots


class Planner(Protocol):
    name: ClassVar[str]
    cfg: PlannerConfig

    def initial_state(self) -> Any: ...

    def plan(self, counts_DE: np.ndarray, state: Any = None) -> tuple[Plan, Any]:
        """counts_DE: int64 [D, E], tokens each source rank routes to each expert (top-k expanded).
        Returns the plan and the state to pass to the next call (None for stateless planners)."""
        ...


class PlannerBase:
    name: ClassVar[str] = ""

    def __init__(self, cfg: PlannerConfig):
        self.cfg = cfg
        self.check_config()

    def check_config(self) -> None:
        """Raise PlannerError if this policy cannot serve cfg."""

    def initial_state(self) -> Any:
        return None

    def counts(self, counts_DE) -> np.ndarray:
        return check_counts(counts_DE, self.cfg.num_ranks, self.cfg.num_experts)

    def counts_and_load(self, counts_DE) -> tuple[np.ndarray, np.ndarray]:
        """The checked counts (int64 [D, E], read-only) and every expert's tokens (int64 [E])."""
        return counts_and_load(counts_DE, self.cfg.num_ranks, self.cfg.num_experts)

    @property
    def tol_limit(self) -> float:
        """1 + tolerance, or 0 without one: the compiled planners' form of the tolerance."""
        return 1.0 + self.cfg.tolerance if self.cfg.tolerance else 0.0

    def tolerated(self, max_load: int, total: int) -> bool:
        """Whether a stock layout whose busiest rank computes max_load of `total` tokens is within
        the configured tolerance (max/mean <= 1 + tolerance): then no weights move."""
        return max_load * self.cfg.num_ranks <= (1.0 + self.cfg.tolerance) * total

    def plan(self, counts_DE, state=None):  # pragma: no cover - interface
        raise NotImplementedError


_EVEN_QUOTAS = compiled("megatron_rails.core._route_c", "even_quotas")  # None: numpy below


def even_quotas(load_E: np.ndarray, expert_ptr: np.ndarray) -> np.ndarray:
    """int64 [R]: every expert's tokens (int64 [E], non-negative) split evenly over its replicas
    (in replica order), the first load % n of an expert's n replicas taking one more. Compiled
    where built (one pass, where numpy's half-dozen calls cost tens of microseconds on the cold
    caches between a step's plans); the same numbers."""
    if _EVEN_QUOTAS is not None and load_E.dtype == np.int64 and expert_ptr.dtype == np.int64 and load_E.size:
        quota = np.empty(int(expert_ptr[-1]), dtype=np.int64)
        _EVEN_QUOTAS(c_order(load_E), c_order(expert_ptr), load_E.size, quota)
        return quota
    n_E = expert_ptr[1:] - expert_ptr[:-1]
    R = int(expert_ptr[-1])
    if R == 0:
        return np.zeros(0, dtype=np.int64)
    e_R = np.repeat(np.arange(n_E.size), n_E)
    k_R = np.arange(R) - expert_ptr[e_R]  # index of the replica within its expert
    base, extra = np.divmod(load_E[e_R], n_E[e_R])
    return (base + (k_R < extra)).astype(np.int64)
