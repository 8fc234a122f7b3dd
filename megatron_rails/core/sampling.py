"""Sampling token routing: counts_DE of ranks whose tokens each pick topk distinct experts.

Model: a skew gives routing weights p_E (one step and layer, core/workloads.py), shared by all ranks
(rows differ through their own tokens' draws). Every token picks topk experts by sequential sampling
without replacement from p_E (Plackett-Luce, what the Gumbel-top-k trick samples): first choice ~ p_E,
each later one ~ p_E renormalized over the experts it has not picked. The sampler is exact per token (up
to float64 rounding of the cumulative weights) and vectorized over tokens: experts are relabeled hottest
first, each choice is drawn from p_E truncated below the token's smallest unpicked label (2^16-cell
lookup tables), a repeated choice is redrawn by rejection and, for the rare survivors, from the
renormalized distribution directly. A top-k of 32 or more that is at least an eighth of the experts
draws by the Gumbel-top-k trick instead (a key per expert and token), where the redraws would grow with
top-k squared. The draws for a given generator state are fixed (tests/test_workloads.py pins seeded
workloads).

Shape legend: D ranks, E experts, T tokens per rank, N tokens in one sampling chunk (in `_Dist` and
`_clash` also a subset of them: the tokens being redrawn). Spelled out, without a letter: the top-k
choices per token (topk), the choices made so far, the truncation points of the lookup tables (trunc)
and the 2^16 cells of one table.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from .errors import WorkloadError

MIN_WEIGHT = 1e-12                  # the topk-th largest routing weight must reach this (relative to the sum)
_CELLS = 1 << 16                    # lookup-table cells (16 random bits per draw)
MAX_EXPERTS = 0xFFFF                # experts are uint16 labels, and this one is taken:
_MARK = MAX_EXPERTS                 # the table entry for a cell that straddles experts
_CHUNK_TOKENS = 1 << 16             # tokens sampled together: big enough to amortize numpy calls, cache-sized
_REJECT_ROUNDS = 4                  # rejection rounds for a repeated choice before the renormalized draw
_TABLES = 64                        # truncation points with a prebuilt table (uint16, 128 KiB each)
_BITMAP_TOPK = 32                   # from this top-k on, a token's picks are also kept as a bitmap
_BITMAP_BYTES = 1 << 26             # of at most this size (the chunk's tokens x E bits)
_GUMBEL_TOPK = 32                   # from this top-k on, and an eighth of the experts: the Gumbel-top-k trick
_GUMBEL_BLOCK = 1 << 22             # keys per block there (float64: 32 MiB)


class _Dist:
    """Draws from weights p_E sorted hottest first, truncated to labels >= q (q < n_trunc).

    Table q splits [cum_start[q], 1) into 2^16 equal cells; a cell inside one expert's interval maps to it,
    a cell straddling experts (_MARK) is resolved with a second uniform and a binary search. `table` holds
    the first min(n_trunc, _TABLES) tables end to end (uint16 [tables * cells], flattened); a cell of a later
    table is worked out when drawn, by the same float operations (so with the same result), which keeps a
    large top-k from building tables of gigabytes.
    """

    def __init__(self, p_E: np.ndarray, n_trunc: int):
        cum_end = np.cumsum(p_E / p_E.sum())
        cum_end[-1] = 1.0
        self.cum_end_E = cum_end
        self.p_E = np.diff(cum_end, prepend=0.0)  # the weights exactly as the cumulative sums encode them
        self.cum_start_E = np.concatenate(([0.0], cum_end[:-1]))
        self.lo_trunc = self.cum_start_E[:n_trunc].copy()
        self.width_trunc = (1.0 - self.lo_trunc) / _CELLS
        self.n_tables = min(n_trunc, _TABLES)
        q = np.arange(self.n_tables)
        self.table = self._cells(q[:, None], np.arange(_CELLS)[None, :]).reshape(-1)

    def _cells(self, q, cell) -> np.ndarray:
        """uint16, broadcast shape of q and cell: the expert of table q's cell, _MARK where it straddles."""
        start = self.lo_trunc[q] + cell * self.width_trunc[q]
        e_start = np.minimum(np.searchsorted(self.cum_end_E, start, side="right"), self.p_E.size - 1)
        return np.where(start + self.width_trunc[q] <= self.cum_end_E[e_start], e_start, _MARK).astype(np.uint16)

    def search(self, u_N: np.ndarray) -> np.ndarray:
        """Expert whose [cum_start, cum_end) holds u_N; side="right" never returns a zero-width expert."""
        return np.searchsorted(self.cum_end_E, np.minimum(u_N, np.nextafter(1.0, 0.0)), side="right")

    def draw(self, rng: np.random.Generator, m: int, q_N: np.ndarray | None = None) -> np.ndarray:
        """uint16 [N] (N = m): one draw per entry from p_E truncated to labels >= q_N[i] (all labels if None)."""
        r16 = rng.bit_generator.random_raw(-(-m // 4)).view(np.uint16)[:m]
        if q_N is None:
            e = np.take(self.table, r16)
        else:
            q = q_N.astype(np.intp)
            beyond = np.flatnonzero(q >= self.n_tables)
            e = np.take(self.table, (np.minimum(q, self.n_tables - 1) << 16) | r16)
            if beyond.size:
                e[beyond] = self._cells(q[beyond], r16[beyond].astype(np.intp))
        split = np.flatnonzero(e == _MARK)
        if split.size:
            q = 0 if q_N is None else q_N[split]
            e[split] = self.search(self.lo_trunc[q] + (r16[split] + rng.random(split.size)) * self.width_trunc[q])
        return e

    def draw_excluding(self, rng: np.random.Generator, excl: np.ndarray) -> np.ndarray:
        """uint16 [N]: one draw per column from p_E renormalized over labels not in excl[:, n] (distinct);
        excl: [choices so far, N]."""
        out = np.empty(excl.shape[1], dtype=np.uint16)
        todo = np.arange(excl.shape[1])
        ex = np.sort(excl, axis=0).astype(np.intp)  # [choices so far, tokens still to draw]
        for _ in range(64):  # float rounding at an interval edge may land on an excluded expert: redraw those
            pex, sex = self.p_E[ex], self.cum_start_E[ex]
            u = rng.random(todo.size) * (1.0 - pex.sum(axis=0))
            e = self.search(skip_excluded(u, pex, sex))
            clash = (ex == e).any(axis=0)
            out[todo[~clash]] = e[~clash]
            todo, ex = todo[clash], ex[:, clash]
            if not todo.size:
                return out
        raise WorkloadError("could not draw distinct experts: routing weights too concentrated for float64")


def skip_excluded(u_N: np.ndarray, pex: np.ndarray, sex: np.ndarray) -> np.ndarray:
    """float64 [N]: u_N, a point on the line with the excluded intervals cut out, mapped back onto the whole
    line: the width pex[i] of each excluded interval (sorted by start sex[i]; [choices so far, N]) is added
    in order while u has reached its start. Once u stays below a start it stays below every later one, so
    the adds are a prefix: a running sum (sequential, as one add after another would round) picked at each
    token's first start not reached."""
    run = np.cumsum(np.concatenate((u_N[None], pex)), axis=0)  # run[i]: u after the first i adds
    reached = np.concatenate((run[:-1] >= sex, np.zeros((1, u_N.size), dtype=bool)))
    return run[np.argmin(reached, axis=0), np.arange(u_N.size)]


@lru_cache(maxsize=16)
def _dist_cached(p_bytes: bytes, n_trunc: int) -> _Dist:
    return _Dist(np.frombuffer(p_bytes, dtype=np.float64), n_trunc)


def _clash(new_N: np.ndarray, prev: np.ndarray) -> np.ndarray:
    """bool [N]: new_N[n] equals one of prev[:, n] (prev: [choices so far, N])."""
    hit = new_N == prev[0]
    for i in range(1, prev.shape[0]):
        hit |= new_N == prev[i]
    return hit


class _Picked:
    """The experts each of N tokens has picked so far: its columns of `picks` ([topk, N], filled up to
    `j` choices), and for a large top-k also a bitmap (uint8 [N, ceil(E/8)], where that is not too large),
    so that asking whether a draw repeats a pick costs the same at every choice instead of growing with it."""

    def __init__(self, picks: np.ndarray, num_experts: int):
        self.picks, self.j = picks, 1
        shape = (picks.shape[1], -(-num_experts // 8))
        big = picks.shape[0] >= _BITMAP_TOPK and shape[0] * shape[1] <= _BITMAP_BYTES
        self.bits = np.zeros(shape, dtype=np.uint8) if big else None
        self._mark(picks[0])

    def _mark(self, e_N: np.ndarray) -> None:
        """Every token has picked e_N[n]."""
        if self.bits is not None:
            e = e_N.astype(np.intp)
            self.bits[np.arange(e.size), e >> 3] |= (1 << (e & 7)).astype(np.uint8)

    def has(self, rows_N: np.ndarray | None, e_N: np.ndarray) -> np.ndarray:
        """bool [N]: token rows_N[n] (every token if None) has picked e_N[n]."""
        if self.bits is None:
            return _clash(e_N, self.picks[:self.j] if rows_N is None else self.picks[:self.j, rows_N])
        e = e_N.astype(np.intp)
        rows = np.arange(e.size) if rows_N is None else rows_N
        return ((self.bits[rows, e >> 3] >> (e & 7)) & 1).astype(bool)

    def add(self) -> None:
        """Choice j is filled in: count it as picked."""
        self._mark(self.picks[self.j])
        self.j += 1


def gumbel_rule(topk: int, num_experts: int) -> bool:
    """Whether `topk` choices among `num_experts` are drawn by the Gumbel-top-k trick (gumbel_topk) instead
    of one by one: from a top-k of 32 on that is at least an eighth of the experts, where the one-by-one
    draws would mostly repeat earlier picks and their redraws grow with topk^2 (the crossover timed at
    E = 512 and 4096)."""
    return topk >= _GUMBEL_TOPK and 8 * topk >= num_experts


def gumbel_topk(rng: np.random.Generator, p_E: np.ndarray, topk: int, m: int, forced_N=None, hot: int = -1,
                ordered: bool = True) -> np.ndarray:
    """intp [m, topk]: each of m tokens' topk distinct experts, by the Gumbel-top-k trick: the topk largest
    of log p_E + Gumbel noise, in decreasing key order, which is the order (and so the distribution)
    sequential sampling without replacement from p_E gives, from other random draws.

    p_E: float64 [E] weights summing to 1, at least topk of them > 0. forced_N: bool [m] or None: those
    tokens' first choice is `hot` (an infinite key), their others the top-(k-1) of the rest, as sequential
    sampling after it. ordered=False leaves each token's picks in no order (for counts). O(E) per token."""
    E = p_E.size
    with np.errstate(divide="ignore"):
        logp_E = np.log(p_E)  # -inf for a zero weight: never among the top (at least topk weights are > 0)
    out = np.empty((m, topk), dtype=np.intp)
    block = max(1, _GUMBEL_BLOCK // E)  # tokens per block: bounded temporaries
    for t0 in range(0, m, block):
        n = min(block, m - t0)
        keys_NE = logp_E - np.log(-np.log(rng.random((n, E))))
        if forced_N is not None:
            keys_NE[forced_N[t0:t0 + n], hot] = np.inf
        top = np.argpartition(-keys_NE, topk - 1, axis=1)[:, :topk] if topk < E else np.argsort(-keys_NE, axis=1)
        if ordered and topk < E:
            top = np.take_along_axis(top, np.argsort(-np.take_along_axis(keys_NE, top, axis=1), axis=1), axis=1)
        out[t0:t0 + n] = top
    return out


def sample_topk_counts(rng: np.random.Generator, p_E, topk: int, num_ranks: int, tokens_per_rank: int,
                       hot: int = -1, hot_frac: float = 0.0) -> np.ndarray:
    """counts_DE (int64 [D, E]) of D ranks whose T tokens each pick `topk` distinct experts (Plackett-Luce).

    p_E: float [E] non-negative routing weights (normalized here), shared by all ranks.
    hot, hot_frac: if hot >= 0, a token's first choice is forced to expert `hot` with probability hot_frac
    (Binomial(T, hot_frac) tokens per rank); all other choices follow p_E as described above.
    """
    p = np.asarray(p_E, dtype=np.float64)
    if p.ndim != 1 or not p.size or not np.all(np.isfinite(p)) or p.min() < 0 or p.sum() <= 0:
        raise WorkloadError(f"p_E must be 1-D, finite, non-negative with a positive sum, got {p!r}")
    E, topk, D, T = p.size, int(topk), int(num_ranks), int(tokens_per_rank)
    if E >= _MARK or not 1 <= topk <= E or hot >= E or not 0 <= hot_frac <= 1:
        raise WorkloadError(f"need 1 <= topk <= num_experts < {_MARK}, hot < num_experts, 0 <= hot_frac <= 1; "
                            f"got topk={topk}, num_experts={E}, hot={hot}, hot_frac={hot_frac}")
    order_E = np.argsort(-p, kind="stable")  # label i is the i-th hottest expert
    p_sorted = p[order_E] / p.sum()
    if p_sorted[topk - 1] < MIN_WEIGHT:
        raise WorkloadError(f"the {topk}-th largest routing weight {p_sorted[topk - 1]:.3g} is below {MIN_WEIGHT:g}: "
                            f"too concentrated to pick topk={topk} distinct experts (lower the skew)")
    if topk == E:  # every token picks every expert, whatever the weights
        return np.full((D, E), T, dtype=np.int64)
    forced_D = np.zeros(D, dtype=np.int64)
    if hot >= 0 and hot_frac > 0:
        hot = int(np.flatnonzero(order_E == hot)[0])
        forced_D = np.full(D, T, dtype=np.int64) if hot_frac >= 1 else rng.binomial(T, hot_frac, size=D)
    out_DE = np.zeros((D, E), dtype=np.int64)
    if gumbel_rule(topk, E):
        for d in range(D):
            picks_NK = gumbel_topk(rng, p_sorted, topk, T, np.arange(T) < forced_D[d], hot, ordered=False)
            out_DE[d, order_E] = np.bincount(picks_NK.reshape(-1), minlength=E)
        return out_DE
    dist = _dist_cached(p_sorted.tobytes(), topk)  # sorted weights are the same for every layer and step
    Dc = max(1, _CHUNK_TOKENS // max(T, 1))
    base_N = np.repeat(np.arange(Dc, dtype=np.intp) * E, T)
    pos_N = np.tile(np.arange(T, dtype=np.int64), Dc)  # token index within its rank
    for d0 in range(0, D if T else 0, Dc):
        dc = min(Dc, D - d0)
        n = dc * T
        picks = np.empty((topk, n), dtype=np.uint16)  # [topk, N]
        picks[0] = dist.draw(rng, n)
        if forced_D[d0:d0 + dc].any():  # tokens are exchangeable: force the first ones of each rank
            picks[0, pos_N[:n] < np.repeat(forced_D[d0:d0 + dc], T)] = hot
        picked = _Picked(picks, E)
        q_N = (picks[0] == 0).astype(np.uint16)  # a lower bound on the smallest label not picked yet
        for j in range(1, topk):
            # labels below q are all picked, so drawing from p_E truncated there is exact and skips most
            # repeats of a skewed head; the remaining repeats are redrawn by rejection
            col = picks[j]
            col[:] = dist.draw(rng, n, q_N if q_N.any() else None)
            idx = np.flatnonzero(picked.has(None, col))
            for _ in range(_REJECT_ROUNDS):
                if not idx.size:
                    break
                new = dist.draw(rng, idx.size, q_N[idx])
                col[idx] = new
                idx = idx[picked.has(idx, new)]
            if idx.size:
                col[idx] = dist.draw_excluding(rng, picks[:j, idx])
            picked.add()
            if j + 1 < topk:  # one cheap step towards the true smallest unpicked label
                q_N += picked.has(None, q_N)
        keys = (picks + base_N[:n]).reshape(-1)
        out_DE[d0:d0 + dc, order_E] = np.bincount(keys, minlength=dc * E).reshape(dc, E)
    return out_DE
