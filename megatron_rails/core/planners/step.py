"""Plans within one optimizer step: a placement stays resident, the route follows every microbatch.

Owner weights change only at the optimizer step, so replica and FSEP slot weights brought to a rank
for one microbatch serve every later microbatch of the same step (runtime/residency.py). A step's
first microbatch takes its planner's plan and the placement becomes resident; later microbatches
route their tokens exactly on the resident placement (the min-max flow of planners/flow.py, the
`lp` planner's solver) instead of moving weights again. While no training forward has used the
resident weights (inference, evaluation) a fresh placement replaces them when it lowers the busiest
rank by more than `gain` of the mean, which pays for moving its weights.

Legend: D ranks, E experts.
"""
from __future__ import annotations

import numpy as np

from ..plan import Placement, Plan, PlanError, counts_and_load
from .flow import min_max_quotas

REPLAN_GAIN = 0.05  # a fresh placement must lower max tokens per rank by this fraction of the mean


def hosts_every_loaded(placement: Placement, load_E: np.ndarray) -> bool:
    """Whether every expert with tokens has a replica in `placement`."""
    return not bool(((load_E > 0) & (placement.replicas_per_expert_E == 0)).any())


def route_on(placement: Placement, counts_DE: np.ndarray, policy: str, info: dict | None = None) -> Plan:
    """The plan routing counts_DE (int64 [D, E]) on a fixed placement with the smallest possible
    busiest rank (integer min-max quotas by max-flow). PlanError if a loaded expert is not hosted."""
    counts_DE, load_E = counts_and_load(counts_DE, placement.num_ranks, placement.num_experts)
    res = min_max_quotas(load_E, placement, checked=True)
    extra = {"resident": True, "t_int": res.t_int}
    return Plan.trusted(placement, counts_DE, res.quota_R, policy=policy, info={**(info or {}), **extra})


def choose(fresh: Plan, resident: Placement | None, counts_DE: np.ndarray, locked: bool,
           gain: float = REPLAN_GAIN) -> tuple[Plan, bool]:
    """The plan a microbatch runs, and whether its placement becomes the resident one.

    fresh:    the planner's plan for these counts (its state already advanced).
    resident: the placement whose weights are resident now, or None (a new optimizer step).
    locked:   a training forward used the resident weights this step: its gradients are still
              owed to the owners (or shards), so the resident placement must stay.
    """
    if resident is None:
        return fresh, True
    if fresh.placement.digest() == resident.digest():
        return fresh, False
    if not hosts_every_loaded(resident, fresh.load_E):
        if locked:  # the planners keep every expert hosted (fsep: one slot each), so never in practice
            raise PlanError(f"{fresh.policy}: an expert with tokens has no replica in the placement "
                            f"resident for this optimizer step")
        return fresh, True
    on = route_on(resident, counts_DE, fresh.policy, fresh.info)
    if locked:
        return on, False
    mean = fresh.load_D.sum() / max(1, fresh.load_D.size)
    if int(fresh.load_D.max(initial=0)) < int(on.load_D.max(initial=0)) - gain * mean:
        return fresh, True
    return on, False


def added_to(resident: Placement, fresh: Placement) -> Placement | None:
    """`resident` plus those of `fresh`'s replicas it lacks, each put in a free slot of the same
    rank (a rank never hosts an expert twice): the placement a step can grow into without moving
    any resident slot. None when nothing fits or nothing is missing, or the layouts differ."""
    if (fresh.layout != resident.layout or fresh.owner_slots != resident.owner_slots
            or fresh.slot_expert_DS.shape != resident.slot_expert_DS.shape):
        return None
    se_DS = resident.slot_expert_DS.copy()
    added = 0
    for d in range(se_DS.shape[0]):
        have = set(se_DS[d][se_DS[d] >= 0].tolist())
        # an owner layout's first owner_slots slots are the stock owners' (padded with -1 where E is
        # not a multiple of D): never free for a replica
        free = (resident.owner_slots + np.flatnonzero(se_DS[d, resident.owner_slots:] < 0)).tolist()
        for e in fresh.slot_expert_DS[d].tolist():
            if e >= 0 and e not in have and free:
                se_DS[d, free.pop(0)] = e
                have.add(e)
                added += 1
    if not added:
        return None
    return Placement(se_DS, resident.num_experts, resident.ranks_per_node, resident.layout, resident.owner_slots)


def grow(resident: Placement, fresh: Plan, on: Plan, counts_DE: np.ndarray, remaining: int,
         cost_tokens: float) -> Plan | None:
    """The plan on `resident` grown by `fresh`'s missing replicas (added_to), when what they take off
    the busiest rank over the step's `remaining` microbatches (tokens) pays for moving them: each
    new replica costs `cost_tokens`, the expert compute its weight bytes and returned gradient take
    on the network. `on`: the plan on `resident` alone. None when not worth it."""
    grown = added_to(resident, fresh.placement)
    if grown is None:
        return None
    plan = route_on(grown, counts_DE, fresh.policy, fresh.info)
    new = int(grown.is_moved_R.sum() - resident.is_moved_R.sum())
    saved = (int(on.load_D.max(initial=0)) - int(plan.load_D.max(initial=0))) * max(1, int(remaining))
    return plan if saved > 0 and saved >= new * cost_tokens else None


def replica_cost_tokens(bytes_per_param: int, nic_gbps: float = 400.0, gpu_tflops: float = 989.0) -> float:
    """Tokens of expert compute (forward and backward: 6 flops per parameter and token) that take as
    long as moving an expert's weights once and its gradient back (2 x bytes_per_param per parameter
    over one NIC): what one added replica must save, whatever the expert's size. Defaults: a 400 Gb/s
    NIC and 989 dense TFLOPS (core/topology.py's)."""
    return 2.0 * bytes_per_param / (nic_gbps * 1e9 / 8) / (6.0 / (gpu_tflops * 1e12))
