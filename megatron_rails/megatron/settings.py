"""Megatron settings the rails dispatcher cannot serve, named in one place for the two that refuse
them: the dispatcher when it is built (NotImplementedError), and the launcher's check of Megatron-LM's
parsed arguments (megatron/args.py: a one-line ConfigError before minutes of start-up). Both read the
same attribute names: Megatron-LM's arguments carry TransformerConfig's field names.
"""
from __future__ import annotations

from typing import Optional

from .compat import cuda_graphs_capture_dispatch


def unsupported(config, policy) -> Optional[str]:
    """Why the rails dispatcher under `policy` (a PolicyConfig) cannot serve `config` (a
    TransformerConfig or Megatron-LM's parsed arguments), or None when it can."""
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        # that schedule runs dispatch, experts and combine as separate autograd pieces with another
        # microbatch's in between; the slots' gradient return relies on one graph
        return ("megatron-rails does not support overlap_moe_expert_parallel_comm "
                "(--overlap-moe-expert-parallel-comm); turn it off to use the rails dispatcher")
    if getattr(config, "overlap_dispatch_backward_with_experts_wgrad", False):  # 0.19
        # it defers the experts' weight gradients (Transformer Engine's delay_wgrad_compute) and
        # computes them from a node of its own at the dispatch's backward: slots computed with
        # borrowed weights would not be among them
        return ("megatron-rails does not support overlap_dispatch_backward_with_experts_wgrad "
                "(--overlap-dispatch-backward-with-experts-wgrad): it defers the experts' weight gradients, "
                "which the slots' borrowed weights would miss; turn it off")
    captured = cuda_graphs_capture_dispatch(config)
    if captured:
        # the dispatcher gathers counts and plans on the host every step: nothing a graph replays
        fix = ("set inference_cuda_graph_scope to layer" if "inference_cuda_graph_scope" in captured
               else "capture attn, mlp or moe_router only")
        return f"megatron-rails cannot run inside a CUDA graph ({captured}): {fix}, or turn CUDA graphs off"
    if policy.sharded and getattr(config, "transformer_impl", None) == "inference_optimized":
        # a value megatron-core 0.19 introduced: in inference its MoELayer swaps in its own dispatcher,
        # which runs the stock experts; under the sharded layout those hold no weights (placeholders)
        return (f"megatron-rails policy {policy.policy} (fsep shards) cannot run with "
                "transformer_impl='inference_optimized': its inference dispatcher computes the stock experts, "
                "which hold no weights under fsep; use another policy")
    return None
