"""RailsTokenDispatcher: Megatron-Core token dispatcher that balances expert load with a planner.

The six-step contract of `MoETokenDispatcher`, per layer and microbatch on each EP rank:
  dispatch_preprocess  all-gather exact counts -> plan (every rank the same) -> order tokens by
                       (destination rank, slot there)
  token_dispatch       all-to-all of tokens and probs with the plan's split sizes
  dispatch_postprocess group received tokens by slot; owner slots go to the stock experts, replica
                       slots are computed here with weights fetched from their owners
  combine_preprocess   stock outputs + replica outputs, back to the received order
  token_combine        the reverse all-to-all
  combine_postprocess  sum every token's expert outputs (already prob-weighted by the experts)

Legend: T local tokens, E experts, D EP ranks, S slots per rank, P token-expert pairs sent by this
rank, Q pairs received, H hidden size.
"""
from __future__ import annotations

import hashlib
import time
import warnings
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from .comm import all_gather_counts, collective_device, make_comm
from .config import PolicyConfig
from .experts import ExpertStore, ShardedExpertStore, permutation_and_inverse
from .faults import maybe_fault
from .megatron import metrics as rails_metrics
from .plan import SHARDED, PlanError, imbalance, stock_load_D
from .planners import make_planner


METRICS_KEPT = 10_000  # per-layer metric records a dispatcher keeps (one per microbatch step)
RECENT_PLANS = 16  # plans kept for replayed forwards (activation recompute of in-flight microbatches)
BALANCE_WARN = 0.05  # a balancing policy above 1 + this max/mean tokens per rank is reported


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
    send_D = np.bincount(dest, weights=tok_M[row], minlength=plan.send_DD.shape[0]).astype(np.int64).tolist()
    return SendOrder(token_P, probs_P, send_D, plan.send_DD[:, me].tolist(), by_token, k)


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


class PlanMismatchError(RuntimeError):
    """Ranks computed different plans for the same layer (debug check)."""


class RailsTokenDispatcher(MoETokenDispatcher):
    recent_plans = RECENT_PLANS  # 0: plan every call (tests that count calls, benchmarks that time planning)
    policy_config: PolicyConfig = PolicyConfig(policy="ultraep")  # set by megatron_rails.install()

    def __init__(self, num_local_experts: int, local_expert_indices, config, pg_collection=None):
        super().__init__(config=config, pg_collection=pg_collection)
        if self.tp_size > 1:
            raise NotImplementedError("megatron-rails supports expert tensor parallel size 1")
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.num_experts = config.num_moe_experts
        self.ep_rank = dist.get_rank(self.ep_group)
        self.pcfg = type(self).policy_config
        self.planner = make_planner(self.pcfg.policy, self.pcfg.planner_config(self.ep_size, self.num_experts))
        self.sharded = self.pcfg.policy == "fsep" or (self.pcfg.policy == "lp" and self.pcfg.placement == "fsep")
        self.state = self.planner.initial_state()
        self.comm = make_comm(self.pcfg, self.ep_group)
        self.store: Optional[ExpertStore] = None
        self._layer = None  # weak reference to the MoELayer (attach_experts), for Megatron's metric tracker
        # the latest layer steps only: a run of weeks must not grow this without bound
        self.metrics: deque[dict] = deque(maxlen=METRICS_KEPT)
        self.plan = None
        self.unbalanced_steps = 0  # steps whose plan stayed above 1 + BALANCE_WARN max/mean
        self._recent: OrderedDict = OrderedDict()  # counts digest -> plan, the latest RECENT_PLANS

    def attach_experts(self, experts: torch.nn.Module, layer: torch.nn.Module | None = None) -> None:
        """Take over the layer's experts (any kind megatron/expert_kinds.py supports); `layer`, the
        MoELayer, gives the layer number for Megatron's metric tracker (held by weak reference)."""
        self._layer = rails_metrics.layer_ref(layer)
        if self.sharded:
            self.store = ShardedExpertStore(experts, self.num_experts, self.ep_rank, self.ep_size,
                                            self.comm.exchange)
        else:
            self.store = ExpertStore(experts, self.num_experts, self.ep_rank, self.ep_size)

    # -- 1. plan and order tokens ---------------------------------------------------------------
    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """hidden_states [S, B, H]; routing_map bool [T, E]; probs float [T, E]."""
        self.hidden_shape = hidden_states.shape
        x_TH = hidden_states.reshape(-1, self.hidden_shape[-1])
        t0 = time.perf_counter()
        counts_DE = all_gather_counts(routing_map.sum(dim=0), self.ep_group)
        t1 = time.perf_counter()
        # activation recompute runs this forward again (maybe after other microbatches): the same
        # counts get the same plan and do not advance a history-based planner's state twice
        key = hashlib.blake2b(counts_DE.tobytes(), digest_size=16).digest()
        replay = self._recent.get(key)
        if replay is None:
            plan, self.state = self.planner.plan(counts_DE, self.state)
        else:
            plan = replay
        t2 = time.perf_counter()
        if self.pcfg.check_plan:
            self._check_plan(plan)
        if replay is None and self.recent_plans:  # only plans that passed the check are replayed
            self._recent[key] = plan
            if len(self._recent) > self.recent_plans:
                self._recent.popitem(last=False)
        self.plan = plan
        self.sent = order_pairs(plan, self.ep_rank, routing_map, probs)
        self.send_D, self.recv_D = self.sent.send_D, self.sent.recv_D
        if replay is None:  # a replayed forward is not a new step for the metrics either
            self._record(plan, counts_DE, (t1 - t0) * 1e6, (t2 - t1) * 1e6, x_TH)
        return x_TH[self.sent.token_P], self.sent.probs_P

    # -- 2. exchange ----------------------------------------------------------------------------
    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        maybe_fault("token_dispatch", self.ep_rank)
        T = self.plan.send_DD
        x = self.comm.exchange(hidden_states, self.send_D, self.recv_D, T)
        pr = self.comm.exchange(probs.unsqueeze(-1), self.send_D, self.recv_D, T).squeeze(-1)
        return x, pr

    # -- 3. group by slot, compute replicas -------------------------------------------------------
    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        plan = self.plan
        L, S = plan.placement.owner_slots, plan.placement.slots_per_rank
        self.recv_order, self.recv_inverse, per_slot = receive_order(plan, self.ep_rank, hidden_states.device)
        x_Q, pr_Q = (rows(t, self.recv_order, self.recv_inverse) for t in (hidden_states, probs))
        n_owner = int(per_slot[:L].sum())
        weights, anchor = self.store.fetch(plan, self.comm.exchange)
        self.replica_outs = []
        start = n_owner
        for s in range(L, S):
            n = int(per_slot[s])
            if n:
                self.replica_outs.append(self.store.compute(weights[s], x_Q[start:start + n], pr_Q[start:start + n]))
            start += n
        if anchor is not None:  # keep the weight exchange in the graph on every rank (see ExpertStore.fetch):
            # zero rows, concatenated with the outputs in combine_preprocess
            self.replica_outs.append(anchor.view(0, x_Q.shape[-1]))
        # the stock experts compute the owner slots (none under the sharded layout)
        tokens_per_expert = torch.zeros(self.num_local_experts, dtype=torch.int64)
        tokens_per_expert[:L] = torch.from_numpy(per_slot[:L].copy())
        return x_Q[:n_owner], tokens_per_expert, pr_Q[:n_owner]

    # -- 4-6. combine ---------------------------------------------------------------------------
    def combine_preprocess(self, hidden_states: torch.Tensor):
        y_Q = hidden_states
        if self.replica_outs:  # the replica slots' outputs (and the weight exchange's anchor) follow
            y_Q = torch.cat([hidden_states] + [y.to(hidden_states.dtype) for y in self.replica_outs])
        self.replica_outs = []
        return rows(y_Q, self.recv_inverse, self.recv_order)  # back to the received (source-major) order

    def token_combine(self, hidden_states: torch.Tensor):
        maybe_fault("token_combine", self.ep_rank)
        return self.comm.exchange(hidden_states, self.recv_D, self.send_D, self.plan.send_DD.T)

    def combine_postprocess(self, hidden_states: torch.Tensor):
        T = int(np.prod(self.hidden_shape[:-1]))
        return sum_pairs(hidden_states, self.sent, T).view(self.hidden_shape)

    # -- checks and metrics ---------------------------------------------------------------------
    def _check_plan(self, plan) -> None:
        """Debug mode: every rank validates its plan and all-reduces its digest, so a plan that is
        invalid or differs on any rank raises on every rank (never a hang or a silent mismatch)."""
        try:
            plan.validate()
            invalid = ""
        except PlanError as err:
            invalid = str(err)
        digest = int(plan.digest()[:15], 16)
        dev = collective_device(self.ep_group)
        lo = torch.tensor([digest, -int(bool(invalid))], dtype=torch.int64, device=dev)  # min of -flag = -max flag
        hi = torch.tensor([digest], dtype=torch.int64, device=dev)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=self.ep_group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.ep_group)
        if lo[1].item() < 0:
            raise PlanMismatchError(f"EP rank {self.ep_rank}: the plan failed validation on some rank"
                                    + (f" (here: {invalid})" if invalid else " (valid here)"))
        if lo[0].item() != hi[0].item():
            raise PlanMismatchError(f"EP rank {self.ep_rank}: plan digests differ across ranks "
                                    f"(this rank {digest:x}, min {lo[0].item():x}, max {hi[0].item():x}); "
                                    f"token counts or planner state diverged")

    def _record(self, plan, counts_DE, gather_us, plan_us, x_TH) -> None:
        token_bytes = x_TH.element_size() * x_TH.shape[-1]
        send = plan.send_DD
        off_diag = int(send.sum() - np.trace(send))
        expert_bytes = self.store.flat_size * x_TH.element_size() if self.store else 0
        before_D, after_D = stock_load_D(counts_DE, self.ep_size), plan.load_D
        after = imbalance(after_D)
        # the slot budget could not balance this step: say so once per layer, count it in the metric
        limited = plan.policy != "none" and after > 1 + BALANCE_WARN
        if limited:
            self.unbalanced_steps += 1
            if self.unbalanced_steps == 1 and self.ep_rank == 0:
                warnings.warn(f"megatron-rails: {plan.policy} left max/mean tokens per rank at {after:.3f} "
                              f"(> {1 + BALANCE_WARN}); the slot budget (slots: {self.pcfg.slots}) cannot absorb "
                              f"this skew. Counted in the metric 'unbalanced_steps'; raise slots to fix.",
                              RuntimeWarning, stacklevel=2)
        self.metrics.append({
            "policy": plan.policy,
            "max_over_mean_before": imbalance(before_D),
            "max_over_mean_after": after,
            "unbalanced": limited,
            "unbalanced_steps": self.unbalanced_steps,
            "tokens_per_rank_before": before_D.tolist(),
            "tokens_per_rank_after": after_D.tolist(),
            "replicas_used": int(plan.weight_moves),
            "token_bytes_sent": off_diag * token_bytes,
            "weight_bytes_sent": plan.weight_bytes(expert_bytes),
            "plan_us": plan_us,
            "count_gather_us": gather_us,
            "layout": "sharded" if plan.placement.layout == SHARDED else "owner",
            "rails_sprayed": self.comm.sprays(send),  # the token exchange goes over RailS's three phases
        })
        rails_metrics.record_step(self._layer() if self._layer else None, self.metrics[-1], x_TH.device)
