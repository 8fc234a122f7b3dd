"""`eplb`: history-based replication in the style of DeepSeek's EPLB.

Every `interval` steps the planner re-plans from the moving sum of expert loads over the last
`window` steps (the current step included). Between re-plans the placement is kept; each step's
tokens are split evenly over the replicas of their expert, same-node replicas first.

Placement (`place`): a history whose stock layout is within the tolerance (PlannerConfig) gets no
replicas. Otherwise candidates are scored by their busiest rank under the even split of the history,
and the best one is kept (ties: fewer replicas, then candidate order):

* stock: no replicas;
* DeepSeek EPLB: the D*S redundant slots granted greedily to the experts with the largest load per
  replica (water-filling), the replicas packed LPT-style onto the ranks' redundant slots;
* each of those two improved by a local search on the busiest rank: add a replica of one of its
  experts on the least-loaded rank with a free slot, or drop a redundant replica it hosts, whichever
  lowers the busiest pair the most, while that leaves every affected rank below the current maximum.

The packing alone fills every redundant slot: under near-uniform routing it adds half an expert to
ranks that were at the mean and makes the plan worse than stock; the local search from stock only
ever adds a replica that helps, and the stock candidate bounds the result.

Guarantee (`plan`): a kept placement may not fit the current step's counts; when its even split
loads the busiest rank more than the stock layout would for those counts, the step gets the stock
plan instead (`info["stock_fallback"]`). The state still advances and keeps the planned placement.
So an eplb plan is never worse than stock (max/mean tokens per rank) for the counts it planned.

Legend: D ranks, E experts, I steps (of the history window), S redundant slots per rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..plan import Placement, Plan, owner_of_experts, rank_totals
from .base import PlannerBase, PlannerConfig, PlannerError, even_quotas
from .packing import lpt_place, replica_counts

_BIG = np.iinfo(np.int64).max


@dataclass(frozen=True)
class EplbState:
    """history_IE: int64 [I <= window, E] loads of the latest steps; step: steps planned so far;
    placement: the placement planned from the history (kept between re-plans)."""

    history_IE: np.ndarray
    step: int = 0
    placement: Placement | None = None


class EplbPlanner(PlannerBase):
    name = "eplb"

    def __init__(self, cfg: PlannerConfig):
        super().__init__(cfg)
        D, E = cfg.num_ranks, cfg.num_experts
        self._owner = owner_of_experts(E, D)
        self._stock = Placement.owner_from_pairs(E, D, cfg.ranks_per_node, cfg.slots, (), ())

    def initial_state(self) -> EplbState:
        return EplbState(np.zeros((0, self.cfg.num_experts), dtype=np.int64))

    def _check_state(self, state) -> None:
        """The state this planner returned (for this shape): another planner's or shape's would fail
        deep inside numpy or plan on the wrong experts."""
        cfg = self.cfg
        if not isinstance(state, EplbState):
            raise PlannerError(f"eplb's state is the EplbState its last plan() returned (or None), "
                               f"got {type(state).__name__}")
        p, stock = state.placement, self._stock  # a placement of this config has the stock one's shape
        history = getattr(state.history_IE, "shape", ())
        if len(history) != 2 or history[1] != cfg.num_experts or p is not None and (
                p.num_experts, p.slot_expert_DS.shape, p.ranks_per_node) != (
                stock.num_experts, stock.slot_expert_DS.shape, stock.ranks_per_node):
            raise PlannerError(f"eplb's state is for another config (history {history}); this planner has "
                               f"{cfg.num_ranks} ranks, {cfg.num_experts} experts, {cfg.slots} slots, "
                               f"{cfg.ranks_per_node} ranks per node: pass the state its own plan() returned, or None")

    def plan(self, counts_DE, state: EplbState | None = None):
        counts, load_E = self.counts_and_load(counts_DE)
        cfg = self.cfg
        state = self.initial_state() if state is None else state
        self._check_state(state)
        history = np.concatenate([state.history_IE, load_E[None]])[-cfg.window:]
        history.flags.writeable = False
        placement = state.placement
        replanned = placement is None or state.step % cfg.interval == 0
        if replanned:
            placement = self.place(history.sum(axis=0))
        info = {"replanned": replanned, "history_steps": int(history.shape[0]), "stock_fallback": False}
        quota = even_quotas(load_E, placement.expert_ptr)
        # even splits of every expert's load over its replicas: they sum to the counts by construction
        quota.flags.writeable = False
        plan = Plan.trusted(placement, counts, quota, self.name, info)
        if placement.num_replicas > cfg.num_experts:  # replicas: never worse than stock for these counts
            # both busiest ranks by rank_totals (compiled), not numpy's bincounts and maxima: those
            # cost tens of microseconds on the cold caches between a step's plans
            if plan.peak_load()[0] > rank_totals(self._owner, load_E, cfg.num_ranks)[1]:
                info["stock_fallback"] = True
                load_E.flags.writeable = False
                plan = Plan.trusted(self._stock, counts, load_E, self.name, info)  # one replica each
        return plan, EplbState(history, state.step + 1, placement)

    # -- placement ----------------------------------------------------------------------------------
    def place(self, hist_E: np.ndarray) -> Placement:
        """Owner layout plus the redundant replicas that best balance the historical loads hist_E
        (split evenly over each expert's replicas); never worse than stock for hist_E."""
        cfg = self.cfg
        D, E, S = cfg.num_ranks, cfg.num_experts, cfg.slots
        hist_E = np.asarray(hist_E, dtype=np.int64)
        owner = self._owner
        stock_D = np.bincount(owner, weights=hist_E, minlength=D)
        if S == 0 or self.tolerated(int(stock_D.max()), int(hist_E.sum())):
            return self._stock  # balanced enough (or no slot to use): no replicas
        stock_T = np.zeros((E, D), dtype=bool)
        stock_T[np.arange(E), owner] = True
        lpt = self.lpt_placement(hist_E)
        lpt_T = stock_T.copy()
        lpt_T[lpt.replica_expert_R, lpt.replica_rank_R] = True
        max_moves = 2 * D * S + E
        candidates = [self._stock, self._from_hosted(self._local_search(hist_E, stock_T, max_moves)),
                      lpt, self._from_hosted(self._local_search(hist_E, lpt_T, max_moves))]
        best, best_key = None, None
        for i, p in enumerate(candidates):
            quota = even_quotas(hist_E, p.expert_ptr)
            key = (int(np.bincount(p.replica_rank_R, weights=quota, minlength=D).max()), p.num_replicas, i)
            if best_key is None or key < best_key:
                best, best_key = p, key
        return best

    def lpt_placement(self, hist_E: np.ndarray) -> Placement:
        """DeepSeek EPLB: replica counts by water-filling over all E + D*S slots, the replicas
        packed LPT-style (heaviest first onto the least-loaded rank with a free slot that does not
        host the expert). Fills every redundant slot, helpful or not."""
        cfg = self.cfg
        D, E, S = cfg.num_ranks, cfg.num_experts, cfg.slots
        owner = self._owner
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
        ok = item_rank >= 0
        return Placement.owner_from_pairs(E, D, cfg.ranks_per_node, S, item_rank[ok], item_e[ok])

    def _from_hosted(self, hosted_ED: np.ndarray) -> Placement:
        """Owner layout plus a replica wherever hosted_ED (bool [E, D]) marks a non-owner."""
        cfg = self.cfg
        E = cfg.num_experts
        red = hosted_ED.copy()
        red[np.arange(E), self._owner] = False
        e, d = np.nonzero(red)  # a rank's replicas fill its redundant slots in expert order
        return Placement.owner_from_pairs(E, cfg.num_ranks, cfg.ranks_per_node, cfg.slots, d, e)

    def _local_search(self, hist_E: np.ndarray, hosted_ED: np.ndarray, max_moves: int) -> np.ndarray:
        """Improve a placement (bool [E, D]: owners and replicas, modified in place and returned)
        for the historical loads hist_E split evenly (floor(load / replicas) per replica).

        Each move works on the busiest rank d (load M, lowest id on ties): either add a replica of
        an expert d hosts on the least-loaded rank with a free slot not hosting it, or drop a
        redundant replica d hosts. A move is taken only if every rank it changes ends below M, so
        (max load, ranks at the max) decreases at every move; of those, the one with the smallest
        resulting maximum over the changed ranks, then the lowest new load on d, adds before drops,
        then the lowest expert id. Stops when no move qualifies (or after max_moves)."""
        D, S = self.cfg.num_ranks, self.cfg.slots
        owner = self._owner.tolist()
        h = hist_E.tolist()
        n = hosted_ED.sum(axis=1).astype(np.int64)
        per_E = hist_E // n
        load = np.bincount(np.nonzero(hosted_ED)[1], weights=np.repeat(per_E, n), minlength=D).astype(np.int64)
        n, per = n.tolist(), per_E.tolist()
        free = (S - hosted_ED.sum(axis=0) + np.bincount(self._owner, minlength=D)).tolist()
        full = np.array([f <= 0 for f in free], dtype=bool)
        n_free = sum(free)
        on_rank = [[] for _ in range(D)]
        for e, d in zip(*np.nonzero(hosted_ED)):
            on_rank[d].append(int(e))
        for _ in range(max_moves):
            d = int(load.argmax())
            M = int(load[d])
            mine = on_rank[d]
            best = None
            cand = [e for e in mine if h[e] > 0 and n[e] < D] if n_free else []
            if cand:
                masked = np.where(hosted_ED[cand] | full, _BIG, load)  # [c, D]
                r_c = masked.argmin(axis=1)
                lr_c = masked[np.arange(len(cand)), r_c].tolist()
                for e, r, lr in zip(cand, r_c.tolist(), lr_c):
                    if lr == _BIG:
                        continue
                    new_per = h[e] // (n[e] + 1)
                    d_new = M - per[e] + new_per
                    key = (max(d_new, lr + new_per), d_new, 0, e, r)
                    if key[0] < M and (best is None or key < best):
                        best = key
            for e in mine:
                if owner[e] == d:
                    continue
                d_new = M - per[e]
                row = np.where(hosted_ED[e], load, -1)
                row[d] = -1
                others = int(row.max()) + h[e] // (n[e] - 1) - per[e]
                key = (max(d_new, others), d_new, 1, e, d)
                if key[0] < M and (best is None or key < best):
                    best = key
            if best is None:
                break
            _, _, drop, e, r = best
            if drop:
                hosted_ED[e, r] = False
                load[r] -= per[e]
                on_rank[r].remove(e)
                free[r] += 1
                n_free += 1
                n[e] -= 1
            else:
                hosted_ED[e, r] = True
                load[r] += per[e]  # corrected with every host's change below
                on_rank[r].append(e)
                free[r] -= 1
                n_free -= 1
                n[e] += 1
            full[r] = free[r] <= 0
            new_per = h[e] // n[e]
            load[hosted_ED[e]] += new_per - per[e]
            per[e] = new_per
        return hosted_ED
