"""Plans within an optimizer step (core/planners/step.py): growing the resident placement.

`added_to` keeps every resident slot and fills only free ones, never hosting an expert twice on a
rank; `grow` routes on the grown placement as well as the LP optimum (pulp/HiGHS, core/oracle.py)
and grows only when the tokens it saves over the remaining microbatches pay for the new replicas.
"""
import numpy as np
import pytest

from megatron_rails.core.oracle import lp_min_max
from megatron_rails.core.planners import PlannerConfig, make_planner
from megatron_rails.core.planners.step import added_to, grow, replica_cost_tokens, route_on


def _counts(rng, D, E, hot):
    p = np.full(E, 1.0)
    p[hot] = 12.0
    return rng.multinomial(400, p / p.sum(), size=D).astype(np.int64)


@pytest.mark.parametrize("policy", ["ultraep", "lp", "fsep"])
@pytest.mark.parametrize("seed", range(12))
def test_grow_keeps_resident_slots_and_routes_optimally(policy, seed):
    rng = np.random.default_rng(seed)
    # the last three: E not a multiple of D (an owner layout pads some ranks' owner slots with -1)
    D, E = [(2, 8), (4, 8), (4, 16), (3, 5), (3, 8), (7, 10)][seed % 6]
    planner = make_planner(policy, PlannerConfig(D, E, 2 if D % 2 == 0 else 1, 2))
    first = _counts(rng, D, E, hot=0)
    later = _counts(rng, D, E, hot=int(rng.integers(1, E)))
    resident = planner.plan(first)[0].placement
    fresh = planner.plan(later)[0]
    on = route_on(resident, later, policy)
    grown = added_to(resident, fresh.placement)
    if grown is None:
        return
    old, new = resident.slot_expert_DS, grown.slot_expert_DS
    assert np.all((old < 0) | (new == old)), "a resident slot changed"
    assert (new >= 0).sum() > (old >= 0).sum()
    for d in range(D):  # every expert fresh hosts on d is there, unless d ran out of free slots
        missing = set(fresh.placement.slot_expert_DS[d][fresh.placement.slot_expert_DS[d] >= 0]) - set(new[d])
        assert not missing or (new[d] >= 0).all(), f"rank {d} has free slots but lacks {missing}"
    plan = grow(resident, fresh, on, later, remaining=1, cost_tokens=0.0)
    if plan is None:  # nothing to gain: the grown placement does not lower the busiest rank
        assert route_on(grown, later, policy).load_D.max() >= on.load_D.max()
        return
    t_lp, _ = lp_min_max(later.sum(axis=0), grown)
    assert plan.load_D.max() == int(np.ceil(t_lp - 1e-9)), "not the min-max route on the grown placement"
    assert plan.load_D.max() < on.load_D.max()
    plan.validate()
    # the same gain at a cost it does not reach, and reaching it over enough microbatches
    saved = int(on.load_D.max() - plan.load_D.max())
    added = int(grown.is_moved_R.sum() - resident.is_moved_R.sum())
    assert grow(resident, fresh, on, later, remaining=1, cost_tokens=saved / added + 1) is None
    assert grow(resident, fresh, on, later, remaining=10, cost_tokens=saved / added * 10) is not None


@pytest.mark.parametrize("policy", ["ultraep", "lp", "eplb"])
def test_owner_padding_is_no_free_slot(policy):
    """E = 5 on D = 3: rank 2 owns one expert, its second owner slot is padding. A replica added
    there would break the stock owner layout: it goes to the redundant slot after it."""
    planner = make_planner(policy, PlannerConfig(3, 5, 1, 1))
    resident = planner.plan(np.array([[10, 10, 10, 10, 20]] * 3, dtype=np.int64))[0].placement
    assert resident.slot_expert_DS[2, 1] == -1 and resident.owner_slots == 2
    hot = np.array([[90, 0, 0, 0, 0]] * 3, dtype=np.int64)  # all of it to expert 0, owned by rank 0
    fresh = planner.plan(hot)[0]
    grown = added_to(resident, fresh.placement)
    assert grown is not None and grown.slot_expert_DS[2, 1] == -1  # the padding stays
    added = np.argwhere((resident.slot_expert_DS < 0) & (grown.slot_expert_DS >= 0))
    assert len(added) and all(s >= resident.owner_slots for _, s in added)
    on = route_on(resident, hot, policy)
    plan = grow(resident, fresh, on, hot, remaining=4, cost_tokens=0.0)
    t_lp, _ = lp_min_max(hot.sum(axis=0), grown)
    assert plan is not None and plan.load_D.max() == int(np.ceil(t_lp - 1e-9)) < on.load_D.max()
    # with every redundant slot taken, the padding is no room for another replica
    full = resident.slot_expert_DS.copy()
    full[:, 2] = [4, 0, 0]
    assert not type(resident)(full, 5, 1, resident.layout, 2).has_free_slot


def test_added_to_refuses_other_layouts_and_no_news():
    counts = np.array([[50, 1, 1, 1], [40, 1, 1, 1]], dtype=np.int64)
    owner = make_planner("ultraep", PlannerConfig(2, 4, 2, 1)).plan(counts)[0].placement
    sharded = make_planner("fsep", PlannerConfig(2, 4, 2, 1)).plan(counts)[0].placement
    assert added_to(owner, sharded) is None and added_to(sharded, owner) is None
    assert added_to(owner, owner) is None


def test_replica_cost_tokens_is_bytes_over_bandwidth_in_compute_tokens():
    # 2 bytes per parameter both ways over 50 GB/s against 6 flops per parameter at 989 TFLOPS
    want = (2 * 2 / 50e9) / (6 / 989e12)
    assert replica_cost_tokens(2) == pytest.approx(want)
    assert replica_cost_tokens(4, nic_gbps=800.0) == pytest.approx(want)
