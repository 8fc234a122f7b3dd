"""Cascading exports: the core of `ultraep` (owner layout, `slots` redundant slots per rank, threshold T).

Ranks above T ("givers") must export their excess from the experts they own; ranks below T
("takers") have slack. Tokens move along a *chain*: a carry (tokens of one expert) reaches a rank,
which either keeps part of it and passes the rest on (a taker), or keeps all of it and passes on
its own hottest expert instead, now carrying its own excess too (a giver: the *cascade*, an owner
giving away its own tokens to make room for another expert's tail). Every rank then receives at
most one piece, so one redundant slot per rank suffices.

`cascade` (the hot path) fixes the chain's order up front and walks it once. In McNaughton's
wrap-around picture the givers' excesses are laid end to end over the takers' slacks; wherever the
boundary between two givers' streams falls inside a taker, the second giver absorbs the short tail
(the `gap`, less than that taker's slack) and exports that much more of its hottest expert, so that
every boundary lands on a taker cut. A giver whose carry exceeds its hottest expert spreads it over
its next hottest experts, again changing expert only at taker cuts; if it cannot, `cascade` gives up.
`cascade_np` is the same walk in numpy (cumulative sums), for many ranks.

Guarantee: at T = ceil(total / D) the slacks cover the excesses, every taker receives one piece and
every giver at most one, and the only condition is gap + excess <= hottest owned load for every
giver. gap < some taker's slack, so it holds whenever every giver's owned load outside its hottest
expert is at most T - (the largest slack), for any chain order; in particular whenever every rank
owns at most one expert (E <= D), where max load = ceil(mean), the optimum.

`chain_greedy` (the fallback) builds the chain as it goes: absorb the carry at the giver with the
least room that still fits it, else fill the taker with the most slack that the carry covers, else
end the carry at the best-fitting taker, or push the residual back to a pending sibling stream of
the chain's first giver so that the chain ends exactly. `search_threshold` searches it over T.

Chain order: givers by decreasing room w = hottest owned load - excess (the one with the least
room leads: it absorbs nothing), takers by decreasing slack, lower rank first on ties. Given
ranks_per_node < D, nodes come first in that key, visited so that the running sum of their net
excess stays near zero (exports stay inside a node where they can). Legend: D ranks, E experts,
G ranks per node, V nodes, L owner slots per rank, T the threshold (tokens on one rank); a piece is
(expert, rank, tokens).
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right, insort

import numpy as np

from ..plan import owner_of_experts, owner_slots_needed

_NEVER = 1 << 62  # slack of the taker past the last one


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
        self._first = first.astype(np.int64)
        self.first_D = first.tolist()                               # rank d owns experts
        self.count_D = (self.idx_DL < E).sum(axis=1).tolist()      # first_D[d] .. + count_D[d] - 1
        self.single = E <= D                     # every rank owns at most one expert
        self.block = E % D == 0 and not self.single  # every rank owns exactly E/D > 1

    def rank_loads(self, load_E: np.ndarray) -> np.ndarray:
        """int64 [D]: tokens every rank owns."""
        if self.block:
            return load_E.reshape(self.D, -1).sum(axis=1)
        if not self.single:
            return np.add.reduceat(load_E, self._first)
        base = np.zeros(self.D, dtype=np.int64)
        base[self.owner_E] = load_E
        return base

    def hottest(self, load_E: np.ndarray, base_D: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(load, expert) int64 [D] of every rank's hottest owned expert, lower id on ties
        (expert E, load 0 for a rank that owns nothing)."""
        if self.single:
            return base_D, self.idx_DL[:, 0]
        if self.block:
            e = self._first + load_E.reshape(self.D, -1).argmax(axis=1)
        else:
            e = self.idx_DL[np.arange(self.D), np.append(load_E, -1)[self.idx_DL].argmax(axis=1)]
        return load_E[e], e

    def owned_desc(self, load_E: np.ndarray):
        """owned_desc(d) -> rank d's experts as [(load, expert)], hottest first, lower id on ties."""
        first, count = self.first_D, self.count_D

        def owned(d: int) -> list[tuple[int, int]]:
            a = first[d]
            b = a + count[d]
            return sorted(zip(load_E[a:b].tolist(), range(a, b)), key=_hottest_first)

        return owned


def _hottest_first(t: tuple[int, int]) -> tuple[int, int]:
    return -t[0], t[1]


def node_order(net_V: list, first: int) -> list:
    """Position of every node in the chain: `first` leads; then, while the running sum of net
    excess (net_V: excess - slack per node) is positive, the node with the largest deficit next,
    else the one with the largest surplus (lower node first on ties)."""
    rest = [n for n in range(len(net_V)) if n != first]
    plus = sorted((n for n in rest if net_V[n] > 0), key=lambda n: (-net_V[n], n))
    minus = sorted((n for n in rest if net_V[n] <= 0), key=lambda n: (net_V[n], n))
    pos = [0] * len(net_V)
    run, i, j = net_V[first], 0, 0
    for k in range(1, len(net_V)):
        if j >= len(minus) or (run <= 0 and i < len(plus)):
            n, i = plus[i], i + 1
        else:
            n, j = minus[j], j + 1
        pos[n] = k
        run += net_V[n]
    return pos


def cascade(T: int, base: list, hot: list, hot_e: list, owned_desc, ranks_per_node: int):
    """Exports at threshold T along the fixed chain order (module docstring).

    base, hot, hot_e: lists [D] of owned tokens and hottest owned expert (load, id) per rank;
    owned_desc(d): rank d's (load, expert) hottest first; ranks_per_node: G, or D to ignore nodes.
    Needs T >= ceil(sum(base) / D) and some rank above T. Every rank receives at most one piece:
    returns lists (expert_D, tokens_D) [D], the expert whose tokens rank d computes besides its own
    (-1 for none) and how many; every rank ends at or below T. None if some giver's carry cannot be
    split over its experts at taker cuts.
    """
    D, G = len(base), ranks_per_node
    giv, tak = [], []
    if G < D:
        net = [0] * (D // G)
        for d, b in enumerate(base):
            sd = T - b
            net[d // G] -= sd
            if sd < 0:
                giv.append((-(hot[d] + sd), d))  # key: minus the room w = hottest - excess
            elif sd > 0:
                tak.append((-sd, d))
        lead = max(giv)                          # least room (higher rank on ties): absorbs nothing
        pos = node_order(net, lead[1] // G)
        giv = [lead] + [t[1:] for t in sorted((pos[d // G], k, d) for k, d in giv if d != lead[1])]
        tak = [t[1:] for t in sorted((pos[d // G], k, d) for k, d in tak)]
    else:
        for d, b in enumerate(base):
            sd = T - b
            if sd < 0:
                giv.append((-(hot[d] + sd), d))
            elif sd > 0:
                tak.append((-sd, d))
        giv.sort()
        tak.sort()
        giv.insert(0, giv.pop())
    got_e, got_a = [-1] * D, [0] * D
    n_tak, j, c, cur = len(tak), 0, 0, -1
    s_j = -tak[0][0]
    for _, g in giv:
        while s_j <= c:                          # the carry fills whole takers
            t = tak[j][1]
            got_e[t], got_a[t] = cur, s_j
            c -= s_j
            j += 1
            s_j = -tak[j][0] if j < n_tak else _NEVER
        if c:                                    # g absorbs the tail, passes its own expert on
            got_e[g], got_a[g] = cur, c
        c += base[g] - T
        if c <= hot[g]:
            cur = hot_e[g]
            continue
        for left, e in owned_desc(g):            # several experts, changing only at taker cuts
            while s_j <= left and s_j < c:
                t = tak[j][1]
                got_e[t], got_a[t] = e, s_j
                c -= s_j
                left -= s_j
                j += 1
                s_j = -tak[j][0] if j < n_tak else _NEVER
            if c <= left:
                cur = e
                break
        else:
            return None
    while c > 0:                                 # the last carry spreads over the next takers
        t = tak[j][1]
        got_e[t], got_a[t] = cur, (s_j if s_j < c else c)
        c -= s_j
        j += 1
        s_j = -tak[j][0] if j < n_tak else _NEVER
    return got_e, got_a


# cascade_np packs a rank's room or slack below bit 41 of its sort key (the node's turn above it): with
# more tokens than this in a layer it would reorder the chain, so the plain loop runs instead
CASCADE_NP_MAX_TOKENS = 1 << 40


def cascade_np(T: int, base_D: np.ndarray, hot_D: np.ndarray, hot_e_D: np.ndarray, owned_desc,
               ranks_per_node: int):
    """`cascade` vectorized (int64 arrays [D] in, int64 arrays (expert_D, tokens_D) out): the same
    chain order and the same exports, in a fixed number of numpy calls plus a Python step per giver
    that spreads its carry over several experts. Faster than the plain loop from a few hundred ranks.
    Every load must stay below CASCADE_NP_MAX_TOKENS (the caller checks).

    The walk reduces to cumulative sums: giver i's stream starts at the last taker cut at or below
    the excess of the givers before it (Xprev_i); the difference is the tail (gap) it absorbs.
    """
    D, G = base_D.size, ranks_per_node
    sig = T - base_D
    over = sig < 0
    w = hot_D + sig
    if G < D:
        net = (-sig).reshape(-1, G).sum(axis=1).tolist()
        gi = np.flatnonzero(over)
        lead = int(gi[np.flatnonzero(w[gi] == w[gi].min())[-1]])  # least room, higher rank on ties
        node_key = np.repeat(np.array(node_order(net, lead // G), dtype=np.int64) << 42, G)
    else:
        lead = -1
        node_key = 0
    # one stable sort, lower rank first on ties: givers by (node, decreasing room), then takers by
    # (node, decreasing slack), then ranks at T
    key = node_key + ((1 << 41) - np.where(over, w, sig))
    key = np.where(over, key - (1 << 61), np.where(sig > 0, key - (1 << 60), key))
    order = np.argsort(key, kind="stable")
    n_giv = int(np.count_nonzero(over))
    n_tak = int(np.count_nonzero(sig)) - n_giv
    giv = order[:n_giv]
    if lead < 0:
        lead = int(giv[-1])
    giv = np.concatenate(([lead], giv[giv != lead]))
    tak = order[n_giv:n_giv + n_tak]
    s = sig[tak]
    cum_slack = np.zeros(n_tak + 1, dtype=np.int64)
    np.cumsum(s, out=cum_slack[1:])
    X = np.cumsum(-sig[giv])
    end = int(X[-1])
    k = np.searchsorted(cum_slack, X + sig[giv], side="right") - 1  # taker where each stream starts
    k[0] = 0
    gap = X + sig[giv] - cum_slack[k]
    n = int(np.searchsorted(cum_slack, end, side="left"))     # takers 0..n-1 receive a piece
    hot_e = hot_e_D[giv]
    label = np.repeat(hot_e, np.diff(np.append(k, n)))        # expert filling each taker
    last_e = hot_e.copy()                                     # expert each stream ends with
    for i in np.flatnonzero(X - cum_slack[k] > hot_D[giv]).tolist():
        j, c, stop = int(k[i]), int(X[i] - cum_slack[k[i]]), (int(k[i + 1]) if i + 1 < giv.size else n)
        for left, e in owned_desc(int(giv[i])):
            while j < n_tak and s[j] <= left and s[j] < c:
                label[j] = e
                c -= int(s[j])
                left -= int(s[j])
                j += 1
            if c <= left:
                last_e[i] = e
                label[j:stop] = e
                break
        else:
            return None
    e_D = np.full(D, -1, dtype=np.int64)
    a_D = np.zeros(D, dtype=np.int64)
    e_D[tak[:n]] = label
    a_D[tak[:n]] = s[:n]
    a_D[tak[n - 1]] = end - cum_slack[n - 1]
    ab = np.flatnonzero(gap)
    e_D[giv[ab]] = last_e[ab - 1]
    a_D[giv[ab]] = gap[ab]
    return e_D, a_D


# -- sequential chain greedy -----------------------------------------------------------------------
def chain_greedy(T: int, base: list, owned_desc, slots: int, lead: str = "room"):
    """Exports at threshold T as a list of [expert, rank, tokens], or None if the chain runs out of
    receivers. base: owned tokens per rank (list [D]); owned_desc(d): rank d's (load, expert),
    hottest first. A chain starts at the giver with the least room (lead="room") or the least
    excess (lead="excess")."""
    D = len(base)
    sig = [T - b for b in base]
    free = [slots] * D
    takers = sorted((sig[d], d) for d in range(D) if sig[d] > 0)
    own = {d: owned_desc(d) for d in range(D) if sig[d] < 0}
    room = {d: own[d][0][0] + sig[d] for d in own}               # w = hottest - excess
    absorbers = sorted((w, d) for d, w in room.items() if w >= 0)
    skey = room if lead == "room" else {d: -sig[d] for d in own}
    starters = sorted((k, d) for d, k in skey.items())
    pieces: list[list[int]] = []
    pending: list[list[int]] = []                                # side streams [e, tokens, cap, giver]

    def start(g: int, c: int):
        """Giver g takes carry c (or starts a chain, c = 0) and emits c + excess, hottest first."""
        del starters[bisect_left(starters, (skey[g], g))]
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
