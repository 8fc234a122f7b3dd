"""`ultraep`: exact-load quota planning with R redundant slots per rank (UltraEP's scheme).

From the current step's exact counts, find the smallest integer load threshold T for which the
ranks above T can export their excess to ranks below it, every receiver using at most R redundant
slots; each export is a replica with an integer token quota and the owner keeps the rest.

Exports cascade (see `cascade.py`): an overloaded rank may take the tail of another rank's export
and pass on more of its own hottest expert, so that every rank receives at most one piece. The
cascade at T = ceil(mean) is tried first (a plain loop, or numpy from _VECTORIZE_FROM ranks); it
is optimal whenever every rank owns at most one expert (E <= D) and usually succeeds otherwise.
If it cannot split some carry at taker cuts, the cascade and the sequential chain greedy are
searched over T (gallop, then bisect to within 1/1024 of the mean).

The cascade path at T = ceil(mean), from counts to the finished plan, also exists compiled
(`_ultraep_c.c`, built at install where a C compiler is available): it gives bit-identical plans and
is used when present; MEGATRON_RAILS_PURE_PYTHON=1 turns it off. Stock plans, the threshold search
and every error message stay here.
"""
from __future__ import annotations

import numpy as np

from ..compiled import compiled
from ..plan import OWNER, Placement, Plan, _owner_template, check_counts
from .base import PlannerBase
from .cascade import CASCADE_NP_MAX_TOKENS, OwnerBlocks, cascade, cascade_np, chain_greedy, search_threshold

# ranks from which numpy's fixed call overhead beats the plain loop. Plan p50, loop time / numpy time
# (C kernel off, one pinned core, zipf 1.2, E 8-256): 0.4 at D=8, 0.7-0.85 at D=16-128, 1.3 at D=256,
# 2-2.7 at D=1024. The loop also serves the threshold search, at any D.
_VECTORIZE_FROM = 256


def _compiled():
    """The compiled cascade (`_ultraep_c.cascade_plan`), or None where it is not built or turned off."""
    return compiled("megatron_rails.core.planners._ultraep_c", "cascade_plan")


_STOCK, _CASCADE, _GAVE_UP = 0, 1, 2  # cascade_plan's codes (-1: a negative count)


class UltraEPPlanner(PlannerBase):
    name = "ultraep"

    def check_config(self) -> None:
        cfg = self.cfg
        self._blocks = OwnerBlocks(cfg.num_experts, cfg.num_ranks)
        # owner replicas' sort keys (expert * D + rank), to merge exports into replica order
        expert_E, owner_E = np.arange(cfg.num_experts, dtype=np.int64), self._blocks.owner_E
        self._owner_key = expert_E * cfg.num_ranks + owner_E
        slot_E = expert_E - np.asarray(self._blocks.first_D, dtype=np.int64)[owner_E]
        # the owner replicas' table, a row (expert, rank, slot, quota) per owner: quotas set per plan
        self._owner_rows = np.ascontiguousarray(np.stack((expert_E, owner_E, slot_E, expert_E)).T)
        self._L = self._blocks.idx_DL.shape[1]
        # the stock layout (owners, redundant slots empty): shared by every plan that moves nothing
        self._stock = Placement.owner_from_pairs(cfg.num_experts, cfg.num_ranks, cfg.ranks_per_node, cfg.slots, (), ())
        self._stock.replica_expert_R  # its replica table, computed once for every plan that shares it
        self._kernel = _compiled()

    @property
    def compiled(self) -> bool:
        """Whether plans come from the compiled cascade (else pure Python; the plans are identical)."""
        return self._kernel is not None

    def plan(self, counts_DE, state=None):
        if self._kernel is None:
            return self._plan(self.counts(counts_DE)), None
        cfg = self.cfg
        D, E = cfg.num_ranks, cfg.num_experts
        counts = check_counts(counts_DE, D, E, nonnegative=False)  # the kernel checks the sign
        load_E = np.empty(E, dtype=np.int64)
        se = np.empty((D, self._L + cfg.slots), dtype=np.int64)
        table = np.empty((4, E + D), dtype=np.int64)
        info = np.empty(4, dtype=np.int64)
        code = self._kernel(counts, D, E, cfg.ranks_per_node, cfg.slots, self.tol_limit, load_E, se, table, info)
        if code < 0:
            check_counts(counts, D, E)  # raises, naming the negative entry or the total
        lo, X = int(info[0]), int(info[2])
        if code == _STOCK:  # the kernel already judged it: nothing to export (or within tolerance)
            return self._stock_plan(counts, load_E, lo, int(info[1]), "stock"), None
        if code == _GAVE_UP:  # the threshold search: Python
            return self._plan(counts, load_E), None
        se.flags.writeable = False
        table.flags.writeable = False
        table = table[:, :E + X]
        p = Placement.trusted(se, E, cfg.ranks_per_node, OWNER, self._L)
        p.__dict__["_replicas"] = (table[0], table[1], table[2])
        info = {"threshold": lo, "mean_bound": lo, "exports": X, "method": "cascade"}
        return Plan.trusted(p, counts, table[3], policy=self.name, info=info), None

    def _plan(self, counts: np.ndarray, load_E: np.ndarray | None = None) -> Plan:
        """The planner in Python (checked counts; load_E their column sums, if known)."""
        cfg = self.cfg
        D, blocks = cfg.num_ranks, self._blocks
        if load_E is None:
            load_E = counts.sum(axis=0)
        base_D = blocks.rank_loads(load_E)
        base = base_D.tolist()
        total = sum(base)
        lo, hi = -(-total // D), max(base)
        got, threshold, how = None, hi, "stock"
        if hi > lo and cfg.slots > 0 and not (cfg.tolerance and self.tolerated(hi, total)):
            hot_D, hot_e_D = blocks.hottest(load_E, base_D)
            owned_desc = blocks.owned_desc(load_E)
            # visit nodes in turn only where the order cannot break the cascade (one expert per
            # rank); otherwise decreasing room and slack over all ranks keep its gaps small
            G = cfg.ranks_per_node if blocks.single else D
            if D >= _VECTORIZE_FROM and total < CASCADE_NP_MAX_TOKENS:
                got = cascade_np(lo, base_D, hot_D, hot_e_D, owned_desc, G)
            else:
                got = cascade(lo, base, hot_D.tolist(), hot_e_D.tolist(), owned_desc, G)
            threshold, how = lo, "cascade"
            if got is None:
                hot, hot_e = hot_D.tolist(), hot_e_D.tolist()

                def feasible(T):
                    got = cascade(T, base, hot, hot_e, owned_desc, D) if T > lo else None
                    if got is not None:
                        return [(e, d, a) for d, (e, a) in enumerate(zip(*got)) if e >= 0]
                    got = chain_greedy(T, base, owned_desc, cfg.slots, "room")
                    return got if got is not None else chain_greedy(T, base, owned_desc, cfg.slots, "excess")

                threshold, got = search_threshold(lo, hi, feasible)
                how = "chain"
        if not got:
            return self._stock_plan(counts, load_E, lo, threshold, how)
        placement, quota, n = self._build(load_E, got, how)
        info = {"threshold": threshold, "mean_bound": lo, "exports": n, "method": how}
        if how == "cascade":  # owners + one export per rank, quotas summing to the loads by construction
            return Plan.trusted(placement, counts, quota, policy=self.name, info=info)
        return Plan.from_quotas(placement, counts, quota, policy=self.name, info=info)

    def _stock_plan(self, counts: np.ndarray, load_E: np.ndarray, lo: int, threshold: int, how: str) -> Plan:
        """The stock layout: one replica per expert, in expert order, computing all its tokens."""
        load_E.flags.writeable = False
        info = {"threshold": threshold, "mean_bound": lo, "exports": 0, "method": how}
        return Plan.trusted(self._stock, counts, load_E, policy=self.name, info=info)

    def _build(self, load_E: np.ndarray, got, how: str):
        """Placement, quotas and number of exports. got: per-rank lists (expert_D, tokens_D) from
        `cascade` (how="cascade"), else a list of [expert, rank, tokens] pieces (distinct pairs off
        the owners). Replicas are numbered by (expert, rank), owners and exports merged."""
        cfg = self.cfg
        D, E = cfg.num_ranks, cfg.num_experts
        if how == "cascade":  # at most one piece per rank: it goes to the rank's first redundant slot
            # (hot path: as few numpy calls as the merge allows)
            L = self._L
            e_D = np.array(got[0], dtype=np.int64)
            d_X = (e_D >= 0).nonzero()[0]
            e_X = e_D[d_X]
            X = d_X.size
            se = _owner_template(E, D, cfg.slots).copy()
            se[:, L] = e_D
            se.flags.writeable = False
            p = Placement.trusted(se, E, cfg.ranks_per_node, OWNER, L)
            # the replica table directly: owner rows (already in (expert, rank) order) merged with
            # the export rows by their (expert, rank) keys
            rows = np.empty((E + X, 4), dtype=np.int64)
            rows[:E] = self._owner_rows
            ex = rows[E:]
            ex[:, 0], ex[:, 1], ex[:, 2], ex[:, 3] = e_X, d_X, L, np.array(got[1], dtype=np.int64)[d_X]
            # owners keep what they did not export
            rows[:E, 3] = load_E - np.bincount(e_X, weights=ex[:, 3], minlength=E).astype(np.int64)
            key = np.concatenate((self._owner_key, e_X * D + d_X))
            table = np.ascontiguousarray(rows.take(key.argsort(kind="stable"), axis=0).T)
            table.flags.writeable = False
            p.__dict__["_replicas"] = (table[0], table[1], table[2])
            return p, table[3], int(X)  # quotas read-only: Plan keeps them without a copy
        e_I, d_I, a_I = np.array(got, dtype=np.int64).reshape(-1, 3).T
        p = Placement.owner_from_pairs(E, D, cfg.ranks_per_node, cfg.slots, d_I, e_I)
        kept_E = load_E - np.bincount(e_I, weights=a_I, minlength=E).astype(np.int64)
        quota = np.concatenate((kept_E, a_I))[np.argsort(np.concatenate((self._owner_key, e_I * D + d_I)))]
        return p, quota, int(e_I.size)
