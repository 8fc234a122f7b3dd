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
EP group's slice of the topology (`ep_topology`):
  tokens    dispatch sends plan.send_DD rows of H x 2 bytes (bf16), combine the transpose; backward
            repeats both in reverse: (forward passes + 1) x (t(send) + t(send^T)) per microbatch.
  weights   owner layout (eplb, ultraep, lp): every replica with tokens that is not an owner copy is
            fetched whole from its owner (3HF x 2 bytes); its gradient returns the same way (bf16).
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
from ..core.errors import InputError
from ..core.topology import Topology

OVERLAPS = ("none", "weights")
WEIGHT_SYNCS = ("iteration", "microbatch")
A2A_MODELS = ("fluid", "phased")
CHUNK_BYTES = 1 << 20  # unit of weight traffic (1 MiB)


class SimError(InputError):
    """The simulator cannot model this configuration or input."""


@dataclass(frozen=True)
class SimOptions:
    mfu: float = 0.5              # achieved / peak dense bf16 FLOP rate, for every GEMM
    overlap: str = "none"         # none | weights
    a2a_model: str = "fluid"      # fluid | phased (megatron_rails.sim.rails)
    weight_sync: str = "iteration"  # iteration (resident for the step) | microbatch
    dtype_bytes: int = 2          # activations and weights (bf16)
    grad_bytes: int = 2           # returned weight gradients (bf16)

    def __post_init__(self):
        if not 0 < self.mfu <= 1:
            raise SimError(f"--mfu must be in (0, 1], got {self.mfu}")
        if self.overlap not in OVERLAPS:
            raise SimError(f"--overlap must be one of {', '.join(OVERLAPS)}, got {self.overlap!r}")
        if self.weight_sync not in WEIGHT_SYNCS:
            raise SimError(f"--weight-sync must be one of {', '.join(WEIGHT_SYNCS)}, got {self.weight_sync!r}")
        if self.a2a_model not in A2A_MODELS:
            raise SimError(f"--a2a-model must be one of {', '.join(A2A_MODELS)}, got {self.a2a_model!r}")


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
        from ..core.policy import PolicyConfig
        from ..config.checks import ep_ranks_per_node

        m, p, t = rc.model, rc.parallelism, rc.training
        etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
        G_ep = ep_ranks_per_node(rc.topology.gpus_per_node, p.expert_model_parallel_size, etp)
        base = rc.balancer or PolicyConfig(slots=1)
        base = dataclasses.replace(base, ranks_per_node=G_ep, slots=base.slots if slots is None else int(slots))
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
    """All-to-all time (ms) of traffic matrices on one EP topology, memoized by content."""

    def __init__(self, topo: Topology, a2a_model: str = "fluid"):
        self.topo, self.model = topo, a2a_model
        self._cache: dict = {}

    def ms(self, units_DD: np.ndarray, bytes_per_unit: int, scheme: str) -> float:
        traffic = np.ascontiguousarray(units_DD, dtype=np.int64)
        off = traffic.copy()
        np.fill_diagonal(off, 0)
        if not off.any():
            return 0.0
        if self.topo.nodes == 1:  # every message is one NVLink hop: the model's closed form, any scheme
            busiest = max(int(off.sum(axis=1).max()), int(off.sum(axis=0).max())) * float(bytes_per_unit)
            phases = 1  # fluid: one hop's latency; phased: only phase 1 has traffic
            return (busiest * 8.0 / (self.topo.nvlink_gbps * 1e3) + self.topo.latency_us * phases) / 1e3
        key = (scheme, int(bytes_per_unit), traffic.shape, traffic.tobytes())
        hit = self._cache.get(key)
        if hit is None:
            r = simulate_schedule(build_schedule(scheme, traffic, self.topo), scheme, int(bytes_per_unit), (0.0, "-"))
            hit = self._cache[key] = (r.completion_us if self.model == "fluid" else r.phased_us) / 1e3
        return hit


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


def layer_cost(setup: Setup, opts: SimOptions, plan, comm: CommModel, scheme: str) -> dict:
    """Milliseconds of one MoE layer for one microbatch (forward + backward) on its slowest rank,
    without the planner (added by the caller from the measured median)."""
    weights_DD, wbytes = weight_units_DD(plan, setup.expert_bytes * opts.dtype_bytes)
    load_max = int(plan.load_D.max()) if plan.load_D.size else 0
    out = cost_parts(setup, opts, load_max, plan.send_DD, weights_DD, comm, scheme)
    return out | {"weight_bytes": wbytes, "max_over_mean": plan.max_over_mean}


def force_balanced_cost(setup: Setup, opts: SimOptions, counts_DE: np.ndarray, comm: CommModel, scheme: str) -> dict:
    """The force-balanced ideal of UltraEP's comparison: the same tokens as if the router had spread
    them evenly: every rank computes ceil(total / D), every rank sends each rank an equal share of
    its rows, no weights move."""
    c = np.asarray(counts_DE, dtype=np.int64)
    D = c.shape[0]
    rows_D = c.sum(axis=1)
    send_DD = (rows_D[:, None] // D + (np.arange(D)[None, :] < (rows_D % D)[:, None])).astype(np.int64)
    out = cost_parts(setup, opts, -(-int(c.sum()) // D), send_DD, np.zeros((D, D), dtype=np.int64), comm,
                     scheme)
    return out | {"weight_bytes": 0, "max_over_mean": 1.0}


def cost_parts(setup: Setup, opts: SimOptions, load_max: int, send_DD, weights_DD, comm: CommModel,
               scheme: str) -> dict:
    """The cost model proper (module docstring) from the busiest rank's tokens, the token traffic
    (rows, int [D, D]) and the forward weight traffic (CHUNK_BYTES units, int [D, D])."""
    flops_per_ms = setup.topology.gpu_tflops * 1e9 * opts.mfu
    passes = setup.fwd_passes
    expert = load_max * setup.expert_flops_per_token * (passes + 2) / flops_per_ms
    dense = setup.micro_batch * setup.seq / setup.cp * setup.dense_flops_per_token() / flops_per_ms
    send = np.asarray(send_DD)
    tok_bytes = setup.hidden * opts.dtype_bytes
    a2a = (passes + 1) * (comm.ms(send, tok_bytes, scheme) + comm.ms(send.T, tok_bytes, scheme))
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
