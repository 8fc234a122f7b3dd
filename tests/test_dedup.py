"""Token dedup across nodes (runtime/dedup.py) on 4 gloo ranks as 2 virtual nodes of 2.

- parity with the stock allgather dispatcher (output, input and every parameter gradient, fp32
  1e-5) with dedup on, top-k 1, 2, 4 and 8 of 8 experts, skewed, uniform and all-to-one routing,
  every policy, `comm: direct` and `comm: rails` (sprayed);
- dedup on and off give the same forward bits, and the same gradients;
- the metrics' inter-node bytes: with dedup, the distinct (token, remote node) pairs counted from
  the router's own routing map (policy none, where a pair goes to its expert's owner), never more
  than without, equal to it at top-1.
"""
import os

import numpy as np
import pytest
import torch

from moe_harness import build_moe_layer, moe_config, spawn
from test_dispatcher import POLICIES, _routing_input, _worker, forward_backward

TOPKS = (1, 2, 4, 8)
E, H, T = 8, 16, 12


def _parity_worker(rank, world, comm, routings):
    sprays = {}
    for topk in TOPKS:
        # at top-8 of 8 every rank sends each token once to the other node, rail-matched: even
        # rails, nothing to spray; the count is checked over the whole run instead
        sprays[topk] = _worker(rank, world, POLICIES, routings, 17 * topk, comm, topk, True, require_spray=False)
    if comm == "rails":
        assert sum(sum(s.values()) for s in sprays.values()) > 0, f"nothing sprayed: {sprays}"


@pytest.mark.parametrize("comm", ["direct", "rails"])
def test_parity_with_stock_dedup_on(comm):
    scale = float(os.environ.get("MEGATRON_RAILS_TEST_SCALE", "1"))
    spawn(_parity_worker, 4, comm, max(4, int(8 * scale)))


def test_training_with_recompute_across_nodes_matches_stock():
    """Optimizer steps of accumulated microbatches (no_sync), each layer forward recomputed in
    backward (Megatron's checkpoint), on 2 virtual nodes: the deduplicated exchange runs again
    inside backward and the losses and weights after every step equal stock's (tests/test_lifecycle.py)."""
    from test_lifecycle import _worker as lifecycle_worker

    spawn(lifecycle_worker, 4, ("ultraep", "fsep"), True, True, False, 2)


def _distinct_remote_nodes(routing_map_TE: torch.Tensor, rank: int, world: int, G: int) -> int:
    """The reference: (token, node) pairs of this rank's tokens on nodes other than its own, when
    expert e lives on rank e // (E / world) (stock placement)."""
    node_E = (np.arange(E) // (E // world)) // G
    on_node_TV = np.zeros((routing_map_TE.shape[0], world // G), dtype=bool)
    for e in np.flatnonzero(routing_map_TE.any(dim=0).numpy()):
        on_node_TV[:, node_E[e]] |= routing_map_TE[:, e].numpy()
    on_node_TV[:, rank // G] = False
    return int(on_node_TV.sum())


def _on_off_worker(rank, world, comm, routings):
    import torch.distributed as dist

    import megatron_rails

    G = 2
    for topk in TOPKS:
        torch.manual_seed(4321)
        base = build_moe_layer(moe_config(world, "allgather", experts=E, topk=topk, hidden=H))
        u = np.random.default_rng(5).standard_normal(H)
        u /= np.linalg.norm(u)
        router0 = base.router.weight.detach().clone()
        for policy in POLICIES:
            layers = []
            for dedup in (True, False):
                megatron_rails.install({"policy": policy, "slots": 2, "ranks_per_node": G, "comm": comm,
                                        "dedup": dedup, "rails_tolerance": 0.0, "check_plan": True})
                layer = build_moe_layer(moe_config(world, "alltoall", experts=E, topk=topk, hidden=H))
                megatron_rails.uninstall()
                layer.load_state_dict(base.state_dict())
                layers.append(layer)
            rng, shared = np.random.default_rng(rank + 10 * topk), np.random.default_rng(topk)
            for it in range(routings):
                kind = ["zipf", "uniform", "one"][it % 3]
                x_np, _ = _routing_input(rng, T, H, E, kind, u)
                alpha = _routing_input(shared, T, H, E, kind, u)[1]
                router_w = router0 + torch.tensor(np.outer(alpha, u), dtype=torch.float32)
                outs = []
                for layer in layers:
                    out, x = forward_backward(layer, x_np, router_w)
                    outs.append((out.detach(), x.grad.clone(), layer.router.weight.grad.clone()))
                    with torch.no_grad():
                        routing_map = layer.router(x.detach())[1].reshape(-1, E)
                where = f"top-{topk} {policy} {comm} routing {it} ({kind}) rank {rank}"
                (o_on, gx_on, gr_on), (o_off, gx_off, gr_off) = outs
                assert torch.equal(o_on, o_off), f"{where}: forward differs with dedup on and off"
                torch.testing.assert_close(gx_on, gx_off, rtol=1e-6, atol=1e-6, msg=lambda m: f"{where}: {m}")
                torch.testing.assert_close(gr_on, gr_off, rtol=1e-6, atol=1e-6, msg=lambda m: f"{where}: {m}")
                m_on, m_off = (ly.token_dispatcher.metrics[-1] for ly in layers)
                assert m_on["dedup"] and not m_off["dedup"]
                assert m_on["internode_token_bytes_pairs"] == m_off["internode_token_bytes"], where
                assert m_on["internode_token_bytes"] == m_on["internode_token_bytes_dedup"], where
                assert m_on["internode_token_bytes_dedup"] <= m_on["internode_token_bytes_pairs"], where
                if topk == 1:
                    assert m_on["internode_token_bytes_dedup"] == m_on["internode_token_bytes_pairs"], where
                if policy == "none":
                    mine = torch.tensor([_distinct_remote_nodes(routing_map, rank, world, G)])
                    dist.all_reduce(mine)  # every rank's units: the metric is the EP group's total
                    assert m_on["internode_token_bytes_dedup"] == int(mine) * H * 4, where
                    if topk == E:  # every token on every node: one unit per token and remote node
                        assert m_on["internode_token_bytes_dedup"] * (E // 2) == m_on["internode_token_bytes_pairs"]


@pytest.mark.parametrize("comm", ["direct", "rails"])
def test_dedup_on_off_same_forward_and_fewer_internode_bytes(comm):
    scale = float(os.environ.get("MEGATRON_RAILS_TEST_SCALE", "1"))
    spawn(_on_off_worker, 4, comm, max(3, int(6 * scale)))


@pytest.mark.parametrize("D,G", [(4, 2), (8, 2), (8, 4), (12, 3)])
def test_stage_traffic_against_brute_force(D, G):
    """stage1_DD / fanout_DD against a walk over explicit (source, token, destination) pairs."""
    from megatron_rails.runtime.dedup import fanout_DD, stage1_DD

    rng = np.random.default_rng(D * 10 + G)
    pairs = {(s, t, d) for s in range(D) for t in range(20) for d in rng.choice(D, rng.integers(0, 5), replace=False)}
    node = lambda r: r // G  # noqa: E731
    send_DD = np.zeros((D, D), dtype=np.int64)
    units = set()
    for s, t, d in pairs:
        send_DD[s, d] += 1
        if node(d) != node(s):
            units.add((s, t, node(d)))
    units_DV = np.zeros((D, D // G), dtype=np.int64)
    for s, _, b in units:
        units_DV[s, b] += 1
    rows_ref, stream_ref, fan_ref = np.zeros((D, D), np.int64), np.zeros((D, D), np.int64), np.zeros((D, D), np.int64)
    for s, t, d in pairs:
        if node(d) == node(s):
            rows_ref[s, d] += 1
            stream_ref[s, d] += 1
        else:  # through the entry: the rank of d's node with s's place in its node
            entry = node(d) * G + s % G
            stream_ref[s, entry] += 1
            fan_ref[entry, d] += 1
    for s, _, b in units:
        rows_ref[s, b * G + s % G] += 1
    rows_DD, stream_DD = stage1_DD(send_DD, units_DV, G)
    np.testing.assert_array_equal(rows_DD, rows_ref)
    np.testing.assert_array_equal(stream_DD, stream_ref)
    np.testing.assert_array_equal(fanout_DD(send_DD, G), fan_ref)
