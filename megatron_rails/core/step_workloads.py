"""Named routing workloads for `bench step`: exact per-token routing from (workload, seed, step,
microbatch, layer, source rank) alone.

A workload gives, for one source rank's T tokens, the expert weights p_E they route by (one of
the situations below); the rank's counts are drawn from p_E by `sampling.sample_topk_counts`
(every token picks k distinct experts, Plackett-Luce) with a generator seeded by the whole key,
and `routing_Tk` turns those counts into the exact [T, k] expert choices the router hands the
dispatcher (so the counts the dispatcher sees are the workload's, not a router's approximation).
Nothing depends on the expert-parallel layout a policy chooses, nor on the number of ranks: rank
d's tokens are the same under EP 2 and EP 4. Experts "on one rank" below means adjacent experts,
which stock's contiguous layout (expert e on rank e * D // E) puts on one rank whenever a rank
holds two or more.

Pair shares: the two hot experts together take a share P of the routing weight and the others
share the rest evenly (`pair_share_for` gives the P of a stock max/mean on 8 experts over 2 ranks,
in expectation).

Shape legend: T tokens per rank, E experts, k top-k, D ranks.
"""
from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np

from .errors import WorkloadError
from .presets import PRESETS_DIR
from .sampling import sample_topk_counts
from .trace import load_trace

# name -> what it models (the docs and `bench step --help` list these)
WORKLOADS = {
    "balanced": "every expert exactly T k / E of every rank's tokens (the ideal a balancer aims at)",
    "hot-set": "two hot experts drawn per layer (on one stock rank or two), 85% of the tokens",
    "hot-rank": "two hot experts on one stock rank (adjacent, moving with the layer), 85% of the tokens",
    "spread": "hot-rank's heat on two experts half the experts apart (on different stock ranks)",
    "moderate:1.2": "hot experts on one stock rank at stock max/mean 1.2 (8 experts, 2 ranks)",
    "moderate:1.5": "hot experts on one stock rank at stock max/mean 1.5 (8 experts, 2 ranks)",
    "source": "rank 0's tokens to the last two experts (hot-rank's heat), the other ranks' uniform",
    "zero": "the upper half of the experts and expert 0 get no tokens (zero-load experts and, on 2 ranks, "
            "a zero-load rank; as many zeros given back as top-k needs)",
    "rotating": "hot-rank's pair moving by one expert every 2 microbatches, within and across steps",
    "burst": "uniform, but every 4th microbatch a hot pair (hot-rank's heat) that moves every step",
    "zipf:1.2": "zipf 1.2 weights over a random expert order per layer",
    "zipf:2.0": "zipf 2.0 weights over a random expert order per layer",
    "learned": "the CPU demo model's own routing as it trained (a shipped trace: 64 steps on 2 ranks, "
               "its router learning under the demo's bias), rescaled like --trace",
}
DEFAULT_WORKLOADS = tuple(WORKLOADS)
TRACE = "trace"  # `bench step --trace FILE`: a recorded trace's counts, rescaled (`use_trace`)
# recorded workloads shipped with the package. Regenerate (deterministic on one machine):
#   megatron-rails trace --out megatron_rails/presets/traces/demo-learned.npz --steps 64 --ranks 2
SHIPPED = {"learned": PRESETS_DIR / "traces" / "demo-learned.npz"}
SHIPPED_MICROBATCHES = 8  # a shipped trace's microbatches per step until `use_trace` says the bench's
_TRACES: dict[str, tuple[np.ndarray, int]] = {}  # name -> (counts [I, Y, D, E], microbatches per step)
HOT_PAIR = 0.85  # the hot pair's share in hot-set, hot-rank, spread, source, rotating, burst


def pair_share_for(stock_max_over_mean: float) -> float:
    """P for two hot experts on one rank of 2, 8 experts: that rank routes 2 (P / 2) + 2 (1 - P) / 6,
    which over the mean 1/2 is m: P = (3 m / 2 - 1) / 2."""
    return (1.5 * stock_max_over_mean - 1.0) / 2.0


MODERATE = {"moderate:1.2": pair_share_for(1.2), "moderate:1.5": pair_share_for(1.5)}


def parse_workloads(text) -> tuple[str, ...]:
    """Workload names from "A,B,..." (or a sequence of names; None: the default set), each known and
    at most once; WorkloadError naming the first that is not."""
    if text is None:
        return DEFAULT_WORKLOADS
    names = text.split(",") if isinstance(text, str) else list(text)
    bad = [n for n in names if n not in WORKLOADS]
    if bad:
        raise WorkloadError(f"--workloads: unknown workload {bad[0]!r} (choose from {', '.join(WORKLOADS)})")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise WorkloadError(f"--workloads: {twice[0]!r} twice")
    return tuple(names)


def _key(*parts) -> list[int]:
    """A generator seed from any parts (names hashed, so a new workload does not shift the others)."""
    return [int.from_bytes(hashlib.sha256(str(p).encode()).digest()[:8], "little") if isinstance(p, str) else int(p)
            for p in parts]


def _pair(E: int, hot: tuple[int, int], P: float) -> np.ndarray:
    p = np.full(E, (1.0 - P) / max(E - 2, 1))
    p[list(hot)] = P / 2.0
    return p / p.sum()


def _zipf(E: int, s: float, order_E: np.ndarray) -> np.ndarray:
    p = np.empty(E)
    p[order_E] = np.arange(1, E + 1, dtype=np.float64) ** -s
    return p / p.sum()


def zero_weights_E(E: int, k: int) -> np.ndarray:
    """Expert 0 and the upper half get no tokens, as far as k experts are left for every token (the
    zeros given back from the top down)."""
    zero = [0, *range(E // 2, E)]
    while E - len(zero) < k:
        zero.pop()
    p = np.ones(E)
    p[zero] = 0.0
    return p / p.sum()


def weights_E(name: str, E: int, seed: int, step: int, micro: int, layer: int, rank: int,
              k: int = 1) -> np.ndarray | None:
    """float64 [E]: the routing weights rank `rank`'s tokens route by (None: `balanced`, exact counts)."""
    if name not in WORKLOADS or name in SHIPPED:
        raise WorkloadError(f"workload {name!r} has no weights: {', '.join(SHIPPED)} replay recorded counts"
                            if name in SHIPPED else f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if E < 2:
        raise WorkloadError(f"workload {name!r} needs at least 2 experts, got {E}")
    base = (2 * layer) % E  # a different hot pair per layer
    adjacent = (base, (base + 1) % E)
    if name == "balanced":
        return None
    if name == "hot-set":
        perm = np.random.default_rng(_key(seed, layer, "hot-set")).permutation(E)
        return _pair(E, (int(perm[0]), int(perm[1])), HOT_PAIR)
    if name == "hot-rank":
        return _pair(E, adjacent, HOT_PAIR)
    if name == "spread":
        return _pair(E, (base, (base + E // 2) % E), HOT_PAIR)
    if name in MODERATE:
        return _pair(E, adjacent, MODERATE[name])
    if name == "source":
        return _pair(E, (E - 2, E - 1), HOT_PAIR) if rank == 0 else np.full(E, 1.0 / E)
    if name == "zero":
        return zero_weights_E(E, k)
    if name == "rotating":
        j = (step + micro // 2) % E
        return _pair(E, (j, (j + 1) % E), HOT_PAIR)
    if name == "burst":
        if micro % 4 != 3:
            return np.full(E, 1.0 / E)
        j = (2 * step + 2 * layer) % E
        return _pair(E, (j, (j + 1) % E), HOT_PAIR)
    s = float(name.split(":")[1])  # zipf:S
    return _zipf(E, s, np.random.default_rng(_key(seed, layer, "zipf-order")).permutation(E))


def balanced_counts_E(T: int, E: int, k: int, rank: int = 0) -> np.ndarray:
    """int64 [E]: T k / E each; a remainder goes one token each to experts starting at a rank-dependent
    offset (so over ranks the load stays even)."""
    q, r = divmod(T * k, E)
    c = np.full(E, q, dtype=np.int64)
    c[(rank + np.arange(r)) % E] += 1
    return c


@lru_cache(maxsize=4096)
def counts_E(name: str, seed: int, step: int, micro: int, layer: int, rank: int, T: int, E: int,
             k: int) -> np.ndarray:
    """int64 [E]: the tokens of rank `rank` routed to each expert (row sum T k, each <= T), a
    deterministic function of its arguments. Read only (cached)."""
    if not 1 <= k <= E or T < 0:
        raise WorkloadError(f"need 1 <= topk <= experts and tokens >= 0, got topk {k}, experts {E}, tokens {T}")
    if name == TRACE or name in SHIPPED:
        out = _trace_row(name, step, micro, layer, rank, T, E, k)
        out.setflags(write=False)
        return out
    p = weights_E(name, E, seed, step, micro, layer, rank, k)
    if p is None:
        out = balanced_counts_E(T, E, k, rank)
    else:
        # at most k experts can hold all T tokens: weights beyond 1/k saturate there (a token picks
        # distinct experts); the sampler handles that itself
        rng = np.random.default_rng(_key(seed, name, step, micro, layer, rank))
        out = sample_topk_counts(rng, p, k, 1, T)[0]
    out.setflags(write=False)
    return out


def routing_Tk(counts: np.ndarray, T: int, k: int, seed_key: tuple = ()) -> np.ndarray:
    """int64 [T, k]: k distinct experts per token whose counts are exactly `counts` (int [E], sum T k,
    each <= T). The experts laid out in a row, each repeated its count, entry j goes to token j mod T:
    a run of at most T entries never meets one token twice, and every token gets k entries. Tokens
    are then shuffled (seeded by seed_key), so no position in the sequence is always hot."""
    c = np.asarray(counts, dtype=np.int64)
    if c.sum() != T * k or (c > T).any() or (c < 0).any():
        raise WorkloadError(f"counts must be >= 0, each <= T={T}, summing to T k={T * k}; got {c.tolist()}")
    flat = np.repeat(np.arange(c.size), c)  # [T k], expert of each entry
    idx_kT = flat.reshape(k, T)  # entry j = i T + t goes to token t
    perm = np.random.default_rng(_key("tokens", *seed_key)).permutation(T)
    return np.ascontiguousarray(idx_kT.T[perm])


def use_trace(counts_IYDE: np.ndarray, experts: int, microbatches: int, name: str = TRACE) -> str:
    """Make workload `name` (TRACE, or a SHIPPED one: None reads its file) replay `counts_IYDE` (int
    [I, Y, D, E], a recorded trace: one [D, E] per planner call I, layer Y) at `microbatches` per
    step: microbatch m of step s, layer y, rank d routes like the trace's call (s M + m) mod I, layer
    y mod Y, rank d mod D, rescaled to the bench's tokens (`rescaled`). Returns `name`;
    WorkloadError where the trace's experts are not the bench's."""
    if name != TRACE and name not in SHIPPED:
        raise WorkloadError(f"use_trace: {name!r} is not a recorded workload "
                            f"(choose from {', '.join([TRACE, *SHIPPED])})")
    if counts_IYDE is None and name not in SHIPPED:
        raise WorkloadError(f"use_trace: workload {name!r} needs its counts "
                            f"(only {', '.join(SHIPPED)} ship with theirs)")
    what = "--trace" if name == TRACE else f"workload {name!r} ({SHIPPED[name]})"
    c = np.asarray(load_trace(SHIPPED[name])[0] if counts_IYDE is None else counts_IYDE)
    if c.ndim != 4 or c.shape[-1] != experts:
        raise WorkloadError(f"{what}: the trace's counts are [steps, layers, ranks, experts] {list(c.shape)}; "
                            f"the bench's layers have {experts} experts")
    if (c.sum(axis=-1) == 0).any():
        raise WorkloadError(f"{what}: a layer routed no tokens at some step and rank: nothing to rescale")
    if microbatches < 1:
        raise WorkloadError(f"{what}: need at least 1 microbatch per step, got {microbatches}")
    _TRACES[name] = (c.astype(np.int64), int(microbatches))
    counts_E.cache_clear()
    routing_for.cache_clear()
    return name


def rescaled(row_E: np.ndarray, T: int, k: int) -> np.ndarray:
    """int64 [E]: counts in the proportions of `row_E` (a recorded rank's counts, any token count)
    summing to T k, none above T (a token picks k distinct experts): shares above T are capped and
    the excess goes to the others in proportion; whole tokens by largest remainder, ties to the lower
    expert. Experts the row gave no token get none, unless needed to reach T k."""
    r = np.asarray(row_E, dtype=np.float64)
    E, total = r.size, T * k
    want = np.zeros(E)
    free = r > 0
    if free.sum() < k:  # fewer experts than a token picks: the others take what is left
        free = np.ones(E, bool)
        r = np.where(r > 0, r, 1e-9 * (r[r > 0].min() if (r > 0).any() else 1.0))  # they take only the rest
    left = float(total)
    while left > 1e-9 and free.any():
        share = np.where(free, r, 0.0)
        add = left * share / share.sum()
        want = want + add
        over = want > T
        left = float((want[over] - T).sum())
        want[over] = T
        free &= ~over
    base = np.floor(want + 1e-9).astype(np.int64)
    short = total - int(base.sum())
    room = (base < T) & (want > 0) if ((base < T) & (want > 0)).sum() >= short else base < T
    order = sorted(np.flatnonzero(room), key=lambda e: (-(want[e] - base[e]), e))
    base[order[:short]] += 1
    return base


def _trace_row(name: str, step: int, micro: int, layer: int, rank: int, T: int, E: int, k: int) -> np.ndarray:
    if name not in _TRACES:
        if name == TRACE:
            raise WorkloadError("workload 'trace' needs a trace: bench step --trace FILE")
        use_trace(None, E, SHIPPED_MICROBATCHES, name)
    c, M = _TRACES[name]
    if c.shape[-1] != E:
        raise WorkloadError(f"workload {name!r}: its trace has {c.shape[-1]} experts, asked for {E}")
    I, Y, D, _ = c.shape
    return rescaled(c[(step * M + micro) % I, layer % Y, rank % D], T, k)


@lru_cache(maxsize=1024)
def routing_for(name: str, seed: int, step: int, micro: int, layer: int, rank: int, T: int, E: int,
                k: int) -> np.ndarray:
    """int64 [T, k]: rank `rank`'s routing under workload `name` (counts_E made exact by routing_Tk).
    Read only (cached: every case of a round asks for the same)."""
    idx = routing_Tk(counts_E(name, seed, step, micro, layer, rank, T, E, k), T, k,
                     (seed, name, step, micro, layer, rank))
    idx.setflags(write=False)
    return idx


def stock_max_over_mean(counts_DE: np.ndarray) -> float:
    """Tokens on stock's busiest rank over the mean (expert e on rank e * D // E)."""
    D, E = counts_DE.shape
    load_D = np.bincount(np.arange(E) * D // E, weights=counts_DE.sum(axis=0), minlength=D)
    return float(load_D.max() * D / max(load_D.sum(), 1))
