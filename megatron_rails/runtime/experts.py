"""Expert stores: where expert weights live and how replica / FSEP slots get them.

* ExpertStore (owner layout): the stock local experts are the owners (and what checkpoints save);
  replica slots borrow their weights from the owners for one layer step.
* ShardedExpertStore (FSEP): every expert's weights are sharded over all EP ranks.

Both work on any expert module an adapter (runtime/expert_kind.py's interface; the Megatron-Core
ones are in megatron/expert_kinds.py) describes: which views of the stock parameters make up
expert i and how one expert computes; nothing here knows a module's parameter layout.

Replica weights travel as one flat vector per replica through a differentiable all-to-all, so in
backward the replica weight gradients flow back through the reverse exchange and are summed into
the owner's parameters by autograd, in a fixed order (same graph, same order on every run).

Shape letters (docs/architecture.md): W parameters of one expert (flat), N tokens of one slot, H hidden
size, E experts, D EP ranks; a shard row holds ceil(W/D) of an expert's parameters.
"""
from __future__ import annotations

import numpy as np
import torch

from ..core.plan import Plan, owner_of_experts
from .expert_kind import ExpertKind
from .local import permutation_and_inverse


def _slot_major(got: torch.Tensor, D: int, n: int) -> torch.Tensor:
    """[D * n, shard] received by source rank -> [n, D * shard]: every slot's D shards in a row."""
    shard = got.shape[-1]
    return got.view(D, n, shard).transpose(0, 1).reshape(n, D * shard)


def _rank_major(flat: torch.Tensor, D: int) -> torch.Tensor:
    """The inverse of _slot_major: [n, D * shard] -> [D * n, shard], shard k of every slot for rank k."""
    n, shard = flat.shape[0], flat.shape[1] // D
    return flat.view(n, D, shard).transpose(0, 1).reshape(D * n, shard)


class _ToMainGrad(torch.autograd.Function):
    """Identity on a view of an owner parameter whose gradient goes straight into the same view of
    `param.main_grad`. Megatron's DDP adds `param.grad` to `main_grad` only when the module did not
    accumulate into `main_grad` itself (`grad_added_to_main_grad`, Transformer Engine's fused wgrad
    accumulation); adding the replicas' share directly is right in both cases. The owner's
    AccumulateGrad node still waits for this backward, so DDP's grad-ready hook fires after it."""

    @staticmethod
    def forward(ctx, t, main_grad_view):
        ctx.main_grad_view = main_grad_view
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        ctx.main_grad_view.add_(grad)
        return None, None


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

    @property
    def flat_size(self) -> int:
        """W: the parameter count of one expert."""
        return int(sum(self.numels))

    @property
    def param_bytes(self) -> int:
        """Bytes of one expert's parameters (their own dtype) as a weight exchange moves them."""
        ref = next(iter(self.params.values()))
        return self.flat_size * ref.element_size()

    def _before_read(self) -> None:
        if self.before_read is not None:
            self.before_read(self.experts)

    def _views(self, expert: int, source=None) -> list[torch.Tensor]:
        """Expert `expert`'s tensors as views of the stock parameters, or of the same-shaped tensors
        source(name) returns (gradients, checkpoint buffers)."""
        get = source if source is not None else self.params.__getitem__
        return [view(get(name)) for name, view in self.kind.slices(expert - self.first_local)]

    def flat(self, expert: int) -> torch.Tensor:
        """float [W]: owner expert's parameters as one differentiable vector."""
        i = expert - self.first_local
        parts = []
        for name, view in self.kind.slices(i):
            p, t = self.params[name], view(self.params[name])
            main_grad = getattr(p, "main_grad", None)
            if main_grad is not None and p.requires_grad and torch.is_grad_enabled():
                t = _ToMainGrad.apply(t, view(main_grad))
            parts.append(t.reshape(-1))
        return torch.cat(parts)

    def unflatten(self, vec_W: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: t.view(s) for n, t, s in zip(self.names, torch.split(vec_W, self.numels), self.shapes)}

    def fetch(self, plan: Plan, exchange) -> tuple[dict[int, dict[str, torch.Tensor]], torch.Tensor | None]:
        """Bring the weights of this rank's active replica slots from their owners.

        exchange(x, send_D, recv_D, traffic_DD): the all-to-all to use. Every rank calls this with the same
        plan. Returns ({slot: parameter dict}, an empty anchor tensor, or None when no rank
        exchanged weights). The caller must keep the anchor in the autograd graph (its sum is 0),
        so that every rank joins the reverse exchange in backward, with or without slots.
        """
        # the owners' weights as the optimizer left them; on every call, so that data-parallel
        # replicas (whose plans differ) wait for the same all-gathers at the same point
        self._before_read()
        p = plan.placement
        active = np.flatnonzero(p.is_moved_R & (plan.quota_R > 0))
        if active.size == 0:
            return {}, None
        D, me = self.num_ranks, self.rank
        owner = self.owner_E[p.replica_expert_R[active]]
        dest, slot = p.replica_rank_R[active], p.replica_slot_R[active]
        send = active[owner == me]
        send = send[np.lexsort((p.replica_slot_R[send], p.replica_rank_R[send]))]
        recv_mask = dest == me
        recv = active[recv_mask][np.lexsort((slot[recv_mask], owner[recv_mask]))]
        send_D = np.bincount(p.replica_rank_R[send], minlength=D)
        recv_D = np.bincount(self.owner_E[p.replica_expert_R[recv]], minlength=D)
        ref = next(iter(self.params.values()))
        if send.size:
            buf = torch.stack([self.flat(int(e)) for e in p.replica_expert_R[send]])
        else:
            buf = ref.new_zeros((0, self.flat_size)).requires_grad_(ref.requires_grad)
        # the whole exchange, known to every rank from the plan (a RailS backend needs it)
        traffic_DD = np.zeros((D, D), dtype=np.int64)
        np.add.at(traffic_DD, (owner, dest), 1)
        got = exchange(buf, send_D.tolist(), recv_D.tolist(), traffic_DD)
        return {int(s): self.unflatten(got[i]) for i, s in enumerate(p.replica_slot_R[recv])}, got[:0]

    def compute(self, params: dict[str, torch.Tensor], x_NH: torch.Tensor, probs_N: torch.Tensor) -> torch.Tensor:
        """One expert with borrowed weights: the stock module's math for that expert, probs applied."""
        return self.kind.compute(params, x_NH, probs_N)


class ShardedExpertStore(ExpertStore):
    """FSEP layout: every expert's flat parameters live as D shards, shard k on rank k
    (`shards` float [E, ceil(W/D)], a Parameter registered on the experts module); the stock
    expert parameters are kept only as the checkpoint view and no longer train.

    Each step the plan's slots are materialized by one all-to-all of shards; in backward the slot
    weight gradients travel back the same way and land in the shards. `state_dict()` of the layer
    writes the current shards back into the stock parameters first (a collective: every rank
    saves), and `load_state_dict()` re-shards them, so checkpoints keep the stock layout.
    """

    PARAM = "rails_fsep_shards"

    def __init__(self, kind: ExpertKind, num_experts: int, rank: int, num_ranks: int, exchange, before_read=None):
        super().__init__(kind, num_experts, rank, num_ranks, before_read)
        experts = self.experts
        self.exchange = exchange
        self.shard = -(-self.flat_size // num_ranks)
        ref = next(iter(self.params.values()))
        shards = torch.nn.Parameter(ref.new_zeros((num_experts, self.shard)))
        # each EP rank holds different shards: like Megatron's expert weights, reduce them over the
        # expert-data-parallel group only (Megatron DDP reads `allreduce`)
        shards.allreduce = not num_ranks > 1
        experts.register_parameter(self.PARAM, shards)
        for p in self.params.values():
            p.requires_grad_(False)
        self.load_from_owners()
        experts._register_state_dict_hook(self._state_dict_hook)
        experts.register_load_state_dict_post_hook(lambda module, keys: self._after_load(keys))
        # Megatron's distributed checkpoints read the stock parameters through sharded_state_dict(),
        # not state_dict(): write the shards back first there too, and keep the shards out of it.
        # (Loading goes through load_state_dict(), whose post-hook above re-shards.)
        stock_sharded = getattr(experts, "sharded_state_dict", None)
        if stock_sharded is not None:
            def sharded_state_dict(*args, **kwargs):
                self._write_back()
                out = stock_sharded(*args, **kwargs)
                return {k: v for k, v in out.items() if not k.endswith(self.PARAM)}

            experts.sharded_state_dict = sharded_state_dict

    @property
    def shards(self) -> torch.nn.Parameter:
        return getattr(self.experts, self.PARAM)

    def _owned(self) -> list[int]:
        return np.flatnonzero(self.owner_E == self.rank).tolist()

    def _owned_flats(self) -> list[torch.Tensor]:
        return [torch.cat([t.detach().reshape(-1) for t in self._views(e)]) for e in self._owned()]

    @torch.no_grad()
    def load_from_owners(self) -> None:
        """Shard the stock local experts' weights over all ranks (collective)."""
        D, pad = self.num_ranks, self.shard * self.num_ranks
        owned = self._owned()
        flats = [torch.nn.functional.pad(f, (0, pad - self.flat_size)).view(D, self.shard)
                 for f in self._owned_flats()]
        buf = torch.stack(flats, 1).reshape(D * len(owned), self.shard) if owned else \
            self.shards.new_zeros((0, self.shard))
        n_D = np.bincount(self.owner_E, minlength=D)
        got = self.exchange(buf, [len(owned)] * D, n_D.tolist())  # from each owner, its experts in order
        self.shards.copy_(got)

    @torch.no_grad()
    def gather_to_owners(self, source: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Reassemble this rank's owned experts (flat [W] each) from every rank's shards of `source`
        (default the shards themselves; pass shards.grad for gradients). Collective."""
        src = self.shards if source is None else source
        D = self.num_ranks
        n_D = np.bincount(self.owner_E, minlength=D)
        owned = self._owned()
        got = self.exchange(src.detach(), n_D.tolist(), [len(owned)] * D)  # [D * owned, shard], by rank
        full = _slot_major(got, D, len(owned))
        return [full[i, :self.flat_size] for i in range(len(owned))]

    @torch.no_grad()
    def _scatter(self, flats: list[torch.Tensor], source=None) -> None:
        """Write owned experts' flat vectors into the stock parameters (or into source(name))."""
        for e, vec in zip(self._owned(), flats):
            for t, piece in zip(self._views(e, source), torch.split(vec, self.numels)):
                t.copy_(piece.view_as(t))

    def owner_layout_grads(self) -> dict[str, torch.Tensor]:
        """Gradients of the stock expert parameters (names relative to the experts module) implied
        by the shard gradients (collective)."""
        grad = self.shards.grad if self.shards.grad is not None else torch.zeros_like(self.shards)
        out = {n: torch.zeros_like(p) for n, p in self.params.items()}
        self._scatter(self.gather_to_owners(grad), out.__getitem__)
        return out

    @torch.no_grad()
    def _write_back(self) -> None:
        self._scatter(self.gather_to_owners())

    def _state_dict_hook(self, module, state, prefix, local_metadata):
        self._write_back()
        for name, p in self.params.items():
            key = prefix + name
            if key in state:
                state[key] = p.detach().clone()
        state.pop(prefix + self.PARAM, None)
        return state

    def _after_load(self, keys) -> None:
        missing = [k for k in keys.missing_keys if k.endswith(self.PARAM)]
        for k in missing:  # stock checkpoints have no shards: they are rebuilt from the owners
            keys.missing_keys.remove(k)
        self.load_from_owners()

    def fetch(self, plan: Plan, exchange):
        """Materialize this rank's active slots from every rank's shards (see ExpertStore.fetch).
        Returns ({slot: parameter dict}, an empty anchor tensor to keep in the graph)."""
        p = plan.placement
        self._before_read()  # the shards as the optimizer left them (see ExpertStore.fetch)
        active = np.flatnonzero(plan.quota_R > 0)
        if active.size == 0:
            return {}, None
        active = active[np.lexsort((p.replica_slot_R[active], p.replica_rank_R[active]))]
        D, me = self.num_ranks, self.rank
        dest = p.replica_rank_R[active]
        experts = p.replica_expert_R[active]
        # my shard of every active slot, by (rank, slot): the shards as they are when every expert
        # has one slot, in expert order (the common case: no gather, no scatter in backward)
        idx = None if np.array_equal(experts, np.arange(self.num_experts)) else _ShardRows(experts, self.num_experts,
                                                                                         self.shards.device)
        mine = active[dest == me]
        n_send = np.bincount(dest, minlength=D)
        traffic_DD = np.broadcast_to(n_send, (D, D))  # every rank sends its shard of every active slot
        anchor, *tensors = _Materialize.apply(self.shards, idx, exchange, n_send.tolist(), int(mine.size),
                                              traffic_DD, self.flat_size, self.numels)
        k = len(self.names)
        return {int(s): {n: t.view(shape) for n, t, shape in zip(self.names, tensors[i * k:(i + 1) * k], self.shapes)}
                for i, s in enumerate(p.replica_slot_R[mine])}, anchor


class _Materialize(torch.autograd.Function):
    """FSEP slots from shards through one exchange, as one autograd node.

    forward: shards [E, shard] -> (empty anchor, then for each of this rank's n slots the flat
    pieces of its parameters). backward: the slot gradients go straight into the reverse
    exchange's send buffer, and what comes back lands on the shards. (Slicing the gathered buffer
    with differentiable views instead costs a zero-filled full-size gradient per view.) Every rank
    with active slots anywhere runs this node in backward through the anchor, even with n = 0."""

    @staticmethod
    def forward(ctx, shards, idx, exchange, n_send, n_mine, traffic_DD, flat_size, numels):
        D = len(n_send)
        buf = shards if idx is None else shards.index_select(0, idx.rows)
        got = exchange(buf, n_send, [n_mine] * D, traffic_DD)  # [D * n, shard], by source
        full = _slot_major(got, D, n_mine)
        ctx.meta = (idx, exchange, n_send, n_mine, traffic_DD, shards, numels, flat_size)
        ctx.set_materialize_grads(False)
        pieces = [t for i in range(n_mine) for t in torch.split(full[i, :flat_size], numels)]
        return (full.new_empty(0), *pieces)

    @staticmethod
    def backward(ctx, _anchor_grad, *grads):
        idx, exchange, n_send, n_mine, traffic_DD, shards, numels, flat_size = ctx.meta
        D, shard = len(n_send), shards.shape[1]
        flat = shards.new_empty((n_mine, D * shard))
        flat[:, flat_size:] = 0  # the padding of the last shard
        k = len(numels)
        for i in range(n_mine):
            for g, piece in zip(grads[i * k:(i + 1) * k], torch.split(flat[i, :flat_size], numels)):
                if g is None:  # a parameter that took no part (ctx.set_materialize_grads(False))
                    piece.zero_()
                else:
                    piece.copy_(g.reshape(-1))
        back = exchange(_rank_major(flat, D), [n_mine] * D, n_send, np.ascontiguousarray(traffic_DD.T))  # my shard of each slot
        return (back.view(shards.shape) if idx is None else idx.scatter(back)), None, None, None, None, None, None, None


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
