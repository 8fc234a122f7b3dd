"""Bad data at run time and rank consistency, on spawned gloo ranks with real Megatron-Core MoELayers.

* a plan that differs on one rank (its counts corrupted) or is invalid on one rank raises
  PlanMismatchError on every rank in debug mode (check_plan), never a hang or a wrong result;
* NaN router logits / an inf router weight, on some tokens (the others stay finite, compared as
  values): the balanced dispatcher gives what the stock allgather dispatcher gives (NaN where it
  has NaN), without crashing or hanging;
* token counts beyond int32 survive the count all-gather and every planner exactly;
* a skew the slot budget cannot absorb yields the best feasible plan, a warning, and the metric.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_harness import build_moe_layer, moe_config, spawn

E, H, T = 8, 16, 12


def _layer(world, policy, **extra):
    import megatron_rails

    megatron_rails.install({"policy": policy, "slots": 1, "ranks_per_node": 2, "check_plan": True, **extra})
    try:
        return build_moe_layer(moe_config(world, "alltoall", experts=E, hidden=H))
    finally:
        megatron_rails.uninstall()


def _consistency_worker(rank, world, policy):
    import megatron_rails
    from megatron_rails.runtime import layer as disp_mod
    from megatron_rails.megatron.dispatcher import PlanMismatchError
    from megatron_rails.core.plan import Plan

    torch.manual_seed(0)
    layer = _layer(world, policy)
    x = torch.randn(T, 1, H)
    layer(x)  # a healthy step first
    disp = layer.token_dispatcher
    real_gather, real_plan = disp_mod.all_gather_counts, disp.planner.plan

    def corrupt_counts(counts_E, group):
        counts = real_gather(counts_E, group).copy()
        counts[0, 0] += 1  # this rank alone believes rank 0 sends one more token to expert 0
        return counts

    def invalid_plan(counts_DE, state=None):
        plan, state = real_plan(counts_DE, state)
        bad = plan.quota_R.copy()
        bad[0] += 1  # quotas no longer add up to expert 0's tokens
        return Plan.trusted(plan.placement, plan.counts_DE, bad, plan.policy), state

    for what in ("counts", "plan"):
        x = torch.randn(T, 1, H)  # new counts: a replayed forward would reuse its earlier plan
        megatron_rails.new_step()  # a new optimizer step: the planner's plan runs (not the resident placement's)
        if rank == world - 1:
            if what == "counts":
                disp_mod.all_gather_counts = corrupt_counts
            else:
                disp.planner.plan = invalid_plan
        try:
            with pytest.raises(PlanMismatchError, match="digests differ" if what == "counts" else "validation"):
                layer(x)
        finally:
            disp_mod.all_gather_counts, disp.planner.plan = real_gather, real_plan
    out, _ = layer(x)  # the group is still usable afterwards
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("policy", ["ultraep", "fsep"])
def test_corrupted_rank_is_detected_on_every_rank(policy):
    spawn(_consistency_worker, 4, policy)


def _poison_logits(layer, value):
    """The router's logits for expert 3 set to `value` on the tokens whose first input feature is
    positive: a NaN router weight would poison every token (NaN * anything is NaN), leaving nothing
    finite to compare."""
    gating = layer.router.gating

    def poisoned(inp):
        logits = gating(inp).clone()
        rows = inp.reshape(-1, inp.shape[-1])[:, 0] > 0
        logits.view(-1, logits.shape[-1])[rows, 3] = value
        return logits

    layer.router.gating = poisoned


def _nan_worker(rank, world):
    for policy in ("ultraep", "fsep", "lp"):
        torch.manual_seed(1234)
        stock = build_moe_layer(moe_config(world, "allgather", experts=E, hidden=H))
        rails = _layer(world, policy)
        rails.load_state_dict(stock.state_dict())
        for poison in (float("nan"), float("inf")):
            for layer in (stock, rails):
                if poison != poison:  # NaN: in the logits of some tokens
                    _poison_logits(layer, poison)
                else:  # inf in a router weight: +inf logits where x[:, 0] > 0 (NaN outputs), -inf elsewhere
                    with torch.no_grad():
                        layer.router.weight[3, 0] = poison
            x = torch.randn(T, 1, H, generator=torch.Generator().manual_seed(rank))
            ref, _ = stock(x)
            got, _ = rails(x)
            # some tokens poisoned, some finite: equal_nan must not hide a wrong finite value
            finite = torch.isfinite(ref)
            assert finite.any() and not finite.all(), f"{policy}, router {poison}: {int(finite.sum())} finite"
            torch.testing.assert_close(got, ref, equal_nan=True, msg=lambda m: f"{policy}, router {poison}: {m}")
            with torch.no_grad():
                for layer in (stock, rails):
                    layer.router.__dict__.pop("gating", None)  # the class's gating again
                    layer.router.weight.copy_(stock.router.weight.nan_to_num(0.0, 0.0, 0.0))


def test_nan_and_inf_router_match_stock():
    spawn(_nan_worker, 2)


def _int32_worker(rank, world):
    import torch.distributed as dist

    from megatron_rails.runtime.comm import all_gather_counts

    big = torch.tensor([2**31 + 7 * rank, 3 * 2**32, 0, 5], dtype=torch.int64)
    got = all_gather_counts(big, dist.group.WORLD)
    want = np.array([[2**31 + 7 * r, 3 * 2**32, 0, 5] for r in range(world)], dtype=np.int64)
    np.testing.assert_array_equal(got, want)


def test_counts_beyond_int32_survive_the_gather():
    spawn(_int32_worker, 2, megatron=False)


@pytest.mark.parametrize("policy", ["none", "eplb", "ultraep", "lp", "fsep"])
def test_counts_beyond_int32_plan_exactly(policy):
    from megatron_rails.core.planners import PlannerConfig, make_planner

    rng = np.random.default_rng(5)
    counts = rng.integers(2**31, 2**33, size=(8, 16), dtype=np.int64)
    counts[:, 3] *= 6  # a hot expert, total tokens ~ 2**37
    plan, _ = make_planner(policy, PlannerConfig(8, 16, 4, 2)).plan(counts)
    plan.validate()
    ptr, rep, tok = plan.route
    src = np.repeat(np.arange(8), np.diff(ptr))
    got = np.zeros_like(counts)
    np.add.at(got, (src, plan.placement.replica_expert_R[rep]), tok)  # independent recount of the route
    np.testing.assert_array_equal(got, counts)
    assert plan.load_D.sum() == counts.sum()


def _unbalanceable_worker(rank, world):
    import warnings

    from megatron_rails.core.planners import PlannerConfig, make_planner

    layer = _layer(world, "ultraep", slots=1)
    # experts 0-5 (owned by ranks 0, 1 and 2) equally loaded, 6 and 7 (rank 3's) idle: token t goes
    # to experts 2j and 2j+1, j = t % 3 (top-2). Rank 3's one slot holds one replica, at most one
    # expert's load (1/6 of the total, the mean is 1/4), so ranks 0-2 keep at least 5/18 each: no
    # placement in one slot per rank balances it. (Every token to one expert would not do: the
    # owner and three slots split it evenly.)
    with torch.no_grad():
        layer.router.weight.zero_()
        for j in range(3):
            layer.router.weight[2 * j, j] = 1.0
            layer.router.weight[2 * j + 1, j] = 0.5
    x = torch.zeros(T, 1, H)
    x[torch.arange(T), 0, torch.arange(T) % 3] = 1.0
    counts = np.zeros((world, E), dtype=np.int64)
    counts[:, :6] = T * 2 // 6
    best, _ = make_planner("ultraep", PlannerConfig(world, E, 2, 1)).plan(counts)
    assert best.load_D.max() * world > 1.05 * best.load_D.sum(), f"the planner absorbs this skew: {best.load_D}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, _ = layer(x)
        layer(x)
    m = layer.token_dispatcher.metrics[-1]
    n = T * world * 2  # top-2
    assert m["tokens_per_rank_before"] == [2 * n // 6] * 3 + [0], m["tokens_per_rank_before"]
    # it spreads the load as well as one slot per rank allows (the best feasible plan: rank 3 takes
    # one expert's load, the other ranks share the rest) ...
    assert m["max_over_mean_after"] < m["max_over_mean_before"]
    assert max(m["tokens_per_rank_after"]) == -(-(n - n // 6) // 3), m["tokens_per_rank_after"]
    # ... which is not balanced: a warning and the metric
    assert m["max_over_mean_after"] > 1.05, m["tokens_per_rank_after"]
    # two microbatches (equal counts are distinct steps, not replays: tests/test_replay.py), both
    # counted; the warning comes once per layer
    records = list(layer.token_dispatcher.metrics)
    assert [(r["unbalanced"], r["unbalanced_steps"]) for r in records] == [(True, 1), (True, 2)], records
    if rank == 0:
        said = [str(w.message) for w in caught if "cannot absorb" in str(w.message)]
        assert len(said) == 1, [str(w.message) for w in caught]
    assert sum(m["tokens_per_rank_after"]) == n
    assert torch.isfinite(out).all()


def test_unbalanceable_skew_reports_best_plan_and_warns():
    spawn(_unbalanceable_worker, 4)


def _recompute_worker(rank, world):
    """Activation recompute runs each MoE forward twice: the replay must reuse the plan (same result,
    a history-based planner's state advanced once per step) and gradients must match stock."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(1234)
    stock = build_moe_layer(moe_config(world, "allgather", experts=E, hidden=H))
    rails = _layer(world, "eplb", slots=2, interval=1, window=2)
    rails.load_state_dict(stock.state_dict())
    gen = torch.Generator().manual_seed(rank + 17)
    for step in range(4):
        x0 = torch.randn(T, 1, H, generator=gen) + (step % 2) * 2.0  # routings differ step to step
        got = []
        for layer in (stock, rails):
            layer.zero_grad(set_to_none=True)
            x = x0.clone().requires_grad_(True)
            y = checkpoint(lambda inp: layer(inp)[0], x, use_reentrant=True, preserve_rng_state=False)
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
            got.append((y.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in layer.named_parameters()
                                                     if p.grad is not None}))
        (y1, g1, w1), (y2, g2, w2) = got
        torch.testing.assert_close(y2, y1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g2, g1, rtol=1e-5, atol=1e-5)
        for n in w1:
            torch.testing.assert_close(w2[n], w1[n], rtol=1e-5, atol=1e-5, msg=lambda m: f"step {step} {n}: {m}")
    # one planner call and one metric record per step, not two (the recompute replays)
    assert len(rails.token_dispatcher.metrics) == 4, len(rails.token_dispatcher.metrics)


def test_activation_recompute_replays_the_plan():
    spawn(_recompute_worker, 2)
