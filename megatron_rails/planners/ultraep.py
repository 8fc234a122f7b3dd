"""`ultraep`: exact-load quota planning with R redundant slots per rank (UltraEP's scheme).

From the current step's exact counts: find the smallest integer load threshold T (binary search)
for which the overloaded ranks can export their excess over T, hottest owned expert first, to ranks
with slack below T and a free redundant slot. Exports go to same-node ranks first, then to the ranks
with the most slack (so each export needs as few replicas, hence weight copies, as possible).
Each export is a replica with an integer token quota; the owner keeps the rest of its expert.
"""
from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np

from ..plan import Placement, Plan, owner_of_experts
from .base import PlannerBase


class UltraEPPlanner(PlannerBase):
    name = "ultraep"

    def check_config(self) -> None:
        cfg = self.cfg
        self._owner = owner_of_experts(cfg.num_experts, cfg.num_ranks)
        self._node = (np.arange(cfg.num_ranks) // cfg.ranks_per_node).tolist()

    def plan(self, counts_DE, state=None):
        counts = self.counts(counts_DE)
        cfg = self.cfg
        D = cfg.num_ranks
        load_E = counts.sum(axis=0)
        base_D = np.bincount(self._owner, weights=load_E, minlength=D).astype(np.int64)
        total = int(load_E.sum())
        lo, hi = -(-total // D), int(base_D.max())
        exports: list[tuple[int, int, int]] = []
        threshold = hi
        if hi > lo and cfg.slots > 0:
            # each rank's owned experts, hottest first (ties to the lower id): the export order
            order = np.lexsort((np.arange(load_E.size), -load_E, self._owner))
            ptr = np.searchsorted(self._owner[order], np.arange(D + 1))
            givers = np.lexsort((np.arange(D), -base_D)).tolist()
            ctx = (load_E.tolist(), base_D.tolist(), order.tolist(), ptr.tolist(), givers)
            threshold, exports = self._search(lo, hi, ctx)
        placement, quota = self._build(load_E, exports)
        info = {"threshold": threshold, "mean_bound": -(-total // D), "exports": len(exports)}
        return Plan.from_quotas(placement, counts, quota, policy=self.name, info=info), None

    def _search(self, lo: int, hi: int, ctx) -> tuple[int, list]:
        """Smallest threshold in [lo, hi] the greedy export meets, to within 1/1024 of lo: gallop
        up from lo (skewed steps usually succeed within a few tenths of a percent of the mean),
        then bisect. hi always succeeds: no rank exceeds it, so nothing is exported."""
        found = self._exports(lo, *ctx)
        if found is not None:
            return lo, found
        step = max(1, lo >> 10)
        bad, good, best, k = lo, hi, [], 0
        while bad + step * (1 << k) < hi:  # gallop
            t = bad + step * (1 << k)
            found = self._exports(t, *ctx)
            if found is not None:
                good, best = t, found
                break
            bad, k = t, k + 1
        while good - bad > step:  # bisect
            mid = (bad + good) // 2
            found = self._exports(mid, *ctx)
            if found is None:
                bad = mid
            else:
                good, best = mid, found
        return good, best

    def _exports(self, T: int, load: list, base: list, order: list, ptr: list, givers: list):
        """Greedy export at threshold T: list of (expert, receiver rank, tokens), or None if the
        redundant slots cannot absorb the excess.

        Givers go in order of excess, each exporting its hottest experts first. A piece goes to the
        giver's node first, then anywhere: if a receiver there has room for the whole piece, the one
        with the least room takes it (best fit, so big gaps stay for big pieces and no slot is
        spent on a sliver); otherwise the receiver with the most room is filled and the rest moves
        on. Receivers are kept as sorted (slack, rank) lists per node and for the whole group.
        """
        D, R, node = self.cfg.num_ranks, self.cfg.slots, self._node
        slack = [T - b for b in base]
        free = [R] * D
        lists: dict[int, list] = {-1: []}
        for r in range(D):
            if slack[r] > 0:
                lists[-1].append((slack[r], r))
                lists.setdefault(node[r], []).append((slack[r], r))
        for lst in lists.values():
            lst.sort()
        out = []
        for d in givers:
            need = base[d] - T
            if need <= 0:
                break  # givers are sorted by base load: no one else is over T
            for e in order[ptr[d]:ptr[d + 1]]:
                left = need if need < load[e] else load[e]
                if left <= 0:
                    break
                need -= left
                for key in (node[d], -1):
                    lst = lists.get(key)
                    while left > 0 and lst:
                        i = bisect_left(lst, (left, -1))
                        sl, r = lst[i] if i < len(lst) else lst[-1]
                        take = left if left < sl else sl
                        out.append((e, r, take))
                        left -= take
                        slack[r] = sl - take
                        free[r] -= 1
                        for k in (node[r], -1):  # re-file r under its new slack, or drop it
                            ll = lists[k]
                            del ll[bisect_left(ll, (sl, r))]
                            if slack[r] > 0 and free[r] > 0:
                                insort(ll, (slack[r], r))
                if left > 0:
                    return None
        return out

    def _build(self, load_E: np.ndarray, exports):
        cfg = self.cfg
        D, E = cfg.num_ranks, cfg.num_experts
        ex = np.asarray(exports, dtype=np.int64).reshape(-1, 3)
        placement = Placement.owner_from_pairs(E, D, cfg.ranks_per_node, cfg.slots, ex[:, 1], ex[:, 0])
        keys = placement.replica_expert_R * D + placement.replica_rank_R  # ascending
        quota = np.zeros(placement.num_replicas, dtype=np.int64)
        owner_ids = np.searchsorted(keys, np.arange(E) * D + self._owner)
        quota[owner_ids] = load_E
        if ex.size:
            quota[np.searchsorted(keys, ex[:, 0] * D + ex[:, 1])] = ex[:, 2]
            np.subtract.at(quota, owner_ids[ex[:, 0]], ex[:, 2])
        return placement, quota
