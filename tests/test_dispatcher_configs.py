"""RailsTokenDispatcher parity across Megatron-Core MoE settings other than the SwiGLU top-2 layer
of tests/test_dispatcher.py: biases, a non-gated activation, top-1 (probs on the output or on the
input), top-k = E, a sigmoid router with expert bias, router-side token drops (capacity), also
padded to capacity, an fp64 router, group-limited routing, MoELayer's own recompute, shared
experts, and shared experts overlapped with the dispatcher (--moe-shared-expert-overlap, which hands
them to the dispatcher to run). The reference is the stock allgather dispatcher with identical
weights; every policy, fp32, 1e-5 (bf16: against a float32 layer, beside stock's own bf16 error)."""
import numpy as np
import pytest
import torch

from moe_harness import build_moe_layer, moe_config, replicas_used, spawn

POLICIES = ["none", "eplb", "ultraep", "lp", "fsep"]
H = 16
VARIANTS = {
    "bias": dict(add_bias_linear=True),
    "gelu-no-glu": dict(gated_linear_unit=False, activation_func=torch.nn.functional.gelu),
    "top1": dict(moe_router_topk=1, moe_router_pre_softmax=True),
    "top1-probs-on-input": dict(moe_router_topk=1, moe_router_pre_softmax=True, moe_apply_probs_on_input=True),
    "topk=E": dict(num_moe_experts=4, moe_router_topk=4),
    "sigmoid-expert-bias": dict(num_moe_experts=16, moe_router_score_function="sigmoid",
                                moe_router_enable_expert_bias=True),
    "capacity-drops": dict(moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs"),
    "shared-experts": dict(moe_shared_expert_intermediate_size=24),
    # drop-and-pad: every expert gets exactly its capacity (padding pairs with prob 0)
    "pad-to-capacity": dict(moe_expert_capacity_factor=2.0, moe_pad_expert_input_to_capacity=True),
    "router-fp64": dict(moe_router_dtype="fp64"),
    "group-limited": dict(moe_router_num_groups=4, moe_router_group_topk=2),
    # MoELayer checkpoints its own forward (router and dispatcher) and replays it in backward
    "moe-recompute": dict(recompute_granularity="selective", recompute_modules=["moe"]),
}


def _config(world, dispatcher, overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=1, hidden_size=H, num_attention_heads=2, num_moe_experts=8, moe_router_topk=2,
              moe_token_dispatcher_type=dispatcher, ffn_hidden_size=24, moe_ffn_hidden_size=24,
              add_bias_linear=False, expert_model_parallel_size=world, use_cpu_initialization=True,
              moe_aux_loss_coeff=0.0, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
              bias_activation_fusion=False, moe_router_load_balancing_type="none", init_method_std=0.2)
    kw.update(overrides)
    return TransformerConfig(**kw)


def _grads(layer):
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
             for n, p in layer.named_parameters() if not n.endswith("rails_fsep_shards")}
    store = getattr(layer.token_dispatcher, "store", None)
    if hasattr(store, "owner_layout_grads"):  # fsep: expert grads live on the shards
        grads.update({f"experts.{k}": v for k, v in store.owner_layout_grads().items()})
    return grads


def _worker(rank, world, routings, variants=VARIANTS, rails_overrides=None):
    import megatron_rails

    for name, overrides in variants.items():
        torch.manual_seed(1234)
        stock = build_moe_layer(_config(world, "allgather", overrides))
        for policy in POLICIES:
            megatron_rails.install({"policy": policy, "slots": 2, "ranks_per_node": 2, "check_plan": True})
            rails = build_moe_layer(_config(world, "alltoall", {**overrides, **(rails_overrides or {})}))
            megatron_rails.uninstall()
            rails.load_state_dict(stock.state_dict())
            rng = np.random.default_rng(5 + rank)
            for it in range(routings):
                # every other routing pushes the inputs along one direction: skewed routing
                x_np = torch.tensor(rng.standard_normal((10, H)) + (3.0 if it % 2 else 0.0), dtype=torch.float32)
                want, got = _run(stock, x_np), _run(rails, x_np)
                where = f"{name}, policy {policy}, routing {it}, rank {rank}"
                assert set(got) == set(want), where
                for n in want:
                    torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-5,
                                               msg=lambda m: f"{where}: {n}\n{m}")
            # the parity covered replicas (summed over ranks): every policy but none places some under
            # the skewed routing; at top-k = E, and padded to capacity, the counts are even and an
            # owner layout stays as is
            used = replicas_used(rails.token_dispatcher.metrics)
            even = (rails.config.moe_router_topk == rails.config.num_moe_experts
                    or rails.config.moe_pad_expert_input_to_capacity)
            if policy != "none" and (policy == "fsep" or not even):
                assert used > 0, f"{name}, policy {policy}: no replica used in {routings} routings"


def test_parity_across_moe_settings():
    spawn(_worker, 4, 2)  # per setting and policy: one near-uniform routing, one skewed


def _run(layer, x_np, dtype=torch.float32) -> dict:
    """One forward and backward of `layer` on x_np [10, H] (float32) taken as `dtype`: the output,
    the input gradient and every parameter gradient (stock layout), as float32."""
    layer.zero_grad(set_to_none=True)
    x = x_np.clone().to(dtype).view(-1, 1, H).requires_grad_(True)
    y, _ = layer(x)
    (y.float() * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return {"output": y.detach().float(), "input grad": x.grad.float(),
            **{f"grad of {n}": g.float() for n, g in _grads(layer).items()}}


def _bf16_worker(rank, world):
    import megatron_rails

    bf16 = dict(params_dtype=torch.bfloat16, bf16=True)
    for policy in POLICIES:
        torch.manual_seed(1234)
        stock = build_moe_layer(_config(world, "allgather", bf16))
        ref = build_moe_layer(_config(world, "allgather", {}))  # float32, the same (bf16) weights
        ref.load_state_dict(stock.state_dict())
        megatron_rails.install({"policy": policy, "slots": 2, "ranks_per_node": 2})
        rails = build_moe_layer(_config(world, "alltoall", bf16))
        megatron_rails.uninstall()
        rails.load_state_dict(stock.state_dict())
        rng = np.random.default_rng(5 + rank)
        for it in range(2):
            x_np = torch.tensor(rng.standard_normal((10, H)) + (3.0 if it % 2 else 0.0), dtype=torch.float32)
            want = _run(ref, x_np)
            ours, theirs = _run(rails, x_np, torch.bfloat16), _run(stock, x_np, torch.bfloat16)
            for name, got in ours.items():
                # rails' distance from the float32 result within twice stock's own bf16 distance
                # (replicas round partial sums that stock's one GEMM rounds once), plus a quarter
                # of a bf16 ulp of the tensor's largest value
                err, err_stock = (got - want[name]).norm(), (theirs[name] - want[name]).norm()
                slack = want[name].abs().max() * 2.0 ** -10
                assert err <= 2 * err_stock + slack, \
                    f"{policy}, routing {it}, rank {rank}: {name}: |rails - fp32| {err:.3g} vs stock's {err_stock:.3g}"
        assert policy == "none" or replicas_used(rails.token_dispatcher.metrics) > 0, policy


def test_parity_in_bf16():
    """bf16 weights and activations, as GPUs train: output, input and every weight gradient within
    twice the stock dispatcher's own distance from a float32 layer with the same weights, every
    policy, replicas used under skew."""
    spawn(_bf16_worker, 4)


def _overlap_worker(rank, world):
    from ddp_harness import cpu_megatron

    # --moe-shared-expert-overlap runs the shared experts on a CUDA stream of their own: under
    # cpu_megatron every stream is the host's one stream
    shared = {"shared-experts-overlapped": dict(moe_shared_expert_intermediate_size=24)}
    with cpu_megatron():
        _worker(rank, world, 2, shared, dict(moe_shared_expert_overlap=True))


def test_shared_experts_overlapped_with_the_dispatcher_match_stock():
    """With --moe-shared-expert-overlap, MoELayer does not compute the shared experts: it hands them
    to the dispatcher, which must run them at its steps and add their output (the reference runs
    them in MoELayer, without the overlap, which only the alltoall dispatcher takes)."""
    spawn(_overlap_worker, 4)


def _alone_worker(rank, world):
    import warnings

    import megatron_rails
    from megatron_rails.runtime.sharded import ShardedExpertStore

    torch.manual_seed(3)
    stock = build_moe_layer(moe_config(world, "allgather"))
    for policy in ("fsep", "ultraep", "lp", "eplb"):
        megatron_rails.install({"policy": policy, "slots": 2})
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                rails = build_moe_layer(moe_config(world, "alltoall"))
        finally:
            megatron_rails.uninstall()
        rails.load_state_dict(stock.state_dict())
        disp = rails.token_dispatcher
        assert disp.pcfg.policy == policy and disp.runtime.policy.policy == "none"
        assert not isinstance(disp.store, ShardedExpertStore)
        x = torch.randn(24, 1, 16)
        assert torch.equal(rails(x)[0], stock(x)[0])
        assert disp.metrics[-1]["weight_bytes_sent"] == 0
        if policy == "fsep":  # said once per process
            assert any("expert-parallel size 1" in str(w.message) for w in caught), [str(w.message) for w in caught]


def test_one_ep_rank_runs_every_policy_as_none():
    """With one EP rank there is nothing to balance: every policy runs as none (stock layout, no
    weight movement) and says so once; the output is stock's, bit for bit."""
    spawn(_alone_worker, 1)


def _uneven_worker(rank, world):
    import megatron_rails

    T_rank = [13, 7, 5, 11][:world]  # tokens per rank differ (odd sizes too)
    T_max = max(T_rank)
    cfg = {}
    torch.manual_seed(1234)
    stock = build_moe_layer(_config(world, "allgather", cfg))
    rng = np.random.default_rng(17)
    skew = torch.tensor(rng.standard_normal(H), dtype=torch.float32) * 2.0  # every rank leans the same way
    gen = torch.Generator().manual_seed(40 + rank)
    x_np = torch.randn(T_rank[rank], H, generator=gen) + skew
    w_np = torch.linspace(-1, 1, T_rank[rank] * H).view(T_rank[rank], 1, H)
    # stock's allgather dispatcher assumes one token count on every rank: pad its input with tokens
    # whose loss weight is zero (tokens are independent without capacity limits or aux losses)
    x_pad = torch.cat([x_np, torch.zeros(T_max - T_rank[rank], H)]).view(-1, 1, H).requires_grad_(True)
    w_pad = torch.cat([w_np, torch.zeros(T_max - T_rank[rank], 1, H)])
    out, _ = stock(x_pad)
    (out * w_pad).sum().backward()
    want = (out.detach()[:T_rank[rank]], x_pad.grad[:T_rank[rank]].clone(), _grads(stock))
    for policy in POLICIES + ["default"]:
        megatron_rails.install({"policy": policy, "slots": 2, "ranks_per_node": 2, "check_plan": True}
                               if policy != "default" else "default")
        rails = build_moe_layer(_config(world, "alltoall", cfg))
        megatron_rails.uninstall()
        rails.load_state_dict(stock.state_dict())
        x = x_np.clone().view(-1, 1, H).requires_grad_(True)
        got, _ = rails(x)
        (got * w_np).sum().backward()
        where = f"policy {policy}, rank {rank} ({T_rank[rank]} of {T_rank} tokens)"
        torch.testing.assert_close(got.detach(), want[0], rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}: output\n{m}")
        torch.testing.assert_close(x.grad, want[1], rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}: input grad\n{m}")
        mine = _grads(rails)
        for n, g in want[2].items():
            torch.testing.assert_close(mine[n], g, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}: grad of {n}\n{m}")
        moved = torch.tensor([float(rails.token_dispatcher.metrics[-1]["weight_bytes_sent"])])
        torch.distributed.all_reduce(moved)
        assert policy == "none" or moved.item() > 0, f"{where}: no weights moved, the routing was not skewed"


def test_ranks_with_different_token_counts_match_stock():
    """Ranks holding different numbers of tokens (odd ones too) under skewed routing, every policy
    and the shipped default, on 4 ranks (2 per node: RailS and dedup paths)."""
    spawn(_uneven_worker, 4)


# expert-parallel sizes that are not powers of two, odd top-k, 1..4 slots, nodes of 3 ranks under
# comm: rails (the other tests use EP 1, 2, 4, 8, top-1 / 2 / E and nodes of 2)
ODD_SIZES = {
    "ep3-top3": (3, dict(num_moe_experts=9, moe_router_topk=3), [5, 1, 7],
                 {"slots": 1, "ranks_per_node": 3}),
    "ep6-top5-rails": (6, dict(num_moe_experts=12, moe_router_topk=5), [3, 6, 1, 8, 2, 5],
                       {"slots": 3, "ranks_per_node": 3, "comm": "rails", "rails_tolerance": 0.0}),
}


def _odd_worker(rank, world, overrides, T_rank, rails_cfg):
    import megatron_rails

    torch.manual_seed(1234)
    stock = build_moe_layer(_config(world, "allgather", overrides))
    direction = torch.tensor(np.random.default_rng(17).standard_normal(H), dtype=torch.float32)
    T, T_max = T_rank[rank], max(T_rank)
    gen = torch.Generator().manual_seed(40 + rank)
    # a near-uniform routing, then one where every rank's tokens lean the same way (skewed)
    xs = [torch.randn(T, H, generator=gen) + lean * direction for lean in (0.0, 3.0)]
    w_np = torch.linspace(-1, 1, T * H).view(T, 1, H)
    want = []
    for x_np in xs:  # stock's allgather dispatcher takes one token count: padded, loss weight 0
        stock.zero_grad(set_to_none=True)
        x_pad = torch.cat([x_np, torch.zeros(T_max - T, H)]).view(-1, 1, H).requires_grad_(True)
        out, _ = stock(x_pad)
        (out * torch.cat([w_np, torch.zeros(T_max - T, 1, H)])).sum().backward()
        want.append((out.detach()[:T], x_pad.grad[:T].clone(), _grads(stock)))
    for policy in POLICIES + ["default"]:
        megatron_rails.install({"policy": policy, "check_plan": True, **rails_cfg} if policy != "default"
                               else "default")
        rails = build_moe_layer(_config(world, "alltoall", overrides))
        megatron_rails.uninstall()
        rails.load_state_dict(stock.state_dict())
        for i, (x_np, (o1, g1, w1)) in enumerate(zip(xs, want)):
            rails.zero_grad(set_to_none=True)
            x = x_np.clone().view(-1, 1, H).requires_grad_(True)
            got, _ = rails(x)
            (got * w_np).sum().backward()
            where = f"policy {policy}, routing {i}, rank {rank} ({T} of {T_rank} tokens)"
            torch.testing.assert_close(got.detach(), o1, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}: output\n{m}")
            torch.testing.assert_close(x.grad, g1, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}: input grad\n{m}")
            mine = _grads(rails)
            assert set(mine) == set(w1), where
            for n, g in w1.items():
                torch.testing.assert_close(mine[n], g, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}: grad of {n}\n{m}")
        # the policies that plan on the current counts moved weights (eplb plans on the steps
        # before), and RailS sprayed (where on)
        recs = rails.token_dispatcher.metrics
        seen = torch.tensor([float(sum(r["weight_bytes_sent"] for r in recs)),
                             float(sum(r["rails_sprayed"] for r in recs))])
        torch.distributed.all_reduce(seen)
        assert policy in ("none", "eplb") or seen[0] > 0, f"policy {policy}: no weights moved, the routing was not skewed"
        if rails_cfg.get("comm") == "rails" and policy != "default":
            assert seen[1] > 0, f"policy {policy}: the skewed exchange was not sprayed"


@pytest.mark.parametrize("name", sorted(ODD_SIZES))
def test_odd_expert_parallel_sizes_and_topk_match_stock(name):
    world, overrides, T_rank, rails_cfg = ODD_SIZES[name]
    spawn(_odd_worker, world, overrides, T_rank, rails_cfg)
