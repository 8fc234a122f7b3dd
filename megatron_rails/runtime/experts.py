"""Expert stores: where expert weights live and how replica / FSEP slots get them.

* ExpertStore (owner layout): the stock local experts are the owners (and what checkpoints save);
  replica slots borrow their weights from the owners for one layer step.
* ShardedExpertStore (FSEP): every expert's weights are sharded over all EP ranks.

Both work on any expert module an adapter (runtime/expert_kind.py's interface; the Megatron-Core
ones are in megatron/expert_kinds.py) describes: which views of the stock parameters make up
expert i and how one expert computes; nothing here knows a module's parameter layout.

Slot weights are resident for an optimizer step (runtime/residency.py): `open_window` fetches
every slot of a placement once, as one flat vector per slot, `slot_params` hands one microbatch
its slots' parameters (each slot's through an autograd node of its own), and `flush` returns the
accumulated slot gradients to the owners (shards) by the reverse exchange, summed in a fixed order.

Shape letters (docs/architecture.md): W parameters of one expert (flat), N tokens of one slot, H hidden
size, E experts, D EP ranks; a shard row holds ceil(W/D) of an expert's parameters.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping

import numpy as np
import torch

from ..core.plan import Placement, owner_of_experts
from . import residency
from .comm.base import Pending
from .expert_kind import ExpertKind
from .local import permutation_and_inverse
from .residency import Window


def _slot_major(got: torch.Tensor, D: int, n: int) -> torch.Tensor:
    """[D * n, shard] received by source rank -> [n, D * shard]: every slot's D shards in a row."""
    shard = got.shape[-1]
    return got.view(D, n, shard).transpose(0, 1).reshape(n, D * shard)


def _rank_major(flat: torch.Tensor, D: int) -> torch.Tensor:
    """The inverse of _slot_major: [n, D * shard] -> [D * n, shard], shard k of every slot for rank k."""
    n, shard = flat.shape[0], flat.shape[1] // D
    return flat.view(n, D, shard).transpose(0, 1).reshape(D * n, shard)


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
        self.params = dict(experts.named_parameters())  # the stock parameters, by name
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
        self.window = Window(placement, self.key(), bool(placement.is_moved_R.any()),
                             inference=torch.is_inference_mode_enabled())
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
        fetch = comm.exchange_async(buf, send_D, recv_D, traffic_DD) if moved.size else Pending.done(buf)
        route = dict(exchange=comm.exchange, send_D=send_D, recv_D=recv_D, traffic_DD=traffic_DD,
                     send_experts=send_experts)
        return fetch, p.replica_slot_R[recv].astype(np.int64), route

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


class ShardedExpertStore(ExpertStore):
    """FSEP layout: every expert's flat parameters live as D shards, shard k on rank k
    (`shards` float [E, ceil(W/D)], a Parameter registered on the experts module). The stock
    expert parameters stay registered (their names and shapes are the checkpoint layout) but hold
    no memory: each is a placeholder, one element expanded to the stock shape (stride 0), and no
    longer trains. So a rank holds its shards of every expert plus the step's materialized slots.

    A step's slots are materialized by one all-to-all of shards (open_window); their accumulated
    weight gradients travel back the same way and land in the shards (flush). Checkpoints keep the
    stock layout: `state_dict()` assembles the stock tensors from the shards (a collective: every
    rank saves), `load_state_dict()` gives the stock parameters real memory again, loads them and
    re-shards, and a framework that reads the stock parameters in place (Megatron's
    `sharded_state_dict()`) gets them real, holding the shards' values (stock_for_checkpoint); an
    optimizer's state of the shards goes to and from the stock layout by stock_layout and
    shard_layout (megatron/fsep_checkpoint.py). Whatever gives the stock parameters memory again
    (those, or a framework's `.cuda()` / `.bfloat16()`, which expand a placeholder to full size) is
    released at the next window.
    """

    PARAM = "rails_fsep_shards"

    def __init__(self, kind: ExpertKind, num_experts: int, rank: int, num_ranks: int, exchange, before_read=None,
                 stage: torch.device | None = None):
        super().__init__(kind, num_experts, rank, num_ranks, before_read)
        experts = self.experts
        self.exchange = exchange
        # where the exchange's collectives take tensors: CUDA under NCCL (see _whole_experts)
        self.stage = stage if stage is not None else torch.device("cpu")
        self.shard = -(-self.flat_size // num_ranks)
        ref = next(iter(self.params.values()))
        if ref.device.type == "meta":
            raise kind.unsupported("fsep shards the expert weights when the layer is built, and these are on the "
                                   "meta device (--init-model-with-meta-device): build them on a real device")
        shards = torch.nn.Parameter(ref.new_zeros((num_experts, self.shard)))
        # each EP rank holds different shards: like Megatron's expert weights, reduce them over the
        # expert-data-parallel group only (Megatron DDP reads `allreduce`)
        shards.allreduce = not num_ranks > 1
        experts.register_parameter(self.PARAM, shards)
        biases = [n for n, shape in zip(self.names, self.shapes) if len(shape) == 1]
        if biases and not _warned_biases:
            _warn_biases(biases)
        for p in self.params.values():
            p.requires_grad_(False)
        self.load_from_owners()
        self.release_stock()
        experts._register_state_dict_hook(self._state_dict_hook)
        experts.register_load_state_dict_pre_hook(lambda module, *args: self._before_load())
        experts.register_load_state_dict_post_hook(lambda module, keys: self._after_load(keys))
        # Megatron's distributed checkpoints read the stock parameters through sharded_state_dict(),
        # not state_dict(): the Megatron adapter wraps it (megatron/fsep_checkpoint.py) around
        # stock_for_checkpoint(), stock_layout() and shard_layout()

    @property
    def shards(self) -> torch.nn.Parameter:
        return getattr(self.experts, self.PARAM)

    def _owned(self) -> list[int]:
        return np.flatnonzero(self.owner_E == self.rank).tolist()

    def _owned_flats(self, source=None) -> list[torch.Tensor]:
        """Flat [W] vectors of this rank's owned experts, from the stock parameters or from the
        same-named tensors source(name) returns."""
        return [torch.cat([t.detach().reshape(-1) for t in self._views(e, source)]) for e in self._owned()]

    # -- the stock parameters: placeholders, real only around checkpoints ---------------------------
    def stock_released(self) -> bool:
        """Whether every stock parameter is a placeholder (holds one element of memory)."""
        return all(_is_placeholder(p) for p in self.params.values())

    @torch.no_grad()
    def release_stock(self) -> None:
        """Free the stock parameters' memory: each becomes one shared element expanded to its shape.
        A tensor someone still holds (a checkpoint being written) keeps the old memory alive; one
        who holds a parameter itself sees the placeholder after this."""
        self._stock_live = False
        zero = {}  # one element per dtype and device, shared by every placeholder of this store
        for p in self.params.values():
            if not _is_placeholder(p):
                key = (p.dtype, p.device)
                if key not in zero:
                    zero[key] = p.new_zeros(())
                p.data = zero[key].expand(p.shape)

    @torch.no_grad()
    def _materialize_stock(self, flats: list[torch.Tensor]) -> None:
        """Give the stock parameters real memory holding the owned experts' flat vectors `flats`."""
        for p in self.params.values():
            if _is_placeholder(p):
                p.data = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        self._scatter(flats)

    @torch.no_grad()
    def load_from_owners(self) -> None:
        """Shard the stock local experts' weights over all ranks (collective)."""
        self.shards.copy_(self._shard(self._owned_flats()))

    def _shard(self, flats: list[torch.Tensor]) -> torch.Tensor:
        """[E, ceil(W/D)]: this rank's shard of every expert, from every owner's flat [W] vectors of
        the experts it owns, `flats` here (collective; the flats' dtype)."""
        D, pad = self.num_ranks, self.shard * self.num_ranks
        owned = self._owned()
        flats = [torch.nn.functional.pad(f, (0, pad - self.flat_size)).view(D, self.shard) for f in flats]
        buf = torch.stack(flats, 1).reshape(D * len(owned), self.shard) if owned else \
            self.shards.new_zeros((0, self.shard))
        n_D = np.bincount(self.owner_E, minlength=D)
        return self._whole_experts(buf, [len(owned)] * D, n_D.tolist())  # from each owner, its experts in order

    @torch.no_grad()
    def gather_to_owners(self, source: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Reassemble this rank's owned experts (flat [W] each) from every rank's shards of `source`
        (default the shards themselves; pass shards.grad for gradients). Collective."""
        src = self.shards if source is None else source
        D = self.num_ranks
        n_D = np.bincount(self.owner_E, minlength=D)
        owned = self._owned()
        got = self._whole_experts(src.detach(), n_D.tolist(), [len(owned)] * D)  # [D * owned, shard], by rank
        full = _slot_major(got, D, len(owned))
        return [full[i, :self.flat_size] for i in range(len(owned))]

    def _whole_experts(self, buf: torch.Tensor, send_D: list, recv_D: list) -> torch.Tensor:
        """The exchange that shards or reassembles whole experts (layer build, checkpoints), on the
        device its collectives take: Megatron's --use-cpu-initialization builds the weights on the
        host and moves the model to the GPU only later, and NCCL takes no host tensors."""
        if self.stage.type == "cpu" or buf.device.type == self.stage.type:
            return self.exchange(buf, send_D, recv_D)
        return self.exchange(buf.to(self.stage), send_D, recv_D).to(buf.device)

    @torch.no_grad()
    def _scatter(self, flats: list[torch.Tensor], source=None) -> None:
        """Write owned experts' flat vectors into the stock parameters (or into source(name))."""
        for e, vec in zip(self._owned(), flats):
            for t, piece in zip(self._views(e, source), torch.split(vec, self.numels)):
                t.copy_(piece.view_as(t))

    def _stock_tensors(self, flats: list[torch.Tensor], dtype: torch.dtype | None = None,
                       device: torch.device | None = None) -> dict[str, torch.Tensor]:
        """Fresh tensors in the stock parameters' names and shapes holding `flats`, in the parameters'
        dtypes and device or `dtype` / `device`."""
        out = {n: torch.zeros(p.shape, dtype=dtype or p.dtype, device=device or p.device)
               for n, p in self.params.items()}
        self._scatter(flats, out.__getitem__)
        return out

    # -- any tensor shaped like the shards (optimizer state) in and out of the stock layout ---------
    def stock_layout(self, src_EX: torch.Tensor) -> dict[str, torch.Tensor]:
        """The stock parameters' names and shapes holding what `src_EX` [E, ceil(W/D)] (the shards,
        their gradient, an optimizer's state of them) holds for this rank's owned experts, in
        src_EX's dtype and on its device (optimizer state kept on the host stays there; collective)."""
        return self._stock_tensors(self.gather_to_owners(src_EX), src_EX.dtype, src_EX.device)

    @torch.no_grad()
    def shard_layout(self, stock: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The inverse of stock_layout: tensors in the stock parameters' names and shapes -> this
        rank's [E, ceil(W/D)] shards of them, in their dtype (collective)."""
        return self._shard(self._owned_flats(stock.__getitem__))

    def stock_for_checkpoint(self) -> None:
        """Give the stock parameters real memory holding the shards' values, for a framework that
        reads them in place (Megatron's sharded_state_dict()) and may load into them in place; they
        are released at the next window (collective)."""
        self._materialize_stock(self.gather_to_owners())
        self._stock_live = True

    def owner_layout_grads(self) -> dict[str, torch.Tensor]:
        """Gradients of the stock expert parameters (names relative to the experts module) implied
        by the shard gradients (collective)."""
        grad = self.shards.grad if self.shards.grad is not None else torch.zeros_like(self.shards)
        return self._stock_tensors(self.gather_to_owners(grad))

    def stock_weights(self) -> dict[str, torch.Tensor]:
        """The stock expert parameters' current values (names relative to the experts module),
        assembled from the shards (collective)."""
        return self._stock_tensors(self.gather_to_owners())

    def _state_dict_hook(self, module, state, prefix, local_metadata):
        for name, t in self.stock_weights().items():
            key = prefix + name
            if key in state:
                state[key] = t
        state.pop(prefix + self.PARAM, None)
        return state

    def _before_load(self) -> None:
        # the stock parameters receive the checkpoint; those it lacks (a partial load) keep the
        # shards' current values. After sharded_state_dict() they are live already and may hold a
        # distributed checkpoint's values: its load writes in place into the tensors that call
        # handed out, which are these parameters, before Megatron calls load_state_dict with them;
        # writing the shards into them again would load the old weights back
        if not self._stock_live:
            self._materialize_stock(self.gather_to_owners())

    def _after_load(self, keys) -> None:
        missing = [k for k in keys.missing_keys if k.endswith(self.PARAM)]
        for k in missing:  # stock checkpoints have no shards: they are rebuilt from the owners
            keys.missing_keys.remove(k)
        self.load_from_owners()
        self.release_stock()

    def sources(self) -> list[torch.Tensor]:
        return [self.shards]

    def key(self) -> tuple:
        return residency.epoch(), self.shards._version

    @torch.no_grad()
    def open_window(self, placement: Placement, comm) -> Window:
        """Start materializing every slot of `placement` from every rank's shards, once (collective;
        in the background, as ExpertStore.open_window)."""
        self.release_stock()  # memory a checkpoint or a framework's cast gave them back
        window = super().open_window(placement, comm)
        # the slots' gradients accumulate in the order the return sends them (rank-major), unless
        # lent to the experts' linears as main_grad (gradient accumulation fusion), which needs
        # every parameter's piece in one piece
        window.acc_ranks = 0 if self.kind.fused_wgrad else self.num_ranks
        return window

    def _fetch(self, p: Placement, which_R: np.ndarray, comm) -> tuple:
        """Start gathering the slots of `p` among which_R from every rank's shards: (Pending of this
        rank's [n, D * shard] rows, their slots int64 [n], the return route)."""
        D, me = self.num_ranks, self.rank
        order = np.lexsort((p.replica_slot_R, p.replica_rank_R))  # every slot, by (rank, slot)
        order = order[which_R[order]]
        dest, experts = p.replica_rank_R[order], p.replica_expert_R[order]
        mine = dest == me
        n_mine = int(mine.sum())
        # my shard of every slot; the shards as they are when every expert has one slot, in expert
        # order (the common case: no gather now, no scatter when gradients return)
        idx = None if np.array_equal(experts, np.arange(self.num_experts)) else \
            _ShardRows(experts, self.num_experts, self.shards.device)
        n_send = np.bincount(dest, minlength=D)
        traffic_DD = np.broadcast_to(n_send, (D, D))  # every rank sends its shard of every slot
        buf = self.shards.detach() if idx is None else self.shards.detach().index_select(0, idx.rows)
        # [D * n_mine, shard] by source rank, then every slot's D shards in a row
        fetch = comm.exchange_async(buf, n_send.tolist(), [n_mine] * D, traffic_DD).map(
            lambda got: _slot_major(got, D, n_mine))
        route = dict(exchange=comm.exchange, idx=idx, n_send=n_send.tolist(), n_mine=n_mine, traffic_DD=traffic_DD)
        return fetch, p.replica_slot_R[order][mine].astype(np.int64), route

    def _return_grads(self, window: Window) -> torch.Tensor:
        """Every slot's accumulated gradient, cut into D shards, back to the shard holders, part by
        part: float [E, ceil(W/D)], this rank's shards' gradients."""
        D, acc, start = self.num_ranks, window.accumulated(), 0
        total = None
        for r, n in window.routes:
            if acc is None:  # no backward reached the window
                send = self.shards.new_zeros((D * n, self.shard), dtype=self.acc_dtype)
            elif window.acc_ranks:  # a view, but for a window grown by more parts
                send = acc[:, start:start + n].reshape(D * n, self.shard)
            else:
                send = _rank_major(acc[start:start + n], D)
            back = r["exchange"](send, [r["n_mine"]] * D, r["n_send"], np.ascontiguousarray(r["traffic_DD"].T))
            start += n
            grad = back.view(self.shards.shape) if r["idx"] is None else r["idx"].scatter(back)
            total = grad if total is None else total.add_(grad)
        self.returns += 1
        residency.settled(self)
        return total

    @torch.no_grad()
    def flush(self, window: Window, in_graph: bool) -> list:
        """Return the window's slot gradients to the shards (collective): into `main_grad` where the
        framework keeps one, else as the shards' gradient (in_graph) or into `.grad`."""
        grad = self._return_grads(window)
        shards = self.shards
        main_grad = getattr(shards, "main_grad", None)
        out = []
        if main_grad is not None:
            main_grad.add_(grad)
            out = self.idle_grads() if in_graph else []
        elif in_graph:
            out = [grad.to(shards.dtype)]
        else:
            shards.grad = grad.to(shards.dtype) if shards.grad is None else shards.grad.add_(grad)
        window.returned()  # after the received rows are read (they are the accumulator itself at D = 1)
        return out

    def idle_grads(self) -> list:
        """The shards' gradient from a backward pass (ReturnGate's) that hands autograd none: None.
        Where a main_grad exists (Megatron DDP), DDP's gradient-ready hook, which runs after the
        shards' AccumulateGrad, asserts under overlap_grad_reduce that a gradient is there: it finds
        `.grad` set here to zeros of one element expanded to the shards' shape, marked as already in
        main_grad (so DDP does not add it), and clears it. Handed to autograd instead, that zero
        would be copied by AccumulateGrad into a full [E, ceil(W/D)] tensor every microbatch."""
        shards = self.shards
        if getattr(shards, "main_grad", None) is not None:
            shards.grad_added_to_main_grad = True
            shards.grad = shards.new_zeros(()).expand(shards.shape)
        return [None]


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


class _ShardRows:
    """The shard rows an exchange sends (`rows`, torch int64) and how their gradients go back:
    a gather by the inverse permutation when every expert is sent once, else sums into zeros."""

    def __init__(self, rows_N: np.ndarray, E: int, device):
        self.E = E
        if rows_N.size == E and np.array_equal(np.sort(rows_N), np.arange(E)):
            self.rows, self.inverse = permutation_and_inverse(rows_N, device)
        else:
            self.rows, self.inverse = torch.from_numpy(rows_N.astype(np.int64)).to(device), None

    def scatter(self, grad_N: torch.Tensor) -> torch.Tensor:
        """[E, ...]: grad_N's rows summed into the rows they were taken from."""
        if self.inverse is not None:
            return grad_N.index_select(0, self.inverse)
        return grad_N.new_zeros((self.E,) + tuple(grad_N.shape[1:])).index_add_(0, self.rows, grad_N)


_warned_biases = False


def _warn_biases(names: list) -> None:
    """Once per process: expert biases share fsep's one shard parameter with the weights."""
    global _warned_biases
    _warned_biases = True
    warnings.warn(f"megatron-rails fsep: the expert biases ({', '.join(names)}) are sharded together with the "
                  "weights in one parameter, so an optimizer's weight decay decays them too (stock Megatron "
                  "exempts biases), and optimizer checkpoints do not load across policies (their parameter "
                  "groups differ); train with weight decay 0, expert modules without biases, or another "
                  "policy", RuntimeWarning, stacklevel=3)


def _is_placeholder(p: torch.Tensor) -> bool:
    """A tensor whose memory is one element (expanded), or empty."""
    return p.untyped_storage().nbytes() <= p.element_size()
