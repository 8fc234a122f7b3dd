"""RailsTokenDispatcher parity: the MoELayer's output and the gradients of input, router and expert
weights equal those of the stock allgather dispatcher built with identical weights (fp32, 1e-5),
over many random routings per policy: skewed, uniform, all tokens to one expert (so other ranks'
experts get only second choices, some none). Stock Megatron's router rejects a rank with no input
tokens at all, so that case is not part of the comparison."""
import os
import warnings

import numpy as np
import pytest
import torch

import optional
from moe_harness import build_moe_layer, moe_config, spawn

POLICIES = ["none", "eplb", "ultraep", "lp", "fsep"]


def _routing_input(rng, T, H, E, kind, u):
    """Inputs whose router logits follow `kind`: x = c*u + noise, router rows = alpha_e*u + noise."""
    x = rng.standard_normal((T, H)) * 0.5
    if kind == "uniform":
        alpha = np.zeros(E)
    elif kind == "one":
        alpha = np.zeros(E)
        alpha[rng.integers(E)] = 50.0
    else:  # zipf-like skew over a random expert order
        alpha = rng.permutation(3.0 / np.arange(1, E + 1) ** 1.2)
    x = x + 2.0 * u
    return torch.tensor(x, dtype=torch.float32), alpha


def forward_backward(layer, x_np, router_w):
    """One forward and backward of `layer` on x_np [T, H] with router weights router_w: (output,
    the input leaf with its gradient). The loss weighs every output element differently."""
    layer.zero_grad(set_to_none=True)
    with torch.no_grad():
        layer.router.weight.copy_(router_w)
    x = x_np.clone().view(-1, 1, x_np.shape[-1]).requires_grad_(True)
    out, _ = layer(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out, x


def _worker(rank, world, policies, routings, seed, comm="direct", topk=2, dedup=True, require_spray=True):
    """Returns how many of each policy's exchanges RailS sprayed."""
    import megatron_rails

    sprays = {}
    E, H, T = 8, 16, 12
    torch.manual_seed(1234)  # identical router/expert init on the stock and rails layers
    stock = build_moe_layer(moe_config(world, "allgather", experts=E, topk=topk, hidden=H))
    u = np.random.default_rng(99).standard_normal(H)
    u /= np.linalg.norm(u)
    base_router = stock.router.weight.detach().clone()
    for policy in policies:
        megatron_rails.install({"policy": policy, "slots": 2, "ranks_per_node": 2, "interval": 3,
                                "window": 2, "check_plan": True, "comm": comm, "dedup": dedup,
                                "rails_tolerance": 0.0})  # rails: spray whenever a rail is above even
        rails = build_moe_layer(moe_config(world, "alltoall", experts=E, topk=topk, hidden=H))
        megatron_rails.uninstall()
        assert type(rails.token_dispatcher).__name__ == "RailsTokenDispatcher"
        rails.load_state_dict(stock.state_dict())
        rng = np.random.default_rng(seed + 7919 * rank)
        shared = np.random.default_rng(seed)  # the same routing pattern on every rank
        for it in range(routings):
            kind = ["zipf", "uniform", "one", "zipf"][it % 4]
            x_np, alpha = _routing_input(rng, T, H, E, kind, u)
            alpha = _routing_input(shared, T, H, E, kind, u)[1]
            if kind == "one" and rank == 1:  # this rank's tokens skip its own experts entirely
                x_np = x_np + 4.0 * torch.tensor(u, dtype=torch.float32)
            router_w = base_router + torch.tensor(np.outer(alpha, u), dtype=torch.float32)
            outs = []
            for layer in (stock, rails):
                out, x = forward_backward(layer, x_np, router_w)
                grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                         for n, p in layer.named_parameters()}
                store = getattr(layer.token_dispatcher, "store", None)
                if hasattr(store, "owner_layout_grads"):  # fsep: expert grads live on the shards
                    grads.update({f"experts.{k}": v for k, v in store.owner_layout_grads().items()})
                outs.append((out.detach(), x.grad.clone(), grads))
            (o1, g1, w1), (o2, g2, w2) = outs
            where = f"policy {policy}, comm {comm}, top-{topk}, routing {it} ({kind}), rank {rank}"
            torch.testing.assert_close(o2, o1, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}: output\n{m}")
            torch.testing.assert_close(g2, g1, rtol=1e-5, atol=1e-5, msg=lambda m: f"{where}: input grad\n{m}")
            for n in w1:  # every stock parameter, expert weights included
                torch.testing.assert_close(w2[n], w1[n], rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{where}: grad of {n}\n{m}")
        metrics = rails.token_dispatcher.metrics
        assert len(metrics) == routings
        before = np.array([m["max_over_mean_before"] for m in metrics])
        after = np.array([m["max_over_mean_after"] for m in metrics])
        if policy in ("ultraep", "lp"):  # exact-count policies never do worse than stock ...
            assert np.all(after <= before + 1e-12), (policy, before, after)
            # ... and spread an all-to-one-expert step (at top-k = E every expert gets every token:
            # balanced before) unless stock is within the default tolerance (0.05), which they keep
            one = (np.arange(routings) % 4 == 2) & (before > 1.05 + 1e-9)
            assert np.all(after[one] < before[one]), (policy, before[one], after[one])
        if policy == "none":
            np.testing.assert_allclose(after, before)
        elif topk < E or policy == "fsep":  # at top-k = E the counts are even: an owner layout stays as is
            # the skewed routings made the policy place replicas (summed over ranks): the parity
            # above compared slot computation, not only the stock layout
            used = torch.tensor([float(sum(m["replicas_used"] for m in metrics))])
            torch.distributed.all_reduce(used)
            assert used.item() > 0, f"policy {policy}, top-{topk}: no replica used in {routings} routings"
        sprayed = [m["rails_sprayed"] for m in metrics]
        sprays[policy] = sum(sprayed)
        if comm == "rails" and require_spray:  # the parity above covered the sprayed three-phase exchange
            assert any(sprayed), f"policy {policy}: no token exchange was sprayed over the rails"
        elif comm != "rails":
            assert not any(sprayed)
    return sprays

# routings per policy for each world size: 110 + 90 + 4 = 204 per policy in total. CI runs the
# second Megatron-Core version with MEGATRON_RAILS_TEST_SCALE=0.25.
ROUTINGS = {2: 110, 4: 90, 8: 4}


@pytest.mark.parametrize("world", sorted(ROUTINGS))
def test_parity_with_stock_allgather(world):
    scale = float(os.environ.get("MEGATRON_RAILS_TEST_SCALE", "1"))
    routings = max(4, int(ROUTINGS[world] * scale))
    spawn(_worker, world, POLICIES, routings, 11 * world)


# comm: rails on virtual nodes of 2 ranks (ranks_per_node: 2): 2 nodes x 2 at world 4 (8-rank
# topologies of the RailS exchange itself: tests/test_rails_alltoall.py)
RAILS_ROUTINGS = {4: 24}


@pytest.mark.parametrize("world", sorted(RAILS_ROUTINGS))
def test_parity_with_stock_allgather_rails_comm(world):
    scale = float(os.environ.get("MEGATRON_RAILS_TEST_SCALE", "1"))
    routings = max(4, int(RAILS_ROUTINGS[world] * scale))
    # dedup off: the pair traffic, which the skewed routings spray; with dedup (the default) stage 1
    # is rail-matched and often even, so it sprays less (tests/test_dedup.py covers it)
    spawn(_worker, world, POLICIES, routings, 13 * world, "rails", 2, False)

def test_parity_with_the_send_order_made_on_the_device(monkeypatch):
    """The dispatcher with the sync-free send order (runtime/local.order_pairs_on_device, the CUDA
    path) forced on CPU: parity with stock at world 2 and 4 (2 virtual nodes, dedup on)."""
    monkeypatch.setenv("MEGATRON_RAILS_SEND_ORDER", "device")  # the spawned ranks inherit it
    scale = float(os.environ.get("MEGATRON_RAILS_TEST_SCALE", "1"))
    spawn(_worker, 2, POLICIES, max(4, int(20 * scale)), 17)
    spawn(_worker, 4, POLICIES, max(4, int(12 * scale)), 19)


def test_parity_with_the_send_order_made_by_the_triton_kernel(monkeypatch):
    """The dispatcher with the Triton send-order kernel (CUDA's path where Triton is importable), run
    by Triton's interpreter on CPU: parity with stock at world 2, router gradients included (they
    come back through the pairs' probs, gathered outside the kernel)."""
    optional.import_triton()
    monkeypatch.setenv("MEGATRON_RAILS_SEND_ORDER", "triton")  # the spawned ranks inherit both
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spawn(_worker, 2, POLICIES, 4, 23, fresh=True)  # Triton reads it when imported


def _spec_worker(rank, world):
    from megatron_rails.megatron.layers import rails_gpt_layer_local_spec
    from megatron_rails.demo.train import DemoShape, build_model, train_steps

    shape = DemoShape(layers=1)
    spec = rails_gpt_layer_local_spec(shape.experts, moe_grouped_gemm=False, normalization="RMSNorm")
    ref, _ = train_steps(build_model(shape, world, "allgather"), shape, 3, rank, world)
    got, _ = train_steps(build_model(shape, world, "alltoall", layer_spec=spec), shape, 3, rank, world)
    np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_layer_spec_route():
    """RailsMoELayer through a layer spec, without install(): same losses as stock."""
    spawn(_spec_worker, 2)


def test_unbalanced_warning_advice_fits_the_policy():
    """eplb's imbalance comes from its history, not its slot budget: its advice names window and
    interval and never says to raise slots; the per-step planners' says to raise slots."""
    from megatron_rails.core.policy import PolicyConfig
    from megatron_rails.runtime.layer import _unbalanced_advice

    eplb = _unbalanced_advice(PolicyConfig(policy="eplb", window=4, interval=2))
    assert "last 4 steps" in eplb and "every 2 steps" in eplb and "raise slots" not in eplb
    for name in ("ultraep", "lp", "fsep"):
        assert "raise slots" in _unbalanced_advice(PolicyConfig(policy=name, slots=2))


def _refusal_worker(rank, world):
    import megatron_rails

    # each set after validation, which wants CUDA, bf16 or Transformer Engine for it
    for policy, setting, value, word in (
            ("ultraep", "overlap_moe_expert_parallel_comm", True, "overlap_moe_expert_parallel_comm"),
            ("ultraep", "overlap_dispatch_backward_with_experts_wgrad", True, "weight gradients"),
            ("fsep", "transformer_impl", "inference_optimized", "inference_optimized"),
            ("lp", "transformer_impl", "inference_optimized", None),  # owner layout: the stock experts hold weights
            ("none", "overlap_dispatch_backward_with_experts_wgrad", False, None)):
        cfg = moe_config(world, "alltoall")
        setattr(cfg, setting, value)
        megatron_rails.install({"policy": policy})
        try:
            if word is None:
                assert type(build_moe_layer(cfg).token_dispatcher).__name__ == "RailsTokenDispatcher"
            else:
                with pytest.raises(NotImplementedError, match=word):
                    build_moe_layer(cfg)
        finally:
            megatron_rails.uninstall()


def test_settings_the_dispatcher_cannot_serve_are_refused():
    """Refused at build time with the setting's name, not left to fail inside or to train wrongly:
    Megatron's 1F1B all-to-all overlap (it splits the layer's autograd graph into pieces run around
    another microbatch's); megatron-core 0.19's overlap of the dispatch backward with the experts'
    deferred weight gradients (slots' would be missed); fsep under 0.19's inference-optimized
    layers (whose inference dispatcher computes the stock experts, placeholders under fsep). The
    owner-layout policies build under the latter, and with the former off."""
    spawn(_refusal_worker, 1)


def _padding_worker(rank, world):
    import megatron_rails

    for policy, warns in (("ultraep", True), ("none", False)):
        cfg = moe_config(world, "alltoall")
        cfg.moe_expert_capacity_factor, cfg.moe_pad_expert_input_to_capacity = 1.0, True
        megatron_rails.install({"policy": policy})
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                build_moe_layer(cfg)
        finally:
            megatron_rails.uninstall()
        said = [w for w in seen if "moe_pad_expert_input_to_capacity" in str(w.message)]
        assert bool(said) == warns, (policy, [str(w.message) for w in seen])


def test_padding_to_capacity_warns_that_there_is_nothing_to_balance():
    """Drop-and-pad gives every expert its capacity: a balancing policy is told it only adds cost."""
    spawn(_padding_worker, 1)


def _inference_scope(name):
    """0.19's InferenceCudaGraphScope member of that name, as its config holds it; the name on 0.16."""
    try:
        from megatron.core.transformer.enums import InferenceCudaGraphScope
    except ImportError:
        return name
    return None if name is None else InferenceCudaGraphScope[name]


def _cuda_graph_worker(rank, world):
    import megatron_rails

    regions = "cuda_graph_modules" if hasattr(moe_config(world, "alltoall"), "cuda_graph_modules") else \
        "cuda_graph_scope"  # 0.19 / 0.16
    megatron_rails.install({"policy": "ultraep"})
    try:
        for impl, captured, inference, refused in (
                ("local", [], None, True), ("transformer_engine", ["moe_router", "moe_preprocess"], None, True),
                ("transformer_engine", ["attn", "moe_router"], None, False), ("local", ["attn"], "layer", False),
                ("local", ["attn"], "block", True)):  # 0.19's inference graphs over whole blocks
            cfg = moe_config(world, "alltoall")
            cfg.cuda_graph_impl = impl  # set after validation, which wants CUDA and Transformer Engine
            setattr(cfg, regions, captured)
            cfg.inference_cuda_graph_scope = _inference_scope(inference)  # on 0.16 a name it never reads
            if refused:
                fix = "set inference_cuda_graph_scope to layer" if inference == "block" else "capture attn"
                with pytest.raises(NotImplementedError, match=f"CUDA graph .*cuda_graph_impl={impl}.*: {fix}"):
                    build_moe_layer(cfg)
            else:
                build_moe_layer(cfg)
    finally:
        megatron_rails.uninstall()


def test_cuda_graphs_over_the_dispatcher_are_refused():
    """The dispatcher gathers counts and plans on the host every step, which a CUDA graph cannot
    replay: a capture region that holds it (the whole layer, the MoE preprocessing) is refused at
    build time by name; one that does not (attention, the router) is not."""
    spawn(_cuda_graph_worker, 1)


def test_layer_spec_needs_a_number_of_experts():
    """rails_gpt_layer_local_spec builds an MoE layer's spec: without experts Megatron-Core's spec
    has a dense MLP, which the model would only reject when built."""
    import numpy as np

    from megatron_rails.core.policy import ConfigError
    from megatron_rails.megatron.layers import rails_gpt_layer_local_spec

    spec = rails_gpt_layer_local_spec(np.int64(8))
    assert "Rails" in getattr(spec.submodules.mlp, "module", spec.submodules.mlp).__name__ \
        if not hasattr(spec.submodules.mlp, "func") else "Rails" in spec.submodules.mlp.func.__name__
    for bad in (None, 0, -1, "8", 2.5, True):
        with pytest.raises(ConfigError, match="num_experts must be a positive integer"):
            rails_gpt_layer_local_spec(bad)
