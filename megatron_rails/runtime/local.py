"""A rank's local token work in one MoE layer step, given the plan: which token-expert pairs go
where (send order), how received rows group by slot (receive order) and how each token's expert
outputs come back together (combine). Plain torch ops; the plan's tables are numpy on the host.

Shape letters: docs/architecture.md (glossary). Here T local tokens, E experts, D EP ranks, S slots
per rank, P token-expert pairs this rank sends, Q pairs it receives, H hidden size, N rows of one
permutation, M route entries.
"""
from __future__ import annotations

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


def order_pairs(plan, me: int, routing_map: torch.Tensor, probs: torch.Tensor) -> SendOrder:
    """Rank `me`'s token-expert pairs (routing_map bool [T, E], probs [T, E]) in the plan's send order."""
    p = plan.placement
    dev = routing_map.device
    ptr, rep_M, tok_M = plan.route
    row = slice(ptr[me], ptr[me + 1])
    # pairs in expert-major, token-minor order (the stock permutation order); the route row lists
    # this rank's replicas in (expert, rank) order, one run of pairs each: sending by (destination,
    # slot), token order kept, is a stable reorder of those runs
    T, E = routing_map.shape
    lo_hi = torch.stack(torch.aminmax(routing_map.sum(dim=1))) if T else None  # queued before nonzero's sync
    e_P, t_P = routing_map.T.nonzero(as_tuple=True)
    rep = rep_M[row]
    dest, slot = p.replica_rank_R[rep], p.replica_slot_R[rep]
    runs = np.argsort(dest * p.slots_per_rank + slot, kind="stable")
    order = torch.from_numpy(segment_order(tok_M[row], runs)).to(dev)
    token_P, e_sent = t_P[order], e_P[order]
    probs_P = probs[token_P, e_sent]
    P = token_P.numel()
    # every token has the same number k of pairs (top-k routing without drops): the combine sums
    # each token's k outputs as a [T, k, H] reduction instead of scattered adds. by_token lists
    # the send positions of every token's pairs, token-major: a [T, E] table of positions (P where
    # not routed) whose k smallest per row are the token's pairs
    k = P // T if T else 0
    by_token = None
    if k:
        lo, hi = lo_hi.tolist()
        if lo == hi:
            pos_TE = torch.full((T, E), P, dtype=torch.int64, device=dev)
            pos_TE[token_P, e_sent] = torch.arange(P, device=dev)
            by_token = (pos_TE.sort(dim=1).values[:, :k] if k < E else pos_TE).reshape(-1)
    n_run = tok_M[row][runs]
    send_D = np.bincount(dest, weights=tok_M[row], minlength=plan.send_DD.shape[0]).astype(np.int64).tolist()
    return SendOrder(token_P, probs_P, send_D, plan.send_DD[:, me].tolist(), by_token, k,
                     np.repeat(dest[runs], n_run), np.repeat(slot[runs], n_run))


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
