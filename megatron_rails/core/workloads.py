"""Routing workloads: token-count matrices counts_DE, synthetic (uniform, zipf, drift, bursty, one) or recorded.

Shape legend (suffixes on array names): D source ranks, E experts, T tokens per rank, N tokens in one
sampling chunk (in `_Dist` and `_clash` also a subset of them: the tokens being redrawn), I steps, Y layers.
Spelled out, without a letter: the top-k choices per token (topk), the choices made so far, the truncation
points of the lookup tables (trunc) and the 2^16 cells of one table.

counts_DE[d, e] (int64) is how many of rank d's T tokens picked expert e, top-k already expanded: every
token picks topk distinct experts, so a row sums to T*topk and no entry exceeds T.

Sampling model: a skew gives routing weights p_E for one (step, layer), shared by all ranks (rows differ
through their own tokens' draws). Every token picks topk experts by sequential sampling without replacement
from p_E (Plackett-Luce, what the Gumbel-top-k trick samples): first choice ~ p_E, each later one ~ p_E
renormalized over the experts it has not picked. The sampler is exact per token (up to float64 rounding of
the cumulative weights) and vectorized over tokens: experts are relabeled hottest first, each choice is
drawn from p_E truncated below the token's smallest unpicked label (2^16-cell lookup tables), a repeated
choice is redrawn by rejection and, for the rare survivors, from the renormalized distribution directly.
A top-k of 32 or more that is at least an eighth of the experts draws by the Gumbel-top-k trick instead
(a key per expert and token), where the redraws would grow with top-k squared.
Random streams are seeded by (seed, step, layer, sha256 of the canonical skew), never the salted hash().
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np

from .errors import InputError, check_file, cut, reason, shown
from .outfile import open_for_writing, write_text
from .plan import MAX_COUNT_TOTAL, PlanError, check_counts

SKEW_FORMS = "uniform | zipf:S | drift:S[:P] | bursty:S[:F[:R]] | one | file:PATH"
MAX_S = 10.0                        # zipf exponent cap; steeper tails vanish below float64 resolution
DRIFT_PERIOD = 100                  # default P
BURST_FRAC, BURST_RATE = 0.5, 0.25  # default F, R
MAX_TOTAL = MAX_COUNT_TOTAL         # tokens in one counts matrix: exact in int64 sums and float64 means
MIN_WEIGHT = 1e-12                  # the topk-th largest routing weight must reach this (relative to the sum)
_CELLS = 1 << 16                    # lookup-table cells (16 random bits per draw)
_MARK = 0xFFFF                      # table entry for a cell that straddles experts
_CHUNK_TOKENS = 1 << 16             # tokens sampled together: big enough to amortize numpy calls, cache-sized
_REJECT_ROUNDS = 4                  # rejection rounds for a repeated choice before the renormalized draw
_TABLES = 64                        # truncation points with a prebuilt table (uint16, 128 KiB each)
_BITMAP_TOPK = 32                   # from this top-k on, a token's picks are also kept as a bitmap
_BITMAP_BYTES = 1 << 26             # of at most this size (the chunk's tokens x E bits)
_GUMBEL_TOPK = 32                   # from this top-k on, and an eighth of the experts: the Gumbel-top-k trick
_GUMBEL_BLOCK = 1 << 22             # keys per block there (float64: 32 MiB)
_TAG_PERM, _TAG_SAMPLE, _TAG_BURST = 0x5045524D, 0x53414D50, 0x42555253


class WorkloadError(InputError):
    """A workload spec, skew text or counts file is invalid."""


@dataclass(frozen=True)
class Skew:
    """Parsed skew: kind (uniform, zipf, drift, bursty, one, file), zipf exponent s, drift period (steps),
    burst frac (F) and rate (R), counts file path. str() gives the canonical text."""

    kind: str
    s: float = 0.0
    period: int = 0
    frac: float = 0.0
    rate: float = 0.0
    path: str = ""

    def __str__(self) -> str:
        return {"zipf": f"zipf:{self.s!r}", "drift": f"drift:{self.s!r}:{self.period}",
                "bursty": f"bursty:{self.s!r}:{self.frac!r}:{self.rate!r}",
                "file": f"file:{self.path}"}.get(self.kind, self.kind)


def parse_skew(text: str) -> Skew:
    """Parse a skew text; WorkloadError (a ValueError) names the text and lists the accepted forms.

    uniform          every expert equally likely.
    zipf:S           the r-th hottest expert has weight ~ (r+1)^-S, 0 < S <= 10; which expert is r-th is a
                     random permutation drawn from (seed, layer).
    drift:S[:P]      zipf:S whose ranking rotates along that permutation by E/P experts a step, back to the
                     start after P steps (default 100).
    bursty:S[:F[:R]] zipf:S background (S = 0: uniform); a (step, layer) is a burst with probability R
                     (default 0.25): one random expert is then each token's first choice with probability F
                     (default 0.5).
    one              every token's first choice is one expert (random per layer); its other topk-1 choices are
                     uniform over the remaining experts.
    file:PATH        replay a counts file (see load_counts and counts).
    """
    if not isinstance(text, str):
        raise WorkloadError(f"skew must be a string, got {shown(text)}; accepted forms: {SKEW_FORMS}")

    def bad(why: str) -> WorkloadError:
        return WorkloadError(f"bad skew {shown(text)}: {why}; accepted forms: {SKEW_FORMS}")

    def num(x: str, name: str, lo: float, hi: float, lo_open: bool = True) -> float:
        try:
            v = float(x)
        except ValueError:
            raise bad(f"{name} must be a number, got {x!r}") from None
        if not (math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi):
            raise bad(f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {x!r}")
        return v

    kind, _, rest = text.strip().partition(":")
    kind, args = kind.lower(), (rest.split(":") if rest else [])
    if kind == "file" and rest:
        return Skew("file", path=rest)
    if kind in ("uniform", "one") and not args:
        return Skew(kind)
    nmax = {"zipf": 1, "drift": 2, "bursty": 3}.get(kind, 0)
    if not 1 <= len(args) <= nmax:
        raise bad("file needs a path" if kind == "file" else f"{kind} takes no parameters"
                  if kind in ("uniform", "one") else f"unknown kind {kind!r}" if not nmax
                  else f"{kind} takes {1 if nmax == 1 else f'1 to {nmax}'} parameter(s), got {len(args)}")
    s = num(args[0], "S", 0.0, MAX_S, lo_open=kind != "bursty")
    if kind == "zipf":
        return Skew("zipf", s=s)
    if kind == "drift":
        if len(args) > 1 and (not args[1].strip().isdigit() or int(args[1]) < 1):
            raise bad(f"P must be a positive integer number of steps, got {args[1]!r}")
        return Skew("drift", s=s, period=int(args[1]) if len(args) > 1 else DRIFT_PERIOD)
    frac = num(args[1], "F", 0.0, 1.0) if len(args) > 1 else BURST_FRAC
    rate = num(args[2], "R", 0.0, 1.0) if len(args) > 2 else BURST_RATE
    return Skew("bursty", s=s, frac=frac, rate=rate)


def _int(name: str, value, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise WorkloadError(f"{name} must be an integer >= {lo}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class WorkloadSpec:
    """One MoE routing workload: each of num_ranks ranks routes tokens_per_rank tokens to topk distinct of
    num_experts experts, in each of num_layers layers. skew is kept in canonical form (str(parse_skew))."""

    num_ranks: int
    num_experts: int
    topk: int
    tokens_per_rank: int
    skew: str = "uniform"
    seed: int = 0
    num_layers: int = 1

    def __post_init__(self):
        for name, lo in (("num_ranks", 1), ("num_experts", 1), ("topk", 1), ("tokens_per_rank", 0),
                         ("seed", 0), ("num_layers", 1)):
            object.__setattr__(self, name, _int(name, getattr(self, name), lo))
        if self.topk > self.num_experts:
            raise WorkloadError(f"topk={self.topk} exceeds num_experts={self.num_experts}: "
                                "a token picks topk distinct experts")
        if self.num_experts >= _MARK:
            raise WorkloadError(f"num_experts={self.num_experts} must be below {_MARK}")
        object.__setattr__(self, "skew", str(parse_skew(self.skew)))

    @cached_property
    def parsed_skew(self) -> Skew:
        return parse_skew(self.skew)

    @property
    def routed_per_rank(self) -> int:
        """Row sum of every synthetic counts_DE: tokens_per_rank * topk."""
        return self.tokens_per_rank * self.topk


# -- sampling -------------------------------------------------------------------------------------------------

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


# -- generators -----------------------------------------------------------------------------------------------

def _skew_key(skew: str) -> int:
    return int.from_bytes(hashlib.sha256(skew.encode()).digest()[:8], "little")


def _zipf_E(s: float, order_E: np.ndarray) -> np.ndarray:
    """float64 [E]: weight (r+1)^-s on expert order_E[r], normalized."""
    p = np.empty(order_E.size, dtype=np.float64)
    p[order_E] = np.arange(1, order_E.size + 1, dtype=np.float64) ** -s
    return p / p.sum()


def _routing(spec: WorkloadSpec, step: int, layer: int):
    """(p_E float64 [E], hot expert or -1, hot_frac) of a synthetic skew at one step and layer."""
    sk, E = spec.parsed_skew, spec.num_experts
    perm_E = np.random.default_rng([spec.seed, layer, _TAG_PERM]).permutation(E)
    uniform = np.full(E, 1.0 / E)
    if sk.kind in ("uniform", "one"):
        return (uniform, -1, 0.0) if sk.kind == "uniform" else (uniform, int(perm_E[0]), 1.0)
    if sk.kind == "zipf":
        return _zipf_E(sk.s, perm_E), -1, 0.0
    if sk.kind == "drift":
        return _zipf_E(sk.s, np.roll(perm_E, -((step % sk.period) * E // sk.period))), -1, 0.0
    p = _zipf_E(sk.s, perm_E) if sk.s > 0 else uniform
    brng = np.random.default_rng([spec.seed, step, layer, _skew_key(spec.skew), _TAG_BURST])
    if brng.random() < sk.rate:
        return p, int(brng.integers(E)), sk.frac
    return p, -1, 0.0


def counts(spec: WorkloadSpec, step: int = 0, layer: int = 0) -> np.ndarray:
    """counts_DE: int64 [D, E] at one step and layer, a deterministic function of (spec, step, layer).

    Synthetic skews: rows sum to spec.routed_per_rank and entries are <= spec.tokens_per_rank. A file skew
    replays the file (whose D, E must match the spec): a 2-D file at every step and layer, 3-D [I, D, E]
    at step % I for every layer, 4-D [I, Y, D, E] at step % I and layer (needs Y >= spec.num_layers).
    """
    step, layer = _int("step", step, 0), _int("layer", layer, 0)
    if layer >= spec.num_layers:
        raise WorkloadError(f"layer {layer} out of range for num_layers={spec.num_layers}")
    if spec.parsed_skew.kind == "file":
        return _file_counts(spec, step, layer)
    p_E, hot, frac = _routing(spec, step, layer)
    rng = np.random.default_rng([spec.seed, step, layer, _skew_key(spec.skew), _TAG_SAMPLE])
    return sample_topk_counts(rng, p_E, spec.topk, spec.num_ranks, spec.tokens_per_rank, hot, frac)


def trace(spec: WorkloadSpec, steps: int) -> np.ndarray:
    """counts_IYDE: int64 [I, Y, D, E] (I = steps) with counts_IYDE[s, l] == counts(spec, s, l)."""
    steps = _int("steps", steps, 0)
    out = np.empty((steps, spec.num_layers, spec.num_ranks, spec.num_experts), dtype=np.int64)
    for s in range(steps):
        for l in range(spec.num_layers):
            out[s, l] = counts(spec, s, l)
    return out


# -- files ----------------------------------------------------------------------------------------------------

def _validate(arr, where: str) -> np.ndarray:
    """int64 copy of a 2-D [D, E], 3-D [I, D, E] or 4-D [I, Y, D, E] count array; errors name `where`."""
    a = np.asarray(arr)
    if a.ndim not in (2, 3, 4) or 0 in a.shape:
        raise WorkloadError(f"{where}: expected a non-empty 2-D [D,E], 3-D [steps,D,E] or 4-D "
                            f"[steps,layers,D,E] array, got shape {a.shape}")
    if a.dtype.kind == "f":
        ok = np.isfinite(a) & (a == np.round(a))
        if not ok.all():
            at = tuple(int(i) for i in np.argwhere(~ok)[0])
            raise WorkloadError(f"{where}: counts{list(at)} = {a[at].item()!r} is not an integer")
    elif a.dtype.kind not in "iu":
        raise WorkloadError(f"{where}: counts must hold integers, got dtype {a.dtype}")
    # compared as Python numbers: numpy would cast int64's bound to the array's dtype (float16: inf,
    # with an overflow warning)
    if (a.dtype.kind == "u" and int(a.max()) > np.iinfo(np.int64).max) or \
            (a.dtype.kind == "f" and float(a.max()) >= 2.0**63):
        raise WorkloadError(f"{where}: counts exceed int64")
    out = a.astype(np.int64)
    if out.min() < 0:  # named as the file holds it (counts[...]), not as a planner's argument (counts_DE)
        at = tuple(int(i) for i in np.argwhere(out < 0)[0])
        raise WorkloadError(f"{where}: {_at(at[:-2])}counts[{at[-2]}, {at[-1]}] = {out[at]} is negative")
    for at in np.ndindex(*out.shape[:-2]):
        try:
            check_counts(out[at])
        except PlanError as err:
            raise WorkloadError(f"{where}: {_at(at)}{err}") from None
    _check_totals(out, where)
    return out


def _at(index) -> str:
    return "".join(f"{k} {v}, " for k, v in zip(("step", "layer"), index))


def _check_totals(counts_arr: np.ndarray, where: str) -> None:
    """Each [D, E] matrix's total must stay exact in int64 sums and float64 means (planners use both);
    counts near 2^62 would overflow the token totals silently."""
    D, E = counts_arr.shape[-2:]
    totals = counts_arr.reshape(-1, D * E).sum(axis=1, dtype=np.float64)  # float: cannot wrap around
    big = np.flatnonzero(totals > MAX_TOTAL)
    if big.size:
        at = np.unravel_index(big[0], counts_arr.shape[:-2]) if counts_arr.ndim > 2 else ()
        raise WorkloadError(f"{where}: {_at(tuple(int(i) for i in at))}counts sum to {totals[big[0]]:.3g} tokens; "
                            f"at most 2^53 ({MAX_TOTAL:.3g}) per [D, E] matrix are supported")


def validate_counts(arr, where: str) -> np.ndarray:
    """int64 copy of a 2-D, 3-D or 4-D count array (see load_counts); WorkloadError naming `where`."""
    return _validate(arr, where)


NPY_MAGIC, NPZ_MAGIC = b"\x93NUMPY", b"PK\x03\x04"  # how .npy files and .npz (zip) archives begin


def has_magic(p: Path, magic: bytes) -> bool:
    """Whether file p begins with `magic`."""
    with open(p, "rb") as f:
        return f.read(len(magic)) == magic


COUNTS_FILES = ".npy or .json counts, or a `megatron-rails trace` .npz"  # what load_counts reads, for help texts


def _suffix(p: Path, readable: tuple[str, ...] = (".npy", ".json")) -> str:
    if p.suffix.lower() not in readable:
        raise WorkloadError(f"{p}: unsupported extension {p.suffix!r}; use {', '.join(readable[:-1])} or "
                            f"{readable[-1]}")
    return p.suffix.lower()


def _check_npy_size(p: Path) -> None:
    """WorkloadError unless the file holds the bytes its .npy header promises: a corrupt header
    (shape (10^8, 10^5)) would otherwise make numpy allocate terabytes before it finds the file short."""
    fmt = np.lib.format
    with open(p, "rb") as f:
        try:
            read = {(1, 0): fmt.read_array_header_1_0, (2, 0): fmt.read_array_header_2_0}.get(fmt.read_magic(f))
            if read is None:  # a newer header version: numpy's own checks stand
                return
            shape, _, dtype = read(f)
        except (ValueError, OSError, EOFError) as err:
            raise WorkloadError(f"{p}: not a readable .npy array (its header: {err})") from None
        need = math.prod(shape) * dtype.itemsize
        have = os.fstat(f.fileno()).st_size - f.tell()
    if need > have:
        raise WorkloadError(f"{p}: its header promises shape {shape} ({need} bytes) but the file holds {have}: "
                            "cut off or corrupt")


def _load_npy(p: Path):
    if not has_magic(p, NPY_MAGIC):  # else numpy takes it for a pickle and suggests loading it unsafely
        raise WorkloadError(f"{p}: not a .npy file (no NumPy header); save counts with numpy.save or as .json")
    _check_npy_size(p)
    try:
        return np.load(p, allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:  # EOFError: an empty or cut-off file
        why = "it holds Python objects, not numbers" if "pickle" in str(err) else str(err)
        raise WorkloadError(f"{p}: not a readable .npy array ({why})") from None


def _unique_keys(pairs: list) -> dict:
    """json object_pairs_hook: an object with a key given twice is an error (json keeps the last one
    silently, as PyYAML would; the YAML loader refuses them too)."""
    seen = set()
    for k, _ in pairs:
        if k in seen:
            raise WorkloadError(f"key {shown(k)} given twice in one object; give each key once")
        seen.add(k)
    return dict(pairs)


def _load_json(p: Path):
    try:
        data = json.loads(p.read_text(), object_pairs_hook=_unique_keys)
    except WorkloadError as err:  # a key given twice
        raise WorkloadError(f"{p}: {err}") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise WorkloadError(f"{p}: invalid JSON ({err})") from None
    except RecursionError:
        raise WorkloadError(f"{p}: nested too deeply to be counts (at most [steps, layers, ranks, experts])") from None
    if isinstance(data, dict) and "counts" not in data:
        raise WorkloadError(f"{p}: JSON object has no 'counts' key (keys: {shown(sorted(data))})")
    data = data["counts"] if isinstance(data, dict) else data
    if not isinstance(data, list):
        raise WorkloadError(f"{p}: expected a JSON list of lists or {{\"counts\": [...]}}")
    if _has_bool(data):  # numpy would read true / false beside integers as 1 / 0
        raise WorkloadError(f"{p}: counts must be integers, not true / false")
    try:
        data = np.array(data)
    except OverflowError:  # integers beyond int64 (numpy refuses them in an int array)
        raise WorkloadError(f"{p}: counts exceed int64") from None
    except ValueError:  # ragged
        data = None
    if data is not None and data.dtype == object and all(type(v) is int for v in data.ravel()):
        raise WorkloadError(f"{p}: counts exceed int64")  # numpy keeps such integers as Python objects
    if data is None or data.dtype in (bool, object):
        raise WorkloadError(f"{p}: counts must be a rectangular array of integers")
    return data


def _has_bool(x) -> bool:
    """Whether nested lists hold a true / false anywhere (a walk with a stack of its own: JSON nests
    deeper than Python's recursion goes)."""
    todo = [x]
    while todo:
        v = todo.pop()
        if isinstance(v, bool):
            return True
        if isinstance(v, list):
            todo.extend(v)
    return False


def load_trace_npz(path) -> tuple[np.ndarray, dict]:
    """(int64 counts [I, Y, D, E], metadata dict) of a `megatron-rails trace` .npz; WorkloadError naming
    the file for anything else (FileNotFoundError where there is none)."""
    import zipfile

    p = Path(path)
    check_file(p, "trace", WorkloadError, FileNotFoundError(f"trace file {str(p)!r} does not exist"))
    if not has_magic(p, NPZ_MAGIC):  # else numpy takes it for a pickle and suggests loading it unsafely
        raise WorkloadError(f"{p}: not a .npz archive; record one with `megatron-rails trace`")
    try:
        with np.load(p, allow_pickle=False) as z:
            if "counts" not in z.files:
                raise WorkloadError(f"{p}: no 'counts' array in the .npz (arrays: {cut(', '.join(z.files))})")
            c = z["counts"]
            meta = json.loads(str(z["meta"])) if "meta" in z.files else {}
    except WorkloadError:
        raise
    except MemoryError:  # a member whose header claims more than the machine has
        raise WorkloadError(f"{p}: not a readable trace .npz (its counts claim more memory than there is: "
                            "cut off or corrupt)") from None
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:  # EOFError: empty; BadZipFile: cut off
        raise WorkloadError(f"{p}: not a readable trace .npz ({reason(err)})") from None
    if c.ndim != 4 or c.dtype.kind not in "iu" or 0 in c.shape or c.min() < 0:
        raise WorkloadError(f"{p}: counts must be non-negative integers [steps, layers, ranks, experts], "
                            f"got shape {c.shape} dtype {c.dtype}")
    if not isinstance(meta, dict):
        meta = {}
    return _validate(c, str(p)), meta  # the same checks as a counts file (totals within int64)


def load_counts(path: str | os.PathLike) -> np.ndarray:
    """int64 counts [D, E], [I, D, E] or [I, Y, D, E] from a .npy or .json file, or the counts of a
    `megatron-rails trace` .npz ([I, Y, D, E]).

    JSON holds nested lists or an object {"counts": [...]} (each key once). Integral floats are
    accepted; negative, fractional, non-numeric or ragged data raise WorkloadError naming the file, a
    missing file FileNotFoundError.
    """
    p = Path(path)
    if not str(path).strip():  # Path("") is ".", the working directory
        raise WorkloadError(f"an empty path; give a counts file ({COUNTS_FILES})")
    check_file(p, "counts", WorkloadError, FileNotFoundError(f"counts file {str(p)!r} does not exist"))
    suffix = _suffix(p, (".npy", ".json", ".npz"))
    if suffix == ".npz":
        return load_trace_npz(p)[0]
    data = _load_npy(p) if suffix == ".npy" else _load_json(p)
    return _validate(data, str(p))


def save_counts(path: str | os.PathLike, counts_arr) -> Path:
    """Write int counts (2-D [D, E], 3-D [I, D, E] or 4-D [I, Y, D, E]) to .npy or .json {"counts": ...}."""
    p = Path(path)
    suffix = _suffix(p)
    arr = _validate(counts_arr, f"save_counts({str(p)!r})")
    if suffix == ".npy":
        with open_for_writing(p, "wb") as f:  # np.save(str) would append .npy to other names
            np.save(f, arr, allow_pickle=False)
    else:
        write_text(p, json.dumps({"counts": arr.tolist()}))
    return p


@lru_cache(maxsize=8)
def _load_cached(path: str, mtime_ns: int, size: int) -> np.ndarray:
    arr = load_counts(path)
    arr.flags.writeable = False
    return arr


@lru_cache(maxsize=8)
def _all_zero(path: str, mtime_ns: int, size: int) -> bool:
    return not _load_cached(path, mtime_ns, size).any()


def _file_counts(spec: WorkloadSpec, step: int, layer: int) -> np.ndarray:
    path = spec.parsed_skew.path
    try:
        check_file(path, "counts", WorkloadError,
                   FileNotFoundError(f"counts file {path!r} (skew {spec.skew!r}) does not exist"))
    except WorkloadError as err:
        raise WorkloadError(f"{err} (skew {spec.skew!r})") from None
    st = os.stat(path)
    key = (os.path.abspath(path), st.st_mtime_ns, st.st_size)
    arr = _load_cached(*key)  # reloads when the file changes
    if _all_zero(*key):  # every policy would compare idle ranks (--counts and --trace refuse it alike)
        raise WorkloadError(f"{path}: every count is 0; there are no tokens to route (skew {spec.skew!r})")
    if arr.shape[-2:] != (spec.num_ranks, spec.num_experts):
        raise WorkloadError(f"{path}: counts are [D={arr.shape[-2]}, E={arr.shape[-1]}], but the workload has "
                            f"{spec.num_ranks} ranks and {spec.num_experts} experts")
    if arr.ndim == 4 and arr.shape[1] < spec.num_layers:
        raise WorkloadError(f"{path}: file has {arr.shape[1]} layers, the spec has num_layers={spec.num_layers}")
    sl = arr if arr.ndim == 2 else arr[step % arr.shape[0]] if arr.ndim == 3 else arr[step % arr.shape[0], layer]
    return sl.copy()
