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
they agree on when one is due; each layer's ResidentSlots and ReturnGate nodes sit in every rank's
graph (the empty anchor the runtime concatenates into the layer output keeps ResidentSlots there,
and ReturnGate precedes it) so that every rank joins; SlotRow nodes exist where a slot computes.
A flush inside a backward pass runs in ReturnGate, which autograd reaches only after the layer's
stock experts' and slots' backward on every rank alike.

Shape letters (docs/architecture.md): N this rank's resident slots, W parameters of one expert.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.optim.optimizer as torch_optimizer

from ..core.plan import Placement
from .hostbuf import HostBlocks
from .staging import stage

# how many no_sync() contexts are open: one count for the process, not per thread, because it is
# read inside backward passes, whose nodes autograd runs on its own worker thread per CUDA device
# (a per-thread count set by the thread that calls backward() reads as 0 there)
_no_sync_depth = 0
_depth_lock = threading.Lock()
_epoch = 0
# the stores whose window owes gradients, in the order they came to owe them (the backward order:
# identical on every rank). Strong references: a store dropped while it owes must still join the
# flush on every rank; were it weakly held, each rank's garbage collector would decide alone whether
# it is still there, and one rank's collective would find no partner on another
_owing: dict = {}
_hooks = None


@contextlib.contextmanager
def no_sync():
    """Slot weight gradients accumulate locally inside; the first backward outside returns them.
    For the whole process (as Megatron DDP's no_sync is for its module): a backward pass run inside,
    from any thread, keeps them."""
    global _no_sync_depth
    with _depth_lock:
        _no_sync_depth += 1
    try:
        yield
    finally:
        with _depth_lock:
            _no_sync_depth -= 1


def syncing() -> bool:
    """Whether a backward pass running now returns the slots' gradients to their owners."""
    return _no_sync_depth == 0


def new_step() -> None:
    """Mark every resident slot stale: the owners' weights changed (an update no torch optimizer made)."""
    global _epoch
    _epoch += 1


def epoch() -> int:
    return _epoch


def flush_pending(stores=None) -> None:
    """Return the accumulated slot gradients of every store, or of `stores` only (one model
    chunk's), now (collective over each EP group; every rank must call it at the same point), in
    the order the stores came to owe them. Adds into `main_grad` where the framework keeps one,
    else `.grad`."""
    only = None if stores is None else {id(s) for s in stores}
    for store in list(_owing.values()):
        if only is not None and id(store) not in only:
            continue
        if store.window is not None and store.window.pending:
            store.flush(store.window, in_graph=False)
        settled(store)


def owes(store) -> None:
    """`store`'s window holds gradients not yet returned: flush_pending() will return them."""
    _owing.setdefault(id(store), store)


def settled(store) -> None:
    """`store` owes nothing any more (returned, or dropped with its window)."""
    _owing.pop(id(store), None)


def register(store) -> None:
    """Hook the optimizers once per process (flush_pending before every step, new_step after)."""
    global _hooks
    if _hooks is None:
        opt = torch_optimizer
        _hooks = (opt.register_optimizer_step_pre_hook(lambda *_: flush_pending()),
                  opt.register_optimizer_step_post_hook(lambda *_: new_step()))


@dataclass(eq=False)
class Window:
    """The slots resident on this rank for one optimizer step (or, without training, until a better
    placement replaces them). Its rows come in parts, one per fetch: the step's first microbatch
    opens the window, a later one may grow it by replicas in free slots (never moving a resident one).

    placement: the resident placement (the same on every rank).
    key:       (epoch, source parameter versions) when fetched; a different key means stale.
    moved:     whether any rank holds a moved slot (else there is nothing to fetch or return).
    weights_NW: float [N, W'] this rank's slots' flat weights (W' >= W: FSEP pads to D shards), detached;
               the rows of fetches still running are missing until weights() waits for them.
    slots_N:   int64 [N] the slot index of each row, every part's (known before its weights arrive).
    routes:    per part, in row order: (what the store needs to return its gradients, its rows).
    fetches:   the parts' fetches not waited for yet (comm Pendings), in row order.
    acc_NW:    the slots' accumulated weight gradients [N, W'] (allocated by the first backward,
               or, lent, by the first forward; read it through accumulated()); with acc_ranks = D
               laid out [D, N, W'/D] instead: shard k of every row together, as FSEP's gradient
               return sends them (no copy into that order at the return). Rows are read and
               written through row_segments().
    acc_fresh: bool [N]: rows no backward has reached yet (None before the first backward; the
               accumulator is allocated empty and accumulated() zeroes the rows still fresh).
    acc_held:  row -> its first gradients (one per piece, None where none), held as autograd made
               them instead of copied into acc_NW (as AccumulateGrad keeps a parameter's first
               gradient): the row's next backward sums both into acc_NW in one pass, accumulated()
               copies in those still held. acc_spec: (the pieces' numels, acc_NW's dtype).
    acc_lent:  whether acc_NW's rows are lent out as borrowed weights' `main_grad` (gradient
               accumulation fusion), which the experts' linears add into during their backward; it
               is then allocated zeroed, and one a backward still to come may add into (in_flight)
               is never dropped: replaced when the window grows, it is kept in acc_stale, its later
               adds summed into acc_NW by accumulated(); returned, it is zeroed in place.
    pending:   gradients accumulated and not yet returned (identical on every rank).
    in_flight: training forwards on these slots whose backward has not run yet.
    forwards:  training forwards on this window so far.
    inference: fetched under torch.inference_mode() (the store's stale() drops it outside).
    blocks:    the store's HostBlocks, which acc_NW is allocated from (a window's own by default).
    """

    placement: Placement
    key: tuple
    moved: bool
    weights_NW: Optional[torch.Tensor] = None
    slots_N: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    routes: list = field(default_factory=list)
    fetches: list = field(default_factory=list)
    acc_NW: Optional[torch.Tensor] = None
    acc_fresh: Optional[np.ndarray] = None
    acc_held: dict = field(default_factory=dict)
    acc_spec: Optional[tuple] = None
    acc_ranks: int = 0
    acc_lent: bool = False
    acc_stale: list = field(default_factory=list)
    pending: bool = False
    in_flight: int = 0
    forwards: int = 0
    inference: bool = False
    blocks: HostBlocks = field(default_factory=HostBlocks)  # the accumulator's memory (its store's)

    def add_part(self, fetch, slots_N: np.ndarray, route: dict) -> None:
        """Append the rows of one fetch (a Pending of [n, W'] rows for slots_N, int64 [n])."""
        n = int(len(slots_N))
        self.slots_N = np.concatenate([self.slots_N, np.asarray(slots_N, dtype=np.int64)])
        self.routes.append((route, n))
        self.fetches.append(fetch)
        if self.acc_NW is not None and n:
            old = self.acc_NW
            grown = list(old.shape)
            grown[self.acc_row_dim] = n
            self.acc_NW = torch.cat([old, old.new_zeros(grown)], dim=self.acc_row_dim)
            if self.acc_lent and self.in_flight:  # a backward to come adds into old: from zero, merged later
                old.zero_()
                self.acc_stale.append(old)
            self.acc_fresh = np.concatenate([self.acc_fresh, np.zeros(n, dtype=bool)])
        elif self.acc_fresh is not None and n:  # gradients held, nothing allocated yet
            self.acc_fresh = np.concatenate([self.acc_fresh, np.ones(n, dtype=bool)])

    def open_acc(self, W: int, dtype: torch.dtype, lent: bool = False) -> None:
        """Allocate acc_NW for every row in `dtype`: empty (the padding past the W real columns
        zeroed), or, lent, zeroed throughout (see acc_lent)."""
        Wp, D = self.weights_NW.shape[1], self.acc_ranks
        assert not (lent and D), "a lent accumulator's rows are the borrowed weights' main_grad: row-major"
        shape = (D, self.n_rows, Wp // D) if D else (self.n_rows, Wp)
        if lent:
            self.acc_NW = self.weights_NW.new_zeros(shape, dtype=dtype)
        else:
            self.acc_NW = self.blocks.empty(shape, dtype, self.weights_NW.device)
            for k, lo, hi, _ in self.row_segments(W, Wp):
                (self.acc_NW[:, lo:hi] if k is None else self.acc_NW[k, :, lo:hi]).zero_()
        if lent or self.acc_fresh is None:  # else: the rows backward has reached are known already
            self.acc_fresh = np.full(self.n_rows, not lent)
        self.acc_lent = lent

    def returned(self) -> None:
        """The accumulated gradients went back to their owners: nothing is owed. The accumulator is
        dropped, or, lent with a backward still to come, zeroed in place (see acc_lent)."""
        if self.acc_lent and self.in_flight:
            self.acc_NW.zero_()
            for t in self.acc_stale:
                t.zero_()
        else:
            self.acc_NW, self.acc_stale, self.acc_lent = None, [], False
            self.acc_fresh, self.acc_held = None, {}
        self.pending = False

    def accumulated(self) -> Optional[torch.Tensor]:
        """acc_NW, rows no backward reached zeroed and what was added into replaced lent
        accumulators summed in (None before the first backward)."""
        for t in self.acc_stale:
            self.acc_NW[:t.shape[0]].add_(t)
            t.zero_()
        if self.acc_held:
            numels, dtype = self.acc_spec
            if self.acc_NW is None:
                self.open_acc(sum(numels), dtype)
            while self.acc_held:  # each row's held gradients freed as soon as written
                row, grads = self.acc_held.popitem()
                self.write_row(row, numels, grads)
                del grads
        if self.acc_NW is not None and self.acc_fresh.any():
            (rows,) = stage([np.flatnonzero(self.acc_fresh)], self.acc_NW.device)
            self.acc_NW.index_fill_(self.acc_row_dim, rows, 0)
            self.acc_fresh[:] = False
        return self.acc_NW

    @property
    def acc_row_dim(self) -> int:
        """acc_NW's axis of rows: 0 row-major, 1 rank-major."""
        return 1 if self.acc_ranks else 0

    def row_segments(self, a: int, b: int):
        """Where the flat columns [a, b) of a row lie in acc_NW: (k, lo, hi, offset) per contiguous
        piece, acc_NW[row, lo:hi] (k None: row-major) or acc_NW[k, row, lo:hi] (rank-major),
        holding columns a + offset onwards."""
        if not self.acc_ranks:
            yield None, a, b, 0
            return
        shard = self.weights_NW.shape[1] // self.acc_ranks
        for k in range(a // shard, (b - 1) // shard + 1):
            lo, hi = max(a, k * shard), min(b, (k + 1) * shard)
            yield k, lo - k * shard, hi - k * shard, lo - a

    def write_row(self, row: int, numels: list, first: tuple, then: tuple | None = None, add: bool = False) -> None:
        """acc_NW's row `row` := its pieces' gradients `first` (+ `then`, a later backward's, summed
        in one pass where the dtypes allow: the same bits as a copy, then an add), or, add, += first;
        a piece without any is zeroed (left as it is, add)."""
        then = then if then is not None else (None,) * len(first)
        end = 0
        for n, g0, g1 in zip(numels, first, then):
            a, b = end, end + n  # the piece's columns
            end = b
            if g0 is None:
                g0, g1 = g1, None
            flat0 = g0.reshape(-1) if g0 is not None else None
            flat1 = g1.reshape(-1) if g1 is not None else None
            for k, lo, hi, off in self.row_segments(a, b):
                dst = self.acc_NW[row, lo:hi] if k is None else self.acc_NW[k, row, lo:hi]
                src0 = flat0[off:off + hi - lo] if flat0 is not None else None
                if src0 is None:
                    if not add:
                        dst.zero_()
                elif add:
                    dst.add_(src0)
                elif flat1 is not None and src0.dtype == flat1.dtype == dst.dtype:
                    torch.add(src0, flat1[off:off + hi - lo], out=dst)
                else:
                    dst.copy_(src0)
                    if flat1 is not None:
                        dst.add_(flat1[off:off + hi - lo])

    @property
    def n_rows(self) -> int:
        return int(len(self.slots_N))

    def weights(self) -> torch.Tensor:
        """weights_NW with every part, waiting for the fetches still running (they run in the
        background from the plan until the slots are first computed)."""
        if self.fetches:
            got = [f.wait() for f in self.fetches]
            self.fetches = []
            parts = ([self.weights_NW] if self.weights_NW is not None else []) + got
            self.weights_NW = parts[0] if len(parts) == 1 else torch.cat(parts)
        return self.weights_NW

    @property
    def locked(self) -> bool:
        """Whether the placement must stay: gradients are owed on its moved slots, or will be by a
        forward still in flight (a recompute replays its plan, on these weights)."""
        return self.moved and (self.pending or self.in_flight > 0)

    def serves(self, placement: Placement) -> bool:
        """Whether every slot `placement` fills holds the same expert here (the resident placement,
        or one it grew from): a plan on it can compute with these weights."""
        here = self.placement
        if placement is here:
            return True
        if (placement.layout != here.layout or placement.owner_slots != here.owner_slots
                or placement.slot_expert_DS.shape != here.slot_expert_DS.shape):
            return False
        se, we = placement.slot_expert_DS, here.slot_expert_DS
        return bool(np.all((se < 0) | (se == we)))

    def row_of_slot(self) -> dict[int, int]:
        return {int(s): i for i, s in enumerate(self.slots_N)}


class ReturnGate(torch.autograd.Function):
    """Where a microbatch's slot gradients leave for their owners (shards): one autograd node on the
    rows the stock experts compute, so that its backward, which may run the return exchange, comes
    after the stock experts' backward and after ResidentSlots' and SlotRow's (whose `link` input it
    produces) on every rank. Were the exchange in ResidentSlots' own backward, a rank with no slot rows would
    join it before its owner experts' backward and a rank with slot rows after: one waits for the
    other's whole expert backward, every layer (bench step measured ~35 ms a layer at zipf 2.0).

    forward(window, store, x_NH, probs_N, *sources) -> (x_NH, probs_N as views; empty `link`).
    backward: when gradients are owed (SlotRow nodes put them in the window's accumulator) and
    due (`syncing()`, and the store does not defer every return to flush_pending()), the store
    returns them and this node hands autograd the sources' gradients; the sources are inputs so
    that their AccumulateGrad (where Megatron DDP's gradient-ready hook sits) runs after this node."""

    @staticmethod
    def forward(ctx, window: Window, store, x_NH, probs_N, *sources):
        ctx.window, ctx.store = window, store
        ctx.set_materialize_grads(False)
        x_out, probs_out = x_NH.view_as(x_NH), probs_N.view_as(probs_N)
        # rows that need no gradient stay so: the stock experts then skip their input gradients
        ctx.mark_non_differentiable(*[t for t, src in ((x_out, x_NH), (probs_out, probs_N))
                                      if not src.requires_grad])
        return x_out, probs_out, x_NH.new_empty(0)

    @staticmethod
    def backward(ctx, grad_x, grad_probs, _link_grad):
        window, store = ctx.window, ctx.store
        # every rank runs this backward (the node exists on every rank whenever any rank holds a
        # moved slot), after ResidentSlots' and SlotRow's: whether anything is owed is the same
        # everywhere
        if window.pending and syncing() and not store.defer_flush:
            source_grads = store.flush(window, in_graph=True)
        else:
            source_grads = store.idle_grads()
        return (None, None, grad_x, grad_probs, *source_grads)


def resident_anchor(window: Window, store, link: torch.Tensor) -> torch.Tensor:
    """One microbatch's anchor: an empty tensor (a `ResidentSlots` node) the runtime concatenates
    into the layer output, so that its backward runs on every rank, slots or not, and marks the
    window as owing. Waits for the window's fetches still running. link: ReturnGate's empty output
    for this microbatch, an input of every node here, so that the gate's backward runs after them."""
    return ResidentSlots.apply(window, store, link)


def resident_row(window: Window, store, row: int, link: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Row `row`'s parameter pieces (views of window.weights_NW) through a `SlotRow` node of its
    own, whose backward adds their gradients into the row of the accumulator.

    Make it just before that slot computes, not with the other rows up front: autograd runs the
    ready node made last first, so a row made right before its compute gets its gradients as soon
    as that slot's backward has made them (still in cache, and freed then). Made up front, every
    row waited for the last slot's backward, all the slots' gradients alive until then (bench
    step, measured in place: a row's adds took ~35% longer)."""
    return SlotRow.apply(window, store, row, link)


class ResidentSlots(torch.autograd.Function):
    """forward(window, store, link) -> empty anchor. backward: this microbatch's slot gradients are
    owed (its SlotRow nodes have added them into window.acc_NW; ReturnGate returns them when due)."""

    @staticmethod
    def forward(ctx, window: Window, store, link):
        ctx.window, ctx.store, ctx.link_device = window, store, link.device
        return window.weights().new_empty(0)  # waits for the fetches still running

    @staticmethod
    def backward(ctx, _anchor_grad):
        window = ctx.window
        window.in_flight = max(0, window.in_flight - 1)
        window.pending = True
        owes(ctx.store)
        # a defined (empty) gradient for link: ReturnGate then always gets one on the device, so the
        # engine runs it where it runs the rest of the layer's backward
        return None, None, torch.zeros(0, device=ctx.link_device)


class SlotRow(torch.autograd.Function):
    """forward(window, store, row, link) -> the parameter pieces of the window's row `row` (views of
    window.weights_NW). backward: their gradients add into the row of window.acc_NW."""

    @staticmethod
    def forward(ctx, window: Window, store, row: int, link):
        ctx.window, ctx.store, ctx.row, ctx.link_device = window, store, row, link.device
        ctx.set_materialize_grads(False)
        return tuple(torch.split(window.weights_NW[row, :sum(store.numels)], store.numels))

    @staticmethod
    def backward(ctx, *grads):
        window, store, i = ctx.window, ctx.store, ctx.row
        if any(g is not None for g in grads):
            if window.acc_fresh is None:  # the window's first backward
                # the accumulator in the dtype the framework accumulates the sources' gradients in
                # (Megatron DDP's fp32 main_grad under bf16 weights), as the stock experts' accumulate
                window.acc_fresh = np.ones(window.n_rows, dtype=bool)
                window.acc_spec = (list(store.numels), store.acc_dtype)
            fresh = window.acc_fresh[i]
            window.acc_fresh[i] = False
            if fresh and not window.acc_lent:  # held, not copied (Window.acc_held)
                window.acc_held[i] = grads
            else:
                held = window.acc_held.pop(i, None)
                if window.acc_NW is None:  # every row of the window, those of parts still arriving too
                    window.open_acc(sum(store.numels), window.acc_spec[1])
                if held is not None:
                    window.write_row(i, store.numels, held, grads)
                else:
                    window.write_row(i, store.numels, grads, add=True)
        return None, None, None, torch.zeros(0, device=ctx.link_device)


def stale_warning(store) -> None:
    warnings.warn("megatron-rails: slot weight gradients accumulated under no_sync() were never returned "
                  "before the weights changed (the last backward of the step ran inside no_sync and no "
                  "gradient sync followed); they are dropped", RuntimeWarning, stacklevel=3)
