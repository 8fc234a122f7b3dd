"""A rank's local token work in one MoE layer step, given the plan: which token-expert pairs go
where (send order), how received rows group by slot (receive order) and how each token's expert
outputs come back together (combine). Plain torch ops; the plan's tables are numpy on the host.

Shape letters: docs/architecture.md (glossary). Here T local tokens, E experts, D EP ranks, S slots
per rank, P token-expert pairs this rank sends, Q pairs it receives, H hidden size, N rows of one
permutation, M route entries.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


def permutation_and_inverse(order_N: np.ndarray, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A permutation (numpy) and its inverse as int64 tensors on `device`, in one host-to-device copy."""
    both = np.empty((2, order_N.size), dtype=np.int64)
    both[0] = order_N
    both[1, order_N] = np.arange(order_N.size)
    order_t, inverse_t = torch.from_numpy(both).to(device).unbind(0)
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
    dest_P: np.ndarray  # int64 [P] (host): the destination EP rank of every pair
    slot_P: np.ndarray  # int64 [P] (host): its slot there


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


def _send_order(plan, me: int, runs_of_me: tuple, token_P, e_P, probs, T: int, E: int, uniform: bool,
                pos_ET=None) -> SendOrder:
    """The SendOrder of pairs already in send order (token_P, e_P int64 [P] on the device);
    runs_of_me: _runs(plan, me).
    uniform: every token has the same number k of pairs (top-k routing without drops): the combine
    then sums each token's k outputs as a [T, k, H] reduction instead of scattered adds; by_token
    lists the send positions of every token's pairs, token-major: the k smallest per row of a
    [T, E] table of positions (P where not routed), pos_ET's transpose when given."""
    runs, n_M, dest, slot = runs_of_me
    P = int(n_M.sum())
    k = P // T if T else 0
    by_token = None
    if k and uniform:
        if pos_ET is None:
            pos_TE = torch.full((T, E), P, dtype=torch.int64, device=token_P.device)
            pos_TE[token_P, e_P] = torch.arange(P, device=token_P.device)
        else:
            pos_TE = pos_ET.T
        by_token = (pos_TE.sort(dim=1).values[:, :k] if k < E else pos_TE).reshape(-1)
    send_D = np.bincount(dest, weights=n_M, minlength=plan.send_DD.shape[0]).astype(np.int64).tolist()
    return SendOrder(token_P, probs[token_P, e_P], send_D, plan.send_DD[:, me].tolist(), by_token, k,
                     np.repeat(dest[runs], n_M[runs]), np.repeat(slot[runs], n_M[runs]))


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
    return _send_order(plan, me, runs_of_me, t_P[order], e_P[order], probs, T, E, uniform)


def order_pairs_on_device(plan, me: int, routing_map: torch.Tensor, probs: torch.Tensor,
                          uniform: bool) -> SendOrder:
    """order_pairs with the order made on the map's device and no device sync: a pair's place in
    the stock stream comes from per-expert running counts of the map, its run from a search in the
    runs' ends, its send position from the run's shift; the per-plan table (two int64 [M]: run ends
    in the stream, send start minus stream start) is the only copy, non-blocking from pinned memory
    on CUDA. Same result as order_pairs, tensor for tensor."""
    dev = routing_map.device
    T, E = routing_map.shape
    runs_of_me = _runs(plan, me)
    runs, n_M = runs_of_me[:2]
    P = int(n_M.sum())
    if P == 0:
        none = torch.zeros(0, dtype=torch.int64, device=dev)
        return _send_order(plan, me, runs_of_me, none, none, probs, T, E, uniform)
    begin_M = np.cumsum(n_M) - n_M
    send_begin_M = np.empty_like(n_M)
    send_begin_M[runs] = np.cumsum(n_M[runs]) - n_M[runs]
    table = torch.from_numpy(np.stack([begin_M + n_M, send_begin_M - begin_M]))
    if dev.type == "cuda":
        table = table.pin_memory()
    end_M, shift_M = table.to(dev, non_blocking=True).unbind(0)
    routed_ET = routing_map.T
    running_ET = routed_ET.to(torch.int64).cumsum(dim=1)  # pairs of each expert up to each token
    per_E = running_ET[:, -1]
    stream_ET = running_ET - 1 + (per_E.cumsum(0) - per_E).unsqueeze(1)  # place in the stock stream
    run_ET = torch.searchsorted(end_M, stream_ET, right=True).clamp_(max=n_M.size - 1)
    pos_ET = torch.where(routed_ET, stream_ET + shift_M[run_ET], P)  # P: not routed (a dump row)
    t_ET = torch.arange(T, device=dev).expand(E, T)
    e_ET = torch.arange(E, device=dev).unsqueeze(1).expand(E, T)
    token_P = torch.empty(P + 1, dtype=torch.int64, device=dev).scatter_(0, pos_ET.reshape(-1), t_ET.reshape(-1))
    e_P = torch.empty(P + 1, dtype=torch.int64, device=dev).scatter_(0, pos_ET.reshape(-1), e_ET.reshape(-1))
    return _send_order(plan, me, runs_of_me, token_P[:P], e_P[:P], probs, T, E, uniform, pos_ET)


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
    n_DS = np.zeros((D, S), dtype=np.int64)
    np.add.at(n_DS, (src_M[mine], p.replica_slot_R[rep_M[mine]]), tok_M[mine])
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
