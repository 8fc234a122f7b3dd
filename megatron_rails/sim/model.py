"""Analytic cost model of one MoE transformer layer and one microbatch, per policy and comm scheme.

Shape legend:  D expert-parallel ranks   E experts   Y layers   H hidden   F expert FFN width
               (spelled out: seq sequence length, vocab vocabulary size, top-k, groups query groups,
               heads attention heads)

Everything is per GPU and in milliseconds; a training microbatch is forward + backward.

FLOPs (a GEMM of [m, k] x [k, n] is 2mkn; backward = 2 x forward):
  expert    SwiGLU: 3 GEMMs of H x F per routed token (gate, up, down): 6HF forward per token-expert
            pair (2 GEMMs, 4HF, without SwiGLU). Time = max over EP ranks of the tokens the rank computes
            (plan.load_D) x 6HF x 3 / (gpu_tflops x mfu). The slowest rank sets the layer's pace.
  dense     attention + router per token per layer, forward: QKV 2H(H + 2H groups/heads), output 2H^2,
            core 2 seq H (QK^T and AV, 4 seq H, halved for the causal mask), router 2HE; x 3 for
            training, divided by TP; the LM head 2H vocab per token sits on the last pipeline stage.
            Norms, RoPE, softmax, activations and the loss are not counted. Same for every policy.
  recompute selective: the attention core runs forward once more; full: every forward runs twice
            (and with it the MoE layer's planner, weight fetch and dispatch/combine all-to-alls).

Communication (megatron_rails.sim.rails, the fluid model by default, `phased` on request) on the
EP group's slice of the topology (`ep_topology`); `rails` follows the dispatcher's rule and sends an
exchange direct when its rail-matched direct all-to-all is within the policy's rails_tolerance of even
rails (`CommModel`):
  tokens    dispatch sends plan.send_DD rows of H x 2 bytes (bf16), combine the transpose; backward
            repeats both in reverse: (forward passes + 1) x (t(send) + t(send^T)) per microbatch.
  dedup     (`SimOptions.dedup`, on by default like the policy key `dedup`; only when the EP group
            spans nodes) the runtime's two stages (runtime/dedup.py): stage 1 keeps the rows inside
            the sender's node and sends each token ONCE to every remote node b holding one of its
            pairs, to the entry rank b * G + s mod G (s's rail: rail-matched); stage 2 forwards it from
            the entry over NVLink to every rank of b serving one of its pairs, a row per pair (none
            for pairs the entry serves). The combine runs the reverse (the entry sums a token's
            outputs). Timed as `simulate a2a --dedup` times it: fluid, the fan-out's bytes join the
            NVLink ports of stage 1's flow model plus one hop's latency; phased, a fourth phase.
            Stage 1's rows to b are E[distinct tokens with a pair on b], from an analytic model, not
            sampled (`distinct_ratio_DV`): each token of rank s picks its topk experts as independent
            Bernoulli draws with p_e = counts_DE[s, e] / T_s conditioned on exactly topk picks (the
            conditional Poisson design: the maximum-entropy choice of topk distinct experts at these
            per-expert rates), and a pair goes to node b with the share of (s, e)'s rows the plan's
            route sends there; generating functions give P(>= 1 pair on b) / E[pairs on b] exactly
            under that model, and the plan's real pair rows to b times that ratio are the distinct
            rows (so topk = 1 changes no byte, and dedup never adds one).
  weights   owner layout (eplb, ultraep, lp): every replica with tokens that is not an owner copy is
            fetched whole from its owner (3HF x 2 bytes); its gradient returns the same way, in fp32
            (4 bytes: Megatron accumulates and reduces gradients in fp32 under bf16, and the dispatcher
            accumulates and returns slot gradients in the framework's gradient dtype).
            Sharded layout (fsep): every slot with tokens gathers the 1/D shard of its expert from each
            other rank (the forward all-gather) and returns the gradient shards (the backward
            reduce-scatter). Weights move in 1 MiB units, so RailS can spray them. `--weight-sync
            iteration` (default) moves them once per iteration, keeps them for all its microbatches
            and returns the gradients once, as our dispatcher's resident slots do (owner weights only
            change at the optimizer step). `microbatch` fetches them and returns the gradients every
            microbatch (and again for each recomputed forward): what a dispatcher without resident
            slots would do.
  planner   the measured median wall time of planner.plan on the simulated counts (this machine's
            CPU), once per forward pass; the counts all-gather is not modeled.

Overlap: `none` (default) serializes everything, as megatron-rails' dispatcher executes today (the plan
needs the current counts, so weights move after the router). `weights` hides weight movement behind
the same layer's dense compute, up to its duration: what a history-based planner (LAER-MoE) could
reach by prefetching.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from .rails import build_schedule, simulate_schedule
from ..core.compiled import compiled
from ..core.errors import InputError, shown
from ..core.topology import Topology

OVERLAPS = ("none", "weights")
WEIGHT_SYNCS = ("iteration", "microbatch")
A2A_MODELS = ("fluid", "phased")
CHUNK_BYTES = 1 << 20  # unit of weight traffic (1 MiB)


class SimError(InputError):
    """The simulator cannot model this configuration or input."""


MIN_MFU = 0.001  # 0.1% of peak: anything slower is a typo, not a GPU
MAX_VALUE_BYTES = 16  # SimOptions.dtype_bytes / grad_bytes: fp64 is 8; anything past 16 is a typo


@dataclass(frozen=True)
class SimOptions:
    mfu: float = 0.5              # achieved / peak dense bf16 FLOP rate, for every GEMM
    overlap: str = "none"         # none | weights
    a2a_model: str = "fluid"      # fluid | phased (megatron_rails.sim.rails)
    weight_sync: str = "iteration"  # iteration (resident for the step) | microbatch
    dtype_bytes: int = 2          # activations and weights (bf16)
    grad_bytes: int = 4           # returned weight gradients: fp32, Megatron's gradient dtype under bf16
    dedup: bool = True            # a token crosses to a remote node once (policy key `dedup`)

    def __post_init__(self):
        # numpy scalars (a sweep's np.linspace, np.True_) as the built-in values they stand for, so that
        # results, equality and JSON output treat them alike (as PolicyConfig does)
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            plain = bool(v) if isinstance(v, np.bool_) else int(v) if isinstance(v, np.integer) else \
                float(v) if isinstance(v, np.floating) else str(v) if isinstance(v, np.str_) else v
            if plain is not v:
                object.__setattr__(self, f.name, plain)
        mfu = self.mfu
        if isinstance(mfu, bool) or not isinstance(mfu, (int, float)) or not MIN_MFU <= mfu <= 1:
            # below MIN_MFU, absurd times (300-digit table cells at 1e-300)
            raise SimError(f"--mfu must be a number in [{MIN_MFU}, 1], got {shown(mfu)}")
        for key, flag, choices in (("overlap", "--overlap", OVERLAPS), ("weight_sync", "--weight-sync", WEIGHT_SYNCS),
                                   ("a2a_model", "--a2a-model", A2A_MODELS)):
            v = getattr(self, key)
            if not isinstance(v, str) or v not in choices:
                raise SimError(f"{flag} must be one of {', '.join(choices)}, got {shown(v)}")
        for key, what in (("dtype_bytes", "bytes per activation and weight value"),
                          ("grad_bytes", "bytes per returned gradient value")):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_VALUE_BYTES:
                raise SimError(f"{key} must be a positive integer ({what}, at most {MAX_VALUE_BYTES}), got {shown(v)}")
        if not isinstance(self.dedup, bool):
            raise SimError(f"--dedup must be on or off (True or False), got {shown(self.dedup)}")


def ep_topology(topo: Topology, ep: int, ep_per_node: int) -> Topology:
    """The slice of `topo` one EP group's all-to-all runs on: `ep_per_node` members per node, each on
    its own share of the node's rails (the other EP groups of the node use the remaining rails at the
    same time), ep / ep_per_node nodes."""
    g = int(ep_per_node)
    if ep % g:
        raise SimError(f"expert-parallel size {ep} is not a multiple of its {g} members per node")
    rails = max(1, topo.rails_per_node * g // topo.gpus_per_node)
    while g % rails:
        rails -= 1
    return dataclasses.replace(topo, name=f"{topo.name}/EP{ep}", gpus_per_node=g, rails_per_node=rails,
                               nodes=ep // g)


@dataclass(frozen=True)
class Setup:
    """What the model needs from a run config (see `from_run_config`)."""

    name: str
    layers: int
    hidden: int
    ffn: int                   # expert FFN width
    heads: int
    query_groups: int
    seq: int
    vocab: int
    experts: int
    topk: int
    swiglu: bool
    tp: int
    pp: int
    cp: int
    ep: int
    etp: int
    dp: int
    micro_batch: int
    global_batch: int
    recompute: str             # "", selective, full
    topology: Topology         # the whole cluster
    ep_topo: Topology          # one EP group's slice
    ep_per_node: int
    policy: object             # PolicyConfig: slots, window, interval, placement for every policy

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def tokens_per_rank(self) -> int:
        """Tokens one EP rank routes per microbatch (sequence parallel over TP, split over CP)."""
        return self.micro_batch * self.seq // (self.tp * self.cp)

    @property
    def fwd_passes(self) -> int:
        return 2 if self.recompute == "full" else 1

    @property
    def expert_flops_per_token(self) -> float:
        """Forward FLOPs of one token through one expert."""
        return 2.0 * (3 if self.swiglu else 2) * self.hidden * self.ffn

    @property
    def expert_bytes(self) -> int:
        return (3 if self.swiglu else 2) * self.hidden * self.ffn

    def dense_flops_per_token(self) -> float:
        """Training FLOPs (fwd + bwd + recompute) of one token through one layer's attention and
        router, on one GPU (divided by TP)."""
        H, s = self.hidden, self.seq
        kv = H * self.query_groups / self.heads
        core = 2.0 * s * H
        fwd = 2.0 * H * (H + 2 * kv) + 2.0 * H * H + core + 2.0 * H * self.experts
        extra = fwd if self.recompute == "full" else core if self.recompute == "selective" else 0.0
        return (3 * fwd + extra) / self.tp

    def head_flops_per_token(self) -> float:
        return (3 + (self.recompute == "full")) * 2.0 * self.hidden * self.vocab / self.tp

    @classmethod
    def from_run_config(cls, rc, slots: int | None = None) -> "Setup":
        from ..core.policy import MAX_SLOTS, PolicyConfig
        from ..config.checks import ep_ranks_per_node
        from ..config.run import RunConfig

        if not isinstance(rc, RunConfig):
            raise SimError(f"rc must be a RunConfig (config.run.load_run_config), got {type(rc).__name__}")
        if slots is not None:
            if isinstance(slots, np.integer):
                slots = int(slots)
            if isinstance(slots, bool) or not isinstance(slots, int) or not 0 <= slots <= MAX_SLOTS:
                raise SimError(f"slots must be an integer in [0, {MAX_SLOTS}] (redundant slots per rank) or None "
                               f"(the config's balancer), got {shown(slots)}")
        m, p, t = rc.model, rc.parallelism, rc.training
        etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
        G_ep = ep_ranks_per_node(rc.topology.gpus_per_node, p.expert_model_parallel_size, etp)
        base = rc.balancer or PolicyConfig(slots=1)
        base = dataclasses.replace(base, ranks_per_node=G_ep, slots=base.slots if slots is None else slots)
        dp = rc.data_parallel_size
        gbs = t.global_batch_size or t.micro_batch_size * dp
        if p.tensor_model_parallel_size * p.context_parallel_size > t.micro_batch_size * m.seq_length:
            raise SimError("fewer tokens per microbatch than tensor x context parallel ranks")
        return cls(
            name=rc.source or rc.description, layers=m.num_layers, hidden=m.hidden_size,
            ffn=m.moe_ffn_hidden_size or m.ffn_hidden_size, heads=m.num_attention_heads,
            query_groups=m.num_query_groups or m.num_attention_heads, seq=m.seq_length,
            vocab=rc.data.vocab_size or 32000, experts=m.num_experts, topk=m.moe_router_topk, swiglu=m.swiglu,
            tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size, cp=p.context_parallel_size,
            ep=p.expert_model_parallel_size, etp=etp, dp=dp, micro_batch=t.micro_batch_size, global_batch=gbs,
            recompute=t.recompute_granularity or "", topology=rc.topology,
            ep_topo=ep_topology(rc.topology, p.expert_model_parallel_size, G_ep), ep_per_node=G_ep, policy=base)

    def describe(self) -> dict:
        out = {k: getattr(self, k) for k in ("name", "layers", "hidden", "ffn", "heads", "query_groups", "seq",
                                             "vocab", "experts", "topk", "swiglu", "tp", "pp", "cp", "ep", "etp",
                                             "dp", "micro_batch", "global_batch", "recompute", "ep_per_node")}
        out |= {"microbatches": self.microbatches, "tokens_per_rank": self.tokens_per_rank,
                "slots": self.policy.slots, "topology": self.topology.name, "nodes": self.topology.nodes,
                "gpu_tflops": self.topology.gpu_tflops, "ep_nodes": self.ep_topo.nodes,
                "ep_rails_per_node": self.ep_topo.rails_per_node, "expert_bytes": self.expert_bytes * 2}
        return out


class CommModel:
    """All-to-all time (ms) of traffic matrices on one EP topology, memoized by content.

    rails_tolerance: None prices `rails` as RailS's spraying schedule always; a number applies the
    dispatcher's rule (runtime/comm/rails.py, the policy's `rails_tolerance`): an exchange whose
    rail-matched direct all-to-all loads its busiest rail at most 1 + tolerance times the even spread
    is sent direct, so it is priced as `direct`."""

    def __init__(self, topo: Topology, a2a_model: str = "fluid", rails_tolerance: float | None = None):
        self.topo, self.model, self.rails_tolerance = topo, a2a_model, rails_tolerance
        self._cache: dict = {}

    def _scheme(self, scheme: str, traffic: np.ndarray) -> str:
        if scheme != "rails" or self.rails_tolerance is None:
            return scheme
        from ..core.rails_schedule import rail_imbalance

        return "direct" if rail_imbalance(traffic, self.topo) <= 1.0 + self.rails_tolerance else scheme

    def ms(self, units_DD: np.ndarray, bytes_per_unit: int, scheme: str, fan_DD=None) -> float:
        """Completion of the exchange `units_DD` under `scheme`; with `fan_DD` (node dedup's stage 2,
        rows inside nodes) followed by that fan-out, as `simulate a2a --dedup` prices it: fluid, the
        fan-out's bytes join every GPU's NVLink ports (a token is forwarded as it arrives) and the path
        one more hop; phased, the fan-out is a phase of its own (busiest NVLink port + one latency)."""
        traffic = np.ascontiguousarray(units_DD, dtype=np.int64)
        off = traffic.copy()
        np.fill_diagonal(off, 0)
        fan = None if fan_DD is None else np.ascontiguousarray(fan_DD, dtype=np.int64)
        if fan is not None and not fan.any():
            fan = None
        if fan is None and not off.any():
            return 0.0
        if self.topo.nodes == 1 and fan is None:  # every message is one NVLink hop: the closed form
            return self.nvlink_ms(off, bytes_per_unit)
        key = (scheme, int(bytes_per_unit), traffic.shape, traffic.tobytes(), None if fan is None else fan.tobytes())
        hit = self._cache.get(key)
        if hit is None:
            scheme = self._scheme(scheme, traffic)
            sch = build_schedule(scheme, traffic, self.topo)
            r = simulate_schedule(sch, scheme, int(bytes_per_unit), (0.0, "-"))
            us = r.completion_us if self.model == "fluid" else r.phased_us
            if fan is not None:  # priced as `simulate a2a --dedup` prices it
                from .dedup import fanout_times

                e2e, phased, _ = fanout_times(sch, r, fan, int(bytes_per_unit))
                us = e2e if self.model == "fluid" else phased
            hit = self._cache[key] = us / 1e3
        return hit

    def nvlink_ms(self, units_DD: np.ndarray, bytes_per_unit: int) -> float:
        """Time of traffic that stays inside nodes, every message one NVLink hop: the flow model's closed
        form, the busiest NVLink port's bytes / nvlink_gbps + one latency (fluid and phased alike: one
        phase carries it all)."""
        off = np.array(units_DD, dtype=np.int64)
        np.fill_diagonal(off, 0)
        if not off.any():
            return 0.0
        busiest = max(int(off.sum(axis=1).max()), int(off.sum(axis=0).max())) * float(bytes_per_unit)
        return (busiest * 8.0 / (self.topo.nvlink_gbps * 1e3) + self.topo.latency_us) / 1e3


# -- node dedup (issue #17) -------------------------------------------------------------------------------------

_DISTINCT_PAIRS = compiled("megatron_rails.sim._dedup_c", "distinct_pairs")  # None: the numpy loop below


def distinct_ratio_DV(counts_DE, rows_DEV, topk: int, compiled: bool = True) -> np.ndarray:
    """float64 [D, V]: for the tokens of source rank s, E[tokens with >= 1 pair on node b] / E[pairs on b],
    in [0, 1] (1 where s sends b nothing). Analytic, no sampling (the module docstring's model): a token
    picks each expert e independently with p_e = counts_DE[s, e] / T_s (T_s = the row's sum / topk,
    clipped to [0, 1]), conditioned on exactly topk picks; a picked expert's pair goes to node b with
    probability f_eb = rows_DEV[s, e, b] / counts_DE[s, e] (the share the plan's route sends there).

    With z counting picks, the coefficients of z^topk of
        A(z) = prod_e (1 - p_e + p_e z)                          P(topk picks)
        B(z) = prod_e (1 - p_e + p_e (1 - f_eb) z)                P(topk picks, none on b)
        C(z) = sum_e p_e f_eb z prod_{j != e} (1 - p_j + p_j z)   E[pairs on b; topk picks]
    give the ratio (A - B) / C: one pass over the experts, polynomials truncated at degree topk, all
    terms non-negative, vectorized over (s, b). The union bound (A - B <= C) keeps it <= 1, and with
    topk = 1 it is 1 (A - B = C). The loop over the experts runs compiled where built (sim/_dedup_c.c,
    bit-identical); compiled=False forces the numpy loop."""
    c = np.asarray(counts_DE, dtype=np.float64)
    rows = np.asarray(rows_DEV, dtype=np.float64)
    D, E = c.shape
    V = rows.shape[2]
    k = int(topk)
    T = c.sum(axis=1) / k
    with np.errstate(divide="ignore", invalid="ignore"):
        p_DE = np.clip(np.where(T[:, None] > 0, c / T[:, None], 0.0), 0.0, 1.0)
        f_DEV = np.where(c[:, :, None] > 0, rows / c[:, :, None], 0.0)
    used = np.flatnonzero(p_DE.any(axis=0))
    # expert-major, degree-major layouts: every step below works on contiguous [D, V] planes
    p_ED = np.ascontiguousarray(p_DE[:, used].T)[:, :, None]                               # [E', D, 1]
    pf_EDV = np.ascontiguousarray((p_DE[:, :, None] * f_DEV)[:, used].transpose(1, 0, 2))  # [E', D, V]
    q_ED, pb_EDV = 1.0 - p_ED, p_ED - pf_EDV
    if compiled and _DISTINCT_PAIRS is not None:
        distinct, pairs = np.empty((D, V)), np.empty((D, V))
        _DISTINCT_PAIRS(p_ED[:, :, 0], q_ED[:, :, 0], pf_EDV, pb_EDV, used.size, D, V, k, distinct, pairs)
    else:
        distinct, pairs = _polynomials(p_ED, q_ED, pf_EDV, pb_EDV, k)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(pairs > 0, distinct / pairs, 1.0)
    return np.clip(ratio, 0.0, 1.0)


def _polynomials(p_ED, q_ED, pf_EDV, pb_EDV, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(A[k] - B[k], C[k]), float64 [D, V] each: distinct_ratio_DV's polynomials multiplied out, one
    expert's factor at a time (p_ED, q_ED: [E', D, 1]; pf_EDV, pb_EDV: [E', D, V])."""
    D, V = pf_EDV.shape[1:]
    A = np.zeros((k + 1, D, 1))
    A[0] = 1.0
    B = np.zeros((k + 1, D, V))
    B[0] = 1.0
    C = np.zeros((k + 1, D, V))
    tmp, tmp_a = np.empty((k, D, V)), np.empty((k, D, 1))
    for i in range(p_ED.shape[0]):  # multiply every polynomial by expert i's factor (old values into tmp first)
        p, q = p_ED[i], q_ED[i]
        np.multiply(C[:-1], p, out=tmp)
        tmp += A[:-1] * pf_EDV[i]
        C *= q
        C[1:] += tmp
        np.multiply(B[:-1], pb_EDV[i], out=tmp)
        B *= q
        B[1:] += tmp
        np.multiply(A[:-1], p, out=tmp_a)
        A *= q
        A[1:] += tmp_a
    return A[k] - B[k], C[k]


def route_rows_DEV(plan, ranks_per_node: int) -> np.ndarray:
    """float64 [D, E, V]: the rows source rank s sends for expert e to node b under the plan's route."""
    p = plan.placement
    D, E = p.num_ranks, p.num_experts
    V = D // ranks_per_node
    ptr, rep, tok = plan.route
    src = np.repeat(np.arange(D), np.diff(ptr))
    flat = (src * E + p.replica_expert_R[rep]) * V + p.replica_rank_R[rep] // ranks_per_node
    return np.bincount(flat, weights=tok, minlength=D * E * V).reshape(D, E, V)


@dataclass(frozen=True)
class LayerTraffic:
    """One dispatch's token rows (the combine is the transpose), as priced: `net_DD` through the
    all-to-all model, then `fan_DD` (inside nodes) on NVLink. Without dedup net_DD is send_DD and
    fan_DD is empty. `inter_rows`: rows crossing nodes without dedup (pairs); `inter_rows_dedup`: with
    dedup (distinct (token, remote node) pairs, expected, rounded per (s, b)); `fan_rows`: NVLink fan-out
    rows with dedup."""

    net_DD: np.ndarray
    fan_DD: np.ndarray
    dedup: bool
    inter_rows: int
    inter_rows_dedup: int
    fan_rows: int


def entry_DV(D: int, G: int) -> np.ndarray:
    """int64 [D, V]: the entry rank on node b of rank s's tokens, b * G + s mod G: the GPU with s's
    place in the node, on s's rail (runtime/dedup.py's rule)."""
    from .dedup import entry_rank

    return entry_rank(np.arange(D)[:, None], np.arange(D // G)[None, :], G)


def token_traffic(send_DD, ratio_DV, ranks_per_node: int, dedup: bool) -> LayerTraffic:
    """The exchange of `send_DD` (int [D, D] pair rows) with or without node dedup (module docstring);
    ratio_DV: distinct_ratio_DV of the same route (None: one node, nothing to dedup).

    With dedup, stage 1 (`net_DD`) keeps the rows inside the sender's node and sends, per remote node b,
    round(ratio_sb x the pair rows to b) distinct tokens to the entry rank entry(s, b); stage 2
    (`fan_DD`) forwards every pair row to b from that entry to the rank serving it, over NVLink (a pair
    the entry serves itself moves no further): the runtime's two stages (runtime/dedup.py)."""
    send = np.asarray(send_DD, dtype=np.int64)
    D, G = send.shape[0], int(ranks_per_node)
    V = D // G
    node = np.arange(D) // G
    remote = node[:, None] != node[None, :]
    inter = int(send[remote].sum())
    if ratio_DV is None or V == 1:
        return LayerTraffic(send, np.zeros_like(send), dedup, inter, inter, 0)
    distinct_DV = np.rint(send.reshape(D, V, G).sum(axis=2) * np.minimum(ratio_DV, 1.0)).astype(np.int64)
    distinct_DV[np.arange(D), node] = 0
    s_idx, d_idx = np.nonzero(remote & (send > 0))
    entry = entry_DV(D, G)
    fan = np.zeros_like(send)
    np.add.at(fan, (entry[s_idx, node[d_idx]], d_idx), send[s_idx, d_idx])
    np.fill_diagonal(fan, 0)  # pairs the entry serves itself
    deduped, fanned = int(distinct_DV.sum()), int(fan.sum())
    if not dedup:
        return LayerTraffic(send, np.zeros_like(send), False, inter, deduped, fanned)
    net = np.where(remote, 0, send)
    net[np.arange(D)[:, None], entry] += distinct_DV
    return LayerTraffic(net, fan, True, inter, deduped, fanned)


def plan_traffic(setup: Setup, opts: SimOptions, plan) -> LayerTraffic:
    """The token traffic of a plan (the dedup figures are computed with dedup on or off, for the report)."""
    G = setup.ep_topo.gpus_per_node
    if setup.ep_topo.nodes == 1:
        return token_traffic(plan.send_DD, None, G, opts.dedup)
    ratio = distinct_ratio_DV(plan.counts_DE, route_rows_DEV(plan, G), setup.topk)
    return token_traffic(plan.send_DD, ratio, G, opts.dedup)


def balanced_send_DD(counts_DE) -> np.ndarray:
    """int64 [D, D]: every rank sends each rank an equal share of its rows (the force-balanced router)."""
    c = np.asarray(counts_DE, dtype=np.int64)
    D = c.shape[0]
    rows_D = c.sum(axis=1)
    return (rows_D[:, None] // D + (np.arange(D)[None, :] < (rows_D % D)[:, None])).astype(np.int64)


def balanced_traffic(setup: Setup, opts: SimOptions, counts_DE) -> LayerTraffic:
    """The force-balanced ideal's token traffic: every rank's tokens pick the experts uniformly (p_e =
    topk / E), expert e is served by the ranks [eD/E, (e+1)D/E), so its pairs go to the nodes those ranks
    sit on; the rows to each rank are the equal shares of `balanced_send_DD`."""
    send = balanced_send_DD(counts_DE)
    G, D, E = setup.ep_topo.gpus_per_node, send.shape[0], setup.experts
    if setup.ep_topo.nodes == 1:
        return token_traffic(send, None, G, opts.dedup)
    V = D // G
    lo, hi = np.arange(E) * D / E, np.arange(1, E + 1) * D / E  # expert e's span of ranks
    b_lo, b_hi = np.arange(V) * G, np.arange(1, V + 1) * G
    share_EV = np.clip(np.minimum(hi[:, None], b_hi[None, :]) - np.maximum(lo[:, None], b_lo[None, :]), 0, None)
    share_EV /= share_EV.sum(axis=1, keepdims=True)
    rows_D = send.sum(axis=1).astype(np.float64)
    counts = np.repeat(rows_D[:, None] / E, E, axis=1)
    ratio = distinct_ratio_DV(counts, counts[:, :, None] * share_EV[None], setup.topk)
    return token_traffic(send, ratio, G, opts.dedup)


def weight_units_DD(plan, expert_bytes: int) -> tuple[np.ndarray, int]:
    """(int64 [D, D] weight traffic in CHUNK_BYTES units of the forward fetch, bytes it moves)."""
    from ..core.plan import SHARDED

    p = plan.placement
    D = p.num_ranks
    weights_DD = np.zeros((D, D), dtype=np.int64)
    moved = p.is_moved_R & (plan.quota_R > 0)
    if p.layout == SHARDED:
        shard = -(-expert_bytes // D)
        units = -(-shard // CHUNK_BYTES)
        slots_D = np.bincount(p.replica_rank_R[moved], minlength=D)
        weights_DD += slots_D[None, :] * units
        np.fill_diagonal(weights_DD, 0)
        return weights_DD, int(slots_D.sum()) * (D - 1) * shard
    units = -(-expert_bytes // CHUNK_BYTES)
    owner = (p.replica_expert_R * D) // p.num_experts  # owner_of_experts
    np.add.at(weights_DD, (owner[moved], p.replica_rank_R[moved]), units)
    return weights_DD, int(moved.sum()) * expert_bytes


def _traffic_figures(setup: Setup, opts: SimOptions, tr: LayerTraffic) -> dict:
    tok = setup.hidden * opts.dtype_bytes
    return {"internode_bytes": tr.inter_rows * tok, "internode_bytes_dedup": tr.inter_rows_dedup * tok,
            "fanout_bytes": tr.fan_rows * tok}


def layer_cost(setup: Setup, opts: SimOptions, plan, comm: CommModel, scheme: str,
               traffic: LayerTraffic | None = None) -> dict:
    """Milliseconds of one MoE layer for one microbatch (forward + backward) on its slowest rank,
    without the planner (added by the caller from the measured median). `traffic`: plan_traffic of the
    plan, when the caller prices it under several schemes."""
    weights_DD, wbytes = weight_units_DD(plan, setup.expert_bytes * opts.dtype_bytes)
    load_max = int(plan.load_D.max()) if plan.load_D.size else 0
    tr = traffic if traffic is not None else plan_traffic(setup, opts, plan)
    out = cost_parts(setup, opts, load_max, tr.net_DD, weights_DD, comm, scheme, fan_DD=tr.fan_DD)
    return out | {"weight_bytes": wbytes, "max_over_mean": plan.max_over_mean} | _traffic_figures(setup, opts, tr)


def force_balanced_cost(setup: Setup, opts: SimOptions, counts_DE: np.ndarray, comm: CommModel, scheme: str,
                        traffic: LayerTraffic | None = None) -> dict:
    """The force-balanced ideal of UltraEP's comparison: the same tokens as if the router had spread
    them evenly: every rank computes ceil(total / D), every rank sends each rank an equal share of
    its rows (deduplicated per node as `balanced_traffic` models it), no weights move."""
    c = np.asarray(counts_DE, dtype=np.int64)
    D = c.shape[0]
    tr = traffic if traffic is not None else balanced_traffic(setup, opts, c)
    out = cost_parts(setup, opts, -(-int(c.sum()) // D), tr.net_DD, np.zeros((D, D), dtype=np.int64), comm,
                     scheme, fan_DD=tr.fan_DD)
    return out | {"weight_bytes": 0, "max_over_mean": 1.0} | _traffic_figures(setup, opts, tr)


def cost_parts(setup: Setup, opts: SimOptions, load_max: int, send_DD, weights_DD, comm: CommModel,
               scheme: str, fan_DD=None) -> dict:
    """The cost model proper (module docstring) from the busiest rank's tokens, the token traffic
    (rows, int [D, D]; with dedup the network exchange, then `fan_DD` on NVLink) and the forward weight
    traffic (CHUNK_BYTES units, int [D, D])."""
    flops_per_ms = setup.topology.gpu_tflops * 1e9 * opts.mfu
    passes = setup.fwd_passes
    expert = load_max * setup.expert_flops_per_token * (passes + 2) / flops_per_ms
    dense = setup.micro_batch * setup.seq / setup.cp * setup.dense_flops_per_token() / flops_per_ms
    send = np.asarray(send_DD)
    tok_bytes = setup.hidden * opts.dtype_bytes
    fan = None if fan_DD is None else np.asarray(fan_DD)  # dispatch: stage 1, fan-out; combine: the reverse
    a2a = (passes + 1) * (comm.ms(send, tok_bytes, scheme, fan)
                          + comm.ms(send.T, tok_bytes, scheme, None if fan is None else fan.T))
    w_fwd = comm.ms(weights_DD, CHUNK_BYTES, scheme)
    w_bwd = comm.ms(np.asarray(weights_DD).T, CHUNK_BYTES, scheme) * opts.grad_bytes / opts.dtype_bytes
    if opts.weight_sync == "iteration":  # fetched once, kept for every microbatch; grads returned once
        weights_total = (w_fwd + w_bwd) / setup.microbatches
    else:
        weights_total = passes * w_fwd + w_bwd
    weights = max(0.0, weights_total - dense) if opts.overlap == "weights" else weights_total
    return {"dense_ms": dense, "expert_compute_ms": expert, "token_a2a_ms": a2a, "weights_ms": weights,
            "weights_total_ms": weights_total, "max_load": load_max}


def head_ms(setup: Setup, opts: SimOptions) -> float:
    return (setup.micro_batch * setup.seq / setup.cp * setup.head_flops_per_token()
            / (setup.topology.gpu_tflops * 1e9 * opts.mfu))
