"""Token dedup across nodes: a token crosses the network once per remote node it has pairs on.

    stage 1   the EP group, through the layer's exchange (direct or RailS): every rank sends its
              same-node pairs as the plain exchange does (a row per pair) and, per remote node b,
              each unit (runtime/units.py) once, to the entry rank entry(s, b) = b * G + s mod G:
              the rank on the sender's rail, so the message is rail-matched and RailS sprays it
              only when the rails are unbalanced. Beside the rows, a per-pair stream over the EP
              group (direct; 4 + 24 bytes a pair): every pair's prob and, for remote pairs, its
              unit, its place in the unit and its (rank, slot) on the node.
    stage 2   the node group: every entry rank fans its units out, one row per pair, to the ranks
              of its node that serve them.
    the rows are put in the order the plain exchange delivers (source-major, slot-minor, token
    order within a slot), so everything after the exchange is unchanged.
    return    stage 2 reversed; the entry sums each unit's pair outputs (prob-weighted already)
              into one row; stage 1 reversed; the source sums each token's rows.

All steps are differentiable (index_select, all-to-all, elementwise adds): the backward sends a
unit's gradient once across the network as well. Every rank derives every table on the host from
the plan's send_DD and the all-gathered units per (rank, node); the only device-dependent order is
the fan-out's, sorted on the device.

Shape letters (docs/architecture.md): D EP ranks, G ranks per node, V nodes, S slots per rank, H
hidden size, Q rows this rank receives (the plain exchange's); here F the pairs this rank fans out
as an entry, N the rows of a stage-1 message list.
"""
from __future__ import annotations

import numpy as np
import torch

from .comm.base import node_group
from .comm.direct import all_to_all
from .local import SendOrder
from .staging import stage
from .units import NodeUnits, ordered_sum

META = 3  # per-pair stream columns: unit within its (source, node) message, place in the unit, code


def entry_DV(D: int, G: int) -> np.ndarray:
    """int64 [D, V]: the entry rank on node b of units from EP rank s: the same place in the node
    (the same rail on a rail-optimized fabric)."""
    V = D // G
    return np.arange(V)[None, :] * G + (np.arange(D) % G)[:, None]


def stage1_DD(send_DD: np.ndarray, units_DV: np.ndarray, G: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows_DD, stream_DD), int64 [D, D]: stage 1's row traffic (same-node pairs, units to entry
    ranks) and its per-pair stream's (same-node pairs, every remote pair to its node's entry)."""
    D = send_DD.shape[0]
    V = D // G
    node = np.arange(D) // G
    same = node[:, None] == node[None, :]
    s, b = np.nonzero(node[:, None] != np.arange(V)[None, :])
    entry = entry_DV(D, G)[s, b]
    rows_DD = np.where(same, send_DD, 0)
    rows_DD[s, entry] = units_DV[s, b]
    stream_DD = np.where(same, send_DD, 0)
    stream_DD[s, entry] = send_DD.reshape(D, V, G).sum(axis=2)[s, b]
    return rows_DD, stream_DD


def fanout_DD(send_DD: np.ndarray, G: int) -> np.ndarray:
    """int64 [D, D]: stage 2's rows, entry rank -> node member (zero across nodes): the pairs of
    every remote source entering at e that member m serves."""
    D = send_DD.shape[0]
    A_VGD = send_DD.reshape(D // G, G, D)  # source s = (node, place in node)
    # entry e = (v, g) takes the sources with place g on every node but v
    into_DD = (A_VGD.sum(axis=0)[None] - A_VGD).reshape(D, D)
    node = np.arange(D) // G
    return np.where(node[:, None] == node[None, :], into_DD, 0)


def _ranges(start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """The positions start[i] .. start[i] + length[i] - 1 of every i, concatenated (int64)."""
    length = np.asarray(length, dtype=np.int64)
    return (np.repeat(np.asarray(start, dtype=np.int64) - (np.cumsum(length) - length), length)
            + np.arange(int(length.sum()), dtype=np.int64))


def _starts(n: np.ndarray) -> np.ndarray:
    return np.cumsum(n) - n


class _OneNode(torch.autograd.Function):
    """fn(*inputs) as a single node of the outer graph: its backward replays fn's own graph in one
    nested backward, where every rank meets the same graph and so runs the collectives in it in
    the same order."""

    @staticmethod
    def forward(ctx, fn, *inputs):
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
            outs = fn(*leaves)
        ctx.leaves, ctx.outs = leaves, outs
        return tuple(o.detach() for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        pairs = [(o, g) for o, g in zip(ctx.outs, grads) if o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        leaves, ctx.leaves, ctx.outs = ctx.leaves, None, None
        return (None, *(t.grad if t.requires_grad else None for t in leaves))


class DedupExchange:
    """One microbatch's deduplicated exchange on one EP rank: `send_rows` (what dispatch hands to
    the exchange), `exchange` (stage 1 + stage 2 -> the plain exchange's rows), `give_back` (the
    reverse, with the entry's sums) and the tables they use."""

    def __init__(self, plan, so: SendOrder, units: NodeUnits, units_DV: np.ndarray, me: int, G: int,
                 group, comm, width: int):
        """width: the most pairs a token has on any EP rank (host int): it bounds the pairs of any
        unit this rank sums as an entry."""
        self.group, self.comm, self.me, self.G, self.width = group, comm, me, G, int(width)
        self.node_group = node_group(group, G)
        self.units = units
        send_DD = plan.send_DD
        D, S = send_DD.shape[0], plan.placement.slots_per_rank
        self.slots = S
        self.rows_DD, self.stream_DD = stage1_DD(send_DD, units_DV, G)
        self._source_stream(so, units, S)
        self._receiver_tables(send_DD, units_DV, D)
        # the receiving side's tables on the device, in one non-blocking copy (no wait for the
        # kernels queued before)
        names = ("fan_pos", "first_unit", "fan_src", "unit_rows", "x_order", "p_order", "q_of_stage2", "stage1_back")
        self.on_dev = dict(zip(names, stage([getattr(self, n) for n in names], so.token_P.device)))

    # -- the source side ---------------------------------------------------------------------------
    def _source_stream(self, so: SendOrder, u: NodeUnits, S: int) -> None:
        """The per-pair stream in stage-1 order: each remote node's pairs grouped by unit (units by
        token, a unit's pairs in send order), this node's pairs as sent."""
        dev = so.token_P.device
        by_unit = torch.argsort(u.unit_of_R, stable=True)
        lo, hi = u.pair_lo, u.pair_hi
        remote = u.remote_R[by_unit]
        pos = torch.arange(lo, hi, device=dev)
        self.stream_pos = torch.cat([remote[:lo], pos, remote[lo:]])
        dest_R = np.r_[so.dest_P[:lo], so.dest_P[hi:]]  # the remote pairs, on the host (no device sync)
        node_R = dest_R // self.G
        first_unit_R, code_R = stage([_starts(u.units_V)[node_R],
                                      dest_R % self.G * S + np.r_[so.slot_P[:lo], so.slot_P[hi:]]], dev)
        meta_R = torch.stack([u.unit_of_R - first_unit_R, u.level_R, code_R], dim=1)[by_unit]
        pad = torch.zeros((hi - lo, META), dtype=torch.int64, device=dev)
        self.meta = torch.cat([meta_R[:lo], pad, meta_R[lo:]])

    def send_rows(self, x_TH: torch.Tensor, probs_P: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x_N [N, H]: the stage-1 rows, probs in stream order [Ps])."""
        return x_TH.index_select(0, self.units.row_token_N), probs_P.index_select(0, self.stream_pos)

    # -- the receiving and entry side ------------------------------------------------------------------
    def _receiver_tables(self, send_DD: np.ndarray, units_DV: np.ndarray, D: int) -> None:
        me, G = self.me, self.G
        node = np.arange(D) // G
        mine = node[me]
        same = node == mine
        entered = ~same & (np.arange(D) % G == me % G)  # the sources whose units enter here
        rows_in, stream_in = self.rows_DD[:, me], self.stream_DD[:, me]
        self.rows_recv, self.stream_recv = rows_in.tolist(), stream_in.tolist()
        self.rows_send, self.stream_send = self.rows_DD[me].tolist(), self.stream_DD[me].tolist()
        row_start, stream_start = _starts(rows_in), _starts(stream_in)
        # the pairs to fan out: the entered sources' streams, each source's in order
        src = np.flatnonzero(entered)
        self.fan_pos = _ranges(stream_start[src], stream_in[src])
        self.fan_src = np.repeat(src, stream_in[src])
        unit_rows = _ranges(row_start[src], units_DV[src, mine])  # their units' stage-1 rows
        self.unit_rows, self.first_unit = unit_rows, np.repeat(_starts(units_DV[src, mine]), stream_in[src])
        members = np.arange(mine * G, (mine + 1) * G)
        self.fan_send = send_DD[np.ix_(src, members)].sum(axis=0).tolist()  # to each node member
        # what arrives in stage 2 from entry e: the sources with that place, ascending, send_DD[s, me] each
        from_e = [np.flatnonzero(~same & (np.arange(D) % G == e)) for e in range(G)]
        self.fan_recv = [int(send_DD[s_e, me].sum()) for s_e in from_e]
        # the plain exchange's order: source-major; same-node sources from stage 1, others from stage 2
        n1, n1s = int(rows_in.sum()), int(stream_in.sum())
        x_at, p_at = np.zeros(D, dtype=np.int64), np.zeros(D, dtype=np.int64)
        x_at[same], p_at[same] = row_start[same], stream_start[same]
        at2 = 0
        for s_e in from_e:
            for s in s_e:
                x_at[s], p_at[s] = n1 + at2, n1s + at2
                at2 += int(send_DD[s, me])
        n_in = send_DD[:, me]
        self.x_order = _ranges(x_at, n_in)  # rows of cat(stage-1 rows, stage-2 rows)
        self.p_order = _ranges(p_at, n_in)  # probs of cat(stage-1 stream, stage-2 probs)
        # the way back: every stage-2 row's place in the plain order; the stage-1 rows from
        # cat(y_Q, unit sums): same-node sources' rows by their place, units by their sum's index
        q_of = np.empty(n1 + at2, dtype=np.int64)
        q_of[self.x_order] = np.arange(self.x_order.size)
        self.q_of_stage2 = q_of[n1:]
        back = np.empty(n1, dtype=np.int64)
        pair_rows = _ranges(row_start[same], rows_in[same])
        back[pair_rows] = q_of[pair_rows]
        back[unit_rows] = self.x_order.size + np.arange(unit_rows.size)
        self.stage1_back = back
        self.D, self.unit_span = D, int(units_DV[:, mine].max(initial=0)) + 1

    def exchange(self, x_N: torch.Tensor, probs_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stages 1 and 2: (x_Q [Q, H], probs_Q [Q]), the plain exchange's rows in its order. One
        autograd node: the rows' and the probs' collectives run in parallel chains, whose backward
        the engine could order differently on different ranks (a collective mismatch)."""
        return _OneNode.apply(self._exchange, x_N, probs_S)

    def _exchange(self, x_N: torch.Tensor, probs_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.on_dev
        x1 = self.comm.exchange(x_N, self.rows_send, self.rows_recv, self.rows_DD)
        p1 = all_to_all(probs_S, self.stream_send, self.stream_recv, self.group)
        meta1 = all_to_all(self.meta, self.stream_send, self.stream_recv, self.group)
        fan_pos = t["fan_pos"]
        meta_F = meta1.index_select(0, fan_pos)
        unit_F = t["first_unit"] + meta_F[:, 0]
        S = self.slots
        dest_F, slot_F = meta_F[:, 2] // S, meta_F[:, 2] % S
        src_F = t["fan_src"]
        # to each node member, by source, slot there, then token (units are in token order)
        order_F = torch.argsort(((dest_F * self.D + src_F) * S + slot_F) * self.unit_span + meta_F[:, 0])
        self.fan_unit, self.fan_level = unit_F[order_F], meta_F[:, 1][order_F]
        unit_rows = t["unit_rows"]
        x2 = all_to_all(x1.index_select(0, unit_rows[self.fan_unit]), self.fan_send, self.fan_recv, self.node_group)
        p2 = all_to_all(p1.index_select(0, fan_pos[order_F]), self.fan_send, self.fan_recv, self.node_group)
        x_Q = torch.cat([x1, x2]).index_select(0, t["x_order"])
        probs_Q = torch.cat([p1, p2]).index_select(0, t["p_order"])
        return x_Q, probs_Q

    def give_back(self, y_QH: torch.Tensor) -> torch.Tensor:
        """The way back: [N, H], this rank's stage-1 rows' outputs (same-node pairs' outputs and
        its units' sums from the entry ranks), in its send order."""
        t = self.on_dev
        y2 = y_QH.index_select(0, t["q_of_stage2"])
        y_fan = all_to_all(y2, self.fan_recv, self.fan_send, self.node_group)
        sums_UH = ordered_sum(y_fan, self.fan_unit, self.fan_level, self.unit_rows.size, self.width)
        y1 = torch.cat([y_QH, sums_UH]).index_select(0, t["stage1_back"])
        return self.comm.exchange(y1, self.rows_recv, self.rows_send, self.rows_DD.T)
