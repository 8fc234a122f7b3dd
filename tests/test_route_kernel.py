"""A plan's token route: the compiled route (`_route_c.c`) and route_csr's Python fast path against
the definition (`split_by_quota`, then `to_csr`), entry for entry, on every planner's plans and on
random quotas; and quotas that do not fit the counts still fail with the definition's message.
"""
import os
import shutil

import numpy as np
import pytest

from megatron_rails.core import route as route_mod
from megatron_rails.core.plan import Placement, PlanError
from megatron_rails.core.planners import PlannerConfig, make_planner
from megatron_rails.core.route import route_csr, split_by_quota, to_csr

PURE = os.environ.get("MEGATRON_RAILS_PURE_PYTHON", "") not in ("", "0")


def definition(plan_or_parts):
    counts, placement, quota = plan_or_parts
    src, rep, tok = split_by_quota(counts, placement, quota)
    return to_csr(placement.num_ranks, max(placement.num_replicas, 1), src, rep, tok)


def assert_same(got, want):
    assert len(got) == 3
    for g, w in zip(got, want):
        assert g.dtype == np.int64 and not g.flags.writeable
        assert np.array_equal(g, w)


def counts_for(rng, D, E, trial):
    if trial % 3 == 0:
        c = rng.integers(0, 60, (D, E))
    else:
        c = rng.zipf(1.4, size=(D, E)) * rng.integers(0, 3, size=(D, E))
    if trial % 5 == 0:
        c[:, rng.integers(0, E)] = 0  # an expert nobody routes to
    return np.minimum(c, 10**6).astype(np.int64)


def test_compiled_route_is_built_where_a_compiler_exists():
    if PURE or shutil.which("cc") is None:
        pytest.skip("pure Python here (MEGATRON_RAILS_PURE_PYTHON or no C compiler)")
    assert route_mod._KERNEL is not None, "megatron_rails/core/_route_c.c was not built: reinstall (pip install -e .)"


# (32, 64, 8): the route's worst-case buffers above route._KEEP_CAPACITY (entries copied out)
@pytest.mark.parametrize("D,E,G", [(2, 4, 1), (4, 8, 2), (8, 8, 8), (8, 8, 2), (8, 16, 4), (16, 64, 4), (4, 6, 2),
                                   (32, 8, 8), (32, 64, 8)])
def test_every_planners_route_matches_the_definition(D, E, G):
    rng = np.random.default_rng(D * 1000 + E * 10 + G)
    policies = (["none"] if E % D == 0 else []) + ["eplb", "ultraep", "lp", "fsep"]
    for policy in policies:
        planner = make_planner(policy, PlannerConfig(num_ranks=D, num_experts=E, ranks_per_node=G, slots=2))
        state = planner.initial_state()
        for trial in range(12):
            plan, state = planner.plan(counts_for(rng, D, E, trial), state)
            want = definition((plan.counts_DE, plan.placement, plan.quota_R))
            for compiled in (True, False):
                assert_same(route_csr(plan.counts_DE, plan.placement, plan.quota_R, compiled=compiled), want)
            assert_same(plan.route, want)
            # the split sizes made with the compiled route, against their definition from the route
            ptr, rep, tok = want
            src = np.repeat(np.arange(D), np.diff(ptr))
            ref_DD = np.zeros((D, D), dtype=np.int64)
            np.add.at(ref_DD, (src, plan.placement.replica_rank_R[rep]), tok)
            assert np.array_equal(plan.send_DD, ref_DD) and plan.send_DD.dtype == np.int64
            assert not plan.send_DD.flags.writeable


def test_random_quotas_on_random_placements():
    """Quotas split arbitrarily over replicas (not a planner's even or cascaded splits): several
    replicas per expert on several nodes, zero quotas beside positive ones."""
    rng = np.random.default_rng(5)
    for trial in range(300):
        G = int(rng.choice([1, 2, 4]))
        D = G * int(rng.integers(1, 5))
        E = int(rng.integers(1, 12))
        S = int(rng.integers(1, 4))
        se = np.full((D, S), -1, dtype=np.int64)
        for d in range(D):
            experts = rng.permutation(E)[:S]
            se[d, :experts.size] = experts
        for e in range(E):  # every expert hosted somewhere
            if not (se == e).any():
                d = int(rng.integers(0, D))
                se[d, int(rng.integers(0, S))] = -1
                if not (se[d] == e).any():
                    se[d, np.flatnonzero(se[d] == -1)[0]] = e
        try:
            p = Placement(se, E, G, "sharded", 0)
        except PlanError:
            continue  # a row lost its last copy of another expert: skip this draw
        counts = counts_for(rng, D, E, trial)
        if (p.replicas_per_expert_E == 0).any():
            counts[:, p.replicas_per_expert_E == 0] = 0
        load = counts.sum(axis=0)
        quota = np.zeros(p.num_replicas, dtype=np.int64)
        for e in range(E):
            lo, hi = p.expert_ptr[e], p.expert_ptr[e + 1]
            if hi > lo:
                cut = np.sort(rng.integers(0, load[e] + 1, hi - lo - 1))
                quota[lo:hi] = np.diff(np.r_[0, cut, load[e]])
        want = definition((counts, p, quota))
        for compiled in (True, False):
            assert_same(route_csr(counts, p, quota, compiled=compiled), want)


def test_quotas_that_do_not_fit_fail_as_the_definition_does():
    planner = make_planner("ultraep", PlannerConfig(num_ranks=4, num_experts=8, ranks_per_node=2, slots=1))
    counts = np.arange(32, dtype=np.int64).reshape(4, 8) * 7
    plan, _ = planner.plan(counts)
    bad = plan.quota_R.copy()
    bad[0] += 1
    with pytest.raises(PlanError, match="replica quotas sum to"):
        definition((plan.counts_DE, plan.placement, bad))
    for compiled in (True, False):
        with pytest.raises(PlanError, match="replica quotas sum to"):
            route_csr(plan.counts_DE, plan.placement, bad, compiled=compiled)
    neg = plan.quota_R.copy()
    neg[0], neg[1] = -1, neg[1] + 1
    for compiled in (True, False):
        with pytest.raises(PlanError, match="negative"):
            route_csr(plan.counts_DE, plan.placement, neg, compiled=compiled)


def test_count_sums_and_peak_load_match_numpy():
    """counts_and_load's compiled pass (count_sums) against numpy's column sums, and
    Plan.peak_load (compiled rank_sums) against load_D's max and sum, on every planner's plans;
    a negative count fails naming the entry either way."""
    from megatron_rails.core import plan as plan_mod
    from megatron_rails.core.plan import counts_and_load

    if plan_mod._COUNT_SUMS is None and not PURE and shutil.which("cc"):
        pytest.fail("count_sums not built although a C compiler exists")
    rng = np.random.default_rng(3)
    for trial in range(60):
        D, E = int(rng.integers(1, 9)), int(rng.integers(1, 40))
        c = counts_for(rng, D, E, trial)
        counts, load_E = counts_and_load(c, D, E)
        assert counts.dtype == np.int64 and not counts.flags.writeable and np.array_equal(counts, c)
        assert load_E.dtype == np.int64 and np.array_equal(load_E, c.sum(axis=0))
        if plan_mod._COUNT_SUMS is not None:
            got = np.empty(E, dtype=np.int64)
            assert plan_mod._COUNT_SUMS(counts, D, E, got) == 0 and np.array_equal(got, c.sum(axis=0))
        bad = c.copy()
        d, e = int(rng.integers(D)), int(rng.integers(E))
        bad[d, e] = -1 - int(rng.integers(5))
        with pytest.raises(PlanError, match=rf"counts_DE\[{d}, {e}\] = {bad[d, e]} is negative"):
            counts_and_load(bad, D, E)
        G = D if trial % 2 else 1
        for policy in ("none", "eplb", "ultraep", "lp", "fsep"):
            if policy == "none" and E % D:
                continue
            planner = make_planner(policy, PlannerConfig(num_ranks=D, num_experts=E, ranks_per_node=G, slots=2))
            plan, _ = planner.plan(c, planner.initial_state())
            load_D = plan.load_D
            assert plan.peak_load() == (load_D.max(), load_D.sum()), (policy, D, E, trial)


def test_sharded_table_and_even_quotas_match_the_definitions(monkeypatch):
    """Placement.sharded_table (the compiled replica table) against the constructor's sort, and
    the compiled even_quotas against numpy's, on random slot tables; a table with an id out of
    range or an expert twice on a rank fails with the constructor's message."""
    from megatron_rails.core import plan as plan_mod
    from megatron_rails.core.planners import base

    if plan_mod._REPLICA_TABLE is None and not PURE and shutil.which("cc"):
        pytest.fail("replica_table not built although a C compiler exists")
    rng = np.random.default_rng(11)
    for trial in range(200):
        D, S, E = int(rng.integers(1, 9)), int(rng.integers(1, 6)), int(rng.integers(1, 30))
        se = np.full((D, S), -1, dtype=np.int64)
        for d in range(D):  # distinct experts per rank, some slots empty
            k = int(rng.integers(0, min(S, E) + 1))
            se[d, rng.permutation(S)[:k]] = rng.permutation(E)[:k]
        G = D if trial % 2 else 1
        want = Placement(se.copy(), E, G, "sharded", 0)
        got = Placement.sharded_table(se.copy(), E, G)
        for name in ("replica_expert_R", "replica_rank_R", "replica_slot_R", "expert_ptr"):
            a = getattr(got, name)
            assert a.dtype == np.int64 and not a.flags.writeable and np.array_equal(a, getattr(want, name)), name
        assert not got.slot_expert_DS.flags.writeable and got.digest() == want.digest()
        load_E = rng.integers(0, 1000, E).astype(np.int64) * (rng.random(E) < 0.8)
        q = base.even_quotas(load_E, want.expert_ptr)
        with monkeypatch.context() as m:
            m.setattr(base, "_EVEN_QUOTAS", None)
            assert np.array_equal(q, base.even_quotas(load_E, want.expert_ptr))
        if D * S >= 2 and E >= 2:
            bad = se.copy()
            bad[rng.integers(D), rng.integers(S)] = E + int(rng.integers(3)) if trial % 2 else -2
            with pytest.raises(PlanError) as want_err:
                Placement(bad.copy(), E, G, "sharded", 0)
            with pytest.raises(PlanError) as got_err:
                Placement.sharded_table(bad.copy(), E, G)
            assert str(got_err.value) == str(want_err.value)
        if S >= 2:
            twice = se.copy()
            twice[0, :2] = int(rng.integers(E))
            with pytest.raises(PlanError, match="hosts an expert twice"):
                Placement.sharded_table(twice, E, G)
