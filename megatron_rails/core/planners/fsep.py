"""`fsep` (LAER-MoE's fully sharded expert parallelism): every expert's parameters are sharded over
all ranks, and each step every rank materializes C = ceil(E/D) + R expert slots chosen from the
current counts. Replica counts follow load (water-filling), replicas are packed LPT-style, and each
expert's tokens are split evenly over its replicas, same-node replicas first.

With a tolerance (PlannerConfig), one replica per loaded expert is tried first: if that plan keeps
max/mean tokens per rank within 1 + tolerance it is used, and fewer weights move; else every slot.
"""
from __future__ import annotations

import numpy as np

from ..plan import SHARDED, Placement, Plan
from .base import PlannerBase, PlannerError, even_quotas
from .packing import lpt_place, replica_counts


class FsepPlanner(PlannerBase):
    name = "fsep"

    def check_config(self) -> None:
        if self.cfg.total_slots < 1:
            raise PlannerError("fsep needs at least one slot per rank")

    def plan(self, counts_DE, state=None):
        counts = self.counts(counts_DE)
        cfg = self.cfg
        D, E, C = cfg.num_ranks, cfg.num_experts, cfg.total_slots
        load_E = counts.sum(axis=0)
        loaded = load_E > 0
        if int(loaded.sum()) > D * C:
            raise PlannerError(f"fsep: {int(loaded.sum())} experts receive tokens but the {D} ranks have only "
                               f"{D}x{C} = {D * C} slots; raise slots (R) to at least "
                               f"{-(-int(loaded.sum()) // D) - cfg.owner_slots}")
        # every loaded expert once, unless one expert alone already exceeds the tolerance
        total = int(load_E.sum())
        if cfg.tolerance and self.tolerated(int(load_E.max(initial=0)), total):
            lean = self._plan(counts, load_E, loaded.astype(np.int64))
            if self.tolerated(int(lean.load_D.max(initial=0)), total):
                return lean, None
        n_E = replica_counts(load_E, D * C, loaded.astype(np.int64), D)
        n_E[~loaded] = 0
        return self._plan(counts, load_E, n_E), None

    def _plan(self, counts: np.ndarray, load_E: np.ndarray, n_E: np.ndarray) -> Plan:
        """The plan with n_E replicas of every expert, LPT-placed."""
        cfg = self.cfg
        D, E, C = cfg.num_ranks, cfg.num_experts, cfg.total_slots
        item_e = np.repeat(np.arange(E, dtype=np.int64), n_E)
        item_load = even_quotas(load_E, np.r_[0, np.cumsum(n_E)])
        order = np.lexsort((item_e, -item_load))  # heaviest first, ties to the lower expert id
        item_e, item_load = item_e[order], item_load[order]
        rank_load = np.zeros(D, dtype=np.int64)
        hosted = np.zeros((D, E), dtype=bool)
        free = np.full(D, C, dtype=np.int64)
        item_rank = lpt_place(item_e, item_load, rank_load, hosted, free)
        placed = item_rank >= 0
        slot_DS = np.full((D, C), -1, dtype=np.int64)
        r, e = item_rank[placed], item_e[placed]
        slot = np.zeros(r.size, dtype=np.int64)  # slot index = order of arrival on the rank
        by_rank = np.argsort(r, kind="stable")
        starts = np.r_[0, np.cumsum(np.bincount(r, minlength=D))[:-1]]
        slot[by_rank] = np.arange(r.size) - starts[r[by_rank]]
        slot_DS[r, slot] = e
        placement = Placement(slot_DS, E, cfg.ranks_per_node, SHARDED, 0)
        quota = even_quotas(load_E, placement.expert_ptr)
        return Plan.from_quotas(placement, counts, quota, policy=self.name,
                                info={"slots_per_rank": C, "unplaced_replicas": int((~placed).sum()),
                                      "replicas": int(placed.sum())})
