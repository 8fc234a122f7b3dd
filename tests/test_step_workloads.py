"""core/step_workloads.py: each workload's routing is exact (the routing map's counts are the
workload's counts, k distinct experts per token), deterministic, a function of rank and not of the
number of ranks, different per layer, moving where it says; the named stock max/mean on 8 experts
over 2 ranks is what the names say (a direct count over many draws); bad input is one error."""
import itertools

import numpy as np
import pytest

from megatron_rails.core import step_workloads as sw
from megatron_rails.core.errors import WorkloadError


def _stock_mm(name, T=512, E=8, k=2, D=2, steps=4, micro=8, layers=2):
    """Stock max/mean by a direct count: ranks' loads of contiguous expert blocks."""
    out = []
    for s, m, y in itertools.product(range(steps), range(micro), range(layers)):
        load_E = np.sum([sw.counts_E(name, 0, s, m, y, d, T, E, k) for d in range(D)], axis=0)
        load_D = load_E.reshape(D, E // D).sum(axis=1)
        out.append(load_D.max() / load_D.mean())
    return float(np.mean(out))


@pytest.mark.parametrize("name", list(sw.WORKLOADS))
@pytest.mark.parametrize("T,E,k", [(512, 8, 2), (37, 8, 2), (24, 4, 3), (10, 2, 1), (9, 3, 3), (64, 16, 4)])
def test_routing_is_exact(name, T, E, k):
    if name in sw.SHIPPED and E != 8:  # a recorded workload has its trace's experts only
        with pytest.raises(WorkloadError, match=rf"its trace has 8 experts, asked for {E}|layers have {E} experts"):
            sw.counts_E(name, 0, 0, 0, 0, 0, T, E, k)
        return
    for s, m, y, d in [(0, 0, 0, 0), (1, 3, 1, 1), (5, 7, 0, 3)]:
        c = sw.counts_E(name, 0, s, m, y, d, T, E, k)
        assert c.sum() == T * k and (c <= T).all() and (c >= 0).all()
        idx = sw.routing_for(name, 0, s, m, y, d, T, E, k)
        assert idx.shape == (T, k)
        assert all(len(set(row)) == k for row in idx.tolist()), "an expert twice for one token"
        assert np.array_equal(np.bincount(idx.ravel(), minlength=E), c)
        # deterministic: the same arguments anew (past the cache) give the same routing
        again = sw.routing_Tk(sw.counts_E.__wrapped__(name, 0, s, m, y, d, T, E, k), T, k, (0, name, s, m, y, d))
        assert np.array_equal(again, idx)


def test_learned_replays_the_shipped_demo_trace():
    """At the trace's own tokens per rank the rescale is the identity: microbatch m of step s is the
    recorded call 8 s + m (8 microbatches a step until use_trace says otherwise), layer and rank as
    recorded; ranks beyond the recorded 2 repeat them."""
    from megatron_rails.core.trace import load_trace

    c, meta = load_trace(sw.SHIPPED["learned"])
    T, (I, Y, D, E) = meta["tokens_per_rank"], c.shape
    assert (Y, D, E, meta["topk"]) == (2, 2, 8, 2) and I >= 8 * 7  # a full bench's rounds without wrapping
    sw._TRACES.pop("learned", None)
    for s, m, y, d in [(0, 0, 0, 0), (0, 5, 1, 1), (3, 7, 0, 1), (7, 7, 1, 0), (2, 1, 1, 3)]:
        got = sw.counts_E.__wrapped__("learned", 0, s, m, y, d, T, E, 2)
        assert got.tolist() == c[(8 * s + m) % I, y, d % D].tolist()
    sw.use_trace(None, 8, 4, "learned")  # the bench's 4 microbatches a step
    try:
        assert sw.counts_E("learned", 0, 3, 1, 0, 0, T, E, 2).tolist() == c[13, 0, 0].tolist()
    finally:
        sw._TRACES.pop("learned")
        sw.counts_E.cache_clear()
    with pytest.raises(WorkloadError, match="has no weights"):
        sw.weights_E("learned", 8, 0, 0, 0, 0, 0)


def test_the_shipped_trace_is_what_the_demo_records(tmp_path):
    """The shipped trace's first steps recorded afresh (`megatron-rails trace`, the command its
    comment names): the same counts, bar a handful of tokens a CPU's float rounding may flip."""
    from megatron_rails.core.trace import load_trace
    from megatron_rails.demo.trace import record_demo

    shipped = load_trace(sw.SHIPPED["learned"])[0]
    fresh = load_trace(record_demo(str(tmp_path / "t.npz"), steps=3, ranks=2, quiet=True))[0]
    assert fresh.shape == (3, *shipped.shape[1:])
    assert np.abs(fresh - shipped[:3]).sum() <= 0.01 * fresh.sum(), (fresh - shipped[:3]).tolist()


def test_balanced_is_exact_and_zero_is_zero():
    assert sw.counts_E("balanced", 0, 3, 1, 0, 0, 512, 8, 2).tolist() == [128] * 8
    uneven = [sw.counts_E("balanced", 0, 0, 0, 0, d, 37, 8, 2) for d in range(8)]
    assert np.ptp(np.sum(uneven, axis=0)) == 0  # remainders spread over ranks evenly
    z = sw.counts_E("zero", 0, 0, 0, 0, 0, 512, 8, 2)
    assert z[0] == 0 and (z[4:] == 0).all() and (z[1:4] > 0).all()


def test_independent_of_the_rank_count_and_per_layer():
    # rank 1's tokens take no argument saying how many ranks there are: the same whatever D; layers differ
    for name in ("hot-set", "hot-rank", "spread", "zipf:1.2", "rotating"):
        a = sw.counts_E(name, 0, 0, 0, 0, 1, 512, 8, 2)
        b = sw.counts_E(name, 0, 0, 0, 1, 1, 512, 8, 2)
        assert not np.array_equal(a, b), name
    assert not np.array_equal(sw.routing_for("balanced", 0, 0, 0, 0, 0, 64, 8, 2),
                              sw.routing_for("balanced", 0, 0, 0, 1, 0, 64, 8, 2))  # token order differs too


def _hot(name, s, m, y=0):
    c = sw.counts_E(name, 0, s, m, y, 0, 512, 8, 2)
    return set(np.argsort(-c)[:2].tolist())


def test_moving_workloads_move_within_and_across_steps():
    assert _hot("rotating", 0, 0) == _hot("rotating", 0, 1) == {0, 1}
    assert _hot("rotating", 0, 2) == {1, 2} and _hot("rotating", 1, 0) == {1, 2}
    # the burst: uniform but on every 4th microbatch, whose hot pair moves every step
    flat = sw.counts_E("burst", 0, 0, 0, 0, 0, 512, 8, 2)
    assert flat.max() < 1.5 * flat.mean()
    assert _hot("burst", 0, 3) != _hot("burst", 1, 3) and _hot("burst", 0, 3) == _hot("burst", 0, 7)
    # static workloads do not move
    assert _hot("hot-rank", 0, 0) == _hot("hot-rank", 3, 5)


def test_stock_max_over_mean_is_as_named():
    assert _stock_mm("balanced") == 1.0
    assert _stock_mm("zero") == 2.0
    assert abs(_stock_mm("moderate:1.2") - 1.2) < 0.04
    assert abs(_stock_mm("moderate:1.5") - 1.5) < 0.08  # a token's two picks are distinct: a little under
    assert _stock_mm("spread") < 1.05 < 1.6 < _stock_mm("hot-rank")
    mm = np.array([[sw.counts_E("source", 0, 0, 0, 0, d, 512, 8, 2)] for d in range(2)])[:, 0]
    assert mm[0, 6:].sum() > 0.8 * 1024 and mm[1].max() < 0.2 * 1024  # rank 0's tokens to the last two


def test_the_stock_max_over_mean_helper_counts_like_a_direct_count():
    rng = np.random.default_rng(0)
    for D, E in [(2, 8), (4, 8), (3, 6)]:
        c = rng.integers(0, 50, (D, E))
        load = c.sum(axis=0).reshape(D, E // D).sum(axis=1)
        assert sw.stock_max_over_mean(c) == pytest.approx(load.max() / load.mean())


@pytest.mark.parametrize("call,says", [
    (lambda: sw.counts_E("nope", 0, 0, 0, 0, 0, 8, 8, 2), "unknown workload 'nope'"),
    (lambda: sw.counts_E("burst", 0, 0, 0, 0, 0, 8, 1, 1), "at least 2 experts"),
    (lambda: sw.counts_E("burst", 0, 0, 0, 0, 0, 8, 4, 5), "1 <= topk <= experts"),
    (lambda: sw.routing_Tk(np.array([3, 1]), 2, 2), "each <= T=2"),
    (lambda: sw.parse_workloads("burst,,zero"), "unknown workload ''"),
    (lambda: sw.parse_workloads("zero,zero"), "'zero' twice"),
    (lambda: sw.use_trace(None, 8, 2), "workload 'trace' needs its counts"),
    (lambda: sw.use_trace(np.ones((1, 1, 2, 8), int), 8, 2, "zero"), "'zero' is not a recorded workload"),
    (lambda: sw.use_trace(None, 8, 0, "learned"), "at least 1 microbatch"),
])
def test_bad_input_is_one_error(call, says):
    with pytest.raises(WorkloadError, match=says):
        call()


def test_rescaled_keeps_proportions_caps_and_totals():
    assert sw.rescaled(np.array([100, 50, 25, 25, 0, 0, 0, 0]), 512, 2).tolist() == [512, 256, 128, 128, 0, 0, 0, 0]
    # above T: capped, the excess in proportion to the rest
    assert sw.rescaled(np.array([90, 5, 5]), 10, 2).tolist() == [10, 5, 5]
    # fewer experts with tokens than a token picks: the others take the rest, evenly
    assert sw.rescaled(np.array([7, 0, 0]), 4, 2).tolist() == [4, 2, 2]
    rng = np.random.default_rng(1)
    for _ in range(500):
        E = int(rng.integers(2, 10))
        k, T = int(rng.integers(1, E + 1)), int(rng.integers(1, 200))
        r = rng.integers(0, 40, E)
        r[0] += 1
        c = sw.rescaled(r, T, k)
        assert c.sum() == T * k and (c <= T).all() and (c >= 0).all(), (r, T, k, c)
        uncapped = c < T
        if uncapped.sum() > 1 and r[uncapped].sum() > 0:  # within a token of the recorded proportions
            want = r[uncapped] / r[uncapped].sum() * c[uncapped].sum()
            assert np.abs(c[uncapped] - want).max() < 1 + 1e-9, (r, T, k, c)


def test_a_trace_replays_by_call_layer_and_rank():
    c = np.random.default_rng(2).integers(1, 30, (3, 2, 4, 8))  # [I, Y, D, E]
    try:
        assert sw.use_trace(c, 8, 2) == sw.TRACE
        for s, m, y, d in itertools.product(range(3), range(2), range(3), range(5)):
            got = sw.counts_E(sw.TRACE, 0, s, m, y, d, 64, 8, 2)
            assert np.array_equal(got, sw.rescaled(c[(2 * s + m) % 3, y % 2, d % 4], 64, 2))
            idx = sw.routing_for(sw.TRACE, 0, s, m, y, d, 64, 8, 2)
            assert np.array_equal(np.bincount(idx.ravel(), minlength=8), got)
        with pytest.raises(WorkloadError, match="the bench's layers have 6 experts"):
            sw.use_trace(c, 6, 2)
        with pytest.raises(WorkloadError, match="routed no tokens"):
            sw.use_trace(np.zeros((1, 1, 2, 8), int), 8, 2)
    finally:
        sw._TRACES.clear()
    with pytest.raises(WorkloadError, match="needs a trace"):
        sw.counts_E.__wrapped__(sw.TRACE, 0, 0, 0, 0, 0, 8, 8, 2)
