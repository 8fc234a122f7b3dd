"""Per-GPU memory of a run config under each policy (`simulate run` prints it).

The busiest GPU is one of the first pipeline stage's: ceil(layers / PP) layers, the embedding and,
with PP 1, the output layer; activations for the microbatches in flight there.

Parameters and optimizer state follow Megatron-LM's own accounting (megatron/training/
theoretical_memory_usage.py): under bf16 / fp16 a parameter costs its 2-byte weight, a 4-byte fp32
gradient (main_grad), a 4-byte fp32 master copy and Adam's two 4-byte moments (SGD: one), the master
copy and the moments sharded over the data-parallel group under the distributed optimizer; in fp32,
a 4-byte weight and gradient and the moments, no master copy. Megatron divides every layer's
parameters by TP and PP only; here the experts are divided by EP x ETP instead, and their optimizer
state is sharded over the expert data-parallel group (world / (ETP EP PP)), as Megatron-Core does.

What a policy adds (the runtime's residency windows, runtime/residency.py and runtime/sharded.py):
  owner layouts (eplb, ultraep, lp on those): R replica slots per rank and layer, each an expert's
    weights (the weight dtype) and its gradient accumulator (the main_grad dtype), held from the
    step's first microbatch that needs them to its end; none: nothing;
  fsep (and lp on fsep): the shards hold the rank's E / EP experts' worth, with the optimizer
    state stock's experts would have, and the step materializes up to ceil(E / EP) + R slots
    (weights and accumulators) in every layer, held the whole step.
This is the peak a skewed step reaches; a step within the policy's tolerance moves and holds none
(owner layouts) or ceil(E / EP) slots (fsep).

Activations: Megatron-LM's formulas as it applies them (Korthikanti et al. 2022, Table 2, with
sequence parallelism and selective recompute; its without-SP estimate otherwise), the same for
every policy; Megatron's estimate does not model full recompute, nor do we.

Units: bytes (int or float); the topology's gpu_memory_gib is in 2^30 bytes.
"""
from __future__ import annotations

import math

from ..core.errors import shown


def _expert_params(m) -> int:
    """Parameters of one expert: fc1 [H, F] (x2 gated) and fc2 [F, H], their biases unless disabled."""
    H, F = m.hidden_size, m.moe_ffn_hidden_size or m.ffn_hidden_size
    gated = 2 if m.swiglu else 1
    bias = 0 if m.disable_bias_linear else gated * F + H
    return (gated + 1) * H * F + bias


def _dense_layer_params(m, tp: int) -> float:
    """One layer's non-expert parameters on one GPU: attention (q, k, v, out; divided by TP), its and
    the MLP's norms and the router (replicated)."""
    H = m.hidden_size
    kv = H * (m.num_query_groups or m.num_attention_heads) / m.num_attention_heads
    bias = 0 if m.disable_bias_linear else H + 2 * kv + H
    norms = 2 * H * (1 if m.normalization == "RMSNorm" else 2)
    return (H * (H + 2 * kv) + H * H + bias) / tp + norms + H * m.num_experts


def _bytes_per_param(t, dp: int) -> tuple[int, float]:
    """(weight + gradient bytes, master copy + optimizer bytes on this GPU) per parameter."""
    mixed = t.bf16 or t.fp16
    moments = 8 if t.optimizer == "adam" else 4
    held = (2 + 4) if mixed else (4 + 4)
    state = (4 if mixed else 0) + moments
    return held, state / dp if t.use_distributed_optimizer else float(state)


def _activation_bytes(rc) -> float:
    """Megatron-LM's activation estimate for the first pipeline stage (bytes), as its
    report_theoretical_memory chooses it."""
    m, p, t = rc.model, rc.parallelism, rc.training
    s, b, H, L, pp, tp = m.seq_length, t.micro_batch_size, m.hidden_size, m.num_layers, \
        p.pipeline_model_parallel_size, p.tensor_model_parallel_size
    V = rc.data.vocab_size or 32000
    gbs = t.global_batch_size or b * rc.data_parallel_size
    micro = max(1, gbs // (b * rc.data_parallel_size))
    sp = p.sequence_parallel and t.recompute_granularity == "selective"
    per_layer = s * b * H * (18 + 4 * m.ffn_hidden_size / H) if sp else s * b * H * (10 + 24 / tp)
    act = per_layer * L + 8 * s * b * pp + s * b * H * pp
    if pp > 1:
        act *= min(1.0, micro / pp)
    if pp == 1:
        act += s * b * H * 4 * (1 + V / H) if sp else (s * b * V / tp + s * b * H) * 2
    return act / tp if sp else act * 1.05


def slots_per_layer(policy, experts: int, ep: int) -> int:
    """Expert-sized slots a rank holds in a layer at the peak of a skewed step under `policy`
    (PolicyConfig; None: stock): fsep's ceil(E / EP) + R, an owner layout's R replicas, none's and
    stock's 0 (lp: those of its placement; static: stock's)."""
    if policy is None:
        return 0
    layout = policy.placement if policy.policy == "lp" else policy.policy
    if layout == "fsep":
        return math.ceil(experts / ep) + policy.slots
    return 0 if layout in ("none", "static") else policy.slots


def gpu_memory(rc, policy) -> dict:
    """The busiest GPU's memory (bytes) under `policy` (a PolicyConfig, or None: stock): experts'
    weights and gradients, their optimizer state, the policy's slots (weights and accumulators),
    the rest of the model's parameters with gradients and optimizer state, and activations; with
    `expert_bytes` (experts' weights, gradients and slots: what `bench step` reports per rank) and
    `total`."""
    from ..config.run import RunConfig

    if not isinstance(rc, RunConfig):
        raise TypeError(f"gpu_memory takes a RunConfig (config.run.load_run_config), got {shown(rc)}")
    m, p, t = rc.model, rc.parallelism, rc.training
    tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
    etp = p.expert_tensor_parallel_size or tp
    layers = math.ceil(m.num_layers / pp)
    expert_dp = max(1, rc.world_size // (etp * ep * pp))
    per_expert = _expert_params(m) / etp
    local = m.num_experts / ep
    held, state = _bytes_per_param(t, expert_dp)
    experts = layers * local * per_expert
    slots = slots_per_layer(policy, m.num_experts, ep)
    # a slot holds what a parameter does before the optimizer: its weight and a gradient (accumulator)
    slot_bytes = layers * slots * per_expert * held
    d_held, d_state = _bytes_per_param(t, rc.data_parallel_size)
    V = rc.data.vocab_size or 32000
    embed = V * m.hidden_size / tp * (2 if pp == 1 and m.untie_embeddings_and_output_weights else 1)
    dense = layers * _dense_layer_params(m, tp) + embed
    out = {"expert_weights_grads": experts * held, "expert_optimizer": experts * state, "slots": slot_bytes,
           "dense": dense * (d_held + d_state), "activations": _activation_bytes(rc)}
    out["expert_bytes"] = out["expert_weights_grads"] + slot_bytes
    out["total"] = sum(out[k] for k in ("expert_weights_grads", "expert_optimizer", "slots", "dense", "activations"))
    return out


def memory_rows(rc, policies: dict) -> list[dict]:
    """One row per policy (name -> PolicyConfig; stock first, from None): gpu_memory's parts in
    bytes, expert bytes over stock's, and whether the total fits the topology's GPU memory."""
    cap = rc.topology.gpu_memory_gib * 2**30
    stock = gpu_memory(rc, None)
    rows = []
    for name, cfg in {"stock": None, **policies}.items():
        g = stock if cfg is None else gpu_memory(rc, cfg)
        rows.append({"policy": name, **g, "expert_over_stock": g["expert_bytes"] / stock["expert_bytes"],
                     "gpu_memory_gib": rc.topology.gpu_memory_gib, "fits": g["total"] <= cap})
    return rows
