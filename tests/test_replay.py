"""Activation recompute is told apart from new microbatches explicitly, not by equal counts.

* Distinct microbatches whose token counts are equal (top-k = E: every token goes to every expert,
  so every microbatch has the same counts) are each a step: the planner runs, a history planner's
  window grows, one metric record each.
* A forward recomputed in backward (Megatron's `tensor_parallel.checkpoint`, torch's reentrant and
  non-reentrant `torch.utils.checkpoint`) is a replay: no planner call, no state change, no record,
  and the gradients equal the stock allgather dispatcher's without recompute. Skewed counts (top-2
  of 4, every token leaning to expert 0), so that every policy's plan uses slots (checked).
* `replaying()` marks replays a framework runs outside a backward pass.
"""
import numpy as np
import pytest
import torch

from moe_harness import build_moe_layer, moe_config, spawn

E, H, T = 4, 16, 8


def _layers(world, policy, topk=E, skew=0.0):
    """skew: added to expert 0's router row, so that tokens leaning along ones(H) prefer it."""
    import megatron_rails

    torch.manual_seed(7)
    stock = build_moe_layer(moe_config(world, "allgather", experts=E, topk=topk, hidden=H))
    megatron_rails.install({"policy": policy, "slots": 1, "comm": "direct", "tolerance": 0.0, "window": 8})
    try:
        rails = build_moe_layer(moe_config(world, "alltoall", experts=E, topk=topk, hidden=H))
    finally:
        megatron_rails.uninstall()
    with torch.no_grad():
        stock.router.weight[0].add_(skew)
    rails.load_state_dict(stock.state_dict())
    return stock, rails


def _count_planner_calls(disp):
    calls = []
    real = disp.runtime.planner.plan

    def plan(counts_DE, state=None):
        calls.append(counts_DE.copy())
        return real(counts_DE, state)

    disp.runtime.planner.plan = plan
    return calls


def _equal_counts_worker(rank, world):
    from megatron_rails.runtime.layer import replaying

    stock, rails = _layers(world, "eplb")
    disp = rails.token_dispatcher
    calls = _count_planner_calls(disp)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(3):  # three different microbatches, identical counts (top-k = E)
        x = torch.randn(T, 1, H, generator=gen)
        out, _ = rails(x)
        ref, _ = stock(x)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert len(calls) == 3 and all(np.array_equal(c, calls[0]) for c in calls), "each microbatch plans"
    assert len(disp.metrics) == 3, "one metric record per microbatch"
    state = disp.runtime.state  # eplb keeps its moving window of loads in the state
    assert state.step == 3 and len(state.history_IE) == 3, f"eplb's window saw {len(state.history_IE)} steps"
    with replaying():  # an explicit replay: planned already, nothing recorded, state kept
        rails(x)
    assert len(calls) == 3 and len(disp.metrics) == 3 and disp.runtime.state.step == 3


def _recompute_worker(rank, world, how, policy):
    from megatron.core import tensor_parallel
    from torch.utils.checkpoint import checkpoint

    # top-2 of 4 with every token leaning towards expert 0 (rank 0's): skewed counts, so that the
    # policies place replicas / slots and the recompute replays a plan that moved weights (at
    # top-k = E the counts are even and nothing would move)
    stock, rails = _layers(world, policy, topk=2, skew=3.0)
    disp = rails.token_dispatcher
    calls = _count_planner_calls(disp)
    gen = torch.Generator().manual_seed(200 + rank)
    # two microbatches in flight, then their backward passes in reverse order (as a pipeline
    # schedule does): each backward recomputes its microbatch's forward
    xs = [torch.randn(T, 1, H, generator=gen) + 0.5 for _ in range(2)]
    w = torch.linspace(-1, 1, T * H).view(T, 1, H)
    grads = {}
    for name, layer, recompute in (("stock", stock, False), ("rails", rails, True)):
        layer.zero_grad(set_to_none=True)
        outs, inputs = [], []
        for x in xs:
            x = x.clone().requires_grad_(True)
            fwd = (lambda t, m=layer: m(t)[0])
            if not recompute:
                out = fwd(x)
            elif how == "megatron":
                out = tensor_parallel.checkpoint(fwd, False, x)
            else:
                out = checkpoint(fwd, x, use_reentrant=(how == "reentrant"))
            outs.append(out)
            inputs.append(x)
        planned = len(calls)  # the forwards' planner calls (a stateless planner routes a locked step's later
        # microbatches on the resident placement without planning afresh)
        for out in reversed(outs):
            (out * w).sum().backward()
        grads[name] = ([x.grad.clone() for x in inputs],
                       {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None})
        if name == "rails":
            assert 1 <= planned <= 2 and len(calls) == planned, f"{how}: the recompute called the planner"
            assert len(disp.metrics) == 2, f"{how}: {len(disp.metrics)} metric records for 2 microbatches"
            # the premise: the replayed plans used slots (summed over ranks)
            used = torch.tensor([float(sum(r["resident_slots"] for r in disp.metrics))])
            torch.distributed.all_reduce(used)
            assert used.item() > 0, f"{how}, {policy}: no slot was used, the recompute replayed a stock layout " \
                f"({[(r['max_over_mean_before'], r['max_over_mean_after']) for r in disp.metrics]})"
    (gx_s, gw_s), (gx_r, gw_r) = grads["stock"], grads["rails"]
    for a, b in zip(gx_r, gx_s):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    store = disp.store
    if hasattr(store, "owner_layout_grads"):  # fsep: the expert grads live on the shards
        gw_r.update({f"experts.{k}": v for k, v in store.owner_layout_grads().items()})
        gw_r.pop(f"experts.{store.PARAM}", None)
    assert set(gw_s) <= set(gw_r)
    for n in gw_s:
        torch.testing.assert_close(gw_r[n], gw_s[n], rtol=1e-5, atol=1e-5, msg=lambda m: f"{how}, {n}: {m}")


def test_equal_counts_are_distinct_steps():
    spawn(_equal_counts_worker, 2)


@pytest.mark.parametrize("how,policy", [("megatron", "eplb"), ("reentrant", "fsep"), ("non-reentrant", "ultraep")])
def test_recompute_is_a_replay(how, policy):
    spawn(_recompute_worker, 2, how, policy)


def test_is_replay_outside_and_inside_backward():
    from megatron_rails.runtime.layer import is_replay, replaying

    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(is_replay())
            return g

    assert not is_replay()
    with replaying():
        assert is_replay()
    assert not is_replay()
    Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen == [True]


def _weight_bytes_worker(rank, world):
    """weight_bytes_sent counts expert weights in the parameters' dtype, whatever the activations'."""
    stock, rails = _layers(world, "ultraep")
    disp = rails.token_dispatcher
    x = torch.randn(T, 1, H)
    rails(x)
    counts_DE = np.zeros((world, E), dtype=np.int64)
    counts_DE[:, 0] = 100  # one hot expert: its owner exports replicas
    plan, _ = disp.runtime.planner.plan(counts_DE, disp.runtime.planner.initial_state())
    experts = list(rails.experts.parameters())
    expert_bytes = sum(p.numel() * p.element_size() for p in experts) // disp.num_local_experts  # fp32 params
    for act_dtype in (torch.float32, torch.bfloat16, torch.float64):
        moved = int(plan.placement.is_moved_R.sum())  # a window fetches every moved replica once
        disp.runtime._record(plan, 0.0, 0.0, x.view(T, H).to(act_dtype), opened=True, fetched=moved)
        rec = disp.runtime.metrics[-1]  # complete (its traffic and weight bytes follow the exchange)
        assert moved > 0 and rec["weight_bytes_sent"] == moved * expert_bytes, (act_dtype, rec["weight_bytes_sent"])
        assert rec["token_bytes_sent"] % (H * torch.empty(0, dtype=act_dtype).element_size()) == 0


def test_weight_bytes_use_the_parameter_dtype():
    spawn(_weight_bytes_worker, 2)
