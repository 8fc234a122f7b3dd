"""The routing sampler (core/sampling.py) against exact Plackett-Luce probabilities, its paths against
each other, and its failures."""
import itertools
import math

import numpy as np
import pytest

from megatron_rails.core import sampling as sp
from megatron_rails.core.errors import WorkloadError
from megatron_rails.core.sampling import sample_topk_counts


# -- exactness ---------------------------------------------------------------------------------

def plackett_luce_inclusion(p_E, k, first=None):
    """float [E]: exact probability that each expert is among a token's k picks."""
    p = np.asarray(p_E, dtype=float) / np.sum(p_E)
    incl = np.zeros(p.size)
    for seq in itertools.permutations(range(p.size), k):
        if first is not None and seq[0] != first:
            continue
        prob, used = 1.0, 0.0
        for i, e in enumerate(seq):
            if not (i == 0 and first is not None):
                prob *= p[e] / (1.0 - used)
            used += p[e]
        incl[list(seq)] += prob
    return incl


# rejection: repeats redrawn; fallback: every repeat takes the exact renormalized draw; gumbel: the
# Gumbel-top-k path a large top-k over most experts takes
SAMPLER_PATHS = {"rejection": {}, "fallback": {"_REJECT_ROUNDS": 0}, "gumbel": {"_GUMBEL_TOPK": 1}}


@pytest.mark.parametrize("path", SAMPLER_PATHS)
def test_sampler_matches_plackett_luce(monkeypatch, path):
    for name, value in SAMPLER_PATHS[path].items():
        monkeypatch.setattr(sp, name, value)
    p = np.array([0.5, math.pi / 20, 0.05, 0.17, math.e / 30, 0.0, 0.01])  # zero weight: never picked
    D, T, topk = 16, 1 << 15, 4
    c = sample_topk_counts(np.random.default_rng(7), p, topk, D, T)
    freq = c.sum(axis=0) / (D * T)
    want = plackett_luce_inclusion(p, topk)
    tol = 6 * np.sqrt(want * (1 - want) / (D * T)) + 1e-12
    assert np.all(np.abs(freq - want) <= tol), (freq, want)
    assert c[:, 5].sum() == 0 and np.all(c.sum(axis=1) == T * topk)


@pytest.mark.parametrize("path", SAMPLER_PATHS)
def test_sampler_forced_first_choice_matches(monkeypatch, path):
    for name, value in SAMPLER_PATHS[path].items():
        monkeypatch.setattr(sp, name, value)
    p = np.array([0.4, 0.3, 0.2, 0.1, 0.05])
    D, T, topk, hot, frac = 16, 1 << 15, 3, 3, 0.6
    c = sample_topk_counts(np.random.default_rng(3), p, topk, D, T, hot=hot, hot_frac=frac)
    want = frac * plackett_luce_inclusion(p, topk, first=hot) + (1 - frac) * plackett_luce_inclusion(p, topk)
    freq = c.sum(axis=0) / (D * T)
    assert np.all(np.abs(freq - want) <= 6 * np.sqrt(want * (1 - want) / (D * T)) + 1e-12), (freq, want)


@pytest.mark.parametrize("E,topk,hot", [(40, 12, -1), (1000, 40, 3), (20, 6, 0)])  # none on the Gumbel path
def test_sampler_bitmap_and_computed_tables_draw_the_same(monkeypatch, E, topk, hot):
    # a large top-k keeps picks as a bitmap and works out late tables' cells when drawn: both must leave
    # every draw as it was (generated workloads are reproducible from their seed)
    p = 1.0 / np.arange(1, E + 1) ** 1.3
    def draw():
        sp._dist_cached.cache_clear()  # its tables were built with the _TABLES of their time
        return sample_topk_counts(np.random.default_rng(11), p, topk, 3, 900, hot=hot, hot_frac=0.4)
    plain = draw()
    monkeypatch.setattr(sp, "_BITMAP_TOPK", 1)
    monkeypatch.setattr(sp, "_TABLES", 2)
    assert np.array_equal(draw(), plain)
    sp._dist_cached.cache_clear()


def test_gumbel_topk_orders_picks_as_sequential_sampling():
    # the first pick ~ p_E, the set ~ Plackett-Luce inclusion, every row distinct; forced rows start at hot
    p = np.array([0.5, math.pi / 20, 0.05, 0.17, math.e / 30, 0.0, 0.01])
    p = p / p.sum()
    N, topk = 1 << 18, 4
    picks = sp.gumbel_topk(np.random.default_rng(5), p, topk, N)
    assert picks.shape == (N, topk) and np.all(np.diff(np.sort(picks, axis=1), axis=1) > 0)
    first = np.bincount(picks[:, 0], minlength=p.size) / N
    incl = np.bincount(picks.reshape(-1), minlength=p.size) / N
    for got, want in ((first, p), (incl, plackett_luce_inclusion(p, topk))):
        assert np.all(np.abs(got - want) <= 6 * np.sqrt(want * (1 - want) / N) + 1e-12), (got, want)
    forced = np.arange(N) % 3 == 0
    picks = sp.gumbel_topk(np.random.default_rng(6), p, 2, N, forced, hot=3)
    assert np.all(picks[forced, 0] == 3) and np.all(picks[:, 0] != picks[:, 1])
    second = np.bincount(picks[forced, 1], minlength=p.size) / forced.sum()
    want = np.where(np.arange(p.size) == 3, 0.0, p) / (1 - p[3])
    assert np.all(np.abs(second - want) <= 6 * np.sqrt(want * (1 - want) / forced.sum()) + 1e-12)


def test_sampler_every_expert():
    c = sample_topk_counts(np.random.default_rng(0), [0.9, 0.05, 0.05], 3, 4, 17)
    assert np.array_equal(c, np.full((4, 3), 17))


@pytest.mark.parametrize("tables", [sp._TABLES, 2])  # 2: table 3's cells worked out as they are drawn
@pytest.mark.parametrize("q", [None, 0, 3])
def test_lookup_tables_are_exact(monkeypatch, q, tables):
    # 5000 experts: most of the 2^16 cells of a table straddle two experts and take the exact slow path
    monkeypatch.setattr(sp, "_TABLES", tables)
    p = np.sort(1.0 + np.arange(5000) % 7)[::-1] / (4 * 5000)
    dist = sp._Dist(p, 4)
    N = 1 << 21
    got = np.bincount(dist.draw(np.random.default_rng(1), N, None if q is None else np.full(N, q, np.uint16)),
                      minlength=5000)
    lo = q or 0
    want = N * p[lo:] / p[lo:].sum()
    assert not got[:lo].any()
    chi2 = float(((got[lo:] - want) ** 2 / want).sum())  # ~ chi-square with 5000 - lo - 1 dof
    assert chi2 < 5000 + 8 * math.sqrt(2 * 5000), chi2


def test_sampler_errors():
    rng = np.random.default_rng(0)
    with pytest.raises(WorkloadError, match="too concentrated"):
        sample_topk_counts(rng, [1.0, 1e-15, 1e-15], 2, 1, 10)
    with pytest.raises(WorkloadError, match="too concentrated"):
        sample_topk_counts(rng, [1.0, 0.0, 0.0], 2, 1, 10)
    for bad in ([], [1.0, -0.5], [np.nan, 1.0], [0.0, 0.0], [[1.0, 2.0]]):
        with pytest.raises(WorkloadError, match="p_E"):
            sample_topk_counts(rng, bad, 1, 1, 10)
    with pytest.raises(WorkloadError, match="topk"):
        sample_topk_counts(rng, [1.0, 1.0], 3, 1, 10)
