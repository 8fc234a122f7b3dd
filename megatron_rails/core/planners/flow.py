"""Exact min-max token scheduling over a fixed placement (MicroMoE's per-microbatch LP, solved by max-flow).

Problem: given load_E (int64 [E], tokens routed to every expert) and a Placement, choose quota_R
(int64 [R], tokens every replica computes; an expert's quotas sum to its load) minimizing the largest
rank load (sum of the quotas of the replicas on a rank).

Experts with one replica are a fixed base load b_d on their rank; only experts with two or more replicas
and tokens ("flexible") are decided. For a rank set X let w(X) = b(X) + the load of flexible
experts whose hosts all lie in X. By max-flow/min-cut (Hall's condition) the fractional optimum is
    T* = max over X of w(X) / |X|,
and T is feasible iff the network  source -> expert (cap load) -> host rank (cap inf) -> sink (cap T - b_d)
carries every flexible token. Newton/Dinkelbach iteration: if T is infeasible, the source side X of the
min cut has w(X)/|X| > T; move T there. T is kept as an exact Fraction p/q and capacities are scaled by q,
so every decision is integer arithmetic. The integer optimum is ceil(T*), and max-flow with integer
capacities ceil(T*) - b_d returns integral flows, i.e. integer quotas reaching it.

Legend: D ranks, E experts, R replicas, T a max rank load in tokens (T* the LP optimum). Inside
`_Network` the letters are restricted to the flexible part: E the flexible experts, R their replicas,
D the ranks hosting one (ascending). Everything is deterministic: no hashing, no floats, fixed iteration
orders.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from ..compiled import compiled
from ..plan import OWNER, Placement, PlanError, c_order, rank_totals


@dataclass(frozen=True)
class MinMaxResult:
    """quota_R: int64 [R] tokens per replica; load_D: int64 [D] tokens per rank (max == t_int);
    t_int: optimal integer max rank load; t_frac: exact fractional (LP) optimum; flows: max-flows run."""

    quota_R: np.ndarray
    load_D: np.ndarray
    t_int: int
    t_frac: Fraction
    flows: int = 0


def check_load(load_E, placement: Placement, checked: bool = False) -> np.ndarray:
    """Validate load_E against a placement: int64 [E], non-negative, every loaded expert hosted.
    checked: load_E is an int64 [E] array known to be non-negative (only the hosting is checked)."""
    if checked:
        load = load_E
    else:
        load = np.asarray(load_E)
        if load.shape != (placement.num_experts,):
            raise PlanError(f"load_E has shape {load.shape}, expected ({placement.num_experts},)")
        if load.size and not np.issubdtype(load.dtype, np.integer):
            raise PlanError(f"load_E must hold integers, got dtype {load.dtype}")
        load = load.astype(np.int64, copy=False)
        if load.size and load.min() < 0:
            raise PlanError(f"expert {int(np.argmin(load))} has a negative load {load.min()}")
    orphan = (load > 0) & (placement.replicas_per_expert_E == 0)
    if orphan.any():
        e = int(np.flatnonzero(orphan)[0])
        raise PlanError(f"expert {e} has {load[e]} tokens but no replica in the placement")
    return load


def optimal_as_is(placement: Placement, quota_R: np.ndarray, load_E: np.ndarray) -> tuple[int, bool]:
    """(the busiest rank's load under quota_R, whether no split can do better on placement): it
    reaches the lower bound ceil(total / D) that every split must meet, or no loaded expert has two
    replicas (then every split is the same). Checked before any solve: a placement's own planner
    often gets there (ultraep, whenever its cascade reaches the mean bound). quota_R, load_E: int64."""
    D = placement.num_ranks
    t, total = rank_totals(placement.replica_rank_R, quota_R, D)[1:]
    if t * D <= total + D - 1:  # t <= ceil(total / D)
        return t, True
    if placement.layout == OWNER and placement.num_replicas == placement.num_experts:  # one replica each
        return t, True
    return t, not np.count_nonzero((placement.replicas_per_expert_E >= 2) & (load_E > 0))


def min_max_quotas(load_E, placement: Placement, checked: bool = False) -> MinMaxResult:
    """Exact min-max quotas. load_E: int64 [E] (non-negative). Returns MinMaxResult.
    checked: load_E is known to be an int64 [E] array without negative entries (check_load).

    Raises PlanError if an expert with tokens has no replica.
    """
    p = placement
    D, R, E = p.num_ranks, p.num_replicas, p.num_experts
    ptr, rank_R, n_E = p.expert_ptr, p.replica_rank_R, p.replicas_per_expert_E
    if _FLOW_SPLIT is not None and checked:
        # one compiled pass (a dozen numpy calls below, each costly on the cold caches between a
        # step's microbatches): single-replica experts onto their rank's base, the flexible listed
        quota, base, flex = np.empty(R, dtype=np.int64), np.empty(D, dtype=np.int64), np.empty(E, dtype=np.int64)
        n_flex, total, base_max, orphan = _FLOW_SPLIT(c_order(load_E), c_order(n_E), c_order(ptr),
                                                      c_order(rank_R), E, R, D, quota, base, flex)
        if orphan >= 0:
            raise PlanError(f"expert {orphan} has {load_E[orphan]} tokens but no replica in the placement")
        load, flex = load_E, flex[:n_flex]
    else:
        load = check_load(load_E, p, checked)
        quota = np.zeros(R, dtype=np.int64)
        loaded = load > 0
        single = np.flatnonzero((n_E == 1) & loaded)
        quota[ptr[single]] = load[single]
        base = rank_totals(rank_R[ptr[single]], load[single], D)[0]
        flex = np.flatnonzero((n_E >= 2) & loaded)
        total, base_max = int(load.sum()), int(base.max())
    if flex.size == 0:
        return _result(quota, base, base_max, Fraction(base_max))

    if _FLOW_SOLVE is not None and total * D < _FLOW_SOLVE_MAX:
        # the same iteration compiled (_flow_c.c, which builds the network itself): Python's
        # network and Dinic are most of a route's host time
        load_D = np.empty(D, dtype=np.int64)
        status, t_int, tp, tq, flows = _FLOW_SOLVE(
            c_order(load), c_order(base), c_order(flex), c_order(ptr), c_order(n_E), c_order(rank_R), quota, load_D,
            E, R, D, flex.size, total, base_max)
        if status == 0:
            return _result(quota, load_D, t_int, Fraction(tp, tq), flows)
        # else the Python iteration below, which raises what the compiled one ran into
    shape = _shape(p, flex)
    net = _Network(shape, load[flex], base)
    # Both are ratios w(X)/|X| of real rank sets (all ranks; the most loaded single rank), so T <= T*.
    T = max(Fraction(total, D), Fraction(base_max))
    flows = 0
    # Dinkelbach: each step's X maximizes w(X) - T|X| and |X| strictly shrinks from step to step,
    # so at most (host ranks) + 1 <= D + 1 solves reach T*.
    for _ in range(D + 2):
        flows += 1
        if net.solve(T):
            break
        T = net.cut_ratio()
    else:  # pragma: no cover - a bug guard; Newton on a finite set of ratios always terminates
        raise RuntimeError(f"min_max_quotas: Newton iteration did not converge (T={T})")
    t_int = -(-T.numerator // T.denominator)
    if T.denominator != 1:
        # the fractional flow at T* scaled down and floored is a feasible start for the integer problem
        flows += 1
        if not net.solve(Fraction(t_int)):  # pragma: no cover - t_int >= T* is feasible
            raise RuntimeError(f"min_max_quotas: integer flow at {t_int} >= T*={T} infeasible")
    flow_R = net.flow_R()
    quota[net.rep_R] = flow_R
    load_D = base + rank_totals(net.shape.rank_R, flow_R, D)[0]
    return _result(quota, load_D, t_int, T, flows)


def _result(quota, load_D, t_int, t_frac, flows=0) -> MinMaxResult:
    quota.flags.writeable = False
    load_D.flags.writeable = False
    return MinMaxResult(quota, load_D, int(t_int), t_frac, flows)


_FLOW_SPLIT = compiled("megatron_rails.core._route_c", "flow_split")  # None: numpy in min_max_quotas
_FLOW_SOLVE = compiled("megatron_rails.core.planners._flow_c", "flow_solve")  # None: the Python network
_FLOW_SOLVE_MAX = 1 << 62  # total tokens x ranks below it: every product in the compiled flow fits int64
_SHAPES_KEPT = 8  # flexible-expert sets whose network shape a placement keeps


def _shape(placement: Placement, flex: np.ndarray) -> "_Shape":
    """The network shape of `placement`'s flexible experts `flex` (int64, ascending), made once and
    kept on the placement: a step's resident placement routes every microbatch (planners/step.py)
    and its flexible set rarely changes, so later microbatches skip the construction's numpy calls."""
    kept = placement.__dict__.setdefault("_flow_shapes", {})
    key = flex.tobytes()
    shape = kept.get(key)
    if shape is None:
        if len(kept) >= _SHAPES_KEPT:
            kept.clear()
        p = placement
        shape = kept[key] = _Shape(p.expert_ptr[flex], p.replicas_per_expert_E[flex], p.replica_rank_R, p.num_ranks)
    return shape


class _Shape:
    """What the flow network of a set of flexible experts is, independent of their loads.

    E, R, D count the flexible experts, their replicas and the ranks hosting them (module docstring);
    rank_all_R covers the whole placement, num_ranks its ranks.
    Nodes: 0 source, 1..E experts, E+1..E+D ranks, E+D+1 sink. Edge 2i and its reverse 2i+1:
    source->expert k (i = k), expert->host (i = E + m for flexible replica m), rank->sink (i = E + R + j).
    """

    def __init__(self, ptr_E, n_E, rank_all_R, num_ranks: int):
        E = n_E.size
        R = int(n_E.sum())
        kstart = np.zeros(E + 1, dtype=np.int64)
        np.cumsum(n_E, out=kstart[1:])
        k_R = np.repeat(np.arange(E, dtype=np.int64), n_E)
        self.rep_R = np.arange(R, dtype=np.int64) + np.repeat(ptr_E - kstart[:-1], n_E)
        rank_R = self.rank_R = rank_all_R[self.rep_R]  # every flexible replica's rank (all ranks' numbering)
        hosts = np.zeros(num_ranks, dtype=bool)
        hosts[rank_R] = True
        self.rank_D = np.flatnonzero(hosts)  # ascending: node order does not depend on replica order
        self.node_R = (np.cumsum(hosts) - 1)[rank_R]
        D = self.rank_D.size
        self.E, self.R, self.D = E, R, D
        self.k_R, self.kstart = k_R, kstart
        # Python-int copies: the flow loops run on lists, which are much faster to index than arrays
        self.k_list, self.node_list, self.kstart_list = k_R.tolist(), self.node_R.tolist(), kstart.tolist()
        self.n, self.t = E + D + 2, E + D + 1
        self._graph: tuple | None = None

    def graph(self) -> tuple[list, list]:
        """(adj, to): adjacency edge lists per node and edge heads (never modified: Dinic works on a
        capacity list of its own); built only when a greedy start leaves something for Dinic to do."""
        if self._graph is None:
            E, R, D, t = self.E, self.R, self.D, self.t
            to = np.empty(2 * (E + R + D), dtype=np.int64)
            to[0:2 * E:2] = 1 + np.arange(E)
            to[1:2 * E:2] = 0
            to[2 * E:2 * (E + R):2] = 1 + E + self.node_R
            to[2 * E + 1:2 * (E + R):2] = 1 + self.k_R
            to[2 * (E + R)::2] = t
            to[2 * (E + R) + 1::2] = 1 + E + np.arange(D)
            rep_edges = list(range(2 * E, 2 * (E + R), 2))
            ks = self.kstart_list
            # experts: hosts first (the edge back to the source never lies on a level path)
            adj = [list(range(0, 2 * E, 2))]
            adj += [rep_edges[ks[k]:ks[k + 1]] + [2 * k + 1] for k in range(E)]
            by_rank = np.argsort(self.node_R, kind="stable")
            rs = np.searchsorted(self.node_R[by_rank], np.arange(D + 1)).tolist()
            back = (2 * E + 2 * by_rank + 1).tolist()
            # ranks: the sink first, so augmenting paths end as soon as they can
            adj += [[2 * (E + R + j)] + back[rs[j]:rs[j + 1]] for j in range(D)]
            adj.append(list(range(2 * (E + R) + 1, 2 * (E + R + D), 2)))
            self._graph = (adj, to.tolist())
        return self._graph


class _Network:
    """The flow network of the flexible experts at their loads, re-solved for every T.

    shape: _shape(placement, flexible experts); load_E: int64 [E] their loads; base_all_D: int64
    [D_all] every rank's fixed load (its single-replica experts').
    """

    def __init__(self, shape: _Shape, load_E: np.ndarray, base_all_D: np.ndarray):
        self.shape = shape
        self.E, self.R, self.D, self.n, self.t = shape.E, shape.R, shape.D, shape.n, shape.t
        self.rep_R, self.rank_D, self.node_R, self.k_R, self.kstart = (shape.rep_R, shape.rank_D, shape.node_R,
                                                                       shape.k_R, shape.kstart)
        self.k_list, self.node_list, self.kstart_list = shape.k_list, shape.node_list, shape.kstart_list
        self.load_E, self.base_D = load_E, base_all_D[shape.rank_D]
        self.load, self.base = load_E.tolist(), self.base_D.tolist()
        self.flex_total = sum(self.load)
        self.f: list[int] = []  # flow per flexible replica after the last solve, in units of 1/q
        self.q = 0  # units of the last solve (0: none yet)
        self.level: list[int] = []

    def graph(self) -> tuple[list, list]:
        return self.shape.graph()

    def solve(self, T: Fraction) -> bool:
        """Max-flow at T = p/q with capacities scaled by q (whole tokens for an integer T). True iff
        every flexible token fits.

        T only grows between calls, so the previous flow rescaled to units of 1/q and floored stays
        feasible and is the start; the first call starts from a first-fit greedy flow. Leaves the
        replica flows in self.f and the last BFS levels (the min cut's source side) in self.level.
        """
        E, R, D = self.E, self.R, self.D
        q0, p, q = self.q, T.numerator, T.denominator
        src = [q * x for x in self.load]
        res = [p - q * b for b in self.base]
        if q0:
            f = [x * q // q0 for x in self.f]
            out = [0] * E
            for m, a in enumerate(f):
                out[self.k_list[m]] += a
                res[self.node_list[m]] -= a
        else:
            f, out = [0] * R, [0] * E
            node, ks = self.node_list, self.kstart_list
            for k in range(E):
                r = src[k]
                for m in range(ks[k], ks[k + 1]):
                    c = res[node[m]]
                    if c > 0:
                        a = r if r < c else c
                        f[m] = a
                        res[node[m]] = c - a
                        r -= a
                        if not r:
                            break
                out[k] = src[k] - r
        self.q = q
        need = sum(src) - sum(out)
        if not need:  # the start routed everything: no residual graph needed
            self.f = f
            return True
        inf = q * self.flex_total + 1
        cap = [0] * (2 * (E + R + D))
        cap[0:2 * E:2] = [s - o for s, o in zip(src, out)]
        cap[1:2 * E:2] = out
        cap[2 * E:2 * (E + R):2] = [inf - a for a in f]
        cap[2 * E + 1:2 * (E + R):2] = f
        cap[2 * (E + R)::2] = res
        cap[2 * (E + R) + 1::2] = [p - q * b - r for b, r in zip(self.base, res)]
        adj, to = self.graph()
        pushed, self.level = _dinic(self.n, 0, self.t, adj, to, cap, need)
        self.f = cap[2 * E + 1:2 * (E + R):2]  # flow of a replica edge = its reverse residual
        return pushed == need

    def flow_R(self) -> np.ndarray:
        """int64 [R]: flow on every flexible replica (scaled units of the last solve)."""
        return np.asarray(self.f, dtype=np.int64)

    def cut_ratio(self) -> Fraction:
        """w(X) / |X| for X = ranks on the source side of the last (infeasible) solve's min cut."""
        E, D = self.E, self.D
        return self.set_ratio(np.asarray(self.level[E + 1:E + 1 + D]) >= 0)

    def set_ratio(self, in_D: np.ndarray) -> Fraction:
        """w(X) / |X| for the rank nodes X marked in in_D (bool [D], not all False)."""
        hosts_in = np.bincount(self.k_R[in_D[self.node_R]], minlength=self.E)
        inside = hosts_in == np.diff(self.kstart)  # every host of the expert lies in X
        w = int(self.base_D[in_D].sum()) + int(self.load_E[inside].sum())
        return Fraction(w, int(in_D.sum()))


def _dinic(n: int, s: int, t: int, adj: list, to: list, cap: list, need: int):
    """Dinic's max-flow on residual capacities `cap` (modified in place), stopping once `need` units
    are pushed. Returns (pushed, level) with level[v] >= 0 iff v was reached by the last BFS."""
    pushed = 0
    level = [0] * n
    while pushed < need:
        level = [-1] * n
        level[s] = 0
        queue = [s]
        append = queue.append
        for v in queue:  # BFS; the list grows while we walk it
            lv = level[v] + 1
            if lv > level[t] >= 0:
                break  # nodes at or beyond the sink's distance lie on no shortest path
            for e in adj[v]:
                if cap[e]:
                    w = to[e]
                    if level[w] < 0:
                        level[w] = lv
                        append(w)
        if level[t] < 0:
            break
        it = [0] * n
        path: list[int] = []
        v = s
        while True:  # blocking flow: iterative DFS along level-increasing edges
            if v == t:
                b = min(cap[e] for e in path)
                for e in path:
                    cap[e] -= b
                    cap[e ^ 1] += b
                pushed += b
                if pushed >= need:
                    break
                i = 0
                while cap[path[i]]:  # retreat to the tail of the first saturated edge
                    i += 1
                del path[i:]
                v = to[path[-1]] if path else s
                continue
            a, i, lv = adj[v], it[v], level[v] + 1
            na = len(a)
            while i < na:
                e = a[i]
                if cap[e] and level[to[e]] == lv:
                    break
                i += 1
            it[v] = i
            if i < na:
                path.append(e)
                v = to[e]
            elif v == s:
                break
            else:  # dead end: drop v from this phase and skip the edge that led here
                level[v] = -1
                path.pop()
                v = to[path[-1]] if path else s
                it[v] += 1
    return pushed, level
