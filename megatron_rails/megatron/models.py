"""Megatron-Core building blocks for the tools (demo, benchmarks, soak), so that they never import
megatron.* themselves: parallel state, a TransformerConfig, a stock MoE layer, a GPT model, and
Megatron-Core's own local permute/unpermute for comparison."""
from __future__ import annotations

import torch

from . import cpu_shims
from .compat import MCORE_VERSION, build_moe_layer, stock_permute  # noqa: F401  (re-exported for the tools)


def init_model_parallel(expert_parallel: int, timeout_s: float | None = None) -> None:
    """Megatron's parallel state with expert parallelism `expert_parallel` over the default group
    (once per process); CPU shims applied first."""
    cpu_shims.apply()
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        kw = {} if timeout_s is None else {"distributed_timeout_minutes": timeout_s / 60}
        ps.initialize_model_parallel(expert_model_parallel_size=expert_parallel, **kw)


def transformer_config(**kw):
    """A TransformerConfig; keys as Megatron-Core's."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**kw)


def seed_model_parallel(seed: int) -> None:
    """Megatron's model-parallel RNG tracker seeded (skipped on CPU, where it is not needed)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    try:
        model_parallel_cuda_manual_seed(seed)
    except Exception:  # CPU: the CUDA RNG tracker is not needed
        pass


def gpt_model(cfg, vocab_size: int, max_sequence_length: int, layer_spec=None, **spec_kw):
    """A GPTModel with Megatron-Core's local layer spec (or `layer_spec`), rope positions."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    spec = layer_spec or get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, **spec_kw)
    return GPTModel(cfg, spec, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                    position_embedding_type="rope")


def stock_local_ops():
    """Megatron-Core's alltoall dispatcher's local steps: (permute, sort_chunks_by_idxs, unpermute);
    permute as compat.stock_permute (one signature across versions)."""
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs, unpermute

    return stock_permute, sort_chunks_by_idxs, unpermute


def route_by(layer, choose) -> None:
    """Make `layer`'s router send its tokens where `choose(T, E, k)` says (int64 [T, k], k distinct
    experts per token), whatever its logits: the routing map is exactly that. The router's own
    top-k probabilities are kept (in that order) on the chosen experts, so gradients still reach it."""
    router = layer.router
    forward = router.forward

    def chosen(hidden, *args, **kwargs):
        probs_TE, _ = forward(hidden, *args, **kwargs)
        T, E = probs_TE.shape
        k = layer.config.moe_router_topk
        idx_Tk = torch.as_tensor(choose(T, E, k), dtype=torch.int64).to(probs_TE.device)
        vals_Tk = probs_TE.topk(k, dim=-1).values
        probs = torch.zeros_like(probs_TE).scatter(1, idx_Tk, vals_Tk)
        routing_map = torch.zeros(T, E, dtype=torch.bool, device=probs_TE.device).scatter(1, idx_Tk, True)
        return probs, routing_map

    router.forward = chosen


def force_balanced_routing(layer) -> None:
    """Token t to experts (t + j * E / k) mod E, j < k: every expert gets exactly T * k / E of a rank's
    T tokens (T a multiple of E), the ideal a balancer aims at (`route_by`)."""
    route_by(layer, lambda T, E, k: (torch.arange(T)[:, None] + torch.arange(k)[None, :] * (E // k)) % E)
