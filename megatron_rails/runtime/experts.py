"""Expert stores: where expert weights live and how replica slots get them.

ExpertStore (owner layout): the stock local experts are the owners (and what checkpoints save);
replica slots borrow their weights from the owners. Its FSEP subclass, where every expert's weights
are sharded over all EP ranks, is runtime/sharded.py's ShardedExpertStore.

Both work on any expert module an adapter (runtime/expert_kind.py's interface; the Megatron-Core
ones are in megatron/expert_kinds.py) describes: which views of the stock parameters make up
expert i and how one expert computes; nothing here knows a module's parameter layout.

Slot weights are resident for an optimizer step (runtime/residency.py): `open_window` fetches
every slot of a placement once, as one flat vector per slot, `slot_params` hands one microbatch
its slots' parameters (each slot's through an autograd node of its own), and `flush` returns the
accumulated slot gradients to the owners (shards) by the reverse exchange, summed in a fixed order.

Shape letters (docs/architecture.md): W parameters of one expert (flat), N tokens of one slot, H hidden
size, E experts, D EP ranks.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ..core.plan import Placement, owner_of_experts
from . import residency
from .comm.base import Pending
from .expert_kind import ExpertKind
from .hostbuf import HostBlocks
from .residency import Window


class ExpertStore:
    """Owner layout over an experts module, seen through its adapter `kind`.

    before_read(module), when given, runs before every read of the expert weights: the framework's
    chance to finish pending parameter updates (Megatron DDP's lazy all-gathers; see
    megatron/compat.wait_param_gather)."""

    def __init__(self, kind: ExpertKind, num_experts: int, rank: int, num_ranks: int, before_read=None):
        self.kind = kind
        self.experts = experts = kind.module
        self.before_read = before_read
        self.num_experts, self.rank, self.num_ranks = num_experts, rank, num_ranks
        # the stock parameters the kind's slices view, by name (every one of the module's, but for a
        # part of it: fsep's shards hold the weights and leave the biases stock, runtime/sharded.py)
        held = {name for i in range(kind.num_local) for name, _ in kind.slices(i)}
        self.params = {n: p for n, p in experts.named_parameters() if n in held}
        self.owner_E = owner_of_experts(num_experts, num_ranks)
        self.first_local = int(np.searchsorted(self.owner_E, rank))
        owned = int((self.owner_E == rank).sum())
        if owned != self.kind.num_local:
            raise ValueError(f"EP rank {rank} owns {owned} experts but its {type(experts).__name__} has "
                             f"{self.kind.num_local}")
        first = self._views(self.first_local)
        self.names = list(self.kind.slot_names)
        self.shapes = [t.shape for t in first]
        self.numels = [t.numel() for t in first]
        self.window: Window | None = None  # the resident slots (runtime/residency.py)
        self.blocks = HostBlocks()  # the step's large host buffers, kept between steps
        self.returns = 0  # gradient returns (reverse exchanges) run so far: at most one per step
        self.defer_flush = False  # the framework calls residency.flush_pending() before reading gradients
        residency.register(self)

    @property
    def flat_size(self) -> int:
        """W: the parameter count of one expert."""
        return int(sum(self.numels))

    @property
    def param_bytes(self) -> int:
        """Bytes of one expert's parameters (their own dtype) as a weight exchange moves them."""
        ref = next(iter(self.params.values()))
        return self.flat_size * ref.element_size()

    def refresh(self) -> None:
        """Let the framework finish pending updates of the weights before they are read (see
        before_read). Called every microbatch, so that data-parallel replicas, whose plans differ,
        wait for the same all-gathers at the same point."""
        if self.before_read is not None:
            self.before_read(self.experts)

    def _views(self, expert: int, source=None) -> list[torch.Tensor]:
        """Expert `expert`'s tensors as views of the stock parameters, or of the same-shaped tensors
        source(name) returns (gradients, checkpoint buffers)."""
        get = source if source is not None else self.params.__getitem__
        return [view(get(name)) for name, view in self.kind.slices(expert - self.first_local)]

    def sources(self) -> list[torch.Tensor]:
        """The trainable tensors slot weights come from and their gradients go to: the stock
        parameters (ReturnGate's autograd inputs)."""
        return [p for p in self.params.values() if p.requires_grad]

    @property
    def acc_dtype(self) -> torch.dtype:
        """Slot gradients accumulate in the dtype the framework accumulates the sources' gradients in
        (Megatron DDP's main_grad, fp32), else the sources' own."""
        src = self.sources() or list(self.params.values())
        main_grad = getattr(src[0], "main_grad", None)
        return main_grad.dtype if main_grad is not None else src[0].dtype

    def key(self) -> tuple:
        """What the resident weights were fetched under: the residency epoch and the version counters
        of the source tensors (both move when the weights change)."""
        return residency.epoch(), sum(t._version for t in self.params.values())

    def stale(self) -> bool:
        """Whether the resident window may not serve this forward: the weights changed since it
        was fetched, or it was fetched under torch.inference_mode() (its weights are inference
        tensors, which autograd refuses to save) and this forward is not (such a window never owes
        gradients: dropping it loses nothing)."""
        w = self.window
        if w is None:
            return False
        return w.key != self.key() or (w.inference and not torch.is_inference_mode_enabled())

    def drop_window(self) -> None:
        if self.window is not None:
            if self.window.pending:
                residency.stale_warning(self)
            self.window.weights()  # a fetch still running completes on every rank (collective)
        self.window = None
        residency.settled(self)

    def _flat(self, expert: int) -> torch.Tensor:
        """float [W]: owner expert's parameters as one vector (a copy)."""
        return torch.cat([t.detach().reshape(-1) for t in self._views(expert)])

    def unflatten(self, vec_W: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: t.view(s) for n, t, s in zip(self.names, torch.split(vec_W, self.numels), self.shapes)}

    @torch.no_grad()
    def open_window(self, placement: Placement, comm) -> Window:
        """Start fetching every moved replica of `placement` from its owner, once (collective; every
        rank calls it with the same placement). comm: the exchange backend (runtime/comm); the fetch
        runs in the background (exchange_async) until the window's weights are first read, the
        gradients return by comm.exchange."""
        self.blocks.turn()
        self.window = Window(placement, self.key(), bool(placement.is_moved_R.any()),
                             inference=torch.is_inference_mode_enabled(), blocks=self.blocks)
        self.window.add_part(*self._fetch(placement, np.ones(placement.num_replicas, dtype=bool), comm))
        return self.window

    @torch.no_grad()
    def grow_window(self, placement: Placement, comm) -> Window:
        """The resident placement grown into `placement` (free slots filled, no resident slot
        changed): fetch the new replicas only, as one more part of the window (collective)."""
        w = self.window
        old = w.placement.slot_expert_DS
        new_R = old[placement.replica_rank_R, placement.replica_slot_R] < 0
        w.add_part(*self._fetch(placement, new_R, comm))
        w.placement = placement
        w.moved = w.moved or bool((placement.is_moved_R & new_R).any())
        return w

    def _fetch(self, p: Placement, which_R: np.ndarray, comm) -> tuple:
        """Start fetching the moved replicas of `p` among which_R (bool over its replicas) from their
        owners: (Pending of this rank's [n, W] rows, their slots int64 [n], the return route)."""
        D, me = self.num_ranks, self.rank
        moved = np.flatnonzero(p.is_moved_R & which_R)
        owner = self.owner_E[p.replica_expert_R[moved]]
        dest, slot = p.replica_rank_R[moved], p.replica_slot_R[moved]
        send = moved[owner == me]
        send = send[np.lexsort((p.replica_slot_R[send], p.replica_rank_R[send]))]
        mine = dest == me
        recv = moved[mine][np.lexsort((slot[mine], owner[mine]))]  # the order the exchange delivers
        send_D = np.bincount(p.replica_rank_R[send], minlength=D).tolist()
        recv_D = np.bincount(self.owner_E[p.replica_expert_R[recv]], minlength=D).tolist()
        send_experts = p.replica_expert_R[send]
        ref = next(iter(self.params.values()))
        buf = torch.stack([self._flat(int(e)) for e in send_experts]) if send.size else \
            ref.new_zeros((0, self.flat_size))
        # the whole exchange, known to every rank from the placement (a RailS backend needs it)
        traffic_DD = np.zeros((D, D), dtype=np.int64)
        np.add.at(traffic_DD, (owner, dest), 1)
        if moved.size:
            out = self.receive_buffer(comm, traffic_DD, (sum(recv_D), self.flat_size), buf)
            fetch = comm.exchange_async(buf, send_D, recv_D, traffic_DD, out=out)
        else:
            fetch = Pending.done(buf)
        route = dict(exchange=comm.exchange, send_D=send_D, recv_D=recv_D, traffic_DD=traffic_DD,
                     send_experts=send_experts)
        return fetch, p.replica_slot_R[recv].astype(np.int64), route

    def receive_buffer(self, comm, traffic_DD: np.ndarray, shape, like: torch.Tensor) -> torch.Tensor | None:
        """A kept block for what an exchange of `traffic_DD` receives (`shape`, like's dtype and
        device), or None where the exchange would not receive into it: one rank (the input comes
        back) or a sprayed RailS schedule (its phases make their own buffers)."""
        if self.num_ranks == 1 or comm.sprays(traffic_DD):
            return None
        return self.blocks.empty(shape, like.dtype, like.device)

    def _serving(self, placement: Placement) -> Window | None:
        """The window whose resident slots a plan on `placement` computes with, if any (Window.serves;
        a window without moved slots serves nothing: there is nothing to fetch or return)."""
        w = self.window
        return w if w is not None and w.moved and w.serves(placement) else None

    def return_gate(self, placement: Placement, x_NH: torch.Tensor, probs_N: torch.Tensor):
        """The rows the stock experts compute, through this microbatch's ReturnGate when its slots
        will owe gradients: (x_NH, probs_N, link), link None without one. Call it before the stock
        experts run and pass link to slot_params (the gate's backward returns the slot gradients
        after both the stock experts' and the slots' backward, at the same point on every rank)."""
        w = self._serving(placement)
        if w is None or not self._slot_grads_on():
            return x_NH, probs_N, None
        return residency.ReturnGate.apply(w, self, x_NH, probs_N, *self.sources())

    def _slot_grads_on(self) -> bool:
        """Whether a forward now owes slot gradients: autograd records and the sources train."""
        return torch.is_grad_enabled() and any(t.requires_grad for t in self.sources())

    def slot_params(self, placement: Placement, link: torch.Tensor | None = None
                    ) -> tuple[Mapping[int, dict[str, torch.Tensor]], torch.Tensor | None]:
        """The resident slots' parameters for one microbatch on `placement`: ({slot: {name: tensor}},
        anchor). A slot's parameters are made when it first asks for them, just before it computes
        (SlotParams). With return_gate's link each slot's come through its own SlotRow node
        (residency.resident_row) and the anchor (an empty tensor) must join the layer output, so
        that every rank runs that node in backward; else anchor is None. A plan on a placement the
        window does not serve gets none. Waits for the window's fetches still running."""
        w = self._serving(placement)
        if w is None:
            return {}, None
        if link is None and self._slot_grads_on():
            # without the gate the slots' gradients would be dropped, silently
            raise RuntimeError("slot_params: gradients are on and the slots' weights train: pass the link "
                               "return_gate made for this microbatch")
        anchor = residency.resident_anchor(w, self, link) if link is not None else None
        w.weights()
        return SlotParams(self, w, link), anchor

    def row_params(self, window: Window, row: int, link: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """One resident row's parameters by name, in the stock shapes: views of window.weights_NW,
        through the row's SlotRow node when link is given."""
        if link is not None:
            pieces = residency.resident_row(window, self, row, link)
        else:
            pieces = torch.split(window.weights()[row, :self.flat_size], self.numels)
        params = {n: t.view(shape) for n, t, shape in zip(self.names, pieces, self.shapes)}
        if link is not None and self.kind.fused_wgrad:
            self._lend_main_grads(window, row, params)
        return params

    def _lend_main_grads(self, window: Window, row: int, params: dict) -> None:
        """Under gradient accumulation fusion the experts' linears add weight gradients into
        `weight.main_grad` and give autograd none: every borrowed tensor of the row gets its piece of
        the window's accumulator as main_grad (Window.acc_lent; SlotRow's backward adds the
        gradients autograd still gets, biases')."""
        if not window.acc_lent:
            old = window.accumulated()  # an unlent one (not expected): its unwritten rows zeroed
            window.open_acc(self.flat_size, self.acc_dtype, lent=True)
            if old is not None:
                window.acc_NW.copy_(old)
        grads = self.unflatten(window.acc_NW[row, :self.flat_size])
        for name, t in params.items():
            t.main_grad = grads[name]

    def _acc(self, window: Window) -> torch.Tensor:
        """The window's accumulated slot gradients [N, W'] (zeros when no backward reached it)."""
        acc = window.accumulated()
        return acc if acc is not None else window.weights().new_zeros(window.weights().shape, dtype=self.acc_dtype)

    def _return_grads(self, window: Window) -> list[torch.Tensor]:
        """The reverse of the window's fetches, part by part: every slot's accumulated gradient goes
        to the rank it came from. Returns, per part, what this rank receives; the window owes
        nothing afterwards."""
        acc, start, back = self._acc(window), 0, []
        for r, n in window.routes:
            back.append(r["exchange"](acc[start:start + n], r["recv_D"], r["send_D"],
                                      np.ascontiguousarray(r["traffic_DD"].T)))
            start += n
        self.returns += 1
        residency.settled(self)
        return back

    @torch.no_grad()
    def flush(self, window: Window, in_graph: bool) -> list:
        """Return the window's slot gradients to the owners (collective). Each owner adds what it
        receives into its parameters' `main_grad` where the framework keeps one; otherwise, in a
        backward pass (in_graph), into the gradients returned here for sources(), else into `.grad`."""
        grads: dict[str, torch.Tensor] = {}
        rows = [(row, e) for back_NW, (r, _) in zip(self._return_grads(window), window.routes)
                for row, e in zip(back_NW, r["send_experts"])]
        for row, e in rows:
            for (name, view), piece in zip(self.kind.slices(int(e) - self.first_local), torch.split(row, self.numels)):
                p = self.params[name]
                if not p.requires_grad:
                    continue
                target = getattr(p, "main_grad", None)
                if target is None and in_graph:
                    target = grads.setdefault(name, torch.zeros_like(p))
                elif target is None:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    target = p.grad
                t = view(target)
                t.add_(piece.view(t.shape))
        window.returned()  # after the received rows are read (they are the accumulator itself at D = 1)
        return [grads.get(n) for n, p in self.params.items() if p.requires_grad]

    def idle_grads(self) -> list:
        """The sources' gradients from a backward that owes its slot gradients for later: none (the
        owners get their own from the stock experts)."""
        return [None] * len(self.sources())

    def compute(self, params: dict[str, torch.Tensor], x_NH: torch.Tensor, probs_N: torch.Tensor) -> torch.Tensor:
        """One expert with borrowed weights: the stock module's math for that expert, probs applied."""
        return self.kind.compute(params, x_NH, probs_N)


class SlotParams(Mapping):
    """{slot: {name: tensor}}: one microbatch's resident slot parameters (ExpertStore.slot_params).
    A slot's are made when first asked for, so that its SlotRow node sits right before its compute
    (see residency.resident_row); asked again, the same tensors come back."""

    def __init__(self, store: ExpertStore, window: Window, link: torch.Tensor | None):
        self._store, self._window, self._link = store, window, link
        self._row = window.row_of_slot()
        self._made: dict[int, dict[str, torch.Tensor]] = {}

    def __getitem__(self, slot: int) -> dict[str, torch.Tensor]:
        got = self._made.get(slot)
        if got is None:
            got = self._made[slot] = self._store.row_params(self._window, self._row[slot], self._link)
        return got

    def __contains__(self, slot) -> bool:  # without making the slot's parameters
        return slot in self._row

    def __iter__(self):
        return iter(self._row)

    def __len__(self) -> int:
        return len(self._row)
