"""The exact token scheduler (planners/flow.py), its LP oracle, the slot-budget lower bound and the lp
planner, each checked against an independent reference:

- the pulp/HiGHS LP (`oracle.lp_min_max`) on random placements, and for D <= 10 the exact optimum by
  enumerating every rank set Q: max_Q (tokens of the experts hosted only inside Q) / |Q| (Hall);
- quotas re-checked against the raw slot table, not the placement's derived replica arrays;
- the slot-budget bound against brute force over every placement of the free slots, and against a
  pulp model written with the explicit placement variables x of its definition.
"""
import math
import subprocess
import sys
import textwrap
from fractions import Fraction
from itertools import combinations, product

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_rails.core.oracle import lp_min_max, slot_budget_lower_bound, time_vs_oracle
from megatron_rails.core.plan import Placement, PlanError, owner_of_experts
from megatron_rails.core.planners import PlannerConfig, make_planner
from megatron_rails.core.planners.flow import min_max_quotas
from megatron_rails.core.planners.lp import LpPlanner, highs_quotas, static_placement


# -- instances ---------------------------------------------------------------------------------------
def random_case(rng: np.random.Generator, max_ranks: int = 16, max_experts: int = 32):
    """A random (load_E, placement): owner or sharded layout, random replica counts, ranks hosting
    nothing, zero loads, one hot expert, skewed or flat loads."""
    D = int(rng.integers(1, max_ranks + 1))
    E = int(rng.integers(1, max_experts + 1))
    G = int(rng.choice([g for g in (1, 2, 4, 8) if D % g == 0]))
    if rng.random() < 0.5:
        slots = int(rng.integers(0, 4))
        owner = owner_of_experts(E, D)
        rows = []
        for d in range(D):
            free = np.flatnonzero(owner != d)
            k = int(rng.integers(0, min(slots, free.size) + 1))
            rows.append(rng.choice(free, size=k, replace=False).tolist())
        placement = Placement.owner(E, D, G, rows, slots=slots)
    else:
        slots = int(rng.integers(1, 5))
        rows = [rng.choice(E, size=int(rng.integers(0, min(slots, E) + 1)), replace=False).tolist()
                for _ in range(D)]
        if rng.random() < 0.3:
            rows[int(rng.integers(D))] = []  # a rank hosting nothing
        placement = Placement.sharded(E, G, rows, slots)
    kind = rng.choice(["flat", "skew", "hot", "zeros", "sparse"])
    if kind == "flat":
        load = rng.integers(0, 100, size=E)
    elif kind == "skew":
        load = rng.multinomial(int(rng.integers(1, 5000)), rng.dirichlet(np.full(E, 0.3)))
    elif kind == "hot":
        load = np.zeros(E, dtype=np.int64)
        load[int(rng.integers(E))] = int(rng.integers(1, 3000))
    elif kind == "zeros":
        load = np.zeros(E, dtype=np.int64)
    else:
        load = rng.integers(0, 200, size=E) * (rng.random(E) < 0.3)
    hosted = np.zeros(E, dtype=bool)
    hosted[placement.slot_expert_DS[placement.slot_expert_DS >= 0]] = True
    return np.where(hosted, load, 0).astype(np.int64), placement  # every loaded expert is hosted


def hosts_from_slots(placement):
    """bool [D, E] from the raw slot table."""
    se = np.asarray(placement.slot_expert_DS)
    hosted = np.zeros((se.shape[0], placement.num_experts), dtype=bool)
    d, s = np.nonzero(se >= 0)
    hosted[d, se[d, s]] = True
    return hosted


def hall_optimum(load, placement) -> Fraction:
    """Exact fractional optimum by enumerating every nonempty rank set X (D <= 10)."""
    hosted = hosts_from_slots(placement)
    D = hosted.shape[0]
    mask_E = (hosted.astype(np.int64) << np.arange(D)[:, None]).sum(axis=0)
    sets = np.arange(1, 2 ** D)  # rank sets X as bitmasks
    inside = (mask_E[None, :] & ~sets[:, None]) == 0  # every host of the expert lies in X
    w = (inside * load[None, :]).sum(axis=1)
    size = np.array([bin(x).count("1") for x in sets])
    return max((Fraction(int(a), int(b)) for a, b in zip(w, size)), default=Fraction(0))


def check_quotas(load, placement, quota, t_int):
    """Quotas valid against the slot table: >= 0, sum to each expert's load, max rank load t_int."""
    quota = np.asarray(quota)
    assert quota.dtype == np.int64 and quota.shape == (placement.num_replicas,)
    assert np.all(quota >= 0)
    se = np.asarray(placement.slot_expert_DS)
    got_E = np.zeros(placement.num_experts, dtype=np.int64)
    rank_load = np.zeros(placement.num_ranks, dtype=np.int64)
    for r in range(quota.size):
        d, e, s = (int(placement.replica_rank_R[r]), int(placement.replica_expert_R[r]),
                   int(placement.replica_slot_R[r]))
        assert se[d, s] == e  # the replica really is that slot of a hosting rank
        got_E[e] += quota[r]
        rank_load[d] += quota[r]
    np.testing.assert_array_equal(got_E, load)
    assert rank_load.max() == t_int


def check_against_oracle(load, placement):
    res = min_max_quotas(load, placement)
    t_lp, q_lp = lp_min_max(load, placement)
    assert res.t_int == math.ceil(t_lp - 1e-9)
    assert res.t_int == math.ceil(res.t_frac)
    assert abs(float(res.t_frac) - t_lp) <= 1e-6 * max(1.0, t_lp)
    check_quotas(load, placement, res.quota_R, res.t_int)
    np.testing.assert_array_equal(res.load_D, np.bincount(placement.replica_rank_R, weights=res.quota_R,
                                                          minlength=placement.num_ranks).astype(np.int64))
    assert np.all(q_lp >= -1e-9)  # the oracle's own answer is a valid fractional schedule too
    assert np.allclose(np.bincount(placement.replica_expert_R, weights=q_lp, minlength=load.size), load)
    if placement.num_ranks <= 10:
        assert res.t_frac == hall_optimum(load, placement)
    return res


# -- exact solver vs oracle ----------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(8))
def test_flow_matches_highs_random(seed):
    rng = np.random.default_rng(seed)
    for _ in range(50):  # 8 x 50 = 400 instances
        check_against_oracle(*random_case(rng))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), D=st.integers(1, 16), E=st.integers(1, 32))
def test_flow_matches_highs_hypothesis(seed, D, E):
    rng = np.random.default_rng(seed)
    load, placement = random_case(rng, D, E)
    check_against_oracle(load, placement)


def test_flow_edge_cases():
    p = Placement.owner(4, 2, 2, [[2], [0]], slots=1)  # ranks 0: {0,1,2}, 1: {2,3,0}
    r = min_max_quotas(np.array([10, 3, 7, 1]), p)
    assert r.t_frac == Fraction(21, 2) and r.t_int == 11
    check_quotas(np.array([10, 3, 7, 1]), p, r.quota_R, 11)
    zero = min_max_quotas(np.zeros(4, dtype=np.int64), p)
    assert zero.t_int == 0 and zero.t_frac == 0 and not zero.quota_R.any()
    # no expert with two replicas: no flow at all, the fixed loads are the answer
    single = min_max_quotas(np.array([5, 0, 0, 9]), Placement.owner(4, 2, 2))
    assert (single.t_int, single.flows) == (9, 0)
    # a hot expert replicated on every rank of a sharded placement, one rank hosting nothing else
    sh = Placement.sharded(3, 1, [[0], [0, 1], [0, 2], []], 2)
    hot = min_max_quotas(np.array([90, 5, 1]), sh)
    assert hot.t_frac == Fraction(96, 3) and hot.t_int == 32 and hot.load_D[3] == 0
    with pytest.raises(PlanError, match="no replica"):
        min_max_quotas(np.array([1, 1, 1]), Placement.sharded(3, 1, [[0], [1]], 1))
    with pytest.raises(PlanError, match="negative"):
        min_max_quotas(np.array([-1, 0, 0, 0]), p)


def test_flow_large_values_exact():
    # loads near 2**40: all arithmetic stays integral (no float rounding in capacities)
    rng = np.random.default_rng(3)
    load, p = random_case(rng, 8, 16)
    load = load * (2 ** 40 // max(1, int(load.max()))) + 1 * (load > 0)
    res = min_max_quotas(load, p)
    assert res.t_frac == hall_optimum(load, p) and res.t_int == math.ceil(res.t_frac)
    check_quotas(load, p, res.quota_R, res.t_int)


# -- slot-budget lower bound -----------------------------------------------------------------------------
def brute_force_best(load, D, slots, layout):
    """min over every placement of the free slots of the exact fractional optimum."""
    E = load.size
    best = None
    if layout == "owner":
        owner = owner_of_experts(E, D)
        choices = [list(combinations([e for e in range(E) if owner[e] != d], min(slots, int((owner != d).sum()))))
                   for d in range(D)]
        make = lambda rows: Placement.owner(E, D, 1, [list(r) for r in rows], slots=slots)  # noqa: E731
    else:
        choices = [list(combinations(range(E), min(slots, E)))] * D
        make = lambda rows: Placement.sharded(E, 1, [list(r) for r in rows], slots)  # noqa: E731
    for rows in product(*choices):
        try:
            t = min_max_quotas(load, make(rows)).t_frac
        except PlanError:  # a loaded expert left without a replica
            continue
        best = t if best is None else min(best, t)
    return best


@pytest.mark.parametrize("seed", range(40))
def test_lower_bound_vs_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    D, E = int(rng.integers(1, 4)), int(rng.integers(1, 6))
    layout = "owner" if seed % 2 else "sharded"
    slots = int(rng.integers(0, 3)) if layout == "owner" else int(rng.integers(-(-E // D), max(-(-E // D), 3) + 1))
    load = rng.multinomial(int(rng.integers(0, 500)), rng.dirichlet(np.full(E, 0.4))).astype(np.int64)
    bound = slot_budget_lower_bound(load, D, slots, layout=layout)
    best = brute_force_best(load, D, slots, layout)
    total = int(load.sum())
    assert bound >= total / D - 1e-9
    assert bound <= float(best) + 1e-6 * max(1, total)
    assert abs(bound - slot_budget_lower_bound(load, D, slots, layout=layout, method="full")) <= 1e-6 * max(1, total)
    if layout == "owner" and slots == 0:  # nothing to place: the bound is the stock owner load
        assert bound == pytest.approx(np.bincount(owner_of_experts(E, D), weights=load, minlength=D).max())


def pulp_bound_with_x(load, D, slots, layout):
    """The bound's definition, verbatim: f and x variables, f <= load * x, slots on sum x."""
    import pulp

    E = load.size
    owner = owner_of_experts(E, D)
    prob = pulp.LpProblem("bound", pulp.LpMinimize)
    T = prob.add_variable("T")
    prob += T
    f = {(e, d): prob.add_variable(f"f_{e}_{d}", 0) for e in range(E) for d in range(D)}
    x = {(e, d): prob.add_variable(f"x_{e}_{d}", 0, 1) for e in range(E) for d in range(D)
         if layout == "sharded" or owner[e] != d}
    for e in range(E):
        prob += pulp.lpSum(f[e, d] for d in range(D)) == int(load[e])
    for d in range(D):
        prob += pulp.lpSum(f[e, d] for e in range(E)) <= T
        prob += pulp.lpSum(x[e, d] for e in range(E) if (e, d) in x) <= slots
    for (e, d), xv in x.items():
        prob += f[e, d] <= int(load[e]) * xv
    assert pulp.LpStatus[prob.solve(pulp.HiGHS(msg=False))] == "Optimal"
    return pulp.value(T)


@pytest.mark.parametrize("seed", range(12))
def test_lower_bound_matches_definition(seed):
    rng = np.random.default_rng(200 + seed)
    D, E = int(rng.integers(1, 9)), int(rng.integers(1, 17))
    layout = "owner" if seed % 3 else "sharded"
    slots = int(rng.integers(0, 3)) + (-(-E // D) if layout == "sharded" else 0)
    load = rng.multinomial(int(rng.integers(1, 3000)), rng.dirichlet(np.full(E, 0.3))).astype(np.int64)
    if seed % 4 == 1:  # all load on rank 0's experts: the mean is out of reach with few slots
        load = np.where(owner_of_experts(E, D) == 0, load + 50, 0)
    ref = pulp_bound_with_x(load, D, slots, layout)
    for method in ("full", "auto"):
        assert slot_budget_lower_bound(load, D, slots, layout=layout, method=method) == pytest.approx(ref, rel=1e-6, abs=1e-6)


def test_lower_bound_merged_ranks_equal_full_lp():
    from megatron_rails.core.oracle import _slot_lp, _slot_lp_merged

    rng = np.random.default_rng(5)
    # all tokens on rank 0's many light experts: the mean is out of reach (so no shortcut proves
    # it is attained) and the merged LP runs
    for D, E, S in [(4, 32, 1), (4, 48, 2), (8, 128, 1), (2, 16, 1)]:
        load = np.where(owner_of_experts(E, D) == 0, rng.integers(1, 100, size=E), 0).astype(np.int64)
        full = slot_budget_lower_bound(load, D, S, method="full")
        assert full > load.sum() / D * 1.01
        assert slot_budget_lower_bound(load, D, S) == pytest.approx(full, rel=1e-9)
    # merged ranks on their own (E < D: ranks owning nothing), whatever the certificate says
    for D, E, S in [(16, 5, 1), (32, 12, 1), (24, 6, 2), (12, 20, 1)]:
        load = rng.multinomial(20000, rng.dirichlet(np.full(E, 0.2))).astype(np.int64)
        load[rng.random(E) < 0.3] = 0
        c, owner = load[load > 0] * D / load.sum(), owner_of_experts(E, D)[load > 0]
        assert _slot_lp_merged(c, owner, D, S) == pytest.approx(_slot_lp(c, owner, D, S, False), rel=1e-9)


# -- the lp planner ------------------------------------------------------------------------------------
@pytest.mark.parametrize("placement", ["static", "eplb", "ultraep", "fsep"])
def test_lp_planner_is_optimal_on_its_placement(placement):
    rng = np.random.default_rng(11)
    cfg = PlannerConfig(8, 24, 4, 2, placement=placement)
    planner = make_planner("lp", cfg)
    base = make_planner(placement, cfg) if placement != "static" else None
    state = planner.initial_state()
    base_state = base.initial_state() if base else None
    for step in range(3):
        counts = rng.multinomial(3000, rng.dirichlet(np.full(24, 0.3)), size=8).astype(np.int64)
        plan, state = planner.plan(counts, state)
        load = counts.sum(axis=0)
        t_lp, _ = lp_min_max(load, plan.placement)
        assert plan.load_D.max() == plan.info["t_int"] == math.ceil(t_lp - 1e-9)
        check_quotas(load, plan.placement, plan.quota_R, plan.info["t_int"])
        if base:  # same placement as the policy it borrows, never a worse max load
            ref, base_state = base.plan(counts, base_state)
            assert ref.placement.digest() == plan.placement.digest()
            assert plan.load_D.max() <= ref.load_D.max()
    if placement == "eplb":  # state threaded: step 1 reused step 0's placement, step 2 did not re-plan
        assert plan.info["placement_info"]["history_steps"] == 3


def test_static_placement_spreads_replicas_evenly():
    for E, D, S in [(16, 8, 1), (16, 8, 2), (16, 8, 3), (8, 8, 2), (64, 16, 4), (4, 8, 2), (10, 4, 3)]:
        p = static_placement(E, D, min(4, D), S)
        extra = p.replicas_per_expert_E - 1
        assert extra.sum() == D * S
        if E % D == 0:
            assert extra.max() - extra.min() <= 1
    full = static_placement(3, 2, 2, 5)  # a rank can host only the 3 experts: extra slots stay empty
    assert (full.replicas_per_expert_E == 2).all()


def test_highs_path_and_fallback(monkeypatch):
    rng = np.random.default_rng(2)
    cfg = PlannerConfig(8, 16, 4, 2, placement="static")
    counts = rng.multinomial(2000, rng.dirichlet(np.full(16, 0.3)), size=8).astype(np.int64)
    flow_plan, _ = LpPlanner(cfg).plan(counts)
    highs_plan, _ = LpPlanner(cfg, solver="highs").plan(counts)
    assert highs_plan.info["solver"] == "highs" and flow_plan.info["solver"] == "flow"
    assert highs_plan.load_D.max() == flow_plan.load_D.max() == flow_plan.info["t_int"]
    quota, t_int, _ = highs_quotas(counts.sum(0), flow_plan.placement)
    check_quotas(counts.sum(0), flow_plan.placement, quota, t_int)

    import megatron_rails.core.planners.lp as lp_mod

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(lp_mod, "min_max_quotas", broken)
    plan, _ = LpPlanner(cfg).plan(counts)
    assert plan.info["solver"] == "highs" and "boom" in plan.info["fallback_reason"]
    assert plan.load_D.max() == flow_plan.info["t_int"]


def test_time_vs_oracle_counts_disagreements(monkeypatch):
    """The comparison agrees on real instances and counts every instance where the LP says
    otherwise (an LP optimum one token higher on each instance: every one is a gap)."""
    from megatron_rails.core import oracle

    out = time_vs_oracle(3, seed=1, num_ranks=16, num_experts=32)
    assert out["gap_count"] == 0 and out["max_rel_diff"] < 1e-6
    real = oracle.lp_min_max
    monkeypatch.setattr(oracle, "lp_min_max", lambda load, placement: (real(load, placement)[0] + 1.0, None))
    off = time_vs_oracle(3, seed=1, num_ranks=16, num_experts=32)
    assert off["gap_count"] == 3 and off["max_rel_diff"] > 1e-6


def test_plan_digest_identical_in_subprocess():
    code = textwrap.dedent("""
        import numpy as np
        from megatron_rails.core.planners import PlannerConfig, make_planner
        from megatron_rails.core.planners.flow import min_max_quotas
        rng = np.random.default_rng(9)
        counts = rng.multinomial(5000, rng.dirichlet(np.ones(24) * 0.2), size=8).astype(np.int64)
        for pl in ("static", "ultraep"):
            plan, _ = make_planner("lp", PlannerConfig(8, 24, 4, 2, placement=pl)).plan(counts)
            print(pl, plan.digest(), min_max_quotas(counts.sum(0), plan.placement).quota_R.tolist())
    """)
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(seed), "PATH": ""}).stdout for seed in (0, 1, 2)]
    assert runs[0] == runs[1] == runs[2] and len(runs[0].splitlines()) == 2
    rng = np.random.default_rng(9)
    counts = rng.multinomial(5000, rng.dirichlet(np.ones(24) * 0.2), size=8).astype(np.int64)
    here, _ = make_planner("lp", PlannerConfig(8, 24, 4, 2, placement="static")).plan(counts)
    assert runs[0].split()[1] == here.digest()


def test_solvers_print_nothing():
    """The LP oracle and the slot-budget bound write nothing to stdout (HiGHS prints a banner at a
    process's first solver whatever its options say): `plan --json` and `bench` output stay clean."""
    import subprocess
    import sys

    code = ("import numpy as np\n"
            "from megatron_rails.core.oracle import lp_min_max, random_instance, slot_budget_lower_bound\n"
            "load, placement = random_instance(np.random.default_rng(0), 8, 16, 2)\n"
            "lp_min_max(load, placement)\n"
            "slot_budget_lower_bound(np.r_[1000, np.ones(15)], 8, 2)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "", p.stdout


def test_one_placement_routing_many_loads_matches_fresh_solves():
    """A step's resident placement routes every microbatch on network shapes it keeps per set of
    flexible experts (flow._shape): loads whose flexible sets differ, repeat and overflow the kept
    shapes give what a fresh placement gives for each (quotas, loads, optimum, flows), and the
    oracle's optimum; the pre-checked entry (checked=True) gives the same."""
    from megatron_rails.core.planners import flow

    rng = np.random.default_rng(21)
    for _ in range(40):
        load0, placement = random_case(rng)
        loads = []
        for k in range(2 * flow._SHAPES_KEPT + 3):
            load = load0.copy() if k % 3 == 0 else rng.integers(0, 60, size=load0.size)
            load[rng.random(load.size) < 0.3] = 0  # other experts unloaded: other flexible sets
            load[placement.replicas_per_expert_E == 0] = 0
            loads.append(load.astype(np.int64))
        loads += loads[:4]  # sets seen before, maybe dropped from the kept shapes since
        for load in loads:
            got = min_max_quotas(load, placement)
            fresh = Placement(placement.slot_expert_DS.copy(), placement.num_experts, placement.ranks_per_node,
                              placement.layout, placement.owner_slots)
            want = min_max_quotas(load, fresh)
            checked = min_max_quotas(load, placement, checked=True)
            for res in (got, checked):
                np.testing.assert_array_equal(res.quota_R, want.quota_R)
                np.testing.assert_array_equal(res.load_D, want.load_D)
                assert (res.t_int, res.t_frac, res.flows) == (want.t_int, want.t_frac, want.flows)
            assert len(placement.__dict__.get("_flow_shapes", {})) <= flow._SHAPES_KEPT
        check_against_oracle(loads[-1], placement)
        unhosted = np.flatnonzero(placement.replicas_per_expert_E == 0)
        if unhosted.size:  # a loaded expert without a replica: the same message either way
            bad = loads[0].copy()
            bad[unhosted[-1]] = 7
            for checked in (False, True):
                with pytest.raises(PlanError, match=rf"expert {unhosted[-1]} has 7 tokens but no replica"):
                    min_max_quotas(bad, placement, checked=checked)
