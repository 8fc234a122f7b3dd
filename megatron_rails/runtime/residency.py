"""Resident slot weights: replica and FSEP slot weights are fetched once per optimizer step.

Owner weights (FSEP: the shards) change only when the optimizer steps, so the slots a step's first
microbatch materializes serve all its microbatches and their activation recomputes. The slots'
weight gradients accumulate here and travel back to the owners (shards) by one reverse exchange
when gradient synchronization is due, like data-parallel gradients:

* outside `no_sync()` (the default), at the end of every backward pass through the layer;
* inside `no_sync()`, kept; the first backward outside it returns everything accumulated, and so
  does `flush_pending()` (the Megatron adapter calls it where Megatron DDP starts its gradient
  reduction; every torch optimizer step calls it as the last resort).
The Megatron adapter enters `no_sync()` whenever Megatron DDP's `no_sync()` is entered, which is how
Megatron's schedules mark every microbatch but the last. A store whose `defer_flush` is set (its
framework always calls `flush_pending()` before reading gradients: Megatron DDP without
overlap_grad_reduce) never returns them from a backward pass.

A step ends, and the next forward fetches fresh weights, when any torch optimizer steps (a global
step hook), when `new_step()` is called (for updates no optimizer makes), or when a source
parameter's version counter moves (an in-place update autograd can see).

Every flush is a collective over the EP group. All ranks run the same forwards and backwards, so
they agree on when one is due; each layer's autograd node sits in every rank's graph (the empty
anchor the runtime concatenates into the layer output) so that every rank joins.

Shape letters (docs/architecture.md): N this rank's resident slots, W parameters of one expert.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.optim.optimizer as torch_optimizer

from ..core.plan import Placement

_gate = threading.local()
_epoch = 0
_stores: list = []  # weak references to every store, in creation order (identical on every rank)
_hooks = None


@contextlib.contextmanager
def no_sync():
    """Slot weight gradients accumulate locally inside; the first backward outside returns them."""
    _gate.depth = getattr(_gate, "depth", 0) + 1
    try:
        yield
    finally:
        _gate.depth -= 1


def syncing() -> bool:
    """Whether a backward pass running now returns the slots' gradients to their owners."""
    return getattr(_gate, "depth", 0) == 0


def new_step() -> None:
    """Mark every resident slot stale: the owners' weights changed (an update no torch optimizer made)."""
    global _epoch
    _epoch += 1


def epoch() -> int:
    return _epoch


def flush_pending() -> None:
    """Return every store's accumulated slot gradients now (collective over each EP group; every rank
    must call it at the same point). Adds into `main_grad` where the framework keeps one, else `.grad`."""
    for ref in list(_stores):
        store = ref()
        if store is None:
            _stores.remove(ref)
        elif store.window is not None and store.window.pending:
            store.flush(store.window, in_graph=False)


def register(store) -> None:
    """Track a store for flush_pending(), and hook the optimizers once per process."""
    global _hooks
    _stores.append(weakref.ref(store))
    if _hooks is None:
        opt = torch_optimizer
        _hooks = (opt.register_optimizer_step_pre_hook(lambda *_: flush_pending()),
                  opt.register_optimizer_step_post_hook(lambda *_: new_step()))


@dataclass(eq=False)
class Window:
    """The slots resident on this rank for one optimizer step (or, without training, until a better
    placement replaces them).

    placement: the resident placement (the same on every rank).
    key:       (epoch, source parameter versions) when fetched; a different key means stale.
    weights_NW: float [N, W'] this rank's slots' flat weights (W' >= W: FSEP pads to D shards), detached;
               None while `fetch` (the exchange bringing them, a comm Pending) runs: read weights().
    slots_N:   int64 [N] the slot index of each row.
    moved:     whether any rank holds a moved slot (else there is nothing to fetch or return).
    route:     what the store needs to return gradients (its fetch exchange's split sizes).
    acc_NW:    the slots' accumulated weight gradients (allocated by the first backward).
    pending:   gradients accumulated and not yet returned (identical on every rank).
    in_flight: training forwards on these slots whose backward has not run yet.
    """

    placement: Placement
    key: tuple
    weights_NW: torch.Tensor
    slots_N: np.ndarray
    moved: bool
    route: dict = field(default_factory=dict)
    acc_NW: Optional[torch.Tensor] = None
    pending: bool = False
    in_flight: int = 0
    fetch: object = None

    def weights(self) -> torch.Tensor:
        """weights_NW, waiting for the fetch the first time (the exchange runs in the background
        from the plan until the slots are first computed)."""
        if self.fetch is not None:
            self.weights_NW, self.fetch = self.fetch.wait(), None
        return self.weights_NW

    @property
    def locked(self) -> bool:
        """Whether the placement must stay: gradients are owed on its moved slots, or will be by a
        forward still in flight (a recompute replays its plan, on these weights)."""
        return self.moved and (self.pending or self.in_flight > 0)

    def row_of_slot(self) -> dict[int, int]:
        return {int(s): i for i, s in enumerate(self.slots_N)}


class ResidentSlots(torch.autograd.Function):
    """The resident slots' parameter tensors for one microbatch, as one autograd node.

    forward(window, store, *sources) -> (empty anchor, then every resident slot's parameter pieces,
    views of window.weights_NW). backward: the pieces' gradients add into window.acc_NW; when
    gradients are due (`syncing()`), the store returns them to the sources (owner parameters or
    shards) and this node hands autograd the sources' gradients. The sources are inputs so that
    their AccumulateGrad (where Megatron DDP's gradient-ready hook sits) runs after this node."""

    @staticmethod
    def forward(ctx, window: Window, store, *sources):
        ctx.window, ctx.store, ctx.n_sources = window, store, len(sources)
        ctx.set_materialize_grads(False)
        numels = store.numels
        W = sum(numels)
        weights_NW = window.weights()
        pieces = [t for i in range(weights_NW.shape[0]) for t in torch.split(weights_NW[i, :W], numels)]
        return (weights_NW.new_empty(0), *pieces)

    @staticmethod
    def backward(ctx, _anchor_grad, *grads):
        window, store = ctx.window, ctx.store
        window.in_flight = max(0, window.in_flight - 1)
        k = len(store.numels)
        W = sum(store.numels)
        for i in range(window.weights_NW.shape[0]):
            row = grads[i * k:(i + 1) * k]
            if all(g is None for g in row):
                continue
            if window.acc_NW is None:
                window.acc_NW = torch.zeros_like(window.weights_NW)
            for g, piece in zip(row, torch.split(window.acc_NW[i, :W], store.numels)):
                if g is not None:
                    piece.add_(g.reshape(-1))
        # every rank ran this backward: whether anything is owed is the same everywhere (the node
        # exists on every rank whenever any rank holds a moved slot)
        window.pending = True
        if syncing() and not store.defer_flush:
            source_grads = store.flush(window, in_graph=True)
        else:
            source_grads = store.idle_grads()
        return (None, None, *source_grads)


def stale_warning(store) -> None:
    warnings.warn("megatron-rails: slot weight gradients accumulated under no_sync() were never returned "
                  "before the weights changed (the last backward of the step ran inside no_sync and no "
                  "gradient sync followed); they are dropped", RuntimeWarning, stacklevel=3)
