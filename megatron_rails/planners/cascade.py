"""Cascading exports: the core of `ultraep` (owner layout, R redundant slots per rank, threshold T).

Ranks above T ("givers") must export their excess from the experts they own; ranks below T
("takers") have slack. Both algorithms here move tokens along a *chain*: a carry (tokens of one
expert) enters a rank, which either keeps part of it and passes the rest on (a taker), or keeps all
of it and passes on its own hottest expert instead, now carrying its own excess too (a giver: the
*cascade*). Every rank then receives at most one piece, so one redundant slot per rank suffices.

`cascade` (vectorized, the hot path) fixes the chain order up front: givers after the first in
decreasing order of absorbing room w = hottest owned load - excess, takers by decreasing slack,
each giver inserted just before the taker its carry could not fill. In the line picture
(McNaughton's wrap-around) the excesses are laid end to end over the takers' slacks; wherever a
boundary between two givers' streams falls inside a taker, the next giver absorbs the short tail
(the `gap`, less than that taker's slack) instead, so every boundary lands on a taker cut. A giver
whose carry exceeds its hottest expert splits the rest over its next experts, again at taker cuts.

Guarantee: at T = ceil(total / D) the line always fits (the slacks sum to at least the excesses),
every taker receives one piece and every giver at most one, and the only condition is
gap + excess <= hottest owned load for every giver; gap < the largest slack, so it holds when
every giver's owned load outside its hottest expert is at most T - (largest slack), in particular
whenever every rank owns at most one expert (E <= D): then max load = ceil(mean), the optimum.

`chain_greedy` (sequential, the fallback) chooses the chain as it goes: absorb the carry at the
giver with the least room that fits it, else fill the taker with the most slack that the carry
covers, else end the carry at the best-fitting taker (or push the residual back to a pending sibling
stream of the chain's first giver). It is searched over T by `search_threshold`.

Legend: D ranks, E experts, G givers, K takers, I exported pieces (expert, rank, tokens).
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right, insort

import numpy as np

from ..plan import owner_of_experts, owner_slots_needed


_BIG = 1 << 60  # above any |load| difference: sorts givers ahead of takers in one key


class OwnerBlocks:
    """Static facts of the owner layout for (E, D): owner_E int64 [E], each rank's experts idx_DL
    int64 [D, L] (padded with E), and how to reduce over ranks fast."""

    def __init__(self, num_experts: int, num_ranks: int):
        E, D = num_experts, num_ranks
        self.E, self.D = E, D
        self.owner_E = owner_of_experts(E, D)
        L = owner_slots_needed(E, D)
        first = np.searchsorted(self.owner_E, np.arange(D), side="left")
        idx = first[:, None] + np.arange(L)[None, :]
        ok = idx < E
        ok[ok] = self.owner_E[idx[ok]] == np.nonzero(ok)[0]
        self.idx_DL = np.where(ok, idx, E).astype(np.int64)
        self.first_D = first.astype(np.int64)
        # single: every rank owns at most one expert; block: every rank owns exactly L = E/D
        self.single = E <= D
        self.block = E % D == 0 and not self.single
        self.dense = E >= D

    def rank_loads(self, load_E: np.ndarray) -> np.ndarray:
        """int64 [D]: tokens every rank owns."""
        if self.block:
            return load_E.reshape(self.D, -1).sum(axis=1)
        if self.dense:
            return np.add.reduceat(load_E, self.first_D)
        base = np.zeros(self.D, dtype=np.int64)
        base[self.owner_E] = load_E
        return base

    def hottest(self, load_E: np.ndarray, base_D: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(load, expert) int64 [D] of every rank's hottest owned expert, lower id on ties
        (expert E, load 0 for a rank that owns nothing)."""
        if self.single:
            return base_D, self.idx_DL[:, 0]
        if self.block:
            e = self.first_D + load_E.reshape(self.D, -1).argmax(axis=1)
            return load_E[e], e
        m = np.append(load_E, -1)[self.idx_DL]
        e = self.idx_DL[np.arange(self.D), m.argmax(axis=1)]
        return load_E[e], e

    def owned_desc(self, load: list, d: int) -> list[tuple[int, int]]:
        """Rank d's experts as (load, expert), hottest first, lower id on ties (Python lists)."""
        row = [e for e in self.idx_DL[d].tolist() if e < self.E]
        return sorted(((load[e], e) for e in row), key=lambda t: (-t[0], t[1]))


# -- vectorized cascade ----------------------------------------------------------------------------
def cascade(T: int, load_E: np.ndarray, base_D: np.ndarray, blocks: OwnerBlocks):
    """Exports at threshold T along the fixed chain order described in the module docstring.

    Returns (expert_I, rank_I, tokens_I) int64 with every (expert, rank) distinct, every rank
    receiving at most one piece and every rank ending at or below T; None if some giver's carry
    cannot be split over its experts at taker cuts (the caller falls back to `chain_greedy`).
    Needs T >= ceil(sum(load_E) / D), so that the slacks cover the excesses, and some giver.
    """
    hot_D, hot_e_D = blocks.hottest(load_E, base_D)
    sig = T - base_D
    over = sig < 0
    # one stable sort: givers by decreasing room w = hottest - excess, then takers by decreasing
    # slack, then ranks exactly at T; lower rank first on ties
    order = np.argsort(-np.where(over, hot_D + sig + _BIG, sig), kind="stable")
    G = int(np.count_nonzero(over))
    K = int(np.count_nonzero(sig)) - G
    # the giver with the least room leads: it absorbs nothing
    giv = np.concatenate((order[G - 1:G], order[:G - 1]))
    tak = order[G:G + K]
    neg_x = sig[giv]
    X = -np.cumsum(neg_x)
    s = sig[tak]
    S0 = np.zeros(K + 1, dtype=np.int64)
    np.cumsum(s, out=S0[1:])
    Xprev = X + neg_x
    start = S0[np.searchsorted(S0, Xprev, side="right") - 1]  # the taker cut each stream starts at
    gap = Xprev - start                                         # tail of the previous stream it absorbs
    hot_e = hot_e_D[giv]
    seg_start, seg_e, last_e = start, hot_e, hot_e
    if (X - start > hot_D[giv]).any():
        got = _split_at_cuts(giv, start, X, hot_D[giv], S0, load_E, blocks, hot_e)
        if got is None:
            return None
        seg_start, seg_e, last_e = got
    end = int(X[-1])
    n = int(np.searchsorted(S0, end, side="left"))  # takers 0..n-1 receive a piece
    a = s[:n].copy()
    a[-1] = end - int(S0[n - 1])
    seg = np.searchsorted(seg_start, S0[:n], side="right") - 1
    ab = np.flatnonzero(gap)
    e_I = np.concatenate((seg_e[seg], last_e[ab - 1]))
    d_I = np.concatenate((tak[:n], giv[ab]))
    a_I = np.concatenate((a, gap[ab]))
    return e_I, d_I, a_I


def _split_at_cuts(giv, start, X, hot, S0, load_E, blocks, hot_e):
    """Stream segments (start int64 [*], expert int64 [*]) sorted by start, and the expert whose
    tail each giver's successor absorbs, when some givers spread their carry over several experts,
    changing expert only at taker cuts. None if impossible."""
    load = load_E.tolist()
    starts, experts, ends = start.tolist(), hot_e.tolist(), X.tolist()
    last_e = hot_e.copy()
    extra: list[tuple[int, int, int, int]] = []  # (start, chain index, part, expert)
    cuts = S0.tolist()
    for i in np.flatnonzero(X - start > hot).tolist():
        pos, end = starts[i], ends[i]
        own = blocks.owned_desc(load, int(giv[i]))
        part = 0
        for k, (l, e) in enumerate(own):
            if end - pos <= l:
                break
            # the furthest taker cut this expert can reach; the next expert starts there
            c = cuts[bisect_right(cuts, pos + l) - 1]
            if c <= pos or k + 1 >= len(own):
                return None
            part += 1
            extra.append((c, i, part, own[k + 1][1]))
            pos = c
        else:
            return None
        last_e[i] = own[part][1]
    rows = [(starts[i], i, 0, experts[i]) for i in range(len(starts))] + extra
    rows.sort()
    arr = np.array(rows, dtype=np.int64)
    return arr[:, 0], arr[:, 3], last_e


# -- sequential chain greedy -----------------------------------------------------------------------
def chain_greedy(T: int, load: list, base: list, blocks: OwnerBlocks, slots: int):
    """Exports at threshold T as a list of [expert, rank, tokens], or None if the chain runs out of
    receivers. Pure Python on lists: load (E ints), base (D ints)."""
    D = blocks.D
    sig = [T - b for b in base]
    free = [slots] * D
    takers = sorted((sig[d], d) for d in range(D) if sig[d] > 0)
    own = {d: blocks.owned_desc(load, d) for d in range(D) if sig[d] < 0}
    room = {d: own[d][0][0] + sig[d] for d in own}               # w = hottest - excess
    absorbers = sorted((w, d) for d, w in room.items() if w >= 0)
    starters = sorted((w, d) for d, w in room.items())
    pieces: list[list[int]] = []
    pending: list[list[int]] = []                                # side streams [e, tokens, cap, giver]

    def start(g: int, c: int):
        """Giver g takes carry c (or starts a chain, c = 0) and emits c + excess, hottest first."""
        del starters[bisect_left(starters, (room[g], g))]
        i = bisect_left(absorbers, (room[g], g))
        if i < len(absorbers) and absorbers[i][1] == g:
            del absorbers[i]
        need = c - sig[g]
        streams = []
        for l, e in own[g]:
            if need <= 0:
                break
            a = l if l < need else need
            streams.append([e, a, l, g])
            need -= a
        if need > 0:
            return None
        pending.extend(reversed(streams[1:]))
        return streams[0]

    carry, chain_abs, root = None, [], -1
    while True:
        if carry is None:
            chain_abs = []
            if pending:
                carry = pending.pop()
            elif starters:
                carry = start(starters[0][1], 0)
                if carry is None:
                    return None
            else:
                return [p for p in pieces if p[2] > 0]
            root = carry[3]
            continue
        e, c = carry[0], carry[1]
        i = bisect_left(absorbers, (c, -1))
        if i < len(absorbers):                                   # cascade: a giver absorbs it all
            g = absorbers[i][1]
            chain_abs.append(len(pieces))
            pieces.append([e, g, c])
            free[g] -= 1
            carry = start(g, c)
            if carry is None:
                return None
            continue
        i = bisect_right(takers, (c, D)) - 1
        if i >= 0:                                               # fill the roomiest taker it covers
            s, t = takers.pop(i)
            pieces.append([e, t, s])
            free[t] -= 1
            carry = [e, c - s, carry[2], carry[3]] if c > s else None
            continue
        if not takers:
            return None
        s, t = takers[0]                                         # every taker has more room than c
        if free[t] < 2 and (starters or pending):
            sib = next((q for q in reversed(pending) if q[3] == root and q[2] - q[1] >= c), None)
            if sib is not None and all(pieces[k][2] >= c for k in chain_abs):
                # end exactly: every absorber on this chain takes c less, the root's sibling c more
                for k in chain_abs:
                    pieces[k][2] -= c
                sib[1] += c
                carry = None
                continue
        takers.pop(0)
        pieces.append([e, t, c])
        free[t] -= 1
        if free[t] > 0 and s > c:
            insort(takers, (s - c, t))
        carry = None


def search_threshold(lo: int, hi: int, feasible):
    """Smallest threshold in [lo, hi] that `feasible` (T -> exports or None) meets, to within
    max(1, lo/1024): gallop up from lo, then bisect. hi always succeeds (nothing to export)."""
    found = feasible(lo)
    if found is not None:
        return lo, found
    step = max(1, lo >> 10)
    bad, good, best, k = lo, hi, [], 0
    while bad + step * (1 << k) < hi:
        t = bad + step * (1 << k)
        found = feasible(t)
        if found is not None:
            good, best = t, found
            break
        bad, k = t, k + 1
    while good - bad > step:
        mid = (bad + good) // 2
        found = feasible(mid)
        if found is None:
            bad = mid
        else:
            good, best = mid, found
    return good, best
