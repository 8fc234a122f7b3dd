"""The receiving side of a rank's local work in one MoE layer step: the rows it receives (source-
major, slot-minor, as the exchange delivers them) grouped by slot for the experts, and the slots'
outputs put back in received order for the way back.

Rows move as whole runs where they can (`Runs`: one split and one concatenation, like Megatron-Core's
`sort_chunks_by_idxs`); beyond MAX_RUNS runs, by a permutation. Each reordering is one autograd
node whose backward is the inverse reordering (a gather, never a scatter-add).

Shape letters: docs/architecture.md (glossary). Here S slots per rank, Q rows this rank receives,
H hidden size, N rows of one permutation.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .staging import permutation_and_inverse, segment_order

MAX_RUNS = 256  # received runs regrouped by split + cat up to this many; beyond, by an index gather


@dataclass(frozen=True)
class Runs:
    """A reordering of rows by whole runs: the rows cut into consecutive runs of `sizes` (in input
    order), then taken in the order `take` (indices into sizes). Megatron-Core's sort_chunks_by_idxs
    reorders its received chunks the same way: one split, one concatenation, no index tensor."""
    sizes: tuple
    take: tuple

    def inverse(self) -> "Runs":
        """The reordering that undoes this one (made once: dispatch, regroup's backward and combine
        all ask for it)."""
        inv = self.__dict__.get("_inverse")
        if inv is None:
            back = [0] * len(self.take)
            for j, i in enumerate(self.take):
                back[i] = j
            inv = Runs(tuple(self.sizes[i] for i in self.take), tuple(back))
            inv.__dict__["_inverse"] = self
            self.__dict__["_inverse"] = inv
        return inv

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, ...] (N = sum(sizes)) reordered; no autograd of its own (see `rows`)."""
        chunks = x.split(self.sizes)
        return torch.cat([chunks[i] for i in self.take])


def receive_order_host(plan, me: int) -> tuple:
    """The rows this rank receives arrive source-major, slot-minor. Returns (order, per_slot): how
    to group them by slot, stable within a slot (Runs: one run per (source, slot), up to MAX_RUNS
    of them; beyond, a permutation int64 [Q]; None where the rows already arrive grouped), and the
    rows per slot (int64 [S])."""
    p = plan.placement
    ptr, rep_M, tok_M = plan.route
    mine = np.flatnonzero(p.replica_rank_R[rep_M] == me)  # route entries into this rank: its runs
    slot_m = p.replica_slot_R[rep_M[mine]]
    per_slot = np.bincount(slot_m, weights=tok_M[mine], minlength=p.slots_per_rank).astype(np.int64)
    # the runs arrive by source (the route is source-major), slot-minor; one run per (source, slot)
    src_m = np.searchsorted(ptr, mine, side="right") - 1
    arrive = np.argsort(src_m * p.slots_per_rank + slot_m, kind="stable")
    if (np.diff(slot_m[arrive]) >= 0).all():  # the rows already arrive grouped by slot
        return None, per_slot
    # the received runs taken slot-major (source order kept within a slot)
    return grouping(tok_M[mine][arrive], np.argsort(slot_m[arrive], kind="stable")), per_slot


def grouping(sizes: np.ndarray, take: np.ndarray):
    """Received runs (rows int64 [n] in arrival order) taken in the order `take`: Runs up to
    MAX_RUNS of them, else the permutation of rows (int64 [Q])."""
    if sizes.size <= MAX_RUNS:
        return Runs(tuple(sizes.tolist()), tuple(take.tolist()))
    return segment_order(sizes, take)


def receive_order(plan, me: int, device) -> tuple:
    """receive_order_host's reordering and its inverse, for `rows` and `rows_back`: Runs, or int64
    tensors on `device` (a permutation: many runs); both None where the rows already arrive
    grouped. Then the rows per slot."""
    order, per_slot = receive_order_host(plan, me)
    if order is None:
        return None, None, per_slot
    if isinstance(order, Runs):
        return order, order.inverse(), per_slot
    return (*permutation_and_inverse(order, device), per_slot)


def rows(x: torch.Tensor, index, inverse=None) -> torch.Tensor:
    """x reordered by index: Runs, or a permutation tensor (None: as is). A permutation's backward is
    a gather by its inverse where that is given (else a scatter-add into zeros); Runs' the inverse
    Runs."""
    if index is None:
        return x
    grad = x.requires_grad and torch.is_grad_enabled()
    if isinstance(index, Runs):
        return _TakeRuns.apply(x, index) if grad else index.apply(x)
    if not grad:
        return x.index_select(0, index)  # a row gather (x[index] takes the elementwise indexing kernel)
    if inverse is None:
        return x[index]
    return _PermuteRows.apply(x, index, inverse)


class _TakeRuns(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, runs):
        ctx.runs = runs
        return runs.apply(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.runs.inverse().apply(grad), None


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.inverse = inverse
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        return grad.index_select(0, ctx.inverse), None, None


def _words(x: torch.Tensor) -> torch.Tensor:
    """x [n, H] seen as 8-byte words per row where its layout allows (the same bytes): an indexed
    row write then moves 8 bytes per element, not 2 (bf16), which is what that kernel's time goes by."""
    size = x.element_size()
    # strides, not is_contiguous(): that ignores the row stride of a one- or zero-row slice, which
    # view() checks
    if (x.dim() == 2 and size < 8 and x.dtype != torch.bool and x.stride(1) == 1 and (x.shape[1] * size) % 8 == 0
            and (x.stride(0) * size) % 8 == 0 and (x.storage_offset() * size) % 8 == 0):
        return x.view(torch.int64)
    return x


def rows_back(parts: list, order) -> torch.Tensor:
    """The rows of `parts` (each [n_i, H], together the received rows in slot order, same dtype)
    put back in received order, undoing `rows(x, order)`: for a permutation out[order[j]] =
    cat(parts)[j] (one indexed write of every row, a gather per part in the backward); for Runs
    the parts cut at run boundaries and concatenated in received order (one concatenation, one in
    the backward); order None: the slot order is the received order (no copy where one part holds
    every row: the result is then a view of that part, not to be written in place). Every part gets
    a gradient, zero-row ones too (an autograd anchor must run)."""
    if order is None:
        if len(parts) == 1:
            return parts[0]
        if sum(1 for p in parts if p.shape[0]) > 1:
            return torch.cat(parts)
    if isinstance(order, Runs):
        if any(p.requires_grad for p in parts) and torch.is_grad_enabled():
            return _RunsBack.apply(order, *parts)
        return _runs_back(order, parts)
    return _RowsBack.apply(order, *parts)


def _runs_back(runs: Runs, parts) -> torch.Tensor:
    """cat(parts) reordered by runs.inverse(), without concatenating the parts first: each part is
    cut into the runs it holds (parts hold whole runs: a part is one or more whole slots)."""
    inv = runs.inverse()
    chunks, j = [], 0
    for p in parts:
        n, k = p.shape[0], j
        while n > 0:
            n -= inv.sizes[k]
            k += 1
        if n:
            raise ValueError(f"rows_back: a part of {p.shape[0]} rows does not end at a run boundary")
        chunks += p.split(inv.sizes[j:k]) if k > j else []
        j = k
    return torch.cat([chunks[i] for i in inv.take])


class _RunsBack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runs, *parts):
        ctx.runs, ctx.sizes = runs, [p.shape[0] for p in parts]
        return _runs_back(runs, parts)

    @staticmethod
    def backward(ctx, grad):  # slot order again (one concatenation), then every part's rows: views
        return (None, *ctx.runs.apply(grad).split(ctx.sizes))


class _RowsBack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, order, *parts):
        ctx.order, ctx.sizes = order, [p.shape[0] for p in parts]
        if order is None:  # one part holds every row: it is the result (a view, nothing copied)
            whole = next((p for p in parts if p.shape[0]), parts[0])
            return whole.view_as(whole)
        out = parts[0].new_empty((order.numel(), *parts[0].shape[1:]))
        out_words, start = _words(out), 0
        for p in parts:
            p_words = _words(p)
            dst = out_words if p_words.dtype == out_words.dtype else out
            dst.index_copy_(0, order[start:start + p.shape[0]], p_words if dst is out_words else p)
            start += p.shape[0]
        return out

    @staticmethod
    def backward(ctx, grad):
        grads, start = [], 0
        for n in ctx.sizes:
            if ctx.order is None:
                grads.append(grad if n else grad[:0])
            else:
                grads.append(grad.index_select(0, ctx.order[start:start + n]))
            start += n
        return (None, *grads)
