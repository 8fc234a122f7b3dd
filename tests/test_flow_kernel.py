"""The compiled min-max flow (`_flow_c.c`) against its Python definition (planners/flow.py).

tests/test_lp.py and tests/test_step_plans.py check the flow (compiled wherever it is built)
against the LP solver; here the compiled and the Python iteration must return identical results
(quotas, rank loads, integer and fractional optimum, number of max-flows), so both paths carry
those guarantees. Placements: every planner's, on counts of every kind (uniform, zipf, one hot
expert, idle experts), and random replica tables where many experts share ranks, so that the
iteration takes several fractional steps, warm starts and a final integer flow.
"""
import os
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_rails.core.plan import OWNER, SHARDED, Placement
from megatron_rails.core.planners import PlannerConfig, flow, make_planner
from megatron_rails.core.planners.flow import min_max_quotas

pytestmark = [
    pytest.mark.skipif(os.environ.get("MEGATRON_RAILS_PURE_PYTHON", "") not in ("", "0"),
                       reason="MEGATRON_RAILS_PURE_PYTHON: the compiled flow is turned off"),
    pytest.mark.skipif(flow._FLOW_SOLVE is None and shutil.which("cc") is None,
                       reason="no C compiler: the flow runs in pure Python here"),
]


def test_kernel_is_built_where_a_compiler_exists():
    assert flow._FLOW_SOLVE is not None, \
        "megatron_rails/core/planners/_flow_c.c was not built: reinstall (pip install -e .)"


def both(load_E, placement, monkeypatch):
    """(compiled, Python) results of min_max_quotas; a fresh placement object for each, so that
    neither reuses the network shape the other kept."""
    def fresh():
        return Placement(placement.slot_expert_DS, placement.num_experts, placement.ranks_per_node,
                         placement.layout, placement.owner_slots)

    got = min_max_quotas(load_E, fresh(), checked=True)
    with monkeypatch.context() as m:
        m.setattr(flow, "_FLOW_SOLVE", None)
        want = min_max_quotas(load_E, fresh(), checked=True)
    return got, want


def assert_identical(got, want):
    assert np.array_equal(got.quota_R, want.quota_R) and got.quota_R.dtype == want.quota_R.dtype
    assert np.array_equal(got.load_D, want.load_D)
    assert (got.t_int, got.t_frac, got.flows) == (want.t_int, want.t_frac, want.flows)


@st.composite
def placements(draw):
    """A random sharded replica table (each rank hosts distinct experts, every expert at least once)
    and loads of one of several kinds."""
    D = draw(st.integers(1, 12))
    E = draw(st.integers(1, 16))
    C = draw(st.integers(max(1, -(-E // D)), max(1, -(-E // D)) + 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    slot_DS = np.full((D, C), -1, dtype=np.int64)
    order = rng.permutation(D * C)
    for i, e in enumerate(range(E)):  # every expert once, in distinct cells
        slot_DS.flat[order[i]] = e
    for cell in order[E:]:  # the rest: a random expert the rank lacks, or left free
        d = cell // C
        choices = np.setdiff1d(np.arange(E), slot_DS[d])
        if choices.size and rng.random() < 0.8:
            slot_DS.flat[cell] = rng.choice(choices)
    slot_DS = np.sort(slot_DS, axis=1)[:, ::-1].copy()  # free slots last
    kind = draw(st.sampled_from(["random", "zipf", "one", "zeros", "huge"]))
    if kind == "random":
        load = rng.integers(0, 1000, size=E)
    elif kind == "zipf":
        load = rng.multinomial(int(rng.integers(1, 20000)), 1.0 / np.arange(1, E + 1) ** 1.2 /
                               (1.0 / np.arange(1, E + 1) ** 1.2).sum())
    elif kind == "one":
        load = np.zeros(E, dtype=np.int64)
        load[rng.integers(E)] = int(rng.integers(1, 10**6))
    elif kind == "zeros":
        load = np.zeros(E, dtype=np.int64)
    else:
        load = rng.integers(0, 2**40, size=E)
    placement = Placement.sharded_table(slot_DS, E, 1)
    return np.ascontiguousarray(load, dtype=np.int64), placement


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(prob=placements())
def test_compiled_and_python_flows_are_identical_on_random_placements(prob, monkeypatch):
    assert_identical(*both(*prob, monkeypatch))


@pytest.mark.parametrize("policy", ["eplb", "ultraep", "lp", "fsep"])
@pytest.mark.parametrize("D,E,S", [(8, 8, 1), (8, 8, 2), (16, 64, 2), (64, 256, 1), (5, 7, 2)])
@pytest.mark.parametrize("skew", [0.0, 1.2, 2.0])
def test_compiled_and_python_flows_are_identical_on_planner_placements(policy, D, E, S, skew, monkeypatch):
    rng = np.random.default_rng(D * 1000 + E + S)
    p = 1.0 / np.arange(1, E + 1) ** skew
    planner = make_planner(policy, PlannerConfig(D, E, 1, S))
    first = rng.multinomial(512 * 2, rng.permutation(p / p.sum()), size=D).astype(np.int64)
    placement = planner.plan(first)[0].placement
    assert placement.layout in (OWNER, SHARDED)
    for _ in range(3):  # later microbatches' counts on the step's placement
        later = rng.multinomial(512 * 2, rng.permutation(p / p.sum()), size=D).astype(np.int64)
        load = later.sum(axis=0)
        load[placement.replicas_per_expert_E == 0] = 0  # only hosted experts carry tokens
        assert_identical(*both(load, placement, monkeypatch))


def test_falls_back_beyond_int64(monkeypatch):
    """Token totals whose products could overflow int64 take the Python iteration (same results)."""
    slot_DS = np.array([[0, 1], [1, 2], [2, 0]], dtype=np.int64)
    placement = Placement.sharded_table(slot_DS, 3, 1)
    load = np.array([2**61, 3, 2**60], dtype=np.int64)
    calls = []
    kernel = flow._FLOW_SOLVE
    monkeypatch.setattr(flow, "_FLOW_SOLVE", lambda *a: calls.append(a) or kernel(*a))
    res = min_max_quotas(load, placement, checked=True)
    assert not calls and res.t_int == -(-int(load.sum()) // 3)
