"""Expert biases under tensor parallelism with sequence parallelism and experts not tensor-parallel
(TP 2, EP 2 over the same two ranks, expert TP 1): each rank of the TP pair holds different
experts, so an expert's bias gradient is its own rank's autograd gradient, nothing to sum.
Megatron-Core marks the experts' RowParallelLinear bias `sequence_parallel`, and the reduction
finalize_model_grads runs for such parameters sums them over the TP pair: the stock layer's
gradients come out mixed (checked here, so the case really exercises it); the rails dispatcher's
stay the autograd ones. Reference: the stock allgather dispatcher's gradients before that
reduction, identical weights and inputs, fp32, 1e-5."""
import types

import numpy as np
import pytest
import torch

from moe_harness import build_moe_layer, spawn

H = 16


def _config(dispatcher):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
        moe_token_dispatcher_type=dispatcher, ffn_hidden_size=24, moe_ffn_hidden_size=24, add_bias_linear=True,
        tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1,
        expert_model_parallel_size=2, use_cpu_initialization=True, moe_aux_loss_coeff=0.0, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, bias_activation_fusion=False,
        moe_router_load_balancing_type="none", init_method_std=0.2)


def _bias_grads(layer):
    """{name: grad} of the experts' biases, in the stock layout (fsep: from the shards)."""
    store = getattr(layer.token_dispatcher, "store", None)
    if hasattr(store, "owner_layout_grads"):
        grads = {f"experts.{k}": v for k, v in store.owner_layout_grads().items()}
    else:
        grads = {n: p.grad for n, p in layer.named_parameters()}
    return {n: g.clone() for n, g in grads.items() if n.startswith("experts.") and n.endswith("bias")}


def _finalize_tp_reduction(layer, config):
    """Megatron-Core's own reduction of sequence-parallel gradients over the TP group, as
    finalize_model_grads runs it (on .grad: no DDP buffers here)."""
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads

    chunk = torch.nn.Module()
    chunk.module, chunk.ddp_config = layer, types.SimpleNamespace(use_megatron_fsdp=False)
    _allreduce_non_tensor_model_parallel_grads([chunk], config)


def _worker(rank, world, policies):
    import megatron_rails

    torch.manual_seed(7)
    stock = build_moe_layer(_config("allgather"))
    rng = np.random.default_rng(rank)  # sequence parallelism: each TP rank its own tokens
    x_np = torch.tensor(rng.standard_normal((12, H)) + 1.0, dtype=torch.float32)

    def step(layer):
        layer.zero_grad(set_to_none=True)
        out, _ = layer(x_np.clone().view(-1, 1, H))
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()

    step(stock)
    want = _bias_grads(stock)
    assert any(n.endswith("linear_fc2.bias") for n in want)
    _finalize_tp_reduction(stock, stock.config)
    mixed = _bias_grads(stock)
    assert any(not torch.equal(mixed[n], want[n]) for n in want), "stock no longer sums expert biases over TP"
    for policy in policies:
        megatron_rails.install({"policy": policy, "slots": 1})
        rails = build_moe_layer(_config("alltoall"))
        megatron_rails.uninstall()
        rails.load_state_dict(stock.state_dict())
        step(rails)
        _finalize_tp_reduction(rails, rails.config)
        got = _bias_grads(rails)
        assert set(got) == set(want)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"rank {rank}, {policy}: {n}\n{m}")


@pytest.mark.parametrize("policies", [("none", "ultraep", "fsep")])
def test_expert_bias_gradients_are_not_summed_over_tensor_parallel_ranks(policies):
    spawn(_worker, 2, policies, ep=2, parallel=dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=1))
