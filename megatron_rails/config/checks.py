"""Cross-section checks of a run config, and the values derived from them.

Each section of a RunConfig is valid on its own once `build` accepts it; what remains are the rules
that tie sections together (Megatron-Core's divisibility rules, the topology against the parallel
sizes, the balancer against the expert-parallel group). `check_run` applies them all, reports every
violation naming the file and the key, and fills in what the file may leave out: the world size, the
global batch, the topology's node count and the balancer's EP ranks per node.

Rank layout assumed (Megatron-Core's default order): the dense grid is tp-cp-ep-dp-pp and the expert
grid tp-ep-dp-pp with the expert tensor-parallel size as its tp, so consecutive members of an
expert-parallel group are `expert_tensor_parallel_size` ranks apart.
"""
from __future__ import annotations

import dataclasses
import re

# Megatron-LM's --split: train,valid,test weights (megatron.core.datasets.blended_megatron_dataset_config.
# parse_and_normalize_split reads the numbers in it, at most 3, pads with 0 and normalizes by their sum)
_NUMBER = r"\s*(?:\d+(?:\.\d*)?|\.\d+)\s*"
SPLIT = re.compile(rf"{_NUMBER}(?:[,/]{_NUMBER}){{0,2}}")


def ep_ranks_per_node(gpus_per_node: int, ep: int, etp: int) -> int:
    """EP-group members sharing a node: gpus_per_node / etp of them, at most the whole group."""
    return min(ep, max(1, gpus_per_node // etp))


def check_run(cfg, where: str, origin: dict):
    """`cfg` with derived values filled in; ConfigError listing every cross-section problem."""
    from ..core.planners import PlannerError, make_planner
    from ..core.policy import MAX_EXPERTS
    from .schema import raise_errors

    errors = []

    def err(key, msg, *also):
        """also: other keys of the rule, whose override is named when `key` was not overridden."""
        src = next((origin[k] for k in (key, *also) if k in origin), None)
        errors.append(f"{where}: {key}: {msg}" + (f" (from override '{src}')" if src else ""))

    m, p, t, d, topo, bal = cfg.model, cfg.parallelism, cfg.training, cfg.data, cfg.topology, cfg.balancer
    tp, pp, cp, ep = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size,
                      p.expert_model_parallel_size)
    etp = p.expert_tensor_parallel_size or tp
    G = topo.gpus_per_node
    if bal is not None and etp != 1:  # the dispatcher refuses it when the model is built
        src = "" if p.expert_tensor_parallel_size else " (null: tensor_model_parallel_size, Megatron's default)"
        err("parallelism.expert_tensor_parallel_size", f"{etp}{src}, but a balancer moves whole experts: set 1 "
            "(expert-parallel groups may span tensor-parallel ranks), or balancer: null for stock Megatron-Core")
        etp = 1  # the rules below as they will hold once it is set, not errors that setting it removes

    # topology x parallel sizes
    if topo.nodes and topo.nodes != p.nodes:
        err("topology.nodes", f"{topo.nodes} nodes, but parallelism.nodes is {p.nodes}")
    world = p.nodes * G
    if p.world_size is not None and p.world_size != world:
        err("parallelism.world_size", f"{p.world_size}, but parallelism.nodes {p.nodes} x topology.gpus_per_node "
            f"{G} (topology {topo.name!r}) = {world}")
    if world % (tp * pp * cp):
        err("parallelism", f"world size {world} is not divisible by tensor x pipeline x context parallel "
            f"sizes {tp} x {pp} x {cp} = {tp * pp * cp}")
    if world % (etp * ep * pp):
        err("parallelism.expert_model_parallel_size",
            f"world size {world} is not divisible by expert tensor x expert x pipeline parallel sizes "
            f"{etp} x {ep} x {pp} = {etp * ep * pp}")

    # model x parallel sizes (Megatron-Core's own rules)
    if m.num_layers % pp:
        err("model.num_layers", f"{m.num_layers} is not divisible by pipeline_model_parallel_size {pp}")
    if m.num_attention_heads % tp:
        err("model.num_attention_heads", f"{m.num_attention_heads} is not divisible by tensor_model_parallel_size {tp}")
    if m.hidden_size % m.num_attention_heads:
        err("model.hidden_size", f"{m.hidden_size} is not divisible by num_attention_heads {m.num_attention_heads}")
    if m.num_query_groups is not None:
        if m.num_attention_heads % m.num_query_groups:
            err("model.num_query_groups", f"{m.num_query_groups} does not divide num_attention_heads "
                f"{m.num_attention_heads}")
        if m.num_query_groups % tp:
            err("model.num_query_groups", f"{m.num_query_groups} is not divisible by tensor_model_parallel_size {tp}")
    if m.num_experts > MAX_EXPERTS:  # the planners' tables are [ranks, experts]: refuse before building one
        err("model.num_experts", f"{m.num_experts}: at most {MAX_EXPERTS} experts per layer")
    if m.moe_router_topk > m.num_experts:
        err("model.moe_router_topk", f"{m.moe_router_topk} exceeds num_experts {m.num_experts}")
    # Megatron-LM's validate_args (megatron/training/arguments.py, core_v0.16.1) asserts these at start-up,
    # whatever the position embedding type
    if m.max_position_embeddings is not None and m.max_position_embeddings < m.seq_length:
        err("model.max_position_embeddings", f"{m.max_position_embeddings} is shorter than seq_length {m.seq_length} "
            "(Megatron-LM asserts max_position_embeddings >= seq_length)", "model.seq_length")
    if cp > 1 and m.seq_length % (2 * cp):
        err("model.seq_length", f"{m.seq_length} is not a multiple of 2 x context_parallel_size {cp} = {2 * cp} "
            "(Megatron-LM asserts it when context_parallel_size > 1)", "parallelism.context_parallel_size")

    # training
    dp = world // (tp * pp * cp) if world % (tp * pp * cp) == 0 else 0
    gbs = t.global_batch_size
    if dp and gbs is not None and gbs % (t.micro_batch_size * dp):
        err("training.global_batch_size", f"{gbs} is not divisible by micro_batch_size {t.micro_batch_size} x "
            f"data-parallel size {dp}")
    if tp > 1 and not p.sequence_parallel:  # MoELayer raises it at the first training forward
        err("parallelism.sequence_parallel", f"false, but Megatron-Core trains MoE layers under tensor parallelism "
            f"(tensor_model_parallel_size {tp}) only with sequence parallelism: set it true")
    if t.min_lr > t.lr:
        err("training.min_lr", f"{t.min_lr:g} exceeds lr {t.lr:g} (Megatron-LM asserts min_lr <= lr)", "training.lr")
    if t.save is not None and t.save_interval is None:
        err("training.save", f"{t.save!r} is set, but save_interval is null: Megatron-LM asserts a save_interval "
            "(iterations between checkpoints) whenever save is given", "training.save_interval")
    if t.bf16 and t.fp16:
        err("training.fp16", "bf16 and fp16 are both true")
    if d.data_path is not None and not d.data_path:  # Megatron would get a bare --data-path
        err("data.data_path", "an empty list; list the data files (weights and prefixes), or leave it out "
            "(null) with mock_data: true")
    elif d.mock_data == bool(d.data_path):
        err("data", "set exactly one of mock_data: true and data_path")
    if d.split is not None and (not SPLIT.fullmatch(d.split)
                                or not any(float(x) for x in re.findall(r"[.0-9]+", d.split))):
        err("data.split", f"{d.split!r}: expected 1 to 3 non-negative numbers (train,valid,test weights, not all "
            "zero) separated by commas or slashes, e.g. 969,30,1")

    # balancer x expert-parallel group
    G_ep = ep_ranks_per_node(G, ep, etp)
    if bal is not None:
        if m.moe_token_dispatcher_type != "alltoall":
            err("model.moe_token_dispatcher_type", f"{m.moe_token_dispatcher_type!r}, but a balancer replaces the "
                "alltoall dispatcher: set alltoall, or balancer: null for stock Megatron-Core")
        if bal.ranks_per_node == 0:
            bal = dataclasses.replace(bal, ranks_per_node=G_ep)
        elif min(bal.ranks_per_node, ep) != G_ep:
            err("balancer.ranks_per_node", f"{bal.ranks_per_node}, but this layout puts {G_ep} ranks of each "
                f"expert-parallel group on a node (topology.gpus_per_node {G} / expert tensor parallel {etp}, "
                f"at most expert_model_parallel_size {ep}); set {G_ep}, or 0 to derive it")
        # the planner is tried on the layout's node size: a wrong ranks_per_node is reported once, above,
        # not again as the planner's consequence of it
        fixed = dataclasses.replace(bal, ranks_per_node=G_ep)
        try:
            if m.num_experts <= MAX_EXPERTS:
                make_planner(fixed.policy, fixed.planner_config(ep, m.num_experts))
        except PlannerError as e:
            err("balancer.policy", f"{bal.policy!r} cannot serve this layout: {e}")
    if m.num_experts % ep and not any("balancer.policy" in x for x in errors):
        err("model.num_experts", f"{m.num_experts} is not divisible by expert_model_parallel_size {ep} "
            "(Megatron-Core's MoELayer needs num_experts % EP == 0)")
    raise_errors(errors)
    return dataclasses.replace(
        cfg, parallelism=dataclasses.replace(p, world_size=world), topology=topo.with_nodes(p.nodes),
        training=dataclasses.replace(t, global_batch_size=gbs or t.micro_batch_size * dp), balancer=bal)
