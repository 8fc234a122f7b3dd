"""A rank's token-expert pairs seen node by node, for EP groups that span nodes.

A *unit* is one token of this rank with at least one pair on one remote node: what crosses the
network once when tokens are deduplicated (runtime/dedup.py). Whether or not they are, a token's
outputs are added up node by node: first the outputs of its pairs on each remote node (a unit's
partial sum, in the unit's pair order), then the token's rows (its same-node pairs and its units'
partials, in send order). Every sum is `ordered_sum`, one elementwise add per level, so the
partials are bit-for-bit the same whether the entry rank on the remote node adds them (dedup on)
or this rank does (dedup off), and so is the layer's output.

Shape letters (docs/architecture.md): T tokens on this rank, P pairs it sends, V nodes, G ranks per
node, H hidden size; here U units, sorted by (node, token), and N the rows of this rank's
node-aware message list: the units of nodes before its own, its same-node pairs, the units of the
nodes after (by destination rank, as the pairs are).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .local import SendOrder
from .staging import stage


def ordered_sum(y_NH: torch.Tensor, group_N: torch.Tensor, level_N: torch.Tensor, groups: int,
                width: int) -> torch.Tensor:
    """[groups, H]: every group's rows of y_NH [N, H] added in level order, ((y_0 + y_1) + y_2)...;
    a group without rows gives zeros. group_N, level_N: int64 [N] on y's device, (group, level)
    unique, each group's levels 0, 1, ... below `width` (a host bound, e.g. the most pairs a token
    has: taking it from level_N would sync a GPU). Each level is one elementwise add over all
    groups, so the same rows with the same levels give the same bits on any rank and for any width
    that bounds them (no atomics, no reduction tree; NaN payloads aside)."""
    N, H = y_NH.shape
    # no shortcut for N == 0: the result stays a function of y_NH, so the collective that made
    # y_NH stays in the backward graph on every rank (a rank leaving it out would hang the others)
    W = max(int(width), 1)
    # a missing level 0 (a group without rows) reads row N, +0.0; a missing later level row N + 1,
    # -0.0, since x + (-0.0) is x for every non-NaN x (+0.0 would turn a -0.0 sum into +0.0, so a
    # loose width would change bits)
    table_GW = torch.full((groups, W), N + 1, dtype=torch.int64, device=y_NH.device)
    table_GW[:, 0] = N
    table_GW[group_N, level_N] = torch.arange(N, device=y_NH.device)
    y_pad = torch.cat([y_NH, y_NH.new_zeros((1, H)), y_NH.new_full((1, H), -0.0)])
    out = y_pad[table_GW[:, 0]]
    for w in range(1, W):
        out = out + y_pad[table_GW[:, w]]
    return out


def levels(group_N: torch.Tensor, groups: int) -> torch.Tensor:
    """int64 [N]: each row's rank among the rows of its group (group_N int64 [N], values below
    `groups`), in row order. Sizes come from the host (`groups`), not from the data: no GPU sync
    (bincount would take one for its output size)."""
    N = group_N.numel()
    order = torch.argsort(group_N, stable=True)
    count = torch.zeros(groups, dtype=torch.int64, device=group_N.device)
    count.index_add_(0, group_N, torch.ones_like(group_N))
    start = torch.cumsum(count, 0) - count
    level_N = torch.empty_like(group_N)
    level_N[order] = torch.arange(N, device=group_N.device) - start[group_N[order]]
    return level_N


@dataclass
class NodeUnits:
    """This rank's pairs (a SendOrder's, by destination rank) grouped by node into units.

    pair_lo, pair_hi: the same-node pairs' range in send order. The remote pairs are the others,
    in send order; unit_of_R / level_R (int64 [Pr]) give each its unit and its place among the
    unit's pairs. units_V (host int64 [V]): units per node (0 for this rank's own). row_index_N
    picks the message list's rows from cat(units, pairs); row_token_N / row_level_N: each row's
    token and its place among the token's rows. width: the most pairs a token of this rank has
    (host), which bounds both a unit's pairs and a token's rows."""

    node: int
    pair_lo: int
    pair_hi: int
    remote_R: torch.Tensor
    unit_of_R: torch.Tensor
    level_R: torch.Tensor
    unit_token_U: torch.Tensor
    units_V: np.ndarray
    row_index_N: torch.Tensor
    row_token_N: torch.Tensor
    row_level_N: torch.Tensor
    width: int

    @property
    def num_units(self) -> int:
        return int(self.units_V.sum())

    def rows_from_pairs(self, y_PH: torch.Tensor) -> torch.Tensor:
        """The message list's rows [N, H] made from every pair's output y_PH [P, H] (send order):
        same-node pairs as they are, each unit the ordered sum of its pairs (what the entry rank
        computes when tokens are deduplicated)."""
        partial_UH = ordered_sum(y_PH[self.remote_R], self.unit_of_R, self.level_R, self.num_units,
                                 self.width)
        return torch.cat([partial_UH, y_PH]).index_select(0, self.row_index_N)

    def token_sums(self, y_NH: torch.Tensor, T: int) -> torch.Tensor:
        """[T, H]: every token's rows of the message list summed in send order."""
        return ordered_sum(y_NH, self.row_token_N, self.row_level_N, T, self.width)


def node_units(so: SendOrder, me: int, G: int, V: int, T: int, width: int) -> NodeUnits:
    """Group rank `me`'s pairs (so, token_P on its device) into units: EP ranks d on node d // G,
    V nodes; width: the most pairs a token of this rank has (host int). One host sync: the units
    per node, which the exchange needs as split sizes; the host tables go over in non-blocking
    copies."""
    dev = so.token_P.device
    node = me // G
    node_P = so.dest_P // G
    lo, hi = np.searchsorted(node_P, [node, node + 1])
    P = node_P.size
    remote = np.r_[np.arange(lo, dtype=np.int64), np.arange(hi, P, dtype=np.int64)]
    remote_R, node_R = stage([remote, node_P[remote]], dev)
    key_R = node_R * max(T, 1) + so.token_P[remote_R]
    unit_key_U, unit_of_R = torch.unique(key_R, sorted=True, return_inverse=True)
    unit_node_U = (unit_key_U // max(T, 1)).cpu().numpy()
    units_V = np.bincount(unit_node_U, minlength=V).astype(np.int64)
    U = int(units_V.sum())
    before = int(units_V[:node].sum())  # units of the nodes before this rank's own
    row_index = np.r_[np.arange(before), U + np.arange(lo, hi), np.arange(before, U)].astype(np.int64)
    (row_index_N,) = stage([row_index], dev)
    unit_token_U = unit_key_U % max(T, 1)
    row_token_N = torch.cat([unit_token_U, so.token_P]).index_select(0, row_index_N)
    return NodeUnits(node, int(lo), int(hi), remote_R, unit_of_R, levels(unit_of_R, U), unit_token_U, units_V,
                     row_index_N, row_token_N, levels(row_token_N, T), int(width))
