"""A rank's local token work in one MoE layer step, given the plan: which token-expert pairs go
where (send order), how received rows group by slot (receive order) and how each token's expert
outputs come back together (combine). Plain torch ops; the plan's tables are numpy on the host.

Shape letters: docs/architecture.md (glossary). Here T local tokens, E experts, D EP ranks, S slots
per rank, P token-expert pairs this rank sends, Q pairs it receives, H hidden size, N rows of one
permutation, M route entries.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


def _host_rows(n: int, device) -> torch.Tensor:
    """An int64 [2, n] host buffer for two per-plan rows bound for `device`: filled through
    .numpy(), then sent by one `.to(device, non_blocking=True)`. Pinned for CUDA, so that copy does
    not wait for the device (the caching host allocator keeps the block until the copy is done)."""
    return torch.empty((2, n), dtype=torch.int64, pin_memory=torch.device(device).type == "cuda")


def permutation_and_inverse(order_N: np.ndarray, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A permutation (numpy) and its inverse as int64 tensors on `device`, in one host-to-device copy
    (on CUDA from pinned memory, not waiting for the device)."""
    both = _host_rows(order_N.size, device)
    both_np = both.numpy()
    both_np[0] = order_N
    both_np[1, order_N] = np.arange(order_N.size)
    order_t, inverse_t = both.to(device, non_blocking=True).unbind(0)
    return order_t, inverse_t


@dataclass
class SendOrder:
    """This rank's token-expert pairs in send order (by destination rank, then slot there; token
    order kept within a slot), as order_pairs computes them."""
    token_P: torch.Tensor  # the token of every pair (on the routing map's device)
    probs_P: torch.Tensor  # its routing prob
    send_D: list  # all-to-all split sizes out
    recv_D: list  # and in
    by_token: Optional[torch.Tensor]  # pair positions grouped by token, when every token has k pairs
    k: int
    runs: "_RunsOfPairs"  # the pairs' destinations, by run (host)

    @functools.cached_property
    def dest_P(self) -> np.ndarray:
        """int64 [P] (host): the destination EP rank of every pair (made when first asked for)."""
        return self.runs.expand("dest")

    @functools.cached_property
    def slot_P(self) -> np.ndarray:
        """int64 [P] (host): its slot there."""
        return self.runs.expand("slot")


@dataclass
class _RunsOfPairs:
    """The send order's runs (int64 [M] each, in send order): destination rank, slot, pairs; their
    per-pair expansion is made only for the paths that need it (dedup)."""
    dest_M: np.ndarray
    slot_M: np.ndarray
    n_M: np.ndarray

    def expand(self, what: str) -> np.ndarray:
        return np.repeat(self.dest_M if what == "dest" else self.slot_M, self.n_M)


def segment_order(lengths: np.ndarray, seg_order: np.ndarray) -> np.ndarray:
    """Positions of a stream cut into consecutive segments of `lengths`, the segments taken in
    `seg_order` (each one's positions ascending): a permutation, built without sorting the stream."""
    starts = np.cumsum(lengths) - lengths
    L, S = lengths[seg_order], starts[seg_order]
    return np.repeat(S - (np.cumsum(L) - L), L) + np.arange(int(L.sum()), dtype=np.int64)


def pairs_per_token_range(routing_map: torch.Tensor) -> torch.Tensor:
    """int64 [2] on the map's device: (min, max) pairs per token, [0, 0] without tokens. Queued
    with the token counts' all-gather so that the send order needs no sync of its own."""
    if routing_map.shape[0] == 0:
        return torch.zeros(2, dtype=torch.int64, device=routing_map.device)
    return torch.stack(torch.aminmax(routing_map.sum(dim=1))).to(torch.int64)


def _runs(plan, me: int) -> tuple:
    """This rank's route row, host side: (runs in send order (int64 [M] positions into the row),
    tokens per run in row order (int64 [M]), destination rank and slot of every run (int64 [M])).
    The row lists this rank's replicas in (expert, rank) order, one run of pairs each, and those
    runs cut the stock (expert-major, token-minor) pair stream in turn; sending by (destination,
    slot), token order kept, is a stable reorder of the runs."""
    p = plan.placement
    ptr, rep_M, tok_M = plan.route
    row = slice(ptr[me], ptr[me + 1])
    rep = rep_M[row]
    dest, slot = p.replica_rank_R[rep], p.replica_slot_R[rep]
    runs = np.argsort(dest * p.slots_per_rank + slot, kind="stable")
    return runs, np.asarray(tok_M[row], dtype=np.int64), dest, slot


def _send_order(plan, me: int, runs_of_me: tuple, flat_P, probs, T: int, E: int, uniform: bool,
                pos_ET=None) -> SendOrder:
    """The SendOrder of pairs already in send order, given as flat_P (int64 [P] on the device:
    token * E + expert, an index into the [T, E] map); runs_of_me: _runs(plan, me).
    uniform: every token has the same number k of pairs (top-k routing without drops): the combine
    then sums each token's k outputs as a [T, k, H] reduction instead of scattered adds; by_token
    lists the send positions of every token's pairs, token-major: the k smallest per row of a
    [T, E] table of positions (P where not routed), pos_ET's transpose when given; at k == E every
    row whole, in expert order (both send-order paths alike)."""
    runs, n_M, dest, slot = runs_of_me
    P = int(n_M.sum())
    k = P // T if T else 0
    by_token = None
    if k and uniform:
        if pos_ET is None:
            pos_TE = torch.full((T * E,), P, dtype=torch.int64, device=flat_P.device)
            pos_TE[flat_P] = torch.arange(P, device=flat_P.device)
            pos_TE = pos_TE.view(T, E)
        else:
            pos_TE = pos_ET.T
        # ascending: the k smallest are the routed ones (each token's, in send order)
        by_token = (pos_TE.topk(k, dim=1, largest=False, sorted=True).values if k < E else pos_TE).reshape(-1)
    send_D = np.bincount(dest, weights=n_M, minlength=plan.send_DD.shape[0]).astype(np.int64).tolist()
    return SendOrder(torch.div(flat_P, E, rounding_mode="floor"), probs.reshape(-1)[flat_P], send_D,
                     plan.send_DD[:, me].tolist(), by_token, k, _RunsOfPairs(dest[runs], slot[runs], n_M[runs]))


def order_pairs(plan, me: int, routing_map: torch.Tensor, probs: torch.Tensor,
                uniform: Optional[bool] = None) -> SendOrder:
    """Rank `me`'s token-expert pairs (routing_map bool [T, E], probs [T, E]) in the plan's send
    order, the order made on the host: the stock pair stream (nonzero: a device sync), reordered by
    a host-made permutation copied over. uniform: whether every token has the same number of pairs
    (pairs_per_token_range; None: found here, another sync)."""
    T, E = routing_map.shape
    lo_hi = pairs_per_token_range(routing_map) if uniform is None else None  # queued before nonzero's sync
    e_P, t_P = routing_map.T.nonzero(as_tuple=True)
    runs_of_me = _runs(plan, me)
    runs, n_M = runs_of_me[:2]
    order = torch.from_numpy(segment_order(n_M, runs)).to(routing_map.device)
    if uniform is None:
        lo, hi = lo_hi.tolist()
        uniform = lo == hi
    return _send_order(plan, me, runs_of_me, (t_P * E + e_P)[order], probs, T, E, uniform)


_FLAT_TE: dict = {}  # (T, E, device) -> int64 [E*T]: t*E + e in (e, t) order (a constant per shape)


def _flat_te_in_et_order(T: int, E: int, dev) -> torch.Tensor:
    key = (T, E, str(dev))
    if key not in _FLAT_TE:
        if len(_FLAT_TE) >= 4:  # token counts vary (last batch, inference): keep a few ([T*E] int64 each)
            _FLAT_TE.clear()
        _FLAT_TE[key] = torch.arange(T * E, device=dev).view(T, E).T.reshape(-1)
    return _FLAT_TE[key]


def order_pairs_on_device(plan, me: int, routing_map: torch.Tensor, probs: torch.Tensor,
                          uniform: bool) -> SendOrder:
    """order_pairs with the order made on the map's device and no device sync, in few kernels: a
    running count over the map taken expert-major is each routed pair's place (+1) in the stock
    stream; a search in the runs' ends gives its run, the run's shift its send position, and one
    scatter of every (token, expert)'s flat index puts the pairs in send order. The per-plan table
    (two int64 [M]: run ends in the stream, send start minus stream start minus 1) is the only
    copy, non-blocking from pinned memory on CUDA. Same result as order_pairs, tensor for tensor."""
    dev = routing_map.device
    T, E = routing_map.shape
    runs_of_me = _runs(plan, me)
    runs, n_M = runs_of_me[:2]
    P = int(n_M.sum())
    if P == 0:
        none = torch.zeros(0, dtype=torch.int64, device=dev)
        return _send_order(plan, me, runs_of_me, none, probs, T, E, uniform)
    table = _host_rows(n_M.size, dev)
    end_M, shift_M = table.numpy()
    np.cumsum(n_M, out=end_M)  # run ends in the stream (exclusive)
    shift_M[runs] = np.cumsum(n_M[runs]) - n_M[runs]  # send start of every run ...
    shift_M -= end_M - n_M + 1  # ... minus its stream start, minus 1 (count is place + 1)
    end_M, shift_M = table.to(dev, non_blocking=True).unbind(0)
    routed_F = routing_map.T.contiguous().view(-1)  # F = E*T flat, expert-major: the stock stream's order
    count_F = routed_F.cumsum(0)  # int64: a routed pair's place in the stock stream, plus one
    # its run: the first whose end (exclusive) reaches count (count <= P = the last end: in range)
    pos_F = torch.where(routed_F, count_F + shift_M[torch.searchsorted(end_M, count_F)], P)  # P: a dump row
    flat_P = torch.empty(P + 1, dtype=torch.int64, device=dev).scatter_(0, pos_F, _flat_te_in_et_order(T, E, dev))
    return _send_order(plan, me, runs_of_me, flat_P[:P], probs, T, E, uniform, pos_F.view(E, T))


def sum_pairs(y_P: torch.Tensor, so: SendOrder, T: int) -> torch.Tensor:
    """[T, H]: every token's returned expert outputs summed (rows of y_P in send order)."""
    if so.by_token is not None:
        return y_P[so.by_token].view(T, so.k, y_P.shape[-1]).sum(dim=1)
    return y_P.new_zeros((T, y_P.shape[-1])).index_add(0, so.token_P, y_P)


def receive_order(plan, me: int, device) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], np.ndarray]:
    """The rows this rank receives arrive source-major, slot-minor. Returns (order, inverse,
    per_slot): the permutation that groups them by slot (stable within a slot), its inverse (both
    None where the rows already arrive grouped) and the rows per slot."""
    p = plan.placement
    D, S = plan.send_DD.shape[0], p.slots_per_rank
    ptr, rep_M, tok_M = plan.route
    src_M = np.repeat(np.arange(D), np.diff(ptr))
    mine = p.replica_rank_R[rep_M] == me
    n_DS = np.bincount(src_M[mine] * S + p.replica_slot_R[rep_M[mine]], weights=tok_M[mine],
                       minlength=D * S).astype(np.int64).reshape(D, S)
    per_slot = n_DS.sum(axis=0)
    run_slot = np.tile(np.arange(S), D)[n_DS.ravel() > 0]
    if (np.diff(run_slot) >= 0).all():  # the rows already arrive grouped by slot
        return None, None, per_slot
    # the received runs (source-major, slot-minor), taken slot-major
    order = segment_order(n_DS.ravel(), np.arange(D * S).reshape(D, S).T.ravel())
    return (*permutation_and_inverse(order, device), per_slot)


def rows(x: torch.Tensor, index: Optional[torch.Tensor], inverse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x reordered by index (None: as is). Given the inverse permutation too, the backward is a
    gather by it instead of a scatter-add into zeros."""
    if index is None:
        return x
    if inverse is None or not (x.requires_grad and torch.is_grad_enabled()):
        return x[index]
    return _PermuteRows.apply(x, index, inverse)


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.inverse = inverse
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(0, ctx.inverse), None, None


def rows_back(parts: list, order: Optional[torch.Tensor]) -> torch.Tensor:
    """The rows of `parts` (each [n_i, H], together the received rows in slot order, same dtype)
    put back in received order: out[order[j]] = cat(parts)[j]; order None: the slot order is the
    received order. One write of every row (no concatenated copy first), and a gather per part in
    the backward. Every part gets a gradient, zero-row ones too (an autograd anchor must run)."""
    if order is None:
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    return _RowsBack.apply(order, *parts)


class _RowsBack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, order, *parts):
        ctx.order, ctx.sizes = order, [p.shape[0] for p in parts]
        out = parts[0].new_empty((order.numel(), *parts[0].shape[1:]))
        start = 0
        for p in parts:
            out.index_copy_(0, order[start:start + p.shape[0]], p)
            start += p.shape[0]
        return out

    @staticmethod
    def backward(ctx, grad):
        grads, start = [], 0
        for n in ctx.sizes:
            grads.append(grad.index_select(0, ctx.order[start:start + n]))
            start += n
        return (None, *grads)


SEND_ORDER_ENV = "MEGATRON_RAILS_SEND_ORDER"  # auto (device path on CUDA), device, host


def send_order(plan, me: int, routing_map: torch.Tensor, probs: torch.Tensor, uniform: bool) -> SendOrder:
    """The dispatcher's send order: made on the device for CUDA maps (no sync), on the host for CPU
    ones (cheaper there; no device to wait for). $MEGATRON_RAILS_SEND_ORDER=device / host forces
    one path (tests run the device path on CPU this way)."""
    how = os.environ.get(SEND_ORDER_ENV, "auto")
    if how not in ("auto", "device", "host"):
        raise ValueError(f"{SEND_ORDER_ENV}={how!r}: expected auto, device or host")
    if how == "device" or (how == "auto" and routing_map.is_cuda):
        return order_pairs_on_device(plan, me, routing_map, probs, uniform)
    return order_pairs(plan, me, routing_map, probs, uniform)
