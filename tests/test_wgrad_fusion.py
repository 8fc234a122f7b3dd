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


def _in_flight_worker(rank, world):
    """Two microbatches in flight (as a pipeline schedule runs them), the second growing the
    window, then their backward passes in reverse order, each returning the slot gradients."""
    import megatron_rails

    _fused_linears()
    cfg = moe_config(world, "allgather", experts=E)
    cfg.gradient_accumulation_fusion = True
    torch.manual_seed(7)
    stock = build_moe_layer(cfg)
    megatron_rails.install({"policy": "ultraep", "slots": 2, "comm": "direct", "tolerance": 0.0,
                            "replica_cost_tokens": 1})
    try:
        cfg_r = moe_config(world, "alltoall", experts=E)
        cfg_r.gradient_accumulation_fusion = True
        rails = build_moe_layer(cfg_r)
    finally:
        megatron_rails.uninstall()
    rails.load_state_dict(stock.state_dict())
    H = cfg.hidden_size
    u = torch.tensor(np.random.default_rng(3).standard_normal((E, H)), dtype=torch.float32)
    u /= u.norm(dim=1, keepdim=True)
    for layer in (stock, rails):
        with torch.no_grad():
            layer.router.weight.add_(4.0 * u)
        for p in layer.parameters():  # what Megatron DDP gives every parameter (here without DDP)
            p.main_grad = torch.zeros_like(p)
    g = torch.Generator().manual_seed(50 + rank)
    # microbatch 0 leans on expert 1, microbatch 1 on expert 2 (both owned by rank 0, so both
    # replicas land on rank 1): the second grows the window on the rank whose rows are lent
    xs = [torch.randn(TOKENS, H, generator=g) * 0.5 + 1.5 * u[hot] for hot in (1, 2)]
    w = torch.linspace(-1, 1, TOKENS * H).view(TOKENS, 1, H)
    got = {}
    for name, layer in (("stock", stock), ("rails", rails)):
        inputs = [x.clone().view(TOKENS, 1, H).requires_grad_(True) for x in xs]
        outs, rows = [], []
        for x in inputs:
            outs.append(layer(x)[0])
            if name == "rails":  # this rank's resident slot rows after each forward
                rows.append(layer.token_dispatcher.store.window.n_rows)
        for out in reversed(outs):
            (out * w).sum().backward()
        got[name] = ([x.grad for x in inputs], layer.router.weight.grad,
                     {n: p.main_grad for n, p in layer.named_parameters() if n.startswith("experts.")})
    every = [None] * world
    torch.distributed.all_gather_object(every, rows)
    # the case under test: a rank whose rows were lent out by microbatch 0 gets more in microbatch 1
    assert any(r0 >= 1 and r1 > r0 for r0, r1 in every), f"no rank with lent rows grew: rows per rank {every}"
    (gx_s, gr_s, gw_s), (gx_r, gr_r, gw_r) = got["stock"], got["rails"]
    for a, b in zip(gx_r, gx_s):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gr_r, gr_s, rtol=1e-5, atol=1e-5)
    for n, v in gw_s.items():
        torch.testing.assert_close(gw_r[n], v, rtol=1e-5, atol=1e-5, msg=lambda m: f"rank {rank} {n}\n{m}")


def test_microbatches_in_flight_across_growth_return_every_fused_gradient():
    """The lent accumulator under a pipeline-like order: weights of microbatch 0 hold main_grad views
    while microbatch 1's forward grows the window, and microbatch 1's backward returns the window's
    gradients before microbatch 0's backward adds its own: every expert's main_grad equals stock's."""
    spawn(_in_flight_worker, 2)
