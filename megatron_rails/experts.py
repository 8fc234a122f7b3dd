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
