"""Grouped expert modules under RailsTokenDispatcher, and its metrics in Megatron's MoE tracker.

* parity: a MoELayer with GroupedMLP (legacy grouped_gemm, megatron-core 0.16 only) or TEGroupedMLP
  (over a CPU stand-in for Transformer Engine's GroupedLinear, both versions) gives the same output
  and gradients (input, router, every expert weight) as the stock allgather dispatcher with the same
  weights, under ultraep, lp and fsep, on 2 and 4 gloo ranks, over skewed random routings; variants
  cover GLU and plain activations, expert biases, the fused bias-SwiGLU, probs applied on the input,
  and Transformer Engine style fused weight-gradient accumulation into `main_grad`;
* checkpoints: a layer trained under fsep saves a stock-layout state_dict that a stock layer loads
  strictly and computes the same with (and a fresh fsep layer re-shards);
* clear errors for expert modules the stores cannot handle;
* metrics: after forward/backward Megatron's tracker holds the dispatcher's values per layer number
  (checked against the dispatcher's record and a recount from the routing), and the end-of-step
  report logs them although the caller names only its own metrics (as Megatron-LM's loop does).

CPU stand-ins (tests/cpu_experts.py): a reference grouped_gemm installed before megatron is imported
in the spawned ranks, and CpuGroupedLinear. torch.compile (Megatron's jit_fuser) is turned off in the
ranks: it only costs compile time here.
"""
import multiprocessing
import types

import cpu_experts
import numpy as np
import pytest
import torch
from moe_harness import moe_config, spawn

if multiprocessing.parent_process() is not None:  # a spawned rank: before megatron imports grouped_gemm
    cpu_experts.install_fake_grouped_gemm()


def _has_legacy_grouped_mlp() -> bool:
    from megatron.core.transformer.moe import experts as mx

    return hasattr(mx, "GroupedMLP")


def _rank_setup():
    cpu_experts.install_fake_grouped_gemm()
    import torch._dynamo

    torch._dynamo.config.disable = True


# variant -> (expert kind, TransformerConfig overrides, top-k, fused-wgrad emulation)
GELU = {"gated_linear_unit": False, "activation_func": torch.nn.functional.gelu}
VARIANTS = {
    "grouped_glu": ("grouped", {}, 2, False),
    "grouped_gelu_probs_on_input": ("grouped", {**GELU, "moe_apply_probs_on_input": True}, 1, False),
    "te_glu_bias_fused_swiglu": ("te_grouped", {"add_bias_linear": True, "bias_activation_fusion": True}, 2, False),
    "te_gelu_bias_main_grad": ("te_grouped", {**GELU, "add_bias_linear": True}, 2, True),
}


def _config(world, dispatcher, variant, E=8, H=16, num_layers=1):
    import dataclasses

    kind, over, topk, _ = VARIANTS[variant]
    cfg = moe_config(world, dispatcher, experts=E, hidden=H)
    extra = {"moe_grouped_gemm": True, "bf16": True} if kind == "grouped" else {}  # GroupedMLP asserts bf16
    if topk != cfg.moe_router_topk:  # Megatron wants the softmax before a top-1 choice
        extra.update(moe_router_topk=topk, moe_router_pre_softmax=topk == 1)
    return dataclasses.replace(cfg, num_layers=num_layers, **extra, **over)


def _build(variant, cfg):
    from megatron.core.transformer.moe import experts as mx
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from mcore_versions import grouped_experts_spec
    from megatron_rails.megatron.compat import build_moe_layer, moe_submodules

    kind = VARIANTS[variant][0]
    if kind == "grouped":
        layer = build_moe_layer(cfg, grouped_gemm=True)
    else:
        subs = moe_submodules(cfg.num_moe_experts)
        subs.experts = grouped_experts_spec(mx.TEGroupedMLP, cpu_experts.CpuGroupedLinear,
                                            cpu_experts.CpuGroupedLinear)
        layer = MoELayer(cfg, subs)
    expected = {"grouped": "GroupedMLP", "te_grouped": "TEGroupedMLP"}[kind]
    assert type(layer.experts).__name__ == expected, type(layer.experts)
    return layer


def _build_rails(variant, world, policy, E=8, H=16):
    import megatron_rails

    megatron_rails.install({"policy": policy, "slots": 2, "ranks_per_node": 2, "interval": 3, "window": 2,
                            "check_plan": True})
    try:
        layer = _build(variant, _config(world, "alltoall", variant, E, H))
    finally:
        megatron_rails.uninstall()
    assert type(layer.token_dispatcher).__name__ == "RailsTokenDispatcher"
    return layer


def _routing_input(rng, shared, T, H, E, kind, u, rank):
    x = torch.tensor(rng.standard_normal((T, H)) * 0.5 + 2.0 * u, dtype=torch.float32)
    if kind == "uniform":
        alpha = np.zeros(E)
    elif kind == "one":
        alpha = np.zeros(E)
        alpha[shared.integers(E)] = 50.0
        if rank == 1:  # this rank's tokens skip its own experts entirely
            x = x + 4.0 * torch.tensor(u, dtype=torch.float32)
    else:  # zipf-like skew over a random expert order, the same on every rank
        alpha = shared.permutation(3.0 / np.arange(1, E + 1) ** 1.2)
    return x, alpha


def _grads(layer, main_grad):
    grads = {}
    for n, p in layer.named_parameters():
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        if main_grad and hasattr(p, "main_grad"):  # Megatron DDP: main_grad, plus .grad unless flagged
            g = p.main_grad.clone() + (0 if getattr(p, "grad_added_to_main_grad", False) else g)
        grads[n] = g
    store = getattr(layer.token_dispatcher, "store", None)
    if hasattr(store, "owner_layout_grads"):  # fsep: expert grads live on the shards
        grads.update({f"experts.{k}": v for k, v in store.owner_layout_grads().items()})
    return grads


def _parity_worker(rank, world, variant, policies, routings, seed):
    _rank_setup()
    E, H, T = 8, 16, 12
    main_grad = VARIANTS[variant][3]
    cpu_experts.CpuGroupedLinear.fuse_wgrad = main_grad
    torch.manual_seed(1234)
    stock = _build(variant, _config(world, "allgather", variant, E, H))
    u = np.random.default_rng(99).standard_normal(H)
    u /= np.linalg.norm(u)
    base_router = stock.router.weight.detach().clone()
    for policy in policies:
        rails = _build_rails(variant, world, policy, E, H)
        rails.load_state_dict(stock.state_dict())
        with_main_grad = main_grad and policy != "fsep"
        rng, shared = np.random.default_rng(seed + 7919 * rank), np.random.default_rng(seed)
        for it in range(routings):
            kind = ["zipf", "uniform", "one", "zipf"][it % 4]
            x_np, alpha = _routing_input(rng, shared, T, H, E, kind, u, rank)
            router_w = base_router + torch.tensor(np.outer(alpha, u), dtype=torch.float32)
            outs = []
            for layer in (stock, rails):
                layer.zero_grad(set_to_none=True)
                if layer is rails and with_main_grad:
                    for p in layer.experts.parameters():
                        p.main_grad = torch.zeros_like(p)
                        p.grad_added_to_main_grad = False
                with torch.no_grad():
                    layer.router.weight.copy_(router_w)
                x = x_np.clone().view(-1, 1, H).requires_grad_(True)
                out, _ = layer(x)
                (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
                outs.append((out.detach(), x.grad.clone(), _grads(layer, layer is rails and with_main_grad)))
            (o1, g1, w1), (o2, g2, w2) = outs
            where = f"{variant}, policy {policy}, routing {it} ({kind}), rank {rank}"
            for what, got, want in [("output", o2, o1), ("input grad", g2, g1)] + \
                    [(f"grad of {n}", w2[n], w1[n]) for n in w1]:  # every stock parameter, biases too
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5,
                                           msg=lambda m, w=f"{where}: {what}": f"{w}\n{m}")
        replicas = sum(m["replicas_used"] for m in rails.token_dispatcher.metrics)
        assert replicas > 0, f"{variant} {policy}: no replica or FSEP slot was ever used"


ROUTINGS = 20
CASES = [(v, w) for v in VARIANTS for w in (2, 4)]


@pytest.mark.parametrize("variant,world", CASES, ids=[f"{v}-{w}" for v, w in CASES])
def test_parity_with_stock_allgather(variant, world):
    if VARIANTS[variant][0] == "grouped" and not _has_legacy_grouped_mlp():
        pytest.skip("this megatron-core has no legacy GroupedMLP (0.16 has it, 0.19 removed it)")
    spawn(_parity_worker, world, variant, ["ultraep", "lp", "fsep"], ROUTINGS, 17 * world + len(variant))


def _ckpt_worker(rank, world, variant):
    _rank_setup()
    E, H, T = 8, 16, 12
    torch.manual_seed(4321)
    stock = _build(variant, _config(world, "allgather", variant, E, H))
    rails = _build_rails(variant, world, "fsep", E, H)
    # biases stay stock parameters that train, out of the shards (tests/test_fsep_biases.py)
    biases = [n for n, p in rails.experts.named_parameters() if p.dim() == 1 and p.requires_grad]
    assert bool(biases) == VARIANTS[variant][1].get("add_bias_linear", False), (variant, biases)
    assert not set(biases) & set(rails.token_dispatcher.store.params), (variant, biases)
    rails.load_state_dict(stock.state_dict())
    gen = torch.Generator().manual_seed(7 + rank)
    skew = torch.linspace(0, 3, H)  # inputs that favour a few experts
    for _ in range(3):  # train the shards away from the stock initialisation
        rails.zero_grad(set_to_none=True)
        out, _ = rails(torch.randn(T, 1, H, generator=gen) + skew)
        out.square().mean().backward()
        with torch.no_grad():
            for p in rails.parameters():
                if p.grad is not None:
                    p -= 0.5 * p.grad
    state = rails.state_dict()  # collective under fsep
    stock_keys = set(stock.state_dict())
    assert set(state) == stock_keys, set(state) ^ stock_keys
    moved = [k for k in stock_keys if "experts" in k and not torch.equal(state[k], stock.state_dict()[k])]
    assert moved, "training under fsep did not change the saved expert weights"
    loaded = _build(variant, _config(world, "allgather", variant, E, H))
    loaded.load_state_dict(state, strict=True)
    if VARIANTS[variant][0] == "grouped":  # the CPU stand-in for TE's grouped linear has no sharded_state_dict
        _optimizer_entries_match_stock(rails, loaded, f"{variant}, rank {rank}")
    again = _build_rails(variant, world, "fsep", E, H)  # a stock-layout checkpoint re-shards on load
    again.load_state_dict(state, strict=True)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(T, 1, H, generator=gen) + skew
            want, _ = rails(x)
            for other in (loaded, again):
                got, _ = other(x)
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _built(sharded: dict) -> dict:
    """{(key, global offset): data} of every ShardedTensor a sharded state dict holds, factories built."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    def leaves(x):
        return nested_values(x) if isinstance(x, (dict, list)) else [x]

    out = {}
    for v in nested_values(sharded):
        for t in leaves(v.build()) if isinstance(v, ShardedTensorFactory) else [v]:
            if isinstance(t, ShardedTensor):
                out[t.key, t.global_offset] = t.data
    return out


def _optimizer_entries_match_stock(rails, stock, where):
    """An optimizer's entry of fsep's shards (as Megatron's optimizers make it: `data` replaced by a
    state tensor shaped like the shards, `key` prefixed) builds into the stock entries of the
    module's expert kind, here over the shards' values: stock's entries over the same weights."""
    from dataclasses import replace

    store = rails.token_dispatcher.store
    ours = rails.sharded_state_dict()
    factory = next(v for k, v in ours.items() if k.endswith(store.PARAM))
    prefix = "optimizer.state.exp_avg."
    got = _built({"x": replace(factory, key=prefix + factory.key, data=store.shards.detach().clone())})
    want = {k: v for k, v in _built(stock.sharded_state_dict()).items() if ".experts." in k[0]}
    assert want and {(prefix + k, o) for k, o in want} == set(got), (where, sorted(want), sorted(got))
    for (k, o), v in want.items():
        torch.testing.assert_close(got[prefix + k, o], v, rtol=0, atol=0, msg=lambda m: f"{where}: {k} {o}\n{m}")


@pytest.mark.parametrize("variant", ["grouped_glu", "te_glu_bias_fused_swiglu"])
def test_fsep_checkpoint_round_trip(variant):
    if VARIANTS[variant][0] == "grouped" and not _has_legacy_grouped_mlp():
        pytest.skip("this megatron-core has no legacy GroupedMLP (0.16 has it, 0.19 removed it)")
    spawn(_ckpt_worker, 2, variant)


# -- unsupported modules: clear errors --------------------------------------------------------------

def test_unsupported_expert_module_is_named():
    from megatron_rails.megatron.expert_kinds import UnsupportedExperts, expert_kind

    class MyExperts(torch.nn.Module):
        num_local_experts = 2
        config = types.SimpleNamespace(fp8=None, fp4=None)

    with pytest.raises(TypeError, match=r"MyExperts.*unknown expert module class.*Supported: SequentialMLP") as err:
        expert_kind(MyExperts())
    assert isinstance(err.value, UnsupportedExperts)


def test_fp8_delayed_wgrad_and_single_grouped_weight_are_refused():
    from megatron.core.transformer.moe import experts as mx

    from megatron_rails.megatron.expert_kinds import UnsupportedExperts, expert_kind

    class Seq(mx.SequentialMLP):
        def __init__(self, fp8, delay_wgrad_compute=False):
            torch.nn.Module.__init__(self)
            self.num_local_experts = 1
            self.local_experts = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
            self.config = types.SimpleNamespace(fp8=fp8, fp4=None, delay_wgrad_compute=delay_wgrad_compute)

    assert expert_kind(Seq(None)).name == "sequential"
    with pytest.raises(UnsupportedExperts, match="Seq.*fp8/fp4"):
        expert_kind(Seq("hybrid"))
    with pytest.raises(UnsupportedExperts, match="Seq.*delay_wgrad_compute"):
        expert_kind(Seq(None, delay_wgrad_compute=True))

    class TE(mx.TEGroupedMLP):
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.num_local_experts = 2
            self.config = types.SimpleNamespace(fp8=None, fp4=None)
            self.linear_fc1 = torch.nn.Linear(2, 8)
            self.linear_fc1.single_grouped_weight = True
            self.linear_fc2 = torch.nn.Linear(4, 2)

    with pytest.raises(UnsupportedExperts, match="TE.*one grouped weight tensor"):
        expert_kind(TE())


# -- Transformer Engine proper (GPU only) -----------------------------------------------------------

def _have_te_cuda() -> bool:
    import importlib.util

    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def _te_worker(rank, world):
    from megatron_rails.megatron.compat import build_moe_layer
    from megatron_rails.megatron.expert_kinds import expert_kind

    cfg = moe_config(world, "allgather", experts=4, hidden=64, ffn=128)
    experts = build_moe_layer(cfg, grouped_gemm=True, use_te=True).experts.cuda()
    assert type(experts).__name__ == "TEGroupedMLP"
    kind = expert_kind(experts)
    params = dict(experts.named_parameters())
    for i in range(kind.num_local):
        x = torch.randn(5, 64, device="cuda")
        probs = torch.rand(5, device="cuda")
        tokens = torch.zeros(kind.num_local, dtype=torch.int64)
        tokens[i] = 5
        want, _ = experts(x, tokens, probs)
        slot = {n: view(params[p]) for n, (p, view) in zip(kind.slot_names, kind.slices(i))}
        torch.testing.assert_close(kind.compute(slot, x, probs), want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not _have_te_cuda(), reason="needs Transformer Engine and CUDA to build TE's GroupedLinear; "
                    "the TEGroupedMLP adapter is covered on CPU by the te_* parity variants")
def test_te_grouped_linear_adapter_matches_stock_module():
    spawn(_te_worker, 1)


# -- metrics in Megatron's tracker ------------------------------------------------------------------

class _Writer:
    def __init__(self):
        self.scalars = {}

    def add_scalar(self, name, value, iteration):
        self.scalars[name] = float(value)


def _metrics_worker(rank, world):
    import torch.distributed as dist
    from megatron.core import tensor_parallel
    from moe_harness import build_moe_layer

    import megatron_rails
    import mcore_versions
    from megatron_rails.megatron.metrics import TRACKED

    E, H, T, L = 8, 16, 12, 3
    torch.manual_seed(99)
    megatron_rails.install({"policy": "ultraep", "slots": 1, "ranks_per_node": 2})
    try:
        import dataclasses

        cfg = dataclasses.replace(moe_config(world, "alltoall", experts=E, hidden=H), num_layers=L)
        layers = {1: build_moe_layer(cfg), 3: build_moe_layer(cfg)}  # a MoE layer at 1 and 3 of 3
    finally:
        megatron_rails.uninstall()
    maps = {}
    for number, layer in layers.items():
        layer.set_layer_number(number)
        with torch.no_grad():  # a strong skew towards expert 0 (rank 0's)
            layer.router.weight[0] += 2.0
        layer.router.register_forward_hook(lambda mod, inp, out, n=number: maps.setdefault(n, []).append(out[1]))
    mcore_versions.clear_moe_metrics()
    gen = torch.Generator().manual_seed(rank)
    skew = torch.ones(H)
    layers[1].eval()
    with torch.no_grad():  # evaluation (Megatron's evaluate()): nothing goes to the tracker
        layers[1](torch.randn(T, 1, H, generator=gen) + skew)
    layers[1].train()
    values = [mcore_versions.moe_metric_values(n) for n in TRACKED]
    assert all(v is None or not v.any() for v in values)
    maps.clear()
    records = {n: [] for n in layers}
    recount = {n: [] for n in layers}
    for micro in range(2):  # two microbatches, the second under Megatron's activation recompute
        for number, layer in layers.items():
            x = torch.randn(T, 1, H, generator=gen).add_(skew).requires_grad_(True)
            if micro == 0:
                out, _ = layer(x)
            else:  # its first forward runs without autograd, the replay inside the backward
                out = tensor_parallel.checkpoint(lambda inp, m=layer: m(inp)[0], False, x)
            out.sum().backward()
            disp = layer.token_dispatcher
            records[number].append(disp.metrics[-1])
            # independent recount: expert counts from the routing map, pairs actually received
            counts = [torch.zeros(E, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(counts, maps[number][-1].sum(0).to(torch.int64))
            before = torch.stack(counts).sum(0).view(world, E // world).sum(1).double()
            got = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(got, torch.tensor([sum(disp.runtime.sent.recv_D)]))
            after = torch.cat(got).double()
            recount[number].append((float(before.max() / before.mean()), float(after.max() / after.mean())))
    for name, key in TRACKED.items():
        values = mcore_versions.moe_metric_values(name)
        assert values is not None and values.shape == (L,), (name, values)
        assert values[1] == 0, f"{name}: nothing was recorded for layer 2, got {values}"
        for number in layers:
            want = sum(r[key] for r in records[number])  # summed over microbatches, as Megatron's own
            assert abs(float(values[number - 1]) - want) <= 1e-3 * max(1.0, abs(want)), (name, number, values, want)
    for number in layers:
        for r, (before, after) in zip(records[number], recount[number]):
            assert abs(r["max_over_mean_before"] - before) < 1e-9 and abs(r["max_over_mean_after"] - after) < 1e-9
        assert max(b for b, _ in recount[number]) > 1.2, "the routing was not skewed"
    summary = megatron_rails.metrics_summary(list(layers.values()))
    assert summary == {n: records[n][-1] for n in layers}
    # Megatron's end-of-step report, asked (as Megatron-LM's training log asks) for its own names only
    writer = _Writer()
    mcore_versions.report_moe_metrics(loss_scale=0.5, iteration=7, writer=writer, track_names=[], num_layers=L,
                              per_layer_logging=True)
    for name, key in TRACKED.items():
        per_layer = {}
        for number in layers:  # mean over microbatches, then averaged over data-parallel ranks
            mean = torch.tensor([0.5 * sum(r[key] for r in records[number])], dtype=torch.float64)
            dist.all_reduce(mean)
            per_layer[number] = float(mean) / world
        want = sum(per_layer.values()) / L  # Megatron divides by the number of MoE layers
        assert name in writer.scalars, (name, sorted(writer.scalars))
        assert abs(writer.scalars[name] - want) <= 1e-3 * max(1.0, abs(want)), (name, writer.scalars[name], want)
        for number, v in per_layer.items():
            logged = writer.scalars[f"moe/{name}_layer_{number - 1}"]
            assert abs(logged - v) <= 1e-3 * max(1.0, abs(v)), (name, number, logged, v)
        assert not mcore_versions.moe_metric_values(name).any(), "the report clears the tracker"


def test_metrics_reach_megatron_tracker_and_report():
    spawn(_metrics_worker, 2)
