"""The RailS all-to-all on torch.distributed: three uneven all-to-alls over sub-groups.

    phase 1  intra-node group of the sender: each chunk to the GPU whose rail carries it
             (intra-node messages go straight to their destination here)
    phase 2  rail group (the GPUs on one rail, across nodes): forwarder -> landing GPU
    phase 3  intra-node group of the receiver: landing GPU -> destination

Spraying pays an extra hop and two extra collectives, so it is used only where it helps: when the
rail-matched direct all-to-all would load its busiest rail at most 1 + `tolerance` times the even
spread (`schedule.rail_imbalance`), the exchange is that one direct all-to-all. Every rank decides
from the same traffic matrix, so all take the same path.

Every rank derives the same `RailSchedule` from the full traffic matrix, so every rank knows which
chunks each buffer holds and in which order; between phases a buffer is reordered by one
`index_select`. All steps are differentiable and the backward runs the reverse schedule (the
reverse of each phase, in reverse order). The delivered rows are bit-identical to a direct
`all_to_all_single` with the same splits: only the path changes.

Rank legend: global ranks are process ranks; "EP ranks" index the expert-parallel group (what the
schedule and the traffic matrix use); a topology node holds `gpus_per_node` consecutive EP ranks.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .base import Pending, collective_device, group_timeout, node_group, side_group
from .direct import all_to_all, all_to_all_into, start_all_to_all
from ...core.rails_schedule import RailSchedule, rail_imbalance, rails_schedule
from ...core.topology import Topology

_GROUPS: dict = {}  # (ep ranks, gpus_per_node, rails_per_node) -> (node groups, rail groups)


def _subgroups(ep_group, ep_ranks: tuple, topo: Topology):
    """Process groups for one EP group: one per node and one per rail (each rank joins its own two).

    Created once per process with local synchronization, so only the members of a group take part
    and several EP groups (data-parallel replicas of the EP group) can each build theirs; they
    inherit the EP group's timeout."""
    key = (ep_ranks, topo.gpus_per_node, topo.rails_per_node)
    if key not in _GROUPS:
        me = ep_ranks.index(dist.get_rank())
        G, D = topo.gpus_per_node, len(ep_ranks)
        rail_of = topo.rail_of(np.arange(D))
        rail_members = [tuple(ep_ranks[i] for i in np.flatnonzero(rail_of == r)) for r in range(topo.rails_per_node)]
        timeout = group_timeout(ep_group)
        node = node_group(ep_group, G)
        rail = _new_group(rail_members[int(rail_of[me])], timeout)
        _GROUPS[key] = (node, rail)
    return _GROUPS[key]


def _new_group(ranks: tuple, timeout):
    if len(ranks) == dist.get_world_size():
        return dist.group.WORLD
    return dist.new_group(list(ranks), timeout=timeout, use_local_synchronization=True)


class RailsAllToAll:
    """`comm: rails`. Same interface as comm.DirectAllToAll; `traffic_DD` (the full send matrix,
    identical on every rank) avoids an all-gather of the splits when the caller already knows it.

    tolerance: spray only when the rail-matched direct exchange's busiest rail exceeds the even
    spread by more than this fraction (0: whenever any rail is above it).

    `rail_bytes_sent` counts, per rail, the bytes this rank has put on the network (phase 2 when
    sprayed; its inter-node rows, on their destinations' rails, when direct) — measured from the
    tensors handed to the collective, for tests and metrics. `sprayed` and `direct` count the
    exchanges that took each path; `last_sprayed` says which the latest one took."""

    name = "rails"

    def __init__(self, group, topo: Topology, cache: int = 16, tolerance: float = 0.0):
        self.group = group
        self.ep_ranks = tuple(dist.get_process_group_ranks(group))
        self.me = dist.get_rank(group)
        self.topo = topo.for_world(len(self.ep_ranks))
        self.rail = int(self.topo.rail_of(self.me))
        self.node_group, self.rail_group = _subgroups(group, self.ep_ranks, self.topo)
        self._plans: OrderedDict = OrderedDict()
        self._cache = cache
        self.tolerance = float(tolerance)
        self.rail_bytes_sent = np.zeros(self.topo.rails_per_node, dtype=np.int64)
        self.last_schedule: Optional[RailSchedule] = None  # the latest sprayed exchange's
        self.last_sprayed = False
        self.sprayed = self.direct = 0
        dst = np.arange(len(self.ep_ranks))
        self._rail_of_dst = self.topo.rail_of(dst)
        self._off_node = self.topo.node_of(dst) != self.topo.node_of(self.me)

    # -- the exchange ----------------------------------------------------------------------------
    def exchange(self, x: torch.Tensor, send_D: Sequence[int], recv_D: Sequence[int],
                 traffic_DD: Optional[np.ndarray] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: rows for EP rank j in order, send_D[j] of them -> rows from EP rank j in order,
        recv_D[j] of them (as all_to_all_single). With `out`, not differentiable (weights,
        gradients): a direct exchange receives into it, a sprayed one into buffers of its own."""
        steps, row_bytes = self._route(x, send_D, recv_D, traffic_DD)
        if out is not None:  # weights or gradients: nothing to differentiate
            if steps is None:
                return all_to_all_into(x, send_D, recv_D, self.group, out)
            with torch.no_grad():
                return self._spray(x, steps, row_bytes)
        if steps is None:  # the rails are even enough: one direct all-to-all
            return all_to_all(x, send_D, recv_D, self.group)
        return self._spray(x, steps, row_bytes)

    def exchange_async(self, x: torch.Tensor, send_D: Sequence[int], recv_D: Sequence[int],
                       traffic_DD: Optional[np.ndarray] = None, out: Optional[torch.Tensor] = None) -> Pending:
        """exchange() started in the background (not differentiable; for weights). A direct exchange
        runs on a side group, into `out` where given; a sprayed one runs now (each phase sends what
        the previous delivered), and the Pending is already done."""
        steps, row_bytes = self._route(x, send_D, recv_D, traffic_DD)
        if steps is None:
            return start_all_to_all(x, send_D, recv_D, side_group(self.group), out)
        with torch.no_grad():
            return Pending.done(self._spray(x, steps, row_bytes))

    def _route(self, x, send_D, recv_D, traffic_DD) -> tuple[Optional[dict], int]:
        """(the sprayed schedule's steps for this exchange or None for the direct path, bytes per
        row); counts a direct exchange's bytes."""
        if traffic_DD is None:
            traffic_DD = self._gather_traffic(send_D)
        traffic = np.asarray(traffic_DD, dtype=np.int64)
        if not (np.array_equal(traffic[self.me], np.asarray(send_D))
                and np.array_equal(traffic[:, self.me], np.asarray(recv_D))):
            raise ValueError("rails exchange: traffic_DD disagrees with this rank's send/recv splits")
        steps = self._steps(traffic)
        row_bytes = x.element_size() * int(np.prod(x.shape[1:], dtype=np.int64))
        self.last_sprayed = steps is not None
        if steps is None:
            self.direct += 1
            off = self._off_node
            np.add.at(self.rail_bytes_sent, self._rail_of_dst[off], traffic[self.me][off] * row_bytes)
        return steps, row_bytes

    def _spray(self, x: torch.Tensor, steps: dict, row_bytes: int) -> torch.Tensor:
        """The three phases of a sprayed exchange (differentiable)."""
        self.sprayed += 1
        self.last_schedule = steps["schedule"]
        self.rail_bytes_sent[self.rail] += steps["rail_rows"] * row_bytes
        idx = _indices_on(steps, x.device)
        buf1 = all_to_all(x.index_select(0, idx["idx1"]), *steps["splits1"], self.node_group)
        if steps["phase2"]:
            buf2 = all_to_all(buf1.index_select(0, idx["idx2"]), *steps["splits2"], self.rail_group)
            buf3 = all_to_all(buf2.index_select(0, idx["idx3"]), *steps["splits3"], self.node_group)
            buf1 = torch.cat([buf1, buf3])
        return buf1.index_select(0, idx["idx_out"])

    def sprays(self, traffic_DD: np.ndarray) -> bool:
        """Whether an exchange of this traffic goes over the sprayed schedule (else direct)."""
        return self._steps(np.asarray(traffic_DD, dtype=np.int64)) is not None

    def _gather_traffic(self, send_D) -> np.ndarray:
        D = len(self.ep_ranks)
        dev = collective_device(self.group)
        mine = torch.tensor(list(map(int, send_D)), dtype=torch.int64, device=dev)
        out = torch.empty((D, D), dtype=torch.int64, device=dev)
        dist.all_gather(list(out.unbind(0)), mine, group=self.group)
        return out.cpu().numpy()

    def _steps(self, traffic_DD: np.ndarray) -> Optional[dict]:
        """The sprayed exchange's steps for traffic_DD, or None for the direct exchange."""
        key = traffic_DD.tobytes()
        if key in self._plans:
            self._plans.move_to_end(key)
            return self._plans[key]
        if rail_imbalance(traffic_DD, self.topo) <= 1.0 + self.tolerance:
            steps = None
        else:
            steps = build_steps(rails_schedule(traffic_DD, self.topo), self.me)
        self._plans[key] = steps
        if len(self._plans) > self._cache:
            self._plans.popitem(last=False)
        return steps


INDEX_KEYS = ("idx1", "idx2", "idx3", "idx_out")


def _indices_on(steps: dict, device: torch.device) -> dict:
    """The steps' row gathers (int64, built on the host) on `device`, copied there once per device:
    `index_select` needs its index on the input's device (CUDA under NCCL)."""
    device = torch.device(device)
    per_device = steps.setdefault("on_device", {})
    if device not in per_device:
        per_device[device] = {k: steps[k].to(device) for k in INDEX_KEYS if k in steps}
    return per_device[device]


def build_steps(sch: RailSchedule, me: int) -> dict:
    """What EP rank `me` does in each phase: row gathers (CPU int64 tensors; `_indices_on` gives them
    on the exchanged tensor's device) and split sizes (send, recv; group-local order)."""
    topo, D = sch.topo, sch.num_ranks
    G = topo.gpus_per_node
    K = sch.units_K.size
    u = sch.units_K
    inter = sch.inter
    hop1 = np.where(inter, sch.fwd_K, sch.dst_K)  # where phase 1 takes a chunk
    node_lo = (me // G) * G
    rail_members = np.flatnonzero(topo.rail_of(np.arange(D)) == topo.rail_of(me))

    # input: rows by destination, each message's rows in offset order
    start_in = np.zeros(K, dtype=np.int64)
    mine = np.flatnonzero(sch.src_K == me)
    msg_start = np.concatenate([[0], np.cumsum(sch.traffic_DD[me])])[:-1]
    start_in[mine] = msg_start[sch.dst_K[mine]] + sch.off_K[mine]

    def layout(chunks):
        """Row positions of `chunks` laid out in the given order: start per chunk (indexed by k)."""
        start = np.full(K, -1, dtype=np.int64)
        start[chunks] = np.cumsum(u[chunks]) - u[chunks]
        return start

    def gather(chunks, start_from):
        n = u[chunks]
        return torch.from_numpy(np.repeat(start_from[chunks] - (np.cumsum(n) - n), n) + np.arange(n.sum()))

    def splits(send_chunks, send_to, recv_chunks, recv_from, members):
        pos = {int(r): i for i, r in enumerate(members)}
        n = len(members)
        out = np.zeros(n, dtype=np.int64)
        inn = np.zeros(n, dtype=np.int64)
        np.add.at(inn, [pos[int(r)] for r in send_to], u[send_chunks])
        np.add.at(out, [pos[int(r)] for r in recv_from], u[recv_chunks])
        return inn.tolist(), out.tolist()  # send, recv

    node_members = np.arange(node_lo, node_lo + G)
    # phase 1: my chunks ordered by where they go; I receive chunks whose hop1 is me, by source
    send1 = mine[np.lexsort((mine, hop1[mine]))]
    recv1 = np.flatnonzero(hop1 == me)  # canonical order = (source, k)
    steps = {"schedule": sch, "idx1": gather(send1, start_in),
             "splits1": splits(send1, hop1[send1], recv1, sch.src_K[recv1], node_members)}
    at1 = layout(recv1)
    phase2 = bool(inter.any())
    steps["phase2"] = phase2
    at_out = at1
    n1 = int(u[recv1].sum())
    if phase2:
        send2 = recv1[inter[recv1]]
        send2 = send2[np.lexsort((send2, sch.land_K[send2]))]
        recv2 = np.flatnonzero(inter & (sch.land_K == me))
        recv2 = recv2[np.lexsort((recv2, sch.fwd_K[recv2]))]
        steps["idx2"] = gather(send2, at1)
        steps["splits2"] = splits(send2, sch.land_K[send2], recv2, sch.fwd_K[recv2], rail_members)
        steps["rail_rows"] = int(u[send2].sum())
        at2 = layout(recv2)
        send3 = recv2[np.lexsort((recv2, sch.dst_K[recv2]))]
        recv3 = np.flatnonzero(inter & (sch.dst_K == me))
        recv3 = recv3[np.lexsort((recv3, sch.land_K[recv3]))]
        steps["idx3"] = gather(send3, at2)
        steps["splits3"] = splits(send3, sch.dst_K[send3], recv3, sch.land_K[recv3], node_members)
        at3 = layout(recv3)
        at_out = np.where(at3 >= 0, at3 + n1, at1)
    else:
        steps["rail_rows"] = 0
    final = np.flatnonzero(sch.dst_K == me)  # canonical order: by source, then offset
    steps["idx_out"] = gather(final, at_out)
    return steps
