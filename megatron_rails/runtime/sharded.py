"""FSEP's expert store: every expert's weights sharded over all EP ranks (ShardedExpertStore), the
step's slots materialized from the shards by one all-to-all and their gradients returned into them;
the experts' biases stay stock parameters on their owners, lent to the slots as replica weights are.

Shape letters (docs/architecture.md): W parameters of one expert (flat), N rows of one gather, E
experts, D EP ranks; a shard row holds ceil(W/D) of an expert's parameters.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from ..core.plan import Placement
from . import residency
from .expert_kind import ExpertKind
from .experts import ExpertStore
from .staging import permutation_and_inverse, stage
from .residency import Window


def _slot_major(got: torch.Tensor, D: int, n: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """[D * n, shard] received by source rank -> [n, D * shard]: every slot's D shards in a row
    (into `out` where given)."""
    shard = got.shape[-1]
    if out is None:
        return got.view(D, n, shard).transpose(0, 1).reshape(n, D * shard)
    out.view(n, D, shard).copy_(got.view(D, n, shard).transpose(0, 1))
    return out


def _rank_major(flat: torch.Tensor, D: int) -> torch.Tensor:
    """The inverse of _slot_major: [n, D * shard] -> [D * n, shard], shard k of every slot for rank k."""
    n, shard = flat.shape[0], flat.shape[1] // D
    return flat.view(n, D, shard).transpose(0, 1).reshape(D * n, shard)


class ShardedExpertStore(ExpertStore):
    """FSEP layout: every expert's flat weights live as D shards, shard k on rank k (`shards` float
    [E, ceil(W/D)], a Parameter registered on the experts module). The stock weight parameters
    stay registered (their names and shapes are the checkpoint layout) but hold no memory: each is
    a placeholder, one element expanded to the stock shape (stride 0), and no longer trains. So a
    rank holds its shards of every expert plus the step's materialized slots.

    The parameters stock Megatron exempts from weight decay (biases: 1-D, or named `*.bias`) are not
    sharded: they stay stock parameters on their owners and train there, as under stock EP (so an
    optimizer's parameter groups, their weight decay and its checkpoint are stock's), and `biases`,
    an owner-layout ExpertStore over them, lends every slot its expert's biases (W counts the
    weights only; `params`, `names` and the checkpoint layout below are the weights').

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
        biases = _Part(kind, _stock_exempt, fused_wgrad=False)  # biases' gradients come through autograd
        if biases.slot_names:
            kind = _Part(kind, lambda name, p: not _stock_exempt(name, p), fused_wgrad=kind.fused_wgrad)
        super().__init__(kind, num_experts, rank, num_ranks, before_read)
        # the biases' own fetch and gradient return, once per step beside the shards' (their reads
        # wait for the framework's updates with this store's: the same module)
        self.biases = ExpertStore(biases, num_experts, rank, num_ranks) if biases.slot_names else None
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
        """Gradients of the sharded stock parameters (names relative to the experts module) implied
        by the shard gradients (collective; the biases' are their own `.grad`)."""
        grad = self.shards.grad if self.shards.grad is not None else torch.zeros_like(self.shards)
        return self._stock_tensors(self.gather_to_owners(grad))

    def stock_weights(self) -> dict[str, torch.Tensor]:
        """The sharded stock parameters' current values (names relative to the experts module),
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
        """The shards, then the biases that train (ReturnGate's inputs: flush and idle_grads answer
        for them all)."""
        return [self.shards] + (self.biases.sources() if self.biases is not None else [])

    def key(self) -> tuple:
        return residency.epoch(), self.shards._version, self.biases.key()[1] if self.biases is not None else 0

    @torch.no_grad()
    def open_window(self, placement: Placement, comm) -> Window:
        """Start materializing every slot of `placement` from every rank's shards, once (collective;
        in the background, as ExpertStore.open_window)."""
        self.release_stock()  # memory a checkpoint or a framework's cast gave them back
        window = super().open_window(placement, comm)
        if self.biases is not None:  # every slot's biases from their owners, in the background too
            self.biases.open_window(placement, comm)
        # the slots' gradients accumulate in the order the return sends them (rank-major), unless
        # lent to the experts' linears as main_grad (gradient accumulation fusion), which needs
        # every parameter's piece in one piece
        window.acc_ranks = 0 if self.kind.fused_wgrad else self.num_ranks
        return window

    @torch.no_grad()
    def grow_window(self, placement: Placement, comm) -> Window:
        window = super().grow_window(placement, comm)
        if self.biases is not None:
            self.biases.grow_window(placement, comm)
        return window

    def drop_window(self) -> None:
        super().drop_window()
        if self.biases is not None:
            self.biases.drop_window()

    def row_params(self, window: Window, row: int, link: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """The row's weights from the shards and, where the experts have them, its slot's biases from
        their owners' window (each through a SlotRow node of its own window when link is given)."""
        params = super().row_params(window, row, link)
        if self.biases is not None:
            bias_window = self.biases.window
            bias_window.weights()  # waits for its fetch (a SlotRow reads the rows as they are)
            bias_row = bias_window.row_of_slot()[int(window.slots_N[row])]
            params.update(self.biases.row_params(bias_window, bias_row, link))
        return params

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
        # (on one rank the shards themselves come back, and the slots are views of them)
        fetch = comm.exchange_async(buf, n_send.tolist(), [n_mine] * D, traffic_DD,
                                    out=self.receive_buffer(comm, traffic_DD, (D * n_mine, self.shard), buf)).map(
            lambda got: _slot_major(got, D, n_mine, None if D == 1 else
                                    self.blocks.empty((n_mine, D * self.shard), got.dtype, got.device)))
        back_DD = np.ascontiguousarray(traffic_DD.T)
        route = dict(exchange=comm.exchange, idx=idx, n_send=n_send.tolist(), n_mine=n_mine, back_DD=back_DD,
                     # the gradient return's receive buffer, where it takes one
                     into=lambda send: self.receive_buffer(comm, back_DD, (int(n_send.sum()), self.shard), send))
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
            # received into a kept block: as the shards' gradient it is free again once the
            # optimizer has zeroed the gradients (set to None), or main_grad has taken it
            back = r["exchange"](send, [r["n_mine"]] * D, r["n_send"], r["back_DD"], out=r["into"](send))
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
        out = [None]
        if getattr(shards, "main_grad", None) is not None:
            shards.main_grad.add_(grad)
        elif in_graph:
            out = [grad.to(shards.dtype)]
        else:
            shards.grad = grad.to(shards.dtype) if shards.grad is None else shards.grad.add_(grad)
        window.returned()  # after the received rows are read (they are the accumulator itself at D = 1)
        if self.biases is not None:  # the biases' return, on every rank right after the shards'
            out += self.biases.flush(self.biases.window, in_graph)
        if not in_graph:
            return []
        for p, g in zip(self.sources(), out):
            if g is None:
                _in_main_grad(p)
        return out

    def idle_grads(self) -> list:
        """The sources' gradients from a backward pass (ReturnGate's) that hands autograd none: None
        each (see _in_main_grad)."""
        for p in self.sources():
            _in_main_grad(p)
        return [None] * len(self.sources())


class _ShardRows:
    """The shard rows an exchange sends (`rows`, torch int64) and how their gradients go back:
    a gather by the inverse permutation when every expert is sent once, else sums into zeros."""

    def __init__(self, rows_N: np.ndarray, E: int, device):
        self.E = E
        if rows_N.size == E and np.array_equal(np.sort(rows_N), np.arange(E)):
            self.rows, self.inverse = permutation_and_inverse(rows_N, device)
        else:
            (self.rows,), self.inverse = stage([rows_N], device), None

    def scatter(self, grad_N: torch.Tensor) -> torch.Tensor:
        """[E, ...]: grad_N's rows summed into the rows they were taken from."""
        if self.inverse is not None:
            return grad_N.index_select(0, self.inverse)
        return grad_N.new_zeros((self.E,) + tuple(grad_N.shape[1:])).index_add_(0, self.rows, grad_N)


def _in_main_grad(p: torch.Tensor) -> None:
    """Where `p` has a main_grad (Megatron DDP), which its gradient went into already or is owed to
    later: DDP's gradient-ready hook, which runs after p's AccumulateGrad, asserts under
    overlap_grad_reduce that a gradient is there. It finds `.grad` set here to zeros of one element
    expanded to p's shape, marked as already in main_grad (so DDP does not add it), and clears it.
    Handed to autograd instead, that zero would be copied by AccumulateGrad into a full tensor of
    p's shape every microbatch ([E, ceil(W/D)] for the shards)."""
    if getattr(p, "main_grad", None) is not None:
        p.grad_added_to_main_grad = True
        p.grad = p.new_zeros(()).expand(p.shape)


def _stock_exempt(name: str, p: torch.Tensor) -> bool:
    """Whether stock Megatron exempts a parameter from weight decay (megatron.core.optimizer's
    get_standard_config_overrides: 1-D or named `*.bias`): fsep leaves these out of the shards,
    whose one parameter group decays."""
    return p.dim() == 1 or name.endswith(".bias")


class _Part(ExpertKind):
    """The part of an expert kind whose stock parameters satisfy keep(name, parameter): its slices
    and slot names only (one store holds each part); the module's math is the whole kind's."""

    def __init__(self, kind: ExpertKind, keep, fused_wgrad: bool):
        self.whole, self.module, self.num_local, self.name = kind, kind.module, kind.num_local, kind.name
        self.fused_wgrad = fused_wgrad
        params = dict(kind.module.named_parameters())
        self._held = {n for i in range(kind.num_local) for n, _ in kind.slices(i) if keep(n, params[n])}
        self.slot_names = tuple(slot for slot, (n, _) in zip(kind.slot_names, kind.slices(0)) if n in self._held)

    def slices(self, i):
        return [(n, view) for n, view in self.whole.slices(i) if n in self._held]

    def compute(self, params, x_NH, probs_N):
        return self.whole.compute(params, x_NH, probs_N)

    def unsupported(self, why: str):
        return self.whole.unsupported(why)


def _is_placeholder(p: torch.Tensor) -> bool:
    """A tensor whose memory is one element (expanded), or empty."""
    return p.untyped_storage().nbytes() <= p.element_size()
