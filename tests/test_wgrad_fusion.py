"""Slots under Megatron's gradient accumulation fusion (`gradient_accumulation_fusion`, on by
default in Megatron-LM wherever its CUDA kernel is installed): the expert linears then write their
weight gradients into `weight.main_grad` themselves and hand autograd none. A replica or FSEP slot
computes with the stock expert's module on borrowed weights, so those weights must carry a
`main_grad` too, and the gradients written there must reach the owners (shards) like any other.

The fused kernel is CUDA-only; here a CPU stand-in with its contract (main_grad += grad_output^T @
input, in main_grad's dtype) takes its place inside Megatron's linear layers. Trained under
Megatron's own DDP (tests/ddp_harness.py) on 2 gloo ranks against the stock allgather dispatcher:
losses and every parameter after each of 3 steps x 4 microbatches equal to 1e-5.
"""
import numpy as np
import pytest
import torch

from moe_harness import build_moe_layer, moe_config, spawn

MICRO, STEPS, TOKENS, LR, E = 4, 3, 16, 0.1, 8


class _FusedWgrad:
    """CPU stand-in for fused_weight_gradient_mlp_cuda: main_grad += grad_output^T @ input."""

    @staticmethod
    def wgrad_gemm_accum_fp32(input, grad_output, main_grad):
        x = input.reshape(-1, input.shape[-1])
        g = grad_output.reshape(-1, grad_output.shape[-1])
        main_grad.add_((g.t() @ x).to(main_grad.dtype))

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


def _fused_linears():
    from megatron.core.tensor_parallel import layers

    layers._grad_accum_fusion_available = True
    layers.fused_weight_gradient_mlp_cuda = _FusedWgrad


def _build(world, policy, u, bias):
    import megatron_rails
    from ddp_harness import chunk

    cfg = moe_config(world, "allgather" if policy == "stock" else "alltoall", experts=E)
    cfg.gradient_accumulation_fusion = True
    cfg.add_bias_linear = bias  # biases' gradients still come through autograd, beside main_grad
    torch.manual_seed(7)
    if policy == "stock":
        layer = build_moe_layer(cfg)
    else:
        # replica_cost_tokens 1: a step's window grows into free slots wherever that helps at all, so
        # borrowed weights of earlier microbatches hold main_grad views across a growth
        megatron_rails.install({"policy": policy, "slots": 2, "comm": "direct", "tolerance": 0.0,
                                "replica_cost_tokens": 1})
        try:
            layer = build_moe_layer(cfg)
        finally:
            megatron_rails.uninstall()
    fused = [m for m in layer.experts.modules() if getattr(m, "gradient_accumulation_fusion", False)]
    assert fused, "no expert linear uses gradient accumulation fusion: the test would test nothing"
    with torch.no_grad():
        layer.router.weight.add_(4.0 * u)  # the inputs' hot directions skew the routing
    return chunk(cfg, layer)


def _microbatches(rank, step, u, hidden):
    g = torch.Generator().manual_seed(1000 * rank + step)
    out = []
    for m in range(MICRO):
        hot = (step + m) % E
        x = torch.randn(TOKENS, hidden, generator=g) * 0.5 + 1.5 * u[hot]
        out.append((x.view(TOKENS, 1, hidden), torch.randn(TOKENS, 1, hidden, generator=g)))
    return out


def _loss(model, microbatch):
    x, y = microbatch
    return ((model(x) - y) ** 2).mean()


def _worker(rank, world, policy, overlap_grad_reduce, bias):
    from ddp_harness import cpu_megatron, full_params, megatron_ddp, train_step

    _fused_linears()
    H = moe_config(world, "allgather").hidden_size
    u = torch.tensor(np.random.default_rng(3).standard_normal((E, H)), dtype=torch.float32)
    u /= u.norm(dim=1, keepdim=True)
    where = f"{policy} overlap_grad_reduce={overlap_grad_reduce} bias={bias} rank {rank}"
    with cpu_megatron():
        models = {p: _build(world, p, u, bias) for p in ("stock", policy)}
        models[policy].layer.load_state_dict(models["stock"].layer.state_dict())
        trained = {name: megatron_ddp(model, overlap_grad_reduce=overlap_grad_reduce, use_distributed_optimizer=False,
                                      lr=LR, bucket_size=1000 if overlap_grad_reduce else None)
                   for name, model in models.items()}
        disp = models[policy].layer.token_dispatcher
        grown = 0
        for step in range(STEPS):
            mbs = _microbatches(rank, step, u, H)
            want = train_step(*trained["stock"], mbs, _loss)
            got = train_step(*trained[policy], mbs, _loss)
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{where} step {step}: losses\n{m}")
            # the slots computed something: otherwise the borrowed weights' main_grad went unused
            assert any(r["resident_slots"] for r in list(disp.metrics)[-MICRO:]), f"{where}: no slot computed"
            grown += sum(r["slots_added"] for r in list(disp.metrics)[-MICRO:])
            ref = full_params(trained["stock"][0])
            state = models[policy].layer.state_dict()  # stock layout (fsep assembles it from the shards)
            for k, v in ref.items():
                k = k[len("layer."):]
                torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{where} step {step}: {k}\n{m}")
        assert policy == "fsep" or grown, f"{where}: no window grew in {STEPS} steps"


@pytest.mark.parametrize("policy,overlap_grad_reduce,bias", [
    ("ultraep", False, False), ("ultraep", True, False), ("fsep", False, False), ("fsep", True, False),
    ("ultraep", True, True)])
def test_slots_under_gradient_accumulation_fusion_match_stock(policy, overlap_grad_reduce, bias):
    spawn(_worker, 2, policy, overlap_grad_reduce, bias)
