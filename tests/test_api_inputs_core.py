"""The plan model's and the planners' public constructors: bad input raises PlanError / PlannerError
naming the argument; numpy integers, int32 arrays, tuples and lists give the same result as plain ints."""
import numpy as np
import pytest

from megatron_rails.core.plan import OWNER, SHARDED, Placement as P, Plan, PlanError
from megatron_rails.core.planners import MAX_RANKS, PlannerConfig, PlannerError, make_planner
from megatron_rails.core.policy import MAX_EXPERTS, MAX_SLOTS

SE = np.array([[0, 1], [2, 3]])  # a valid owner table: E=4, D=2, ceil(E/D) = 2 owner slots


# -- 1. Placement's scalar fields ---------------------------------------------------------------
@pytest.mark.parametrize("field, kw", [
    ("num_experts", dict(num_experts="4")), ("num_experts", dict(num_experts=4.5)),
    ("num_experts", dict(num_experts=True)), ("num_experts", dict(num_experts=None)),
    ("num_experts", dict(num_experts=np.bool_(True))), ("num_experts", dict(num_experts=0)),
    ("ranks_per_node", dict(ranks_per_node=1.5)), ("ranks_per_node", dict(ranks_per_node=1.0)),
    ("ranks_per_node", dict(ranks_per_node="1")), ("ranks_per_node", dict(ranks_per_node=0)),
    ("owner_slots", dict(owner_slots=2.0)), ("owner_slots", dict(owner_slots="2")),
    ("owner_slots", dict(owner_slots=-1)), ("layout", dict(layout=["owner"])),
])
def test_placement_scalars_refused(field, kw):
    args = dict(slot_expert_DS=SE, num_experts=4, ranks_per_node=1, layout=OWNER, owner_slots=2) | kw
    with pytest.raises(PlanError, match=field):
        P(**args)


def test_placement_numpy_scalars_are_plain_ints():
    ref = P(SE, 4, 1, OWNER, 2)
    for cast in (np.int32, np.int64, np.uint8):
        got = P(SE.astype(np.int32), cast(4), cast(1), OWNER, cast(2))
        assert got.digest() == ref.digest()
        assert type(got.num_experts) is int and type(got.ranks_per_node) is int and type(got.owner_slots) is int
    assert P(tuple(map(tuple, SE.tolist())), 4, 1, OWNER, 2).digest() == ref.digest()


def test_trusted_placement_validate_checks_scalars():
    with pytest.raises(PlanError, match="num_experts"):
        P.trusted(np.array([[0, 1]]), "2", 1, SHARDED, 0).validate()
    assert P.trusted(np.array([[0, 1]]), np.int64(2), 1, SHARDED, 0).validate() is not None


# -- 2. helper constructors ----------------------------------------------------------------------
@pytest.mark.parametrize("name, make", [
    ("num_ranks", lambda: P.owner(4, 0, 1)),
    ("num_ranks", lambda: P.owner(4, -1, 1)),
    ("num_ranks", lambda: P.owner(4, 2.0, 1)),
    ("num_experts", lambda: P.owner(0, 2, 1)),
    ("ranks_per_node", lambda: P.owner(4, 2, True)),
    ("slots", lambda: P.owner(4, 2, 1, None, -1)),
    ("slots", lambda: P.owner(4, 2, 1, None, 1.5)),
    ("slots", lambda: P.owner(4, 2, 1, None, "1")),
    ("slots", lambda: P.sharded(4, 1, [[0], [1]], -1)),
    ("slots", lambda: P.sharded(4, 1, [[0], [1]], 1.5)),
    ("slots", lambda: P.owner_from_pairs(4, 4, 1, "1", [], [])),
    ("num_ranks", lambda: P.owner_from_pairs(4, 0, 1, 1, [], [])),
    (r"redundant_DR\[0\]", lambda: P.owner(4, 4, 1, [[1.7], [], [], []], 1)),
    (r"redundant_DR\[0\]", lambda: P.owner(4, 4, 1, [["a"], [], [], []], 1)),
    (r"redundant_DR\[0\]", lambda: P.owner(4, 4, 1, [[float("nan")], [], [], []], 1)),
    (r"redundant_DR\[0\]", lambda: P.owner(4, 4, 1, [None, [], [], []], 1)),
    (r"redundant_DR\[1\]", lambda: P.owner(4, 4, 1, [[], [-5], [], []], 1)),
    ("redundant_DR", lambda: P.owner(4, 4, 1, 5, 1)),
    ("redundant_DR", lambda: P.owner(4, 4, 1, [[], []], 1)),
    (r"slots_DS\[1\]", lambda: P.sharded(4, 1, [[0], [1.5]], 2)),
    (r"slots_DS\[0\]", lambda: P.sharded(4, 1, [None, [1]], 2)),
    ("slots_DS", lambda: P.sharded(4, 1, None, 2)),
    ("rank_I.*expert_I", lambda: P.owner_from_pairs(4, 4, 1, 1, [0, 1], [2])),
    ("rank_I", lambda: P.owner_from_pairs(4, 4, 1, 1, [0.5], [2])),
    ("rank_I", lambda: P.owner_from_pairs(4, 4, 1, 1, ["a"], [2])),
    ("expert_I", lambda: P.owner_from_pairs(4, 4, 1, 1, [0], [np.nan])),
    ("expert_I", lambda: P.owner_from_pairs(4, 4, 1, 1, [0], [2.5])),
    ("slot_expert_DS", lambda: P([[0, 1], [2]], 4, 1, SHARDED, 0)),  # ragged
    ("slot_expert_DS", lambda: P([[0, 1], [2, "x"]], 4, 1, SHARDED, 0)),
    ("slot_expert_DS", lambda: P.sharded_table([[0, 1], [2]], 4, 1)),
    ("num_experts", lambda: P.sharded_table(np.array([[0, 1]]), "2", 1)),
    ("ranks_per_node", lambda: P.sharded_table(np.array([[0, 1]]), 2, 0.5)),
])
def test_helper_constructors_refuse(name, make):
    with pytest.raises(PlanError, match=name):
        make()


def test_helper_constructors_take_numpy_integers_tuples_and_lists():
    ref = P.owner(4, 4, 2, [[], [], [0], []], slots=1)
    i32 = np.int32
    assert P.owner(i32(4), np.int64(4), np.uint16(2), ((), (), (np.int32(0),), ()), slots=np.int64(1)).digest() \
        == ref.digest()
    assert P.owner(4, 4, 2, [np.array([], dtype=np.int32), [], np.array([0], dtype=np.int32), [-1]], 1).digest() \
        == ref.digest()
    assert P.owner(4, 4, 2, [[], [], [0.0], []], 1).digest() == ref.digest()  # an integral float, as arrays take
    for r, e in (([2], [0]), ((2,), (0,)), (np.array([2], dtype=np.int32), np.array([0], dtype=np.int32)),
                 (np.array([2], dtype=np.uint8), np.array([0], dtype=np.int16))):
        assert P.owner_from_pairs(4, 4, 2, 1, r, e).digest() == ref.digest()
    assert P.owner_from_pairs(np.int32(4), np.int32(4), np.int32(2), np.int32(1), [2], [0]).digest() == ref.digest()

    sh = P.sharded(4, 1, [[0, 1], [2, 3]], 2)
    assert P.sharded(np.int32(4), np.int64(1), ((0, 1), np.array([2, 3], dtype=np.int32)), np.int32(2)).digest() \
        == sh.digest()
    table = np.array([[0, 1], [2, 3]], dtype=np.int64)
    for se in (table.copy(), table.astype(np.int32), table.tolist(), tuple(map(tuple, table.tolist())),
               np.asfortranarray(table), table[:, ::1].copy()):
        got = P.sharded_table(se, np.int32(4), np.int64(1))
        assert got.digest() == sh.digest()
        assert got.replica_rank_R.tolist() == sh.replica_rank_R.tolist()
        assert got.expert_ptr.tolist() == sh.expert_ptr.tolist()


# -- 3. Plan ---------------------------------------------------------------------------------------
PL = P.owner(2, 2, 1, [[1], [0]], slots=1)  # every rank hosts both experts
COUNTS = [[3, 1], [2, 4]]


def _ref():
    return Plan.from_expert_ranks(PL, COUNTS, [0, 0, 1, 1], [0, 1, 0, 1], [4, 1, 2, 3])


@pytest.mark.parametrize("name, make", [
    ("tok_M", lambda: Plan.from_expert_ranks(PL, COUNTS, [0, 0, 1, 1], [0, 1, 0, 1], [4.5, 0.5, 2, 3])),
    ("rank_M", lambda: Plan.from_expert_ranks(PL, COUNTS, [0, 0, 1, 1], [0.5, 1, 0, 1], [4, 1, 2, 3])),
    ("expert_M", lambda: Plan.from_expert_ranks(PL, COUNTS, ["a", 0, 1, 1], [0, 1, 0, 1], [4, 1, 2, 3])),
    ("tok_M", lambda: Plan.from_expert_ranks(PL, COUNTS, [0, 0, 1, 1], [0, 1, 0, 1], [np.nan, 1, 2, 3])),
    ("expert_M", lambda: Plan.from_expert_ranks(PL, COUNTS, [[0, 0], [1]], [0, 1, 0], [4, 1, 2])),
    ("placement", lambda: Plan.from_expert_ranks(None, COUNTS, [0], [0], [1])),
    ("placement", lambda: Plan(None, COUNTS, [1, 2, 3])),
    ("placement", lambda: Plan.from_quotas("owner", COUNTS, [1, 2, 3])),
    ("policy", lambda: Plan(PL, COUNTS, [4, 1, 2, 3], None)),
    ("expert_param_bytes", lambda: _ref().summary("x")),
    ("expert_param_bytes", lambda: _ref().summary(-5)),
    ("expert_param_bytes", lambda: _ref().summary(1.5)),
    ("expert_param_bytes", lambda: _ref().weight_bytes(True)),
    ("moves", lambda: PL.move_bytes(10, -1)),
])
def test_plan_inputs_refused(name, make):
    with pytest.raises(PlanError, match=name):
        make()


def test_plan_takes_numpy_integers_tuples_and_lists():
    ref = _ref()
    i32 = lambda xs: np.array(xs, dtype=np.int32)  # noqa: E731
    assert Plan.from_expert_ranks(PL, np.array(COUNTS, dtype=np.int32), i32([0, 0, 1, 1]), (0, 1, 0, 1),
                                  i32([4, 1, 2, 3])) == ref
    assert Plan.from_expert_ranks(PL, COUNTS, [0.0, 0, 1, 1], [0, 1, 0, 1], [4.0, 1, 2, 3]) == ref
    assert Plan.from_quotas(PL, tuple(map(tuple, COUNTS)), i32(ref.quota_R)).digest() == ref.digest()
    assert ref.summary(np.int64(1000)) == ref.summary(1000)
    assert ref.summary() == ref.summary(0) and ref.summary(1000)["weight_bytes"] == 1000 * ref.weight_moves
    assert PL.move_bytes(np.int32(10), np.int64(2)) == PL.move_bytes(10, 2) == 20


# -- 4. PlannerConfig and make_planner ------------------------------------------------------------
@pytest.mark.parametrize("name, kw", [
    ("num_experts", dict(num_ranks=4, num_experts=4 * 10**11)),
    ("num_experts", dict(num_ranks=4, num_experts=MAX_EXPERTS + 1)),
    ("slots", dict(num_ranks=4, num_experts=4, slots=10**12)),
    ("slots", dict(num_ranks=4, num_experts=4, slots=MAX_SLOTS + 1)),
    ("num_ranks", dict(num_ranks=10**9, num_experts=10**9)),
    ("num_ranks", dict(num_ranks=MAX_RANKS + 1, num_experts=4, ranks_per_node=1)),
    ("window", dict(num_ranks=4, num_experts=4, window=10**12)),
    ("interval", dict(num_ranks=4, num_experts=4, interval=10**12)),
])
def test_planner_config_bounds(name, kw):
    with pytest.raises(PlannerError, match=name):
        PlannerConfig(**kw)


def test_planner_config_bounds_are_inclusive():
    cfg = PlannerConfig(MAX_RANKS, MAX_EXPERTS, 8, MAX_SLOTS)
    assert cfg.num_ranks == MAX_RANKS and cfg.slots == MAX_SLOTS
    assert PlannerConfig(np.int32(4), np.int64(8), np.int16(2), np.uint8(1)) == PlannerConfig(4, 8, 2, 1)


def test_make_planner_fsep_huge_experts_refused_before_allocating():
    with pytest.raises(PlannerError, match="num_experts"):
        make_planner("fsep", PlannerConfig(4, 4 * 10**11))


@pytest.mark.parametrize("name", [["none"], None, 3, ("fsep",)])
def test_make_planner_policy_name_must_be_a_string(name):
    with pytest.raises(PlannerError, match="policy"):
        make_planner(name, PlannerConfig(4, 4, 4, 1))


@pytest.mark.parametrize("policy", ["none", "eplb", "fsep", "ultraep", "lp"])
def test_planners_same_plans_with_numpy_config(policy):
    rng = np.random.default_rng(7)
    counts = rng.integers(0, 50, (8, 16)).astype(np.int64)
    counts[:, 3] *= 20  # one hot expert: the balancing policies place replicas
    a = make_planner(policy, PlannerConfig(8, 16, 4, 2))
    b = make_planner(policy, PlannerConfig(np.int64(8), np.int32(16), np.int64(4), np.int32(2)))
    pa, _ = a.plan(counts, a.initial_state())
    pb, _ = b.plan(counts.astype(np.int32), b.initial_state())
    pa.validate(), pb.validate()
    assert pa.digest() == pb.digest()
