"""Shared building blocks of the replicating planners: how many replicas each expert gets, and where.

Legend: D ranks, E experts; the replica items to place are spelled out (items, n_items of them).
"""
from __future__ import annotations

import numpy as np

_CANDIDATES_MAX = 1 << 18  # E * E * max_per_expert up to which replica_counts tries every threshold at once


def replica_counts(load_E: np.ndarray, budget: int, min_E: np.ndarray, max_per_expert: int) -> np.ndarray:
    """int64 [E]: replica count per expert, min_E <= n <= max_per_expert, sum(n) <= budget.

    Equivalent to repeatedly granting one more replica to the expert with the largest load per
    replica (ties to the lower expert id), computed by a water-filling search on the per-replica
    load threshold instead of one heap operation per replica. Experts with no load keep min_E.
    """
    load = np.asarray(load_E, dtype=np.int64)
    lo = np.minimum(np.asarray(min_E, dtype=np.int64), max_per_expert)
    budget = int(budget)
    if lo.sum() >= budget or not load.any():
        return lo.copy()

    def n_at(lam: int) -> np.ndarray:  # replicas so that no replica carries more than lam tokens
        return np.minimum(np.maximum(-(-load // lam), lo), max_per_expert)  # np.clip costs 5x more here

    a, b = 1, int(load.max())  # n_at(b) is the minimum allocation; find the smallest lam within budget
    if n_at(a).sum() <= budget:
        return n_at(a)
    # below total/budget tokens per replica the replicas would exceed the budget: start the search there
    a0 = max(1, -(-int(load.sum()) // budget) - 1)
    if a0 < b and n_at(a0).sum() > budget:
        a = a0
    if load.size * load.size * max_per_expert <= _CANDIDATES_MAX:
        # n_at's sum drops only where some expert's ceil(load / lam) does, at lam = ceil(load_e / j)
        # (j <= max_per_expert): the smallest such lam in (a, b] within budget, all tried at once (b,
        # the largest load, is one of them), is bisection's answer, in one pass; where none is
        # within budget (experts without load and min 0), bisection ends at b too
        cand = np.unique(-(-load[:, None] // np.arange(1, max_per_expert + 1, dtype=np.int64)))
        cand = cand[(cand > a) & (cand <= b)]
        ok = np.minimum(np.maximum(-(-load[:, None] // cand), lo[:, None]), max_per_expert).sum(axis=0) <= budget
        a, b = b - 1, (int(cand[np.argmax(ok)]) if ok.any() else b)  # the sum is non-increasing along cand
    while b - a > 1:  # many experts: bisect
        mid = (a + b) // 2
        if n_at(mid).sum() <= budget:
            b = mid
        else:
            a = mid
    n = n_at(b)
    left = budget - int(n.sum())
    while left > 0:  # hand out the remainder by largest load per replica, ties to the lower id
        room = np.flatnonzero((n < max_per_expert) & (load > 0))
        if room.size == 0:
            break
        key = load[room] / n[room]
        order = room[np.lexsort((room, -key))][:left]
        n[order] += 1
        left -= order.size
    return n


def lpt_place(item_expert: np.ndarray, item_load: np.ndarray, rank_load_D: np.ndarray,
              hosted_DE: np.ndarray, free_D: np.ndarray) -> np.ndarray:
    """Longest-processing-time placement of replica items onto ranks.

    item_expert, item_load: int64 [items], items already sorted by load, heaviest first.
    rank_load_D: int64 [D] load already on each rank; hosted_DE: bool [D, E] experts already there;
    free_D: int64 [D] free slots. All three are updated in place.
    Returns int64 [items]: the rank of every item, or -1 where no rank with a free slot lacks that
    expert (the caller serves those tokens with the expert's other replicas).

    Items go in rounds: each round hands the next heaviest items, one per rank, to the ranks with
    the least load; a rank that already hosts an item's expert swaps with a later item of the round.
    """
    n_items = item_expert.size
    out = np.full(n_items, -1, dtype=np.int64)
    pos = 0
    while pos < n_items:
        ranks = np.flatnonzero(free_D > 0)
        if ranks.size == 0:
            break
        ranks = ranks[np.argsort(rank_load_D[ranks], kind="stable")]
        m = min(ranks.size, n_items - pos)
        exp = item_expert[pos:pos + m]
        dst = ranks[:m].copy()
        bad = np.flatnonzero(hosted_DE[dst, exp])
        if bad.size:
            dst = _repair_round(exp, dst, ranks[m:], hosted_DE, bad)
        ok = dst >= 0
        out[pos:pos + m] = dst
        rank_load_D[dst[ok]] += item_load[pos:pos + m][ok]  # the round's ranks are distinct: no add.at
        hosted_DE[dst[ok], exp[ok]] = True
        free_D[dst[ok]] -= 1
        pos += m
    return out


def _repair_round(exp: np.ndarray, dst: np.ndarray, spare: np.ndarray, hosted_DE: np.ndarray,
                  bad: np.ndarray) -> np.ndarray:
    """Fix items of one round whose rank already hosts their expert: swap with another item of the
    round, else move to a spare rank of the round, else leave unplaced (-1)."""
    dst = dst.copy()
    spare = list(spare)
    for i in bad.tolist():
        e = exp[i]
        if not hosted_DE[dst[i], e]:
            continue  # fixed by an earlier swap
        for j in range(dst.size):
            # ranks are distinct within a round, so checking the two hosted entries is enough
            if j != i and dst[j] >= 0 and exp[j] != e and not hosted_DE[dst[j], e] \
                    and not hosted_DE[dst[i], exp[j]]:
                dst[i], dst[j] = dst[j], dst[i]
                break
        else:
            for k, r in enumerate(spare):
                if not hosted_DE[r, e]:
                    dst[i] = spare.pop(k)
                    break
            else:
                dst[i] = -1
    return dst
