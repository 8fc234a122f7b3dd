"""Expert store, owner layout: the stock local experts are the owners (and what checkpoints save);
replica slots borrow their weights from the owners for one layer step.

Replica weights travel as one flat vector per replica through a differentiable all-to-all, so in
backward the replica weight gradients flow back through the reverse exchange and are summed into
the owner's parameters by autograd, in a fixed order (same graph, same order on every run).

Legend: P flat parameter count of one expert; N tokens of one slot; H hidden size.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.func import functional_call

from .plan import Plan, owner_of_experts


class ExpertStore:
    """Wraps a Megatron-Core SequentialMLP (`local_experts` of identical MLP modules)."""

    def __init__(self, experts: torch.nn.Module, num_experts: int, rank: int, num_ranks: int):
        local = getattr(experts, "local_experts", None)
        if local is None or len(local) == 0:
            raise TypeError(f"megatron-rails replicas need SequentialMLP experts (local_experts); got "
                            f"{type(experts).__name__}")
        self.experts = experts
        self.local = local
        self.num_experts, self.rank, self.num_ranks = num_experts, rank, num_ranks
        self.names = [n for n, _ in local[0].named_parameters()]
        self.shapes = [p.shape for _, p in local[0].named_parameters()]
        self.numels = [p.numel() for _, p in local[0].named_parameters()]
        self.owner_E = owner_of_experts(num_experts, num_ranks)
        self.first_local = int(np.searchsorted(self.owner_E, rank))

    @property
    def flat_size(self) -> int:
        return int(sum(self.numels))

    def flat(self, expert: int) -> torch.Tensor:
        """float [P]: owner expert's parameters as one differentiable vector."""
        mod = self.local[expert - self.first_local]
        return torch.cat([p.reshape(-1) for p in mod.parameters()])

    def unflatten(self, vec_P: torch.Tensor) -> dict[str, torch.Tensor]:
        return {n: t.view(s) for n, t, s in zip(self.names, torch.split(vec_P, self.numels), self.shapes)}

    def fetch(self, plan: Plan, exchange) -> tuple[dict[int, dict[str, torch.Tensor]], torch.Tensor | None]:
        """Bring the weights of this rank's active replica slots from their owners.

        exchange(x, send_D, recv_D): the all-to-all to use. Every rank calls this with the same
        plan. Returns ({slot: parameter dict}, the received buffer [n, P] or None when no rank
        exchanged weights). The caller must keep the buffer in the autograd graph even when it is
        empty, so that every rank joins the reverse exchange in backward.
        """
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
        ref = next(self.local[0].parameters())
        if send.size:
            buf = torch.stack([self.flat(int(e)) for e in p.replica_expert_R[send]])
        else:
            buf = ref.new_zeros((0, self.flat_size)).requires_grad_(ref.requires_grad)
        got = exchange(buf, send_D.tolist(), recv_D.tolist())
        return {int(s): self.unflatten(got[i]) for i, s in enumerate(p.replica_slot_R[recv])}, got

    def compute(self, params: dict[str, torch.Tensor], x_NH: torch.Tensor, probs_N: torch.Tensor) -> torch.Tensor:
        """The expert MLP with borrowed weights (same module code as the owners)."""
        out, bias = functional_call(self.local[0], params, (x_NH, probs_N))
        if bias is not None:
            out = out + bias
        return out


class ShardedExpertStore(ExpertStore):
    """FSEP layout: every expert's flat parameters live as D shards, shard k on rank k
    (`shards_EP` float [E, ceil(P/D)], a Parameter registered on the experts module); the stock
    local experts are kept only as the checkpoint view and no longer train.

    Each step the plan's slots are materialized by one all-to-all of shards; in backward the slot
    weight gradients travel back the same way and land in the shards. `state_dict()` of the layer
    writes the current shards back into the stock local experts first (a collective: every rank
    saves), and `load_state_dict()` re-shards them, so checkpoints keep the stock layout.
    """

    PARAM = "rails_fsep_shards"

    def __init__(self, experts, num_experts, rank, num_ranks, exchange):
        super().__init__(experts, num_experts, rank, num_ranks)
        self.exchange = exchange
        self.shard = -(-self.flat_size // num_ranks)
        ref = next(self.local[0].parameters())
        shards = torch.nn.Parameter(ref.new_zeros((num_experts, self.shard)))
        experts.register_parameter(self.PARAM, shards)
        for p in self.local.parameters():
            p.requires_grad_(False)
        self.load_from_owners()
        experts._register_state_dict_hook(self._state_dict_hook)
        experts.register_load_state_dict_post_hook(lambda module, keys: self._after_load(keys))

    @property
    def shards_EP(self) -> torch.nn.Parameter:
        return getattr(self.experts, self.PARAM)

    def _owned(self) -> list[int]:
        return np.flatnonzero(self.owner_E == self.rank).tolist()

    @torch.no_grad()
    def load_from_owners(self) -> None:
        """Shard the stock local experts' weights over all ranks (collective)."""
        D, pad = self.num_ranks, self.shard * self.num_ranks
        owned = self._owned()
        flats = [torch.nn.functional.pad(self.flat(e).detach(), (0, pad - self.flat_size)).view(D, self.shard)
                 for e in owned]
        buf = torch.stack(flats, 1).reshape(D * len(owned), self.shard) if owned else \
            self.shards_EP.new_zeros((0, self.shard))
        n_D = np.bincount(self.owner_E, minlength=D)
        got = self.exchange(buf, [len(owned)] * D, n_D.tolist())  # from each owner, its experts in order
        self.shards_EP.copy_(got)

    @torch.no_grad()
    def gather_to_owners(self, source: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Reassemble this rank's owned experts (flat [P] each) from every rank's shards of `source`
        (default the shards themselves; pass shards.grad for gradients). Collective."""
        src = self.shards_EP if source is None else source
        D = self.num_ranks
        n_D = np.bincount(self.owner_E, minlength=D)
        owned = self._owned()
        got = self.exchange(src.detach(), n_D.tolist(), [len(owned)] * D)  # [D * owned, shard], by rank
        full = got.view(D, len(owned), self.shard).transpose(0, 1).reshape(len(owned), -1)
        return [full[i, :self.flat_size] for i in range(len(owned))]

    def owner_layout_grads(self) -> dict[str, torch.Tensor]:
        """Gradients of the stock local-expert parameters implied by the shard gradients (collective)."""
        grad = self.shards_EP.grad if self.shards_EP.grad is not None else torch.zeros_like(self.shards_EP)
        out = {}
        for i, vec in enumerate(self.gather_to_owners(grad)):
            for name, t in self.unflatten(vec).items():
                out[f"local_experts.{i}.{name}"] = t.clone()
        return out

    @torch.no_grad()
    def _write_back(self) -> None:
        for i, vec in enumerate(self.gather_to_owners()):
            for p, t in zip(self.local[i].parameters(), torch.split(vec, self.numels)):
                p.copy_(t.view_as(p))

    def _state_dict_hook(self, module, state, prefix, local_metadata):
        self._write_back()
        for i, mod in enumerate(self.local):
            for name, p in mod.named_parameters():
                key = f"{prefix}local_experts.{i}.{name}"
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
        """Materialize this rank's active slots from every rank's shards (see ExpertStore.fetch)."""
        p = plan.placement
        active = np.flatnonzero(plan.quota_R > 0)
        if active.size == 0:
            return {}, None
        active = active[np.lexsort((p.replica_slot_R[active], p.replica_rank_R[active]))]
        D, me = self.num_ranks, self.rank
        dest = p.replica_rank_R[active]
        idx = torch.from_numpy(p.replica_expert_R[active].copy())
        buf = self.shards_EP.index_select(0, idx)  # my shard of every active slot, by (rank, slot)
        mine = active[dest == me]
        n_send = np.bincount(dest, minlength=D).tolist()
        got = exchange(buf, n_send, [int(mine.size)] * D)  # [D * n_mine, shard], by source rank
        full = got.view(D, mine.size, self.shard).transpose(0, 1).reshape(mine.size, -1)
        return {int(s): self.unflatten(full[i, :self.flat_size]) for i, s in enumerate(p.replica_slot_R[mine])}, got
