"""LP oracles (pulp/HiGHS): the reference the exact planners are tested against, and lower bounds.

- `lp_min_max`: the per-microbatch token-scheduling LP (MicroMoE) over a fixed placement, with pulp.
- `slot_budget_lower_bound`: the LP relaxation of min max rank load when the placement of the
  redundant (or FSEP) slots is free too, built directly with highspy so that E*D = 256*1024 stays fast.
- `lp_integer_quotas`: integer quotas at a fixed integer T from the same LP (its matrix is the incidence
  matrix of a bipartite graph, hence totally unimodular), the lp planner's fallback path.
- `time_vs_oracle`: speed and agreement of the max-flow solver (planners/flow.py) against `lp_min_max`
  on `random_instance`s (EP64 x E256, 2 redundant slots by default).

Legend: D ranks, E experts, R replicas, S slots per rank, T a max rank load (tokens). In the slot-budget
LP (`_slot_highs`, `_slot_lp`, `_slot_lp_merged`, `_mean_is_feasible`) E is restricted to the experts
with tokens (`act` in `slot_budget_lower_bound`).
"""
from __future__ import annotations

import functools
import math
import os
import sys
import time

import numpy as np

from .plan import OWNER, SHARDED, Placement, PlanError, owner_of_experts


@functools.cache
def _highs_banner_spent() -> bool:
    """HiGHS prints a two-line banner to file descriptor 1 when a process makes its first solver,
    before any option can silence it (into a `--json` stdout, past 80 columns): make that first one
    here, with descriptor 1 on /dev/null. False where highspy is missing."""
    try:
        import highspy
    except ImportError:
        return False
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    return True


def _pulp_solver():
    import pulp

    _highs_banner_spent()
    solver = pulp.HiGHS(msg=False)
    # the API solver needs highspy; CBC ships with pulp and is slower but always there
    return solver if solver.available() else pulp.PULP_CBC_CMD(msg=False)


def _var(prob, name: str, low=None, up=None, cat: str = "Continuous"):
    """A pulp variable attached to prob (PuLP >= 3.3 deprecates free-standing LpVariable)."""
    import pulp

    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, low, up, cat)
    return pulp.LpVariable(name, low, up, cat)  # pragma: no cover - PuLP < 3.3


def _check_load(load_E, placement: Placement) -> np.ndarray:
    from .planners.flow import check_load

    return check_load(load_E, placement)


def _quota_lp(load_E, placement: Placement, t_fixed: int | None = None):
    """pulp model of the token-scheduling LP over all replicas; minimizes T, or (t_fixed given) finds
    integer quotas with every rank load <= t_fixed. Returns (T, quota_R float64 [R])."""
    import pulp

    p = placement
    load = _check_load(load_E, p)
    D, R = p.num_ranks, p.num_replicas
    prob = pulp.LpProblem("min_max_rank_load", pulp.LpMinimize)
    cat = pulp.LpContinuous if t_fixed is None else pulp.LpInteger
    f = [_var(prob, f"f{r}", 0, None, cat) for r in range(R)]
    T = _var(prob, "T", 0) if t_fixed is None else t_fixed
    prob += pulp.lpSum([T]) if t_fixed is None else pulp.lpSum([])
    ptr = p.expert_ptr.tolist()
    for e, load_e in enumerate(load.tolist()):
        if ptr[e + 1] > ptr[e]:
            prob += pulp.lpSum(f[ptr[e]:ptr[e + 1]]) == load_e, f"expert{e}"
    by_rank: list[list] = [[] for _ in range(D)]
    for r, d in enumerate(p.replica_rank_R.tolist()):
        by_rank[d].append(f[r])
    for d in range(D):
        if by_rank[d]:
            prob += pulp.lpSum(by_rank[d]) <= T, f"rank{d}"
    status = prob.solve(_pulp_solver())
    if pulp.LpStatus[status] != "Optimal":
        raise PlanError(f"token-scheduling LP is {pulp.LpStatus[status]} (T fixed to {t_fixed})")
    quota = np.array([v.value() or 0.0 for v in f], dtype=np.float64)
    t = float(pulp.value(T)) if t_fixed is None else float(t_fixed)
    return t, quota


def lp_min_max(load_E, placement: Placement) -> tuple[float, np.ndarray]:
    """LP optimum of min max rank load over a fixed placement.

    load_E: int64 [E]. Returns (t_opt, quota_frac_R float64 [R]) with quotas >= 0 summing to every
    expert's load over its replicas. PlanError if an expert with tokens has no replica.
    """
    return _quota_lp(load_E, placement)


def lp_integer_quotas(load_E, placement: Placement, t_int: int) -> np.ndarray:
    """Integer quotas (int64 [R]) with every rank load <= t_int, from HiGHS. The constraint matrix is
    totally unimodular, so such quotas exist whenever t_int >= the LP optimum. Verified exactly."""
    load = _check_load(load_E, placement)
    _, q = _quota_lp(load, placement, int(t_int))
    quota = np.rint(q).astype(np.int64)
    p = placement
    sums = np.zeros(p.num_experts, dtype=np.int64)
    np.add.at(sums, p.replica_expert_R, quota)
    rank = np.zeros(p.num_ranks, dtype=np.int64)
    np.add.at(rank, p.replica_rank_R, quota)
    if quota.size and (quota.min() < 0 or rank.max() > t_int) or not np.array_equal(sums, load):
        raise PlanError(f"integer quotas from the LP at T={t_int} failed verification")
    return quota


def slot_budget_lower_bound(load_E, num_ranks: int, slots: int, ranks_per_node: int | None = None,
                            layout: str = OWNER, method: str = "auto") -> float:
    """Lower bound (in tokens) on the max rank load of any placement with `slots` slots per rank.

    load_E: int64 [E]. LP relaxation with free placement: f[e, d] >= 0 tokens of e on rank d,
    sum_d f[e, d] = load_e, sum_e f[e, d] <= T, and fractional placement x[e, d] in [0, 1] with
    f[e, d] <= load_e * x[e, d] and sum_e x[e, d] <= slots on every rank. Owner layout: x only for
    pairs where d is not e's owner (`owner_of_experts`), `slots` redundant slots per rank. Sharded
    layout (FSEP): x for every pair, `slots` slots per rank in all. x = f / load_e at an optimum, so
    x is eliminated; the model is solved in y = f / load_e. ranks_per_node does not enter (the bound
    ignores locality); it is only validated. Divide by total/D for a max/mean bound.

    method="full" solves that LP whole (E*D columns, E the experts with tokens; minutes at 256 x 1024);
    "auto" returns the same optimum faster: closed forms (sharded; no slot), a constructive proof that
    the mean is attained, else the LP with the ranks that own nothing merged (exact by symmetry, see
    `_slot_lp_merged`).
    """
    load = np.asarray(load_E, dtype=np.int64)
    D, S = int(num_ranks), int(slots)
    if load.ndim != 1 or load.size == 0 or D < 1 or S < 0:
        raise PlanError(f"need load_E [E>0], num_ranks >= 1, slots >= 0; got {load.shape}, {D}, {S}")
    if layout not in (OWNER, SHARDED):
        raise PlanError(f"layout must be {OWNER!r} or {SHARDED!r}, got {layout!r}")
    if method not in ("auto", "full"):
        raise PlanError(f"method must be 'auto' or 'full', got {method!r}")
    if ranks_per_node is not None and (ranks_per_node < 1 or D % min(ranks_per_node, D)):
        raise PlanError(f"ranks_per_node={ranks_per_node} does not divide num_ranks={D}")
    if load.min() < 0:
        raise PlanError("load_E must be non-negative")
    total = int(load.sum())
    if total == 0:
        return 0.0
    owner = owner_of_experts(load.size, D)
    act = np.flatnonzero(load)
    if layout == SHARDED and act.size > D * S:
        raise PlanError(f"{act.size} experts with tokens cannot fit {D} ranks x {S} slots")
    c_E = load[act] * D / total
    if method == "full":
        t = _slot_lp(c_E, owner[act], D, S, layout == SHARDED)
    elif layout == SHARDED:
        # Every load row sums to T >= mean (= 1 here), and y[a, d] = 1/D meets every row: expert rows
        # sum to 1, load rows to sum_a c_a / D = 1, slot rows to E/D <= S (E: the experts with tokens;
        # checked above). So T* = 1.
        t = 1.0
    elif S == 0:
        # no redundant slot: every non-owner y is 0, so every expert stays home
        t = float(np.bincount(owner[act], weights=c_E, minlength=D).max())
    elif _mean_is_feasible(c_E, owner[act], D, S):
        t = 1.0  # the mean is a lower bound (sum of the load rows) and is attained
    else:
        t = _slot_lp_merged(c_E, owner[act], D, S)
    return t * total / D


def _slot_highs(c_E, owner_E, m_D, D: int, S: int, sharded: bool):
    """HiGHS model with T (column 0) and y[a, d] in [0, 1] for every a, d (column 1 + a*D + d), loads
    in units of the mean (c_E float64 [E], only the experts with tokens); rank d stands for m_D[d]
    identical ranks (int64 [D]). Rows: E expert rows sum_d m_d y[a, d] = 1; D load rows
    sum_a c_a y[a, d] - T <= 0; D slot rows sum of slot-consuming y[., d] <= S (all pairs if sharded,
    else pairs where d is not the owner)."""
    import highspy

    E = c_E.size
    n = E * D
    a_col, d_col = np.divmod(np.arange(n), D)
    uses_slot = np.ones(n, dtype=bool) if sharded else d_col != owner_E[a_col]
    start = np.zeros(n + 2, dtype=np.int64)
    start[1] = D  # T: -1 in every load row
    np.cumsum(2 + uses_slot, out=start[2:])
    start[2:] += D
    index = np.empty(int(start[-1]), dtype=np.int32)
    value = np.empty(int(start[-1]), dtype=np.float64)
    index[:D], value[:D] = E + np.arange(D), -1.0
    s = start[1:-1]
    index[s], value[s] = a_col, m_D[d_col]
    index[s + 1], value[s + 1] = E + d_col, c_E[a_col]
    index[s[uses_slot] + 2], value[s[uses_slot] + 2] = E + D + d_col[uses_slot], 1.0

    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n + 1, E + 2 * D
    lp.col_cost_ = np.r_[1.0, np.zeros(n)]
    lp.col_lower_ = np.zeros(n + 1)
    lp.col_upper_ = np.r_[highspy.kHighsInf, np.ones(n)]
    lp.row_lower_ = np.r_[np.ones(E), np.full(2 * D, -highspy.kHighsInf)]
    lp.row_upper_ = np.r_[np.ones(E), np.zeros(D), np.full(D, float(S))]
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = start.astype(np.int32)
    lp.a_matrix_.index_ = index
    lp.a_matrix_.value_ = value
    _highs_banner_spent()
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.passModel(lp)
    h.run()
    status = h.getModelStatus()
    if status != highspy.HighsModelStatus.kOptimal:
        raise PlanError(f"slot-budget LP ended with status {h.modelStatusToString(status)}")
    return float(h.getInfo().objective_function_value)


def _slot_lp(c_E: np.ndarray, owner_E: np.ndarray, D: int, S: int, sharded: bool) -> float:
    """The definition: the whole LP, E*D + 1 columns."""
    return _slot_highs(c_E, owner_E, np.ones(D, dtype=np.int64), D, S, sharded)


def _slot_lp_merged(c_E: np.ndarray, owner_E: np.ndarray, D: int, S: int) -> float:
    """The owner-layout LP with all ranks that own no expert with tokens merged into one. Those ranks
    have identical rows, so permuting them maps solutions to solutions, and averaging a solution over
    the permutations keeps it feasible (the rows are linear) with the same T: some optimum gives them
    all the same y, which is what the merged rank (multiplicity m in the expert rows) models. Same
    optimum, at most min(E, D) + 1 ranks: 257 instead of 1024 columns per expert at E=256, D=1024."""
    hosts, owner_g = np.unique(owner_E, return_inverse=True)
    m = D - hosts.size
    if m == 0:
        return _slot_lp(c_E, owner_E, D, S, False)
    m_D = np.r_[np.ones(hosts.size, dtype=np.int64), m]
    return _slot_highs(c_E, owner_g.astype(np.int64), m_D, hosts.size + 1, S, False)


def _mean_is_feasible(c_E: np.ndarray, owner_E: np.ndarray, D: int, S: int) -> bool:
    """Try to build a feasible point of the owner-layout LP at T = 1 (the mean, loads c_E in units of
    the mean): overloaded ranks export their excess from their heaviest experts first (fewest slots
    per token), underloaded ranks take it, either as the same mixture of every exported piece or
    matched heaviest piece to largest gap. Exporting a piece of size tau of expert a costs tau / c_a
    slots at the receiver. True only if one of the two fits every receiver's S slots."""
    own_D = np.bincount(owner_E, weights=c_E, minlength=D)
    need_D = np.maximum(own_D - 1.0, 0.0)
    order = np.lexsort((-c_E, owner_E))
    c, o = c_E[order], owner_E[order]
    before = np.cumsum(c) - c
    first = np.searchsorted(o, np.arange(D))
    before -= np.r_[before, 0.0][first][o]  # owned load ahead of the expert on its own rank
    piece = np.clip(need_D[o] - before, 0.0, c)
    gap = np.sort(np.maximum(1.0 - own_D, 0.0))[::-1]
    tok_out, slots_out = piece.sum(), (piece / c).sum()
    if tok_out <= 0 or slots_out * gap[0] / tok_out <= S * (1 - 1e-12):
        return True
    by_density = np.argsort(-c, kind="stable")
    tok = np.r_[0.0, np.cumsum(piece[by_density])]
    slot = np.r_[0.0, np.cumsum(piece[by_density] / c[by_density])]
    used = np.diff(np.interp(np.r_[0.0, np.cumsum(gap)], tok, slot))
    return bool(used.max() <= S * (1 - 1e-12))


def random_instance(rng: np.random.Generator, num_ranks: int = 64, num_experts: int = 256, slots: int = 2,
                    ranks_per_node: int = 8, tokens_per_rank: int = 4096 * 8):
    """A skewed load (int64 [E], Dirichlet(0.3) expert popularity, D * tokens_per_rank tokens) and an
    owner placement whose redundant slots hold distinct non-owned experts drawn in proportion to
    load (hot experts get replicas, as a load-aware planner would) or, for half the draws, uniformly."""
    E, D = num_experts, num_ranks
    load = rng.multinomial(D * tokens_per_rank, rng.dirichlet(np.full(E, 0.3))).astype(np.int64)
    owner = owner_of_experts(E, D)
    weight = load + 1.0 if rng.random() < 0.5 else np.ones(E)
    rows = []
    for d in range(D):
        w = np.where(owner == d, 0.0, weight)
        k = min(slots, int((w > 0).sum()))
        rows.append(rng.choice(E, size=k, replace=False, p=w / w.sum()).tolist() if k else [])
    return load, Placement.owner(E, D, min(ranks_per_node, D), rows, slots=slots)


def time_vs_oracle(n_instances: int = 50, seed: int = 0, num_ranks: int = 64, num_experts: int = 256,
                   slots: int = 2) -> dict:
    """Median wall time of the exact max-flow solver (`min_max_quotas`) against the pulp/HiGHS LP
    (`lp_min_max`, model build + solve) on random EP64 x E256 instances with 2 redundant slots, and
    how often they disagree (gap_count: t_int != ceil(t_lp) or |t_frac - t_lp| > 1e-6 relative)."""
    from .planners.flow import min_max_quotas

    rng = np.random.default_rng(seed)
    t_flow, t_lp, gaps, max_rel = [], [], 0, 0.0
    for _ in range(n_instances):
        load, placement = random_instance(rng, num_ranks, num_experts, slots)
        _ = placement.expert_ptr  # both solvers share the cached replica arrays; build them untimed
        t0 = time.perf_counter()
        res = min_max_quotas(load, placement)
        t1 = time.perf_counter()
        opt, _ = lp_min_max(load, placement)
        t2 = time.perf_counter()
        t_flow.append(t1 - t0)
        t_lp.append(t2 - t1)
        rel = abs(float(res.t_frac) - opt) / max(1.0, opt)
        max_rel = max(max_rel, rel)
        gaps += int(res.t_int != math.ceil(opt - 1e-9) or rel > 1e-6)
    med_flow, med_lp = float(np.median(t_flow)), float(np.median(t_lp))
    return {"instances": n_instances, "seed": seed, "num_ranks": num_ranks, "num_experts": num_experts,
            "slots": slots, "median_flow_s": med_flow, "median_lp_s": med_lp, "speedup": med_lp / med_flow,
            "mean_flow_s": float(np.mean(t_flow)), "p99_flow_s": float(np.quantile(t_flow, 0.99)),
            "p99_lp_s": float(np.quantile(t_lp, 0.99)), "gap_count": gaps, "max_rel_diff": max_rel}
