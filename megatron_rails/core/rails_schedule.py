"""RailS spraying: split every node's outgoing inter-node traffic over all its rails, LPT-first.

Shape legend:  D ranks (GPUs)   G ranks per node   V nodes   J rails per node   U node pairs   K chunks

`traffic_DD[s, d]` is what rank s sends rank d, in any integer unit (token rows for the real
all-to-all, bytes for the simulator). A chunk is a contiguous piece of one (s, d) message routed
    s --NVLink--> fwd (sender node, on the chunk's rail) --rail--> land (receiver node, same rail) --NVLink--> d
where fwd == s when s sits on that rail and land == d when d does. Intra-node messages are one chunk
with rail -1 (NVLink only, fwd = land = d).

Per ordered node pair (a, b) the pair's traffic is spread so that every rail carries floor or ceil of
total/J: first each message keeps what fits on its natural rail (the rail of d, which is where a
rail-matched all-to-all would send it, so no receiver-side forwarding), largest message first; then
the overflow is sprayed longest piece first onto the rail with the most room left, split where a rail
fills. Each pair is balanced on its own, so each node's sends are uniform over its rails and, by the
symmetry of a rail-optimized fabric, each node's receives are too: a node schedules from its own
outgoing traffic only. The schedule is a pure, deterministic function of (traffic, topology).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import InputError
from .topology import Topology, load_topology


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
        arrs = [np.array(a, dtype=np.int64) for a in (src, dst, rail, fwd, land, units)]  # own copies (frozen below)
        keep = arrs[-1] > 0
        src, dst, rail, fwd, land, units = arrs if keep.all() else (a[keep] for a in arrs)
        msg = src * (1 << 32) + dst
        if msg.size and np.any(msg[1:] < msg[:-1]):
            order = np.argsort(msg, kind="stable")  # by (src, dst), stable within each message
            src, dst, rail, fwd, land, units, msg = (a[order] for a in (src, dst, rail, fwd, land, units, msg))
        first = np.r_[True, msg[1:] != msg[:-1]] if msg.size else np.zeros(0, bool)
        csum = np.cumsum(units) - units
        off = csum - np.maximum.accumulate(np.where(first, csum, 0)) if msg.size else csum
        traffic = np.asarray(traffic_DD, dtype=np.int64)
        traffic.setflags(write=False)
        for a in (src, dst, rail, fwd, land, units, off):
            a.setflags(write=False)
        return cls(topo, traffic, src, dst, rail, fwd, land, units, off)

    # -- derived figures -------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return self.traffic_DD.shape[0]

    @property
    def inter(self) -> np.ndarray:
        return self.rail_K >= 0

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


def _traffic(traffic_DD) -> np.ndarray:
    """traffic_DD as an integer array [D, D] of non-negative units; InputError otherwise."""
    traffic = np.asarray(traffic_DD)
    if traffic.ndim != 2 or traffic.shape[0] != traffic.shape[1] or not traffic.shape[0]:
        raise InputError(f"traffic_DD must be square [D, D] with D >= 1, got shape {traffic.shape}")
    if traffic.dtype.kind not in "iu" or traffic.min() < 0:
        raise InputError(f"traffic_DD must hold non-negative integers, got {traffic.dtype} values"
                         + (f" down to {traffic.min()}" if traffic.dtype.kind in "iuf" else ""))
    return traffic


def rails_schedule(traffic_DD, topo: Topology | str) -> RailSchedule:
    """The RailS LPT spraying schedule for `traffic_DD` (int [D, D]) on `topo` (sized to D ranks).

    Vectorized over all node pairs at once; the rule is the one in the module docstring, stated per
    pair (a, b) with its messages (i, j, u) (local source, local destination, units):
      1. rail capacities: base = total // J on every rail, +1 on the `total % J` rails ranked first by
         (most natural load, then (r - a - b) mod J);
      2. natural pass, messages in LPT order (-u, i, j): each keeps min(u, room left on rail(j));
      3. spray pass, leftovers in order (-left, i, j): repeatedly onto the rail with the most room
         (lowest index on ties), taking min(left, room).
    A message's chunks are emitted natural piece first, then its sprayed pieces in spray order.
    """
    traffic = _traffic(traffic_DD)
    D = traffic.shape[0]
    topo = load_topology(topo).for_world(D)
    G, J, gpr, V = topo.gpus_per_node, topo.rails_per_node, topo.gpus_per_rail, topo.nodes
    traffic = traffic.astype(np.int64)
    s, d = np.nonzero(traffic)  # row-major: messages in (src, dst) order
    u = traffic[s, d]
    a, b = s // G, d // G
    intra = a == b
    parts = [(s[intra], d[intra], np.full(int(intra.sum()), -1, np.int64), d[intra], d[intra], u[intra],
              np.full(int(intra.sum()), -1, np.int64))]
    m = ~intra
    if m.any():
        parts += _spray(s[m], d[m], u[m], a[m] * V + b[m], G, J, gpr, V)
    src, dst, rail, fwd, land, units, piece = (np.concatenate(c) for c in zip(*parts))
    # emission order within each message, as from_chunks expects
    order = np.argsort((src * D + dst) * (piece.max(initial=-1) + 2) + piece + 1, kind="stable")
    return RailSchedule.from_chunks(topo, traffic, src[order], dst[order], rail[order], fwd[order],
                                    land[order], units[order])


def rail_imbalance(traffic_DD, topo: Topology | str) -> float:
    """How unevenly the rail-matched direct all-to-all (every inter-node message whole on its
    destination's rail, as NCCL's PXN routes it) loads the rails: its busiest (node, rail, direction)
    over the even spread, max over nodes and directions of ceil(node's inter-node units / J). 1.0
    when nothing crosses nodes. Spraying can at best bring it to 1, so it bounds what RailS can gain."""
    traffic = _traffic(traffic_DD).astype(np.int64)
    D = traffic.shape[0]
    topo = load_topology(topo).for_world(D)
    G, J, V = topo.gpus_per_node, topo.rails_per_node, topo.nodes
    if V == 1:
        return 1.0
    node = topo.node_of(np.arange(D))
    cross = np.where(node[:, None] != node[None, :], traffic, 0)  # inter-node units only
    # destination GPU d = node * G + rail * gpus_per_rail + i: sum over senders' GPUs or receivers
    by_VGVJi = cross.reshape(V, G, V, J, topo.gpus_per_rail)  # (src node, src GPU, dst node, rail, i in rail)
    egress_VJ = by_VGVJi.sum(axis=(1, 2, 4))                    # node a's sends on each rail
    ingress_VJ = by_VGVJi.sum(axis=(0, 1, 4))                   # node b's receives on each rail
    busiest = max(int(egress_VJ.max()), int(ingress_VJ.max()))
    if busiest == 0:
        return 1.0
    even = max(-(-int(egress_VJ.sum(axis=1).max()) // J), -(-int(ingress_VJ.sum(axis=1).max()) // J))
    return busiest / even


def _key(major, minor, span=None):
    """One int64 sort key ordering by `major`, then `minor` (both int64; `minor` spans < `span`)."""
    lo = minor.min() if minor.size else 0
    span = span or (int(minor.max() - lo) + 1 if minor.size else 1)
    top = int(major.max()) if major.size else 0
    bot = int(major.min()) if major.size else 0
    if max(abs(top), abs(bot)) + 1 >= (1 << 62) // span:
        raise OverflowError("traffic too large for the schedule's int64 sort keys")
    return major * span + (minor - lo)


def _sum_by(key, vals, n) -> np.ndarray:
    """Exact int64 sums of `vals` grouped by `key` in [0, n)."""
    out = np.zeros(n, dtype=np.int64)
    np.add.at(out, key, vals)
    return out


def _spray(s, d, u, pair, G, J, gpr, V) -> list[tuple]:
    """Chunks of the inter-node messages (s, d, u) of node pairs `pair` = a * V + b (see rails_schedule)."""
    nat = (d % G) // gpr
    up, row = np.unique(pair, return_inverse=True)  # pairs with traffic
    U = up.size
    load_UJ = _sum_by(row * J + nat, u, U * J).reshape(U, J)
    total = load_UJ.sum(axis=1)
    base, rem = np.divmod(total, J)
    rot_UJ = (np.arange(J)[None, :] - (up // V)[:, None] - (up % V)[:, None]) % J
    order_UJ = np.argsort(_key(-load_UJ, rot_UJ, J), axis=1)  # most natural load first, then rotation
    rank_UJ = np.empty_like(order_UJ)  # position of each rail in the +1 order of its pair
    np.put_along_axis(rank_UJ, order_UJ, np.arange(J)[None, :], axis=1)
    cap_UJ = base[:, None] + (rank_UJ < rem[:, None])

    # natural pass: per (pair, rail), messages in LPT order keep what fits
    o = np.argsort(_key(row * J + nat, -u), kind="stable")  # messages come in (i, j) order within a pair
    g = row[o] * J + nat[o]
    cs = np.cumsum(u[o])
    first = np.r_[True, g[1:] != g[:-1]]
    before = cs - u[o] - np.maximum.accumulate(np.where(first, cs - u[o], 0))
    take = np.empty_like(u)
    take[o] = np.clip(cap_UJ.ravel()[g] - before, 0, u[o])
    room_UJ = cap_UJ - np.minimum(cap_UJ, load_UJ)
    out = []
    k = take > 0
    out.append(_chunks(s[k], d[k], nat[k], take[k], np.full(int(k.sum()), -1, np.int64), G, gpr))

    # spray pass: leftovers, longest first, onto the rail with the most room
    left = u - take
    k = np.flatnonzero(left > 0)
    if not k.size:
        return out
    k = k[np.argsort(_key(row[k], -left[k]), kind="stable")]  # (i, j) order kept on ties
    r_k = row[k]
    first = np.r_[True, r_k[1:] != r_k[:-1]]
    pos = np.arange(k.size) - np.maximum.accumulate(np.where(first, np.arange(k.size), 0))
    by_pos = np.argsort(pos, kind="stable")
    bounds = np.searchsorted(pos[by_pos], np.arange(pos.max() + 2))
    for step in range(pos.max() + 1):  # the step-th leftover of every pair at once (one per pair)
        sel = k[by_pos[bounds[step]:bounds[step + 1]]]
        rr, rest, piece = row[sel], left[sel].copy(), 0
        while sel.size:
            room = room_UJ[rr]
            r = room.argmax(axis=1)  # most room; argmax keeps the lowest index on ties
            got = np.minimum(rest, room[np.arange(rr.size), r])
            assert np.all(got > 0), "spray ran out of room (capacities do not add up to the traffic)"
            room_UJ[rr, r] -= got
            out.append(_chunks(s[sel], d[sel], r, got, np.full(sel.size, piece, np.int64), G, gpr))
            rest -= got
            keep = rest > 0
            sel, rr, rest, piece = sel[keep], rr[keep], rest[keep], piece + 1
    return out


def _chunks(s, d, r, units, piece, G, gpr) -> tuple:
    """(src, dst, rail, fwd, land, units, piece) of chunks of s -> d on rails r."""
    i, j = s % G, d % G
    fwd = np.where(i // gpr == r, s, s - i + r * gpr + i % gpr)
    land = np.where(j // gpr == r, d, d - j + r * gpr + j % gpr)
    return s, d, r.astype(np.int64), fwd, land, units, piece
