"""`fsep` (LAER-MoE's fully sharded expert parallelism): every expert's parameters are sharded over
all ranks, and each step every rank materializes C = ceil(E/D) + R expert slots chosen from the
current counts. Every expert keeps at least one slot; beyond that replica counts follow load
(water-filling), replicas are packed LPT-style, and each expert's tokens are split evenly over its
replicas, same-node replicas first; where that split leaves the busiest rank above the lower bound,
the tokens are routed exactly on the layout instead (the min-max flow of planners/flow.py, as the
step's later microbatches are).

With a tolerance (PlannerConfig), the stock layout is tried first (each expert once, on its stock
owner, in expert order: the shards travel without reordering), then one replica per expert
LPT-placed: the first that keeps max/mean tokens per rank within 1 + tolerance is used, and fewer
weights move; else every slot.

The layout (up to the slot table) also exists compiled (`_fsep_c.c`, built at install where a C
compiler is available): bit-identical plans, used when present; MEGATRON_RAILS_PURE_PYTHON=1 turns
it off.
"""
from __future__ import annotations

import numpy as np

from ..compiled import compiled
from ..plan import SHARDED, Placement, Plan, _owner_template, stock_load_D
from .base import PlannerBase, PlannerError, even_quotas
from .flow import min_max_quotas, optimal_as_is
from .packing import lpt_place, replica_counts


_STOCK = 0  # fsep_layout's code for the stock layout (1: one replica per expert, 2: every slot)


def _compiled():
    """The compiled layout (`_fsep_c.fsep_layout`), or None where it is not built or turned off."""
    return compiled("megatron_rails.core.planners._fsep_c", "fsep_layout")


class FsepPlanner(PlannerBase):
    name = "fsep"

    def check_config(self) -> None:
        cfg = self.cfg
        if cfg.total_slots < 1:
            raise PlannerError("fsep needs at least one slot per rank")
        # the stock layout (each expert once, on its stock owner): shared by every plan that keeps it
        self._stock = Placement(_owner_template(cfg.num_experts, cfg.num_ranks, cfg.slots), cfg.num_experts,
                                cfg.ranks_per_node, SHARDED, 0)
        self._kernel = _compiled()

    @property
    def compiled(self) -> bool:
        """Whether layouts come from the compiled kernel (else numpy; the plans are identical)."""
        return self._kernel is not None

    def plan(self, counts_DE, state=None):
        counts, load_E = self.counts_and_load(counts_DE)
        cfg = self.cfg
        D, E, C = cfg.num_ranks, cfg.num_experts, cfg.total_slots
        if self._kernel is not None:  # the same layout, compiled (_fsep_c.c)
            slot_DS = np.empty((D, C), dtype=np.int64)
            code, replicas, unplaced = self._kernel(load_E, D, E, C, self.tol_limit, slot_DS)
            if code == _STOCK:
                return self._stock_plan(counts, load_E), None
            return self._finish(counts, load_E, slot_DS, replicas=replicas, unplaced=unplaced), None
        # every expert keeps at least one slot, loaded or not: the layout serves the later
        # microbatches of the optimizer step too (routed on it exactly), whose counts differ.
        # D * C >= E always (C >= ceil(E/D)), so this never runs out of slots.
        one_E = np.ones(E, dtype=np.int64)
        # one replica per expert, unless one expert alone already exceeds the tolerance
        total = int(load_E.sum())
        if cfg.tolerance and self.tolerated(int(load_E.max(initial=0)), total):
            # the stock layout first: its slots, in (rank, slot) order, are the experts in order, so
            # the store sends its shards as they lie and gets gradients back in place (no copies)
            if self.tolerated(int(stock_load_D(counts, D).max(initial=0)), total):
                return self._stock_plan(counts, load_E), None
            lean = self._place(load_E, one_E)
            if self.tolerated(int(lean[3].max(initial=0)), total):  # its rank loads, before any plan is built
                return self._plan(counts, load_E, one_E, lean), None
        return self._plan(counts, load_E, replica_counts(load_E, D * C, one_E, D)), None

    def _stock_plan(self, counts: np.ndarray, load_E: np.ndarray) -> Plan:
        """Every expert once, on its stock owner, in expert order (still materialized from shards)."""
        quota = load_E.copy()  # one replica per expert, in expert order
        quota.flags.writeable = False
        return Plan.trusted(self._stock, counts, quota, self.name, self._info(self.cfg.num_experts, 0))

    def _place(self, load_E: np.ndarray, n_E: np.ndarray) -> tuple:
        """n_E replicas of every expert, LPT-placed: (expert, rank (-1: unplaced), tokens) of every
        replica item (int64 [items] each, heaviest first) and the ranks' loads (int64 [D]; the tokens
        of unplaced items not counted)."""
        cfg = self.cfg
        D, E, C = cfg.num_ranks, cfg.num_experts, cfg.total_slots
        item_e = np.repeat(np.arange(E, dtype=np.int64), n_E)
        ptr_E = np.zeros(E + 1, dtype=np.int64)
        np.cumsum(n_E, out=ptr_E[1:])
        item_load = even_quotas(load_E, ptr_E)
        order = np.lexsort((item_e, -item_load))  # heaviest first, ties to the lower expert id
        item_e, item_load = item_e[order], item_load[order]
        rank_load = np.zeros(D, dtype=np.int64)
        hosted = np.zeros((D, E), dtype=bool)
        free = np.full(D, C, dtype=np.int64)
        item_rank = lpt_place(item_e, item_load, rank_load, hosted, free)
        return item_e, item_rank, item_load, rank_load

    def _plan(self, counts: np.ndarray, load_E: np.ndarray, n_E: np.ndarray, placed_items=None) -> Plan:
        """The plan with n_E replicas of every expert, LPT-placed (placed_items: _place's result)."""
        cfg = self.cfg
        D, C = cfg.num_ranks, cfg.total_slots
        item_e, item_rank = (placed_items or self._place(load_E, n_E))[:2]
        placed = item_rank >= 0
        slot_DS = np.full((D, C), -1, dtype=np.int64)
        r, e = item_rank[placed], item_e[placed]
        slot = np.zeros(r.size, dtype=np.int64)  # slot index = order of arrival on the rank
        by_rank = np.argsort(r, kind="stable")
        starts = np.zeros(D, dtype=np.int64)
        np.cumsum(np.bincount(r, minlength=D)[:-1], out=starts[1:])
        slot[by_rank] = np.arange(r.size) - starts[r[by_rank]]
        slot_DS[r, slot] = e
        return self._finish(counts, load_E, slot_DS, replicas=int(placed.sum()), unplaced=int((~placed).sum()))

    def _finish(self, counts: np.ndarray, load_E: np.ndarray, slot_DS: np.ndarray, replicas: int,
                unplaced: int) -> Plan:
        """The plan on slot_DS (int64 [D, C], -1 free): every expert's tokens split evenly over its
        slots, or, where that leaves the busiest rank above the lower bound ceil(total / D), routed
        exactly on the layout (the min-max flow the step's later microbatches get, planners/flow.py)
        if that is lower: an even split ignores what the other experts put on each replica's rank.
        The placement is checked (an LPT bug would show there); the quotas fit the counts by
        construction (every expert's even split sums to its load)."""
        cfg = self.cfg
        placement = Placement.sharded_table(slot_DS, cfg.num_experts, cfg.ranks_per_node)
        quota = even_quotas(load_E, placement.expert_ptr)
        if replicas > cfg.num_experts:  # an expert on several ranks: its split is a choice
            peak, optimal = optimal_as_is(placement, quota, load_E)
            if not optimal:  # above the lower bound: the exact route may be lower
                exact = min_max_quotas(load_E, placement, checked=True)
                if exact.t_int < peak:
                    quota = exact.quota_R
        quota.flags.writeable = False
        return Plan.trusted(placement, counts, quota, self.name, self._info(replicas, unplaced))

    def _info(self, replicas: int, unplaced: int) -> dict:
        return {"slots_per_rank": self.cfg.total_slots, "unplaced_replicas": unplaced, "replicas": replicas}
