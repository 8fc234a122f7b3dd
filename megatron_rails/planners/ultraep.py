"""`ultraep`: exact-load quota planning with R redundant slots per rank (UltraEP's scheme).

From the current step's exact counts, find the smallest integer load threshold T for which the
ranks above T can export their excess to ranks below it, every receiver using at most R redundant
slots; each export is a replica with an integer token quota and the owner keeps the rest.

Exports cascade (see `cascade.py`): an overloaded rank may take the tail of another rank's export
and pass on more of its own hottest expert, so that every rank receives at most one piece. The
vectorized cascade at T = ceil(mean) is tried first; it is optimal whenever every rank owns at most
one expert (E <= D) and usually succeeds otherwise. If it cannot split some carry at taker cuts, the
sequential chain greedy is searched over T (gallop, then bisect to within 1/1024 of the mean).
"""
from __future__ import annotations

import numpy as np

from ..plan import Placement, Plan
from .base import PlannerBase
from .cascade import OwnerBlocks, cascade, chain_greedy, search_threshold


class UltraEPPlanner(PlannerBase):
    name = "ultraep"

    def check_config(self) -> None:
        cfg = self.cfg
        self._blocks = OwnerBlocks(cfg.num_experts, cfg.num_ranks)
        self._owner = self._blocks.owner_E
        self._owner_key = np.arange(cfg.num_experts, dtype=np.int64) * cfg.num_ranks + self._owner

    def plan(self, counts_DE, state=None):
        counts = self.counts(counts_DE)
        cfg = self.cfg
        D = cfg.num_ranks
        load_E = counts.sum(axis=0)
        base_D = self._blocks.rank_loads(load_E)
        total = int(base_D.sum())
        lo, hi = -(-total // D), int(base_D.max())
        pieces, threshold, how = None, hi, "stock"
        if hi > lo and cfg.slots > 0:
            pieces, threshold, how = cascade(lo, load_E, base_D, self._blocks), lo, "cascade"
            if pieces is None:
                load, base = load_E.tolist(), base_D.tolist()
                threshold, found = search_threshold(
                    lo, hi, lambda T: chain_greedy(T, load, base, self._blocks, cfg.slots))
                pieces, how = np.array(found, dtype=np.int64).reshape(-1, 3).T, "chain"
        placement, quota = self._build(load_E, pieces)
        info = {"threshold": threshold, "mean_bound": lo, "exports": 0 if pieces is None else int(pieces[0].size),
                "method": how}
        return Plan.from_quotas(placement, counts, quota, policy=self.name, info=info), None

    def _build(self, load_E: np.ndarray, pieces):
        """Placement and quotas from exports (expert_I, rank_I, tokens_I), distinct (expert, rank)
        pairs off the owners. Replicas are numbered by (expert, rank): owners and exports merged."""
        cfg = self.cfg
        D, E = cfg.num_ranks, cfg.num_experts
        if pieces is None or pieces[0].size == 0:
            placement = Placement.owner_from_pairs(E, D, cfg.ranks_per_node, cfg.slots, (), ())
            return placement, load_E
        e_I, d_I, a_I = pieces
        placement = Placement.owner_from_pairs(E, D, cfg.ranks_per_node, cfg.slots, d_I, e_I)
        kept_E = load_E - np.bincount(e_I, weights=a_I, minlength=E).astype(np.int64)
        order = np.argsort(np.concatenate((self._owner_key, e_I * D + d_I)), kind="stable")
        quota = np.concatenate((kept_E, a_I))[order]
        return placement, quota
