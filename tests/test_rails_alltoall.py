"""The RailS multi-phase all-to-all on gloo against a direct all_to_all_single (the reference).

Virtual topologies 2 nodes x 2 GPUs, 4 x 1, 2 x 4, 4 x 2, and 2 x 4 with 2 rails (two GPUs per NIC): random uneven traffic, including empty rows/columns and all traffic
to one rank. Checks: delivered rows bit-identical, gradients (through the reverse schedule)
identical to the direct exchange's, and bytes each rank put on each rail equal to the schedule's.
Each exchange sprays or goes direct by the rails' imbalance under the rail-matched direct
all-to-all, recomputed here from the simulator's direct schedule; both paths are exercised, at
tolerance 0 and 0.25.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from moe_harness import spawn
from schedule_figures import rail_egress, rail_ingress


def _traffic(rng, D, case):
    if case == 0:
        return rng.integers(0, 7, (D, D))
    if case == 1:  # skewed: one hot destination
        traffic = rng.integers(0, 3, (D, D))
        traffic[:, rng.integers(D)] += rng.integers(5, 40, D)
        return traffic
    if case == 2:  # some ranks send nothing, some receive nothing
        traffic = rng.integers(0, 9, (D, D))
        traffic[rng.integers(D)] = 0
        traffic[:, rng.integers(D)] = 0
        return traffic
    if case == 3:
        return np.zeros((D, D), dtype=np.int64)
    if case == 5:  # even: every rail equally loaded, nothing to gain from spraying
        return np.full((D, D), 6, dtype=np.int64)
    if case == 6:  # near-even: a little above the even spread on one rail
        traffic = np.full((D, D), 20, dtype=np.int64)
        traffic[:, rng.integers(D)] += 2
        return traffic
    traffic = np.zeros((D, D), dtype=np.int64)  # everything to one rank
    traffic[:, rng.integers(D)] = rng.integers(1, 30, D)
    return traffic


def _direct(x, send, recv):
    out = x.new_empty((int(sum(recv)),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, list(map(int, recv)), list(map(int, send)))
    return out


def _worker(rank, world, shapes, cases):
    for G, J in shapes:  # several virtual topologies over the same ranks, one spawn
        for tol in (0.0, 0.25):
            _check_topology(rank, world, G, J, cases, tol)


def _sprays(traffic, topo, tol) -> bool:
    """Reference: the direct schedule's busiest rail against the even spread over each node's rails."""
    from megatron_rails.sim.rails import direct_schedule

    d = direct_schedule(traffic, topo)
    J = topo.rails_per_node
    even = max(-(-int(rail_egress(d).sum(axis=1).max()) // J), -(-int(rail_ingress(d).sum(axis=1).max()) // J))
    busiest = max(int(rail_egress(d).max(initial=0)), int(rail_ingress(d).max(initial=0)))
    return busiest > (1 + tol) * even if busiest else False


def _check_topology(rank, world, G, J, cases, tol):
    from megatron_rails.runtime.comm.rails import RailsAllToAll
    from megatron_rails.core.rails_schedule import rails_schedule
    from megatron_rails.sim.rails import direct_schedule
    from megatron_rails.core.topology import Topology

    topo = Topology(gpus_per_node=G, rails_per_node=J)
    a2a = RailsAllToAll(dist.group.WORLD, topo, tolerance=tol)
    rng = np.random.default_rng(1000 + world * 10 + G)  # same on every rank
    H = 3
    for case in range(cases):
        traffic = _traffic(rng, world, case % 7).astype(np.int64)
        send, recv = traffic[rank], traffic[:, rank]
        torch.manual_seed(rank * 7919 + case)
        x = torch.randn(int(send.sum()), H, dtype=torch.float64, requires_grad=True)
        w = torch.randn(int(recv.sum()), H, dtype=torch.float64)
        before = a2a.rail_bytes_sent.copy()
        y = a2a.exchange(x, send, recv, traffic_DD=traffic if case % 2 else None)  # both ways to get it
        ref = _direct(x.detach(), send, recv)
        where = f"{world // G} nodes x {G} GPUs, {J} rails, case {case}"
        assert torch.equal(y, ref), f"{where}: rails delivery differs from all_to_all_single"
        (y * w).sum().backward()
        g_ref = _direct(w, recv, send)  # d/dx of sum(a2a(x) * w) is the reverse exchange of w
        assert torch.equal(x.grad, g_ref), f"{where}: gradient differs from the reverse exchange"
        sprayed = _sprays(traffic, topo, tol) if world > G else False
        assert a2a.last_sprayed == sprayed, f"{where}, tolerance {tol}: sprayed={a2a.last_sprayed}, expected {sprayed}"
        # bytes on each rail: what every rank measured, summed, against the path's schedule
        sent = torch.from_numpy(a2a.rail_bytes_sent - before)
        dist.all_reduce(sent)
        sch = (rails_schedule if sprayed else direct_schedule)(traffic, topo)
        expect = rail_egress(sch).sum(axis=0) * H * 8
        assert np.array_equal(sent.numpy(), expect), f"{where}: rail bytes {sent.tolist()} != {expect.tolist()}"
    if world > G and J > 1:  # both paths taken (one rail per node: spraying never gains, always direct)
        assert a2a.sprayed and a2a.direct, f"{world // G} nodes x {G}, tolerance {tol}: " \
                                           f"sprayed {a2a.sprayed}, direct {a2a.direct}"


@pytest.mark.parametrize("world,shapes", [(4, [(2, 2), (1, 1)]), (8, [(4, 4), (2, 2), (4, 2)])],
                         ids=["4 ranks: 2x2, 4x1", "8 ranks: 2x4, 4x2, 2x4 with 2 rails"])
def test_rails_alltoall_matches_direct(world, shapes):
    spawn(_worker, world, shapes, 14, megatron=False)


def test_sprayed_indices_follow_the_input_device():
    """The sprayed exchange's row gathers are built on the host and must be on the exchanged
    tensor's device for `index_select` (CUDA under NCCL): copied once per device, then cached."""
    from megatron_rails.core.rails_schedule import rails_schedule
    from megatron_rails.core.topology import Topology
    from megatron_rails.runtime.comm.rails import INDEX_KEYS, _indices_on, build_steps

    topo = Topology(name="t", gpus_per_node=2, rails_per_node=2, nodes=2)
    traffic = np.array([[0, 1, 5, 0], [2, 0, 0, 7], [1, 3, 0, 2], [6, 0, 1, 0]], dtype=np.int64)
    steps = build_steps(rails_schedule(traffic, topo), 0)
    assert steps["phase2"], "the case must spray across nodes"
    for device in (torch.device("meta"), torch.device("cpu")):
        idx = _indices_on(steps, device)
        assert set(idx) == {k for k in INDEX_KEYS if k in steps}
        assert all(t.device == device and t.dtype == torch.int64 for t in idx.values())
        assert _indices_on(steps, device) is idx, "copied once per device"
        x = torch.empty((int(traffic[0].sum()), 3), device=device)
        assert x.index_select(0, idx["idx1"]).device == device
