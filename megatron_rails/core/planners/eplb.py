"""`eplb`: history-based replication in the style of DeepSeek's EPLB.

Every `interval` steps the planner re-plans from the moving sum of expert loads over the last
`window` steps (the current step included): the D*S redundant slots are granted greedily to the
experts with the largest load per replica, and the replicas are packed LPT-style onto the ranks'
redundant slots. Between re-plans the placement is kept; each step's tokens are split evenly over
the replicas of their expert, same-node replicas first. A history whose stock layout is within the
tolerance (PlannerConfig) gets no replicas.

Legend: D ranks, E experts, I steps (of the history window), S redundant slots per rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..plan import Placement, Plan, owner_of_experts
from .base import PlannerBase, even_quotas
from .packing import lpt_place, replica_counts


@dataclass(frozen=True)
class EplbState:
    """history_IE: int64 [I <= window, E] loads of the latest steps; step: steps planned so far."""

    history_IE: np.ndarray
    step: int = 0
    placement: Placement | None = None


class EplbPlanner(PlannerBase):
    name = "eplb"

    def initial_state(self) -> EplbState:
        return EplbState(np.zeros((0, self.cfg.num_experts), dtype=np.int64))

    def plan(self, counts_DE, state: EplbState | None = None):
        counts = self.counts(counts_DE)
        cfg = self.cfg
        state = state or self.initial_state()
        load_E = counts.sum(axis=0)
        history = np.concatenate([state.history_IE, load_E[None]])[-cfg.window:]
        history.flags.writeable = False
        placement = state.placement
        replanned = placement is None or state.step % cfg.interval == 0
        if replanned:
            placement = self.place(history.sum(axis=0))
        quota = even_quotas(load_E, placement.expert_ptr)
        plan = Plan.from_quotas(placement, counts, quota, policy=self.name,
                                info={"replanned": replanned, "history_steps": int(history.shape[0])})
        return plan, EplbState(history, state.step + 1, placement)

    def place(self, hist_E: np.ndarray) -> Placement:
        """Owner layout plus the redundant replicas that best balance the historical loads hist_E."""
        cfg = self.cfg
        D, E, S = cfg.num_ranks, cfg.num_experts, cfg.slots
        owner = owner_of_experts(E, D)
        stock_D = np.bincount(owner, weights=hist_E, minlength=D)
        if cfg.tolerance and self.tolerated(int(stock_D.max()), int(hist_E.sum())):
            return Placement.owner_from_pairs(E, D, cfg.ranks_per_node, S, (), ())  # balanced enough: no replicas
        n_E = replica_counts(hist_E, E + D * S, np.ones(E, dtype=np.int64), D)
        per_rep = hist_E // n_E  # expected tokens per replica
        hosted = np.zeros((D, E), dtype=bool)
        hosted[owner, np.arange(E)] = True
        rank_load = np.bincount(owner, weights=per_rep, minlength=D).astype(np.int64)
        item_e = np.repeat(np.arange(E, dtype=np.int64), n_E - 1)
        item_load = per_rep[item_e]
        order = np.lexsort((item_e, -item_load))
        item_e, item_load = item_e[order], item_load[order]
        item_rank = lpt_place(item_e, item_load, rank_load, hosted, np.full(D, S, dtype=np.int64))
        redundant = [[] for _ in range(D)]
        for e, r in zip(item_e.tolist(), item_rank.tolist()):
            if r >= 0:
                redundant[r].append(e)
        return Placement.owner(E, D, cfg.ranks_per_node, redundant, slots=S)
