"""RailS spraying: split every node's outgoing inter-node traffic over all its rails, LPT-first.

Shape legend:  D ranks (GPUs)   K chunks   N rails per node   P nodes

`traffic_DD[s, d]` is what rank s sends rank d, in any integer unit (token rows for the real
all-to-all, bytes for the simulator). A chunk is a contiguous piece of one (s, d) message routed
    s --NVLink--> fwd (sender node, on the chunk's rail) --rail--> land (receiver node, same rail) --NVLink--> d
where fwd == s when s sits on that rail and land == d when d does. Intra-node messages are one chunk
with rail -1 (NVLink only, fwd = land = d).

Per ordered node pair (a, b) the pair's traffic is spread so that every rail carries floor or ceil of
total/N: first each message keeps what fits on its natural rail (the rail of d, which is where a
rail-matched all-to-all would send it, so no receiver-side forwarding), largest message first; then
the overflow is sprayed longest piece first onto the rail with the most room left, split where a rail
fills. Each pair is balanced on its own, so each node's sends are uniform over its rails and, by the
symmetry of a rail-optimized fabric, each node's receives are too: a node schedules from its own
outgoing traffic only. The schedule is a pure, deterministic function of (traffic, topology).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .topology import Topology


@dataclass(frozen=True, eq=False)
class RailSchedule:
    """Chunks in canonical order (src, dst, offset within the message); all arrays int64 [K]."""

    topo: Topology
    traffic_DD: np.ndarray
    src_K: np.ndarray
    dst_K: np.ndarray
    rail_K: np.ndarray   # -1: intra-node (NVLink only)
    fwd_K: np.ndarray    # sender-node GPU that puts the chunk on its rail
    land_K: np.ndarray   # receiver-node GPU the chunk lands on
    units_K: np.ndarray
    off_K: np.ndarray    # first row/byte of the chunk within its (src, dst) message

    @classmethod
    def from_chunks(cls, topo: Topology, traffic_DD, src, dst, rail, fwd, land, units) -> "RailSchedule":
        """Build from chunks in any order; offsets follow the given order within each message."""
        arrs = [np.asarray(a, dtype=np.int64) for a in (src, dst, rail, fwd, land, units)]
        keep = arrs[-1] > 0
        src, dst, rail, fwd, land, units = (a[keep] for a in arrs)
        order = np.lexsort((np.arange(src.size), dst, src))  # stable within each message
        src, dst, rail, fwd, land, units = (a[order] for a in (src, dst, rail, fwd, land, units))
        msg = src * (1 << 32) + dst
        first = np.r_[True, msg[1:] != msg[:-1]] if msg.size else np.zeros(0, bool)
        csum = np.cumsum(units) - units
        off = csum - np.maximum.accumulate(np.where(first, csum, 0)) if msg.size else csum
        T = np.asarray(traffic_DD, dtype=np.int64)
        T.setflags(write=False)
        for a in (src, dst, rail, fwd, land, units, off):
            a.setflags(write=False)
        return cls(topo, T, src, dst, rail, fwd, land, units, off)

    # -- derived figures -------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return self.traffic_DD.shape[0]

    @property
    def inter(self) -> np.ndarray:
        return self.rail_K >= 0

    @cached_property
    def rail_egress_PN(self) -> np.ndarray:
        """Units each node sends on each of its rails, [P nodes, N rails]."""
        return self._per_rail(self.topo.node_of(self.src_K))

    @cached_property
    def rail_ingress_PN(self) -> np.ndarray:
        """Units each node receives on each of its rails, [P, N]."""
        return self._per_rail(self.topo.node_of(self.dst_K))

    def _per_rail(self, node_K) -> np.ndarray:
        P, N = self.num_ranks // self.topo.gpus_per_node, self.topo.rails_per_node
        m = self.inter
        out = np.zeros((P, N), dtype=np.int64)
        np.add.at(out, (node_K[m], self.rail_K[m]), self.units_K[m])
        return out

    @cached_property
    def rail_sent_D(self) -> np.ndarray:
        """Units each rank puts on the network (as forwarder), [D]."""
        m = self.inter
        return np.bincount(self.fwd_K[m], weights=self.units_K[m], minlength=self.num_ranks).astype(np.int64)

    def nvlink_out_D(self) -> np.ndarray:
        """Units each GPU sends over NVLink (intra-node messages + forwarding hops), [D]."""
        D, m = self.num_ranks, self.inter
        out = np.bincount(self.src_K[~m], weights=self.units_K[~m], minlength=D)
        hop1 = m & (self.fwd_K != self.src_K)
        out += np.bincount(self.src_K[hop1], weights=self.units_K[hop1], minlength=D)
        hop3 = m & (self.land_K != self.dst_K)
        out += np.bincount(self.land_K[hop3], weights=self.units_K[hop3], minlength=D)
        return out.astype(np.int64)

    def nvlink_in_D(self) -> np.ndarray:
        D, m = self.num_ranks, self.inter
        out = np.bincount(self.dst_K[~m], weights=self.units_K[~m], minlength=D)
        hop1 = m & (self.fwd_K != self.src_K)
        out += np.bincount(self.fwd_K[hop1], weights=self.units_K[hop1], minlength=D)
        hop3 = m & (self.land_K != self.dst_K)
        out += np.bincount(self.dst_K[hop3], weights=self.units_K[hop3], minlength=D)
        return out.astype(np.int64)

    def check(self) -> None:
        """Raise AssertionError unless the chunks deliver exactly `traffic_DD` along valid hops."""
        t, D = self.topo, self.num_ranks
        got = np.zeros((D, D), dtype=np.int64)
        np.add.at(got, (self.src_K, self.dst_K), self.units_K)
        assert np.array_equal(got, self.traffic_DD), "chunks do not add up to the traffic"
        m = self.inter
        same = t.node_of(self.src_K) == t.node_of(self.dst_K)
        assert np.array_equal(~m, same), "intra-node chunks must use rail -1, inter-node a rail"
        assert np.all(t.node_of(self.fwd_K[m]) == t.node_of(self.src_K[m])), "forwarder off the sender node"
        assert np.all(t.node_of(self.land_K[m]) == t.node_of(self.dst_K[m])), "landing GPU off the receiver node"
        assert np.all(t.rail_of(self.fwd_K[m]) == self.rail_K[m]), "forwarder not on the chunk's rail"
        assert np.all(t.rail_of(self.land_K[m]) == self.rail_K[m]), "landing GPU not on the chunk's rail"


def rails_schedule(traffic_DD, topo: Topology) -> RailSchedule:
    """The RailS LPT spraying schedule for `traffic_DD` (int [D, D]) on `topo` (sized to D ranks)."""
    T = np.asarray(traffic_DD)
    if T.ndim != 2 or T.shape[0] != T.shape[1]:
        raise ValueError(f"traffic_DD must be square [D, D], got shape {T.shape}")
    if T.size and (T.dtype.kind not in "iu" or T.min() < 0):
        raise ValueError("traffic_DD must hold non-negative integers")
    D = T.shape[0]
    topo = topo.for_world(D)
    G, N, gpr, P = topo.gpus_per_node, topo.rails_per_node, topo.gpus_per_rail, topo.nodes
    T = T.astype(np.int64)
    cols: list[list[int]] = [[], [], [], [], [], []]  # src, dst, rail, fwd, land, units
    blocks = T.reshape(P, G, P, G)
    rail_of_local = np.arange(G) // gpr
    for a in range(P):
        for b in range(P):
            blk = blocks[a, :, b, :]
            if a == b:
                i, j = np.nonzero(blk)
                s, d = a * G + i, b * G + j
                for col, vals in zip(cols, (s, d, np.full(i.size, -1), d, d, blk[i, j])):
                    col.extend(vals.tolist())
                continue
            _spray_pair(a, b, blk, G, N, gpr, rail_of_local, cols)
    return RailSchedule.from_chunks(topo, T, *cols)


def _spray_pair(a, b, blk, G, N, gpr, rail_of_local, cols) -> None:
    i, j = np.nonzero(blk)
    if not i.size:
        return
    u = blk[i, j]
    total = int(u.sum())
    nat = rail_of_local[j]
    nat_load = np.bincount(nat, weights=u, minlength=N)
    base, rem = divmod(total, N)
    cap = np.full(N, base, dtype=np.int64)
    # the +1 units go to the rails with the most natural load (fewest splits), rotated by the pair
    # so that a receiver's +1s come in on different rails from different senders
    cap[np.lexsort(((np.arange(N) - a - b) % N, -nat_load))[:rem]] += 1
    order = np.lexsort((j, i, -u))  # LPT: largest message first; ties by source, then destination
    i, j, u, nat = (x[order].tolist() for x in (i, j, u, nat))
    cap = cap.tolist()
    src, dst, rail, fwd, land, units = cols
    spill = []
    for ii, jj, uu, rr in zip(i, j, u, nat):
        take = min(uu, cap[rr])
        if take:
            cap[rr] -= take
            _emit(cols, a, b, ii, jj, rr, take, G, gpr)
        if uu > take:
            spill.append((uu - take, ii, jj))
    spill.sort(key=lambda x: (-x[0], x[1], x[2]))
    for left, ii, jj in spill:
        while left:
            rr = max(range(N), key=lambda r: (cap[r], -r))  # the rail with most room; lowest index on ties
            take = min(left, cap[rr])
            cap[rr] -= take
            left -= take
            _emit(cols, a, b, ii, jj, rr, take, G, gpr)


def _emit(cols, a, b, i, j, r, units, G, gpr) -> None:
    s, d = a * G + i, b * G + j
    f = s if i // gpr == r else a * G + r * gpr + i % gpr
    g = d if j // gpr == r else b * G + r * gpr + j % gpr
    for col, v in zip(cols, (s, d, r, f, g, units)):
        col.append(v)
