"""Expert biases under tensor parallelism with sequence parallelism and experts not tensor-parallel
(TP 2, EP 2 over the same two ranks, expert TP 1): each rank of the TP pair holds different
experts, so an expert's bias gradient is its own rank's autograd gradient, nothing to sum.
Megatron-Core marks the experts' RowParallelLinear bias (fc2's) `sequence_parallel`, and the
reduction finalize_model_grads runs for such parameters sums them over the TP pair. The difference
is pinned exactly: stock's fc2 bias gradients come out as the TP-group sum of the autograd ones
(those of the other rank's experts under the same local names added in), its fc1 biases' stay; the
rails dispatcher's all stay the autograd ones. Reference: the stock allgather dispatcher's
gradients before that reduction, identical weights and inputs, fp32, 1e-5."""
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
    """{name: grad} of the experts' biases (stock parameters under every policy, fsep's too)."""
    return {n: p.grad.clone() for n, p in layer.named_parameters() if n.startswith("experts.") and n.endswith("bias")}


def _finalize_tp_reduction(layer, config):
    """Megatron-Core's own reduction of sequence-parallel gradients over the TP group, as
    finalize_model_grads runs it (on .grad: no DDP buffers here)."""
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads

    chunk = torch.nn.Module()
    chunk.module, chunk.ddp_config = layer, types.SimpleNamespace(use_megatron_fsdp=False)
    _allreduce_non_tensor_model_parallel_grads([chunk], config)


def _worker(rank, world, policies):
    import megatron_rails
    from megatron.core import parallel_state

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
    marked = {n for n, p in stock.named_parameters() if n in want and getattr(p, "sequence_parallel", False)}
    assert marked == {n for n in want if ".linear_fc2." in n} != set(), f"stock marks {sorted(marked)}"
    _finalize_tp_reduction(stock, stock.config)
    mixed = _bias_grads(stock)
    for n, g in want.items():  # stock's: the TP-group sum where marked, else the autograd value
        if n in marked:
            g = g.clone()
            torch.distributed.all_reduce(g, group=parallel_state.get_tensor_model_parallel_group())
            assert not torch.allclose(g, want[n], rtol=1e-5, atol=1e-5), f"rank {rank}: {n}: the sum adds nothing"
        torch.testing.assert_close(mixed[n], g, rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {rank}, stock: {n}\n{m}")
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
