"""Token dedup across nodes (issue #17): a token crosses to a remote node once, then fans out there.

Shape legend:  D ranks   G ranks per node   V nodes   E experts   T tokens per rank   H hidden size
(the top-k axis has no letter: `picks_DT` is [D, T, topk]).

Without dedup, Megatron's alltoall dispatcher sends a token once per (token, expert) pair: a token
routed to k experts on one remote node crosses the network k times. With dedup, rank s sends each
of its tokens ONCE to every remote node b holding at least one of its pairs, to b's entry rank

    entry(s, b) = b * G + (s mod G)

the GPU of node b with s's local index. On a rail-optimized topology that GPU sits on s's rail at
s's position within the rail (`Topology.rail_gpu(b, rail_of(s), s)`, for any rails_per_node that
divides G), so the crossing needs no forwarding in a rail-matched exchange. The entry rank then fans
the token out over NVLink to every rank of node b serving one of its pairs, once per pair (a pair
whose rank is the entry rank itself moves no further). Inside the source's own node nothing changes:
a token goes once per pair to each same-node rank.

Stage 1 (what RailS schedules) is `units_DD`: the intra-node pair rows as before, plus, for remote
d == entry(s, node(d)), the number of distinct tokens of s with at least one pair on node(d).
Stage 2 is `fanout_DD[entry, d]`: pair rows an entry rank forwards to d on its own node (NVLink only).

Token-level routing: every rank's T tokens each pick topk distinct experts from the family's routing
weights p_E (core/workloads.py's, the same hot experts as the count-level families) by sequential
sampling without replacement (Plackett-Luce, the distribution Gumbel-top-k samples), numpy, seeded
per rank, deterministic. Which rank serves a pair follows the runtime's rule for any policy (the
plan's route, runtime/local.py): a rank's pairs in (expert, token) order, cut into the route row's
runs of tok_M pairs, run i to replica rep_M[i]'s rank. Under the stock placement (`none`) that is
the owner, expert e on rank floor(e * D / E).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core.topology import Topology
from ..core.sampling import gumbel_rule, gumbel_topk, skip_excluded
from .rails import SCHEMES, _us, build_schedule, lower_bound_us, resource_loads, simulate_schedule
from .traffic import TrafficError, check_ints, check_policy_slots, family, parse_traffic

MAX_PAIRS = 1 << 26      # token-expert pairs of one token-level sample (2048 ranks x 4096 tokens x top-8)
MIN_WEIGHT = 1e-12       # the topk-th largest routing weight must reach this (relative to the sum)
_TAG = 0x44454450        # "DEDP": the sampler's stream, apart from the count-level sampler's
_CHUNK_PAIRS = 1 << 21   # pairs processed together in dedup_traffic (bounded temporaries)
DEDUP_MODES = ("off", "on", "both")


# -- token-level routing ------------------------------------------------------------------------------------

def routing_weights(skew: str, experts: int, topk: int, seed: int) -> tuple[np.ndarray, int, float]:
    """(p_E float64 [E], hot expert or -1, hot_frac) of a skew at step 0, layer 0: the weights the
    count-level families sample from (core/workloads.py), so both samples share their hot experts."""
    from ..core.workloads import WorkloadError, WorkloadSpec, _routing

    try:
        spec = WorkloadSpec(1, int(experts), int(topk), 0, skew, int(seed))
    except WorkloadError as err:
        raise TrafficError(f"token routing: {err}") from None
    return _routing(spec, 0, 0)


def sample_routing(p_E, num_ranks: int, tokens_per_rank: int, topk: int, seed: int = 0,
                   hot: int = -1, hot_frac: float = 0.0) -> np.ndarray:
    """picks_DT: uint16 [D, T, topk], the topk distinct experts each of rank d's T tokens picks.

    p_E: float [E] non-negative weights (normalized here), shared by all ranks. A token draws its
    experts one by one, each from p_E renormalized over the experts it has not picked yet. hot,
    hot_frac: with hot >= 0 each token's first pick is `hot` with probability hot_frac (the bursty
    and one skews). Rank d draws from its own stream, seeded by (seed, d): deterministic. A top-k that
    core/sampling.py's gumbel_rule names draws the same model by the Gumbel-top-k trick.
    """
    p = np.asarray(p_E, dtype=np.float64)
    E, D, T, k = p.size, int(num_ranks), int(tokens_per_rank), int(topk)
    if p.ndim != 1 or not 1 <= k <= E or E >= 1 << 16 or not np.all(np.isfinite(p)) or p.min() < 0 \
            or p.sum() <= 0:
        raise TrafficError(f"token routing needs 1 <= topk <= experts < 65536 and finite non-negative "
                           f"weights with a positive sum; got topk={k}, experts={E}")
    if np.sort(p)[::-1][k - 1] < MIN_WEIGHT * p.sum():
        raise TrafficError(f"routing weights too concentrated to pick topk={k} distinct experts (lower the skew)")
    cum_end = np.cumsum(p / p.sum())
    cum_end[-1] = 1.0
    w = np.diff(cum_end, prepend=0.0)  # the weights exactly as the cumulative sums hold them
    out = np.empty((D, T, k), dtype=np.uint16)
    for d in range(D):
        rng = np.random.default_rng([int(seed), d, _TAG])
        if gumbel_rule(k, E):  # the same distribution, a key per expert: one by one would redraw ~k^2 times
            forced_T = rng.random(T) < hot_frac if hot >= 0 and hot_frac > 0 else None
            out[d] = gumbel_topk(rng, np.maximum(w, 0.0), k, T, forced_T, hot)  # a rounding's -1e-17: no NaN key
        else:
            out[d] = _sample_rank(rng, w, cum_end, T, k, hot, hot_frac)
    return out


def _sample_rank(rng, w_E, cum_end_E, T: int, topk: int, hot: int, hot_frac: float) -> np.ndarray:
    """int64 [T, topk]: one rank's picks, column by column (see sample_routing)."""
    picks = np.empty((T, topk), dtype=np.int64)
    cum_start_E = cum_end_E - w_E
    for j in range(topk):
        picks[:, j] = _draw_excluding(rng, w_E, cum_start_E, cum_end_E, picks[:, :j])
        if j == 0 and hot >= 0 and hot_frac > 0:
            picks[rng.random(T) < hot_frac, 0] = hot
    return picks


def _draw_excluding(rng, w_E, cum_start_E, cum_end_E, prev) -> np.ndarray:
    """int64 [N]: one draw per row from the weights renormalized over the experts not in prev[n]
    (prev: int64 [N, picks so far], distinct per row). A uniform on [0, 1 - excluded mass) is mapped
    back onto [0, 1) by stepping over the excluded intervals in ascending order; float rounding at an
    interval's edge can still hit an excluded expert, and those rows draw again."""
    out = np.empty(prev.shape[0], dtype=np.int64)
    todo = np.arange(prev.shape[0])
    ex = np.sort(prev, axis=1)
    for _ in range(64):
        wex = w_E[ex]
        u = rng.random(todo.size) * (1.0 - wex.sum(axis=1))
        u = skip_excluded(u, wex.T, cum_start_E[ex].T)
        e = np.minimum(np.searchsorted(cum_end_E, u, side="right"), w_E.size - 1)
        clash = (ex == e[:, None]).any(axis=1)
        out[todo[~clash]] = e[~clash]
        todo, ex = todo[clash], ex[clash]
        if not todo.size:
            return out
    raise TrafficError("could not draw distinct experts: routing weights too concentrated for float64")


def counts_of(picks_DT, num_experts: int) -> np.ndarray:
    """counts_DE int64 [D, E]: pairs of rank d for expert e (the planners' input)."""
    D = picks_DT.shape[0]
    flat = np.arange(D, dtype=np.int64)[:, None] * num_experts + picks_DT.reshape(D, -1)
    return np.bincount(flat.ravel(), minlength=D * num_experts).reshape(D, num_experts)


# -- which rank serves each pair ----------------------------------------------------------------------------

def pair_destinations(picks_DT, plan) -> np.ndarray:
    """dest_DT int32 [D, T, topk]: the rank each pair goes to under `plan` (a core.plan.Plan whose
    counts_DE are counts_of(picks_DT)), by the runtime's rule: rank s's pairs in (expert, token)
    order, cut into its route row's runs (replica ids ascending = expert-major)."""
    picks = np.asarray(picks_DT)
    D, T, k = picks.shape
    ptr, rep_M, tok_M = plan.route
    rank_R = plan.placement.replica_rank_R
    dest = np.empty((D, T * k), dtype=np.int32)  # int32: a 2^26-pair sample stays at 256 MiB
    for s in range(D):
        flat = picks[s].reshape(-1)  # token-major: a stable sort by expert keeps token order
        order = np.argsort(flat, kind="stable")
        row = slice(ptr[s], ptr[s + 1])
        runs = np.repeat(rank_R[rep_M[row]], tok_M[row])
        if runs.size != flat.size:
            raise ValueError(f"plan's route row {s} holds {runs.size} pairs, the routing {flat.size}")
        dest[s, order] = runs
    return dest.reshape(D, T, k)


def entry_rank(src, node, gpus_per_node: int):
    """The rank of `node` that receives src's tokens for that node: node * G + src mod G (the GPU on
    src's rail at src's position within the rail)."""
    return np.asarray(node) * gpus_per_node + np.asarray(src) % gpus_per_node


# -- the deduplicated traffic -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Dedup:
    """Rows (one row = one token's hidden vector) of one dispatch with and without dedup.

    tokens_DD  int64 [D, D]  pair traffic: rows s sends d without dedup (top-k expanded)
    units_DD   int64 [D, D]  stage 1 with dedup: intra-node pairs + distinct tokens to entry ranks
    fanout_DD  int64 [D, D]  stage 2: pair rows entry rank e forwards to d on its node (e != d)
    inter_pairs              inter-node pair rows (sum of tokens_DD over node-crossing (s, d))
    inter_units              distinct (token, remote node) rows (the same sum over units_DD)
    """

    tokens_DD: np.ndarray = field(repr=False)
    units_DD: np.ndarray = field(repr=False)
    fanout_DD: np.ndarray = field(repr=False)
    inter_pairs: int
    inter_units: int

    def figures(self, bytes_per_row: int) -> dict:
        """Inter-node bytes without and with dedup, the share saved, and the fan-out's NVLink bytes."""
        pairs, units = self.inter_pairs * bytes_per_row, self.inter_units * bytes_per_row
        return {"inter_node_bytes_pairs": pairs, "inter_node_bytes_dedup": units,
                "dedup_saving": 1 - units / pairs if pairs else 0.0,
                "fanout_bytes": int(self.fanout_DD.sum()) * bytes_per_row}


def dedup_traffic(dest_DT, gpus_per_node: int) -> Dedup:
    """Pair, stage-1 and fan-out traffic of a routing whose pairs go to ranks dest_DT (int [D, T, topk])."""
    dest_all = np.asarray(dest_DT)
    D, T, k = dest_all.shape
    G = int(gpus_per_node)
    if D % G:
        raise ValueError(f"{D} ranks are not whole nodes of {G}")
    tokens, units, fan = (np.zeros(D * D, dtype=np.int64) for _ in range(3))
    inter_pairs = inter_units = 0
    step = max(1, _CHUNK_PAIRS // max(T * k, 1))
    for s0 in range(0, D, step):
        d = dest_all[s0:s0 + step].astype(np.int64)              # [ranks of the chunk, T, topk]
        s = np.arange(s0, s0 + d.shape[0], dtype=np.int64)[:, None, None]
        node = d // G
        remote = node != s // G
        # the first pair of each (token, node): no earlier pick of the token lands on that node
        first = np.ones(d.shape, dtype=bool)
        for j in range(1, k):
            first[..., j] = ~(node[..., :j] == node[..., j:j + 1]).any(axis=-1)
        entry = entry_rank(s, node, G)
        tokens += np.bincount((s * D + d).ravel(), minlength=D * D)
        units += np.bincount(np.where(remote, s * D + entry, s * D + d)[~remote | first], minlength=D * D)
        hop = remote & (d != entry)
        fan += np.bincount((entry * D + d)[hop], minlength=D * D)
        inter_pairs += int(remote.sum())
        inter_units += int((remote & first).sum())
    out = [a.reshape(D, D) for a in (tokens, units, fan)]
    for a in out:
        a.setflags(write=False)
    return Dedup(*out, inter_pairs, inter_units)


# -- a family's token-level traffic -------------------------------------------------------------------------

@dataclass(frozen=True)
class TokenTraffic:
    """A family's token-level sample on D ranks (nodes of gpus_per_node): its Dedup and how rows become bytes."""

    family: str
    dedup: Dedup
    gpus_per_node: int
    hidden: int
    dtype_bytes: int
    experts: int
    topk: int
    tokens_per_rank: int
    skew: str
    policy: str
    seed: int

    @property
    def num_ranks(self) -> int:
        return self.dedup.tokens_DD.shape[0]

    @property
    def bytes_per_token(self) -> int:
        return self.hidden * self.dtype_bytes

    def describe(self) -> dict:
        return {"traffic": self.family, "routing": "token-level sample", "ranks": self.num_ranks,
                "experts": self.experts, "topk": self.topk, "hidden": self.hidden, "dtype_bytes": self.dtype_bytes,
                "tokens_per_rank": self.tokens_per_rank, "skew": self.skew, "policy": self.policy,
                "seed": self.seed, "total_bytes": int(self.dedup.tokens_DD.sum()) * self.bytes_per_token
                } | self.dedup.figures(self.bytes_per_token)


def token_traffic(text: str, num_ranks: int, ranks_per_node: int = 8, *, tokens_per_rank: int = 4096,
                  hidden: int | None = None, dtype_bytes: int = 2, experts: int | None = None,
                  topk: int | None = None, seed: int = 0, slots: int = 1) -> TokenTraffic:
    """The token-level sample of family `text` (arguments as sim.traffic.make_traffic) and its dedup.

    The `uniform` family samples uniform routing under stock placement; every other family samples its
    skew and routes by its policy's plan of the sample's counts (stock placement for `none`).
    """
    parse_traffic(text)
    check_ints(num_ranks=(num_ranks, 1), ranks_per_node=(ranks_per_node, 1), tokens_per_rank=(tokens_per_rank, 0),
               dtype_bytes=(dtype_bytes, 1), seed=(seed, 0), slots=(slots, 0), hidden=(hidden, 1),
               experts=(experts, 1), topk=(topk, 1))
    D, T, G = int(num_ranks), int(tokens_per_rank), min(int(ranks_per_node), int(num_ranks))
    fam = family(text, D, hidden=hidden, experts=experts, topk=topk)
    skew, policy = (fam.skew, fam.policy) if fam.kind != "uniform" else ("uniform", "none")
    if D * T * fam.topk > MAX_PAIRS:
        raise TrafficError(f"token dedup samples every token: ranks x tokens per rank x topk = {D} x {T} x "
                           f"{fam.topk} exceeds {MAX_PAIRS} pairs (lower --tokens-per-rank)")
    from ..core.planners import PlannerConfig, make_planner

    check_policy_slots(text, policy, slots)
    planner = make_planner(policy, PlannerConfig(D, fam.experts, G, int(slots)))  # its config errors before sampling
    p_E, hot, frac = routing_weights(skew, fam.experts, fam.topk, int(seed))
    picks = sample_routing(p_E, D, T, fam.topk, int(seed), hot, frac)
    plan, _ = planner.plan(counts_of(picks, fam.experts))
    dd = dedup_traffic(pair_destinations(picks, plan), G)
    return TokenTraffic(fam.canon, dd, G, fam.hidden, int(dtype_bytes), fam.experts, fam.topk, T, skew, policy,
                        int(seed))


# -- simulation: stage 1 by every scheme, stage 2 over NVLink ---------------------------------------------------

def _fanout_terms(fanout_DD, bytes_per_row: int) -> tuple[np.ndarray, np.ndarray]:
    """(bytes out of, bytes into) every GPU's NVLink port in the fan-out: float64 [D] each."""
    fan = np.asarray(fanout_DD, dtype=np.float64) * bytes_per_row
    return fan.sum(axis=1), fan.sum(axis=0)


def fanout_times(sch, res, fanout_DD, bytes_per_row: int) -> tuple[float, float, float]:
    """(end_to_end_us, phased_end_to_end_us, fanout_us) of a stage-1 schedule `sch` (SimResult `res`)
    followed by the fan-out (see with_fanout); the one pricing of the fan-out, `simulate run`'s too."""
    t = sch.topo
    out_D, in_D = _fanout_terms(fanout_DD, bytes_per_row)
    loads = resource_loads(sch, bytes_per_row)
    busiest = max(float(np.max(_us(loads.nic_out_VJ, t.nic_gbps), initial=0.0)),
                  float(np.max(_us(loads.nic_in_VJ, t.nic_gbps), initial=0.0)),
                  float(np.max(_us(loads.nvl_out_D + out_D, t.nvlink_gbps), initial=0.0)),
                  float(np.max(_us(loads.nvl_in_D + in_D, t.nvlink_gbps), initial=0.0)))
    moves = bool(out_D.any())
    fan_us = (max(float(np.max(_us(out_D, t.nvlink_gbps), initial=0.0)),
                  float(np.max(_us(in_D, t.nvlink_gbps), initial=0.0))) + t.latency_us) if moves else 0.0
    e2e = busiest + t.latency_us * (loads.hops + moves) if (moves or loads.hops) else 0.0
    return e2e, res.phased_us + fan_us, fan_us


def with_fanout(sch, res, fanout_DD, bytes_per_row: int) -> dict:
    """End-to-end figures of a stage-1 schedule `sch` (SimResult `res`) followed by the fan-out.

    end_to_end_us: the same fluid, pipelined model with the fan-out's NVLink bytes added to every
    GPU's NVLink ports (a token is forwarded as it arrives) and one more hop; phased_end_to_end_us:
    the three stage-1 phases, then the fan-out as a fourth (busiest NVLink port + one latency);
    fanout_us: that fourth phase alone; lower_bound_end_to_end_us: the lower bound of stage 1 and
    stage 2 together (the fan-out counts as intra-node traffic)."""
    e2e, phased, fan_us = fanout_times(sch, res, fanout_DD, bytes_per_row)
    moves = bool(np.asarray(fanout_DD).any())
    both = np.asarray(sch.traffic_DD, dtype=np.float64) + np.asarray(fanout_DD, dtype=np.float64)
    return {"fanout_us": fan_us, "end_to_end_us": e2e, "phased_end_to_end_us": phased,
            "lower_bound_end_to_end_us": lower_bound_us(both * bytes_per_row, sch.topo)[0] if moves
            else res.lower_bound_us}


def simulate_dedup(tt: TokenTraffic, topo: Topology, schemes=SCHEMES, modes=("pairs", "dedup")) -> list[dict]:
    """One dict per (mode, scheme): the scheme's SimResult on the pair traffic (mode "pairs") or on the
    stage-1 units (mode "dedup", then the fan-out: `with_fanout`), with inter_node_bytes (what crosses
    nodes) and speedup_over_pairs (the same scheme's pair-traffic completion / this end-to-end - 1)."""
    dd, bpr = tt.dedup, tt.bytes_per_token
    topo = topo.for_world(tt.num_ranks)
    if topo.gpus_per_node != tt.gpus_per_node:  # the entry ranks and the fan-out were cut at the sample's nodes
        raise ValueError(f"the sample has nodes of {tt.gpus_per_node} ranks, topology {topo.name!r} of "
                         f"{topo.gpus_per_node}")
    none = np.zeros_like(dd.fanout_DD)
    pair_t = {}
    rows = []
    for mode in ("pairs", "dedup"):
        traffic, fan = (dd.tokens_DD, none) if mode == "pairs" else (dd.units_DD, dd.fanout_DD)
        lb = lower_bound_us(traffic.astype(np.float64) * bpr, topo)
        for scheme in schemes:
            sch = build_schedule(scheme, traffic, topo)
            res = simulate_schedule(sch, scheme, bpr, lb)
            row = {"mode": mode, "dedup": mode == "dedup"} | res.to_dict() | with_fanout(sch, res, fan, bpr)
            row["inter_node_bytes"] = (dd.inter_pairs if mode == "pairs" else dd.inter_units) * bpr
            row["fanout_bytes"] = int(fan.sum()) * bpr
            pair_t.setdefault(scheme, row["end_to_end_us"])
            row["speedup_over_pairs"] = pair_t[scheme] / row["end_to_end_us"] - 1 if row["end_to_end_us"] else 0.0
            if mode in modes:
                rows.append(row)
    return rows
