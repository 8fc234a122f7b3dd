"""LayerRuntime: one MoE layer on one EP rank, every microbatch, framework-free.

The steps, in the order a token dispatcher calls them:

    dispatch(x_TH, routing_map_TE, probs_TE)  all-gather exact counts -> plan (the same on every rank)
                                              -> this rank's pairs in send order
    exchange_tokens(x_P, probs_P)             the all-to-all of tokens and probs (direct or RailS)
    split_received(x_Q, probs_Q)              group received rows by slot; owner rows go back to the
                                              caller for the stock experts
    merge(y_owner)                            replica / FSEP slots computed with weights from the
                                              expert store (fetched in the background since dispatch);
                                              owner outputs + slot outputs, back to the received order
    return_tokens(y_Q)                        the reverse all-to-all
    combine(y_P, T)                           every token's expert outputs summed

Activation recompute runs a layer's forward again during backward, maybe after other microbatches'
forwards. Such a replay (`is_replay`: inside an autograd backward pass, or inside `replaying()`)
reuses the plan made for the same counts, does not advance a history-based planner and adds no
metric record. Only replays are detected this way: two different microbatches with equal counts
are two steps.

Shape letters (docs/architecture.md): T local tokens, E experts, D EP ranks, L owner slots, S slots
per rank, P pairs this rank sends, Q pairs it receives, H hidden size.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import math
import os
import threading
import time
import warnings
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ..core.plan import SHARDED, Plan, PlanError, owner_of_experts, peak_over_mean, rank_totals
from ..core.planners import make_planner
from ..core.planners.step import choose, grow, replica_cost_tokens, route_on
from ..core.policy import PolicyConfig
from .comm import all_gather_counts, collective_device, make_comm
from .comm.base import node_group, side_group
from .expert_kind import ExpertKind
from .experts import ExpertStore
from .sharded import ShardedExpertStore
from .faults import maybe_fault
from .dedup import DedupExchange, fanout_DD
from .local import SendOrder, pairs_per_token_range, send_order, sum_pairs, token_rows
from .receive import rows, rows_back
from .units import NodeUnits, node_units

METRICS_KEPT = 10_000  # per-layer metric records kept (one per microbatch step)
RECENT_PLANS = 16  # plans kept for replays (activation recompute of in-flight microbatches)
BALANCE_WARN = 0.05  # a balancing policy above 1 + this max/mean tokens per rank is reported
GROWN = "grown"  # _plan's answer when the resident placement grows by replicas in free slots

_replay = threading.local()
# the autograd engine's current graph task (-1 outside a backward pass); torch.utils.checkpoint
# asks the engine the same question. Private API: where it is missing only replaying() marks replays
_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)


@contextlib.contextmanager
def replaying():
    """Mark the forwards inside as replays of earlier ones (a framework that recomputes activations
    outside autograd's backward pass says so with this; inside a backward pass it is detected)."""
    depth = getattr(_replay, "depth", 0)
    _replay.depth = depth + 1
    try:
        yield
    finally:
        _replay.depth = depth


def is_replay() -> bool:
    """Whether the forward running now recomputes an earlier one: inside `replaying()`, or inside an
    autograd backward pass (Megatron's and torch's activation checkpointing both recompute there;
    a fresh microbatch's forward never runs there). Every EP rank recomputes at the same point, so
    all decide alike."""
    if getattr(_replay, "depth", 0):
        return True
    return _graph_task_id is not None and _graph_task_id() != -1


def _unbalanced_advice(policy: PolicyConfig) -> str:
    """What a user can change when a balancing policy leaves a step unbalanced."""
    if policy.policy == "eplb":
        return (f"eplb places replicas from the last {policy.window} steps' loads, re-planned every "
                f"{policy.interval} steps: a shorter interval / window follows a shifting skew sooner, and "
                "ultraep or lp plan from every step's exact counts.")
    return (f"The slot budget (slots: {policy.slots}) cannot absorb this skew, or the placement resident "
            "since the optimizer step's first microbatch does not fit these counts: raise slots to fix.")


class PlanMismatchError(RuntimeError):
    """Ranks computed different plans for the same layer (debug check)."""


_ALONE_TOLD = False


def _alone(policy: PolicyConfig) -> PolicyConfig:
    """The policy an EP group of one rank runs: none. That rank holds every expert and receives
    every token whatever the plan, so replicas and shards would only cost (a GPU run of Megatron-LM
    measured +21% per iteration for lp and +26% for fsep at EP 1). Said once per process."""
    global _ALONE_TOLD
    if not _ALONE_TOLD and (not dist.is_initialized() or dist.get_rank() == 0):
        warnings.warn(f"megatron-rails: expert-parallel size 1: one rank holds every expert, so there is nothing "
                      f"to balance; policy {policy.policy} runs as none (stock layout, no weight movement)",
                      RuntimeWarning, stacklevel=4)
    _ALONE_TOLD = True
    return dataclasses.replace(policy, policy="none")


class LayerRuntime:
    """One MoE layer's planner, expert store, exchanges and metrics on one rank of `group` (the EP
    process group). `attach(kind)` hands it the layer's experts before the first step."""

    def __init__(self, policy: PolicyConfig, group, num_experts: int):
        self.rank, self.num_ranks = dist.get_rank(group), dist.get_world_size(group)
        if self.num_ranks == 1 and policy.policy != "none":
            policy = _alone(policy)
        self.policy, self.group, self.num_experts = policy, group, num_experts
        # G: ranks per node, for same-node preference and RailS's groups (torchrun says how many
        # ranks it started per node; every node alike, so every rank gets the same G)
        self.node_size = policy.node_size(self.num_ranks, int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0))
        self.planner = make_planner(policy.policy, policy.planner_config(self.num_ranks, num_experts,
                                                                         self.node_size))
        self.state = self.planner.initial_state()
        self.comm = make_comm(policy, group, self.node_size)
        # V: nodes the EP group spans (1: one node, or ranks_per_node not dividing it). Across nodes
        # a token's outputs add up node by node (runtime/units.py), deduplicated or not
        self.nodes = self.num_ranks // self.node_size if self.num_ranks % self.node_size == 0 else 1
        if self.nodes > 1 and policy.dedup:  # the fan-out's group: made with the layer, on every EP
            node_group(group, self.node_size)  # rank at the same point, not in the middle of a step
        if self.num_ranks > 1 and policy.policy != "none":
            # the weight fetches' group, likewise: where the default group is bound to a device,
            # torch makes every new group by splitting the world's NCCL communicator, a collective
            # of all ranks, which pipeline stages reaching their first fetch at different times
            # would never complete
            side_group(group)
        self.units: Optional[NodeUnits] = None
        self.dedup: Optional[DedupExchange] = None
        self.store: Optional[ExpertStore] = None
        # the latest layer steps only: a run of weeks must not grow this without bound
        self._metrics: deque[dict] = deque(maxlen=METRICS_KEPT)
        # the latest record and what completes it (_record), until exchange_tokens or a read does
        self._unfilled: Optional[tuple[dict, Callable[[], dict]]] = None
        self._owner_E = owner_of_experts(num_experts, self.num_ranks)  # stock placement, for the records
        self.unbalanced_steps = 0  # steps whose plan stayed above 1 + BALANCE_WARN max/mean
        self._recent: OrderedDict = OrderedDict()  # counts digest -> plan, the latest RECENT_PLANS
        self.plan: Optional[Plan] = None
        self.sent: Optional[SendOrder] = None
        self.link: Optional[torch.Tensor] = None  # split_received's ReturnGate output, for merge
        self._step_forwards = 0  # training forwards (microbatches) of the latest finished step
        # called with counts_DE (int64 [D, E], on the host) once per training forward, not for a
        # replay: the routing recorder's (megatron/trace_log.py)
        self.count_sink: Optional[Callable[[np.ndarray], None]] = None

    def attach(self, kind: ExpertKind, before_read=None) -> None:
        """Take over the experts `kind` describes (the adapter of runtime/expert_kind.py);
        before_read(module) runs before every read of their weights (see ExpertStore)."""
        if self.policy.sharded:
            self.store = ShardedExpertStore(kind, self.num_experts, self.rank, self.num_ranks, self.comm.exchange,
                                            before_read, stage=collective_device(self.group))
        else:
            self.store = ExpertStore(kind, self.num_experts, self.rank, self.num_ranks, before_read)

    # -- 1. plan and order ------------------------------------------------------------------------
    def dispatch(self, x_TH: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor,
                 training: Optional[bool] = None):
        """x_TH [T, H]; routing_map bool [T, E]; probs float [T, E] -> (x_P [P, H], probs_P [P], the
        step's metric record or None for a replay). A forward trains when autograd records, or when
        `training` says so without recording (reentrant activation recompute's first pass), never
        under inference mode; a training forward pins the resident placement until the optimizer
        step."""
        t0 = time.perf_counter()
        E = routing_map.shape[1]
        # every rank's counts, and this rank's fewest / most pairs per token with them: one sync
        gathered = all_gather_counts(torch.cat([routing_map.sum(dim=0).to(torch.int64),
                                                pairs_per_token_range(routing_map)]), self.group)
        counts_DE, (lo, hi) = gathered[:, :E], gathered[self.rank, E:]
        t1 = time.perf_counter()
        replay = is_replay()
        # a forward autograd records owes gradients whatever the module's mode (training in eval
        # mode, without dropout); inference mode never runs a backward (and its tensors cannot join
        # a training window)
        trains = not torch.is_inference_mode_enabled() and (torch.is_grad_enabled() or bool(training))
        if self.count_sink is not None and trains and not replay:
            self.count_sink(counts_DE)
        self.store.refresh()
        plan, opened = self._plan(counts_DE, replay, trains)
        t2 = time.perf_counter()
        fetched = 0  # replicas whose weights this microbatch fetches
        if opened == GROWN:  # more replicas in free slots of the resident placement (collective)
            fetched = int(plan.placement.is_moved_R.sum() - self.store.window.placement.is_moved_R.sum())
            self.store.grow_window(plan.placement, self.comm)
        elif opened:  # a new window of resident slots: fetch their weights (collective)
            self._end_window()
            self.store.open_window(plan.placement, self.comm)
            fetched = int(plan.placement.is_moved_R.sum())
        window = self.store.window
        if not replay and window.moved and trains:
            window.in_flight += 1  # its backward (ResidentSlots') counts it off
            window.forwards += 1
        self.plan = plan
        self.sent = send_order(plan, self.rank, routing_map, probs, uniform=bool(lo == hi), receive=True)
        units_DV = self._node_units(x_TH.shape[0], gathered[:, E + 1])
        record = None if replay else self._record(plan, (t1 - t0) * 1e6, (t2 - t1) * 1e6, x_TH, opened, fetched,
                                                  units_DV)
        if self.dedup is not None:
            return (*self.dedup.send_rows(x_TH, self.sent.probs_P), record)
        return token_rows(x_TH, self.sent), self.sent.probs_P, record

    def _node_units(self, T: int, most_pairs_D: np.ndarray) -> Optional[np.ndarray]:
        """Across nodes: this rank's units (runtime/units.py) and, all-gathered, every rank's units
        per node (int64 [D, V]; collective); the deduplicated exchange when the policy asks for it.
        most_pairs_D: int64 [D], the most pairs a token has on each EP rank (from the counts'
        all-gather: it bounds the ordered sums without a GPU sync)."""
        self.units = self.dedup = None
        if self.nodes == 1:
            return None
        self.units = node_units(self.sent, self.rank, self.node_size, self.nodes, T, int(most_pairs_D[self.rank]))
        units_DV = all_gather_counts(torch.from_numpy(self.units.units_V).to(self.sent.token_P.device), self.group)
        if self.policy.dedup:
            self.dedup = DedupExchange(self.plan, self.sent, self.units, units_DV, self.rank, self.node_size,
                                       self.group, self.comm, int(most_pairs_D.max()))
        return units_DV

    def _plan(self, counts_DE: np.ndarray, replay: bool, trains: bool = True) -> tuple[Plan, object]:
        """The plan for these counts, and whether it opens a new window of resident slots (True),
        grows the resident one (GROWN) or runs on it (False). Only training forwards advance the
        planner's state (a history planner learns from training counts, not evaluation's)."""
        key = hashlib.blake2b(counts_DE.tobytes(), digest_size=16).digest()
        store = self.store
        if store.stale():  # the weights changed (an optimizer step): a new step begins
            self._end_window()
            self._recent.clear()
        window = store.window
        resident = window.placement if window is not None else None
        if replay:
            plan = self._recent.get(key)
            if plan is not None:
                return plan, False
            # evicted (more microbatches in flight than kept): plan again without touching the state,
            # on the resident placement
            fresh, _ = self.planner.plan(counts_DE, copy.deepcopy(self.state))
            plan, opened = choose(fresh, resident, counts_DE, locked=True)
        elif window is not None and window.locked and self.state is None:
            # the placement stays for this step and a stateless planner has nothing to learn from
            # these counts: route them on it; plan afresh only to look for replicas worth adding
            on = route_on(resident, counts_DE, self.planner.name)
            plan, opened = self._grow(on, counts_DE) if trains else (on, False)
        else:
            if trains:
                fresh, self.state = self.planner.plan(counts_DE, self.state)
            else:
                fresh, _ = self.planner.plan(counts_DE, copy.deepcopy(self.state))
            locked = window is not None and window.locked
            plan, opened = choose(fresh, resident, counts_DE, locked=locked)
            if locked and trains:  # evaluation counts never add replicas to a training window
                plan, opened = self._grow(plan, counts_DE, fresh)
        if self.policy.check_plan:
            self._check_plan(plan)
        if opened is True:  # a new window: no plan of an earlier one is replayed on it
            self._recent.clear()
        self._recent[key] = plan  # only plans that passed the check are replayed
        self._recent.move_to_end(key)
        if len(self._recent) > RECENT_PLANS:
            self._recent.popitem(last=False)
        return plan, opened

    def _end_window(self) -> None:
        """Drop the resident window, remembering how many microbatches its step trained."""
        window = self.store.window
        if window is not None and window.forwards:
            self._step_forwards = window.forwards
        self.store.drop_window()

    def _grow(self, on: Plan, counts_DE: np.ndarray, fresh: Optional[Plan] = None) -> tuple[Plan, object]:
        """`on` (the plan on the resident placement), or the plan on it grown by the replicas of the
        planner's fresh plan (planned here, statelessly, when not given) missing from it, where that
        pays for their weight bytes over the step's remaining microbatches (core/planners/step.grow;
        the previous step's microbatch count is the estimate). Runs every locked microbatch, so it
        plans afresh only when a replica could pay: the route is unbalanced, a slot is free, and the
        most it could save (down to the mean) reaches one replica's cost."""
        window = self.store.window
        # the busiest rank and the total by one compiled pass (Plan.peak_load): numpy's bincount,
        # max and mean on D numbers cost tens of microseconds on the cold caches of every microbatch
        t_max, total = on.peak_load()
        D = on.placement.num_ranks
        remaining = max(1, self._step_forwards - window.forwards)
        cost = self.policy.replica_cost_tokens or replica_cost_tokens(self.store.param_bytes // self.store.flat_size)
        most = (t_max - math.ceil(total / D)) * remaining  # down to the mean (rounded up as before)
        balanced = peak_over_mean(t_max, total, D) <= 1 + BALANCE_WARN
        if balanced or most <= 0 or most < cost or not window.placement.has_free_slot:
            return on, False
        if fresh is None:
            fresh, _ = self.planner.plan(counts_DE, self.state)
        grown = grow(window.placement, fresh, on, counts_DE, remaining, cost)
        return (on, False) if grown is None else (grown, GROWN)

    # -- 2. exchange ------------------------------------------------------------------------------
    def exchange_tokens(self, x_P: torch.Tensor, probs_P: torch.Tensor):
        """The token all-to-all: (x_Q [Q, H], probs_Q [Q]) in source-rank order."""
        maybe_fault("token_dispatch", self.rank)
        if self.dedup is not None:
            received = self.dedup.exchange(x_P, probs_P)
            self._fill_record()
            return received
        send_DD, so = self.plan.send_DD, self.sent
        x_Q = self.comm.exchange(x_P, so.send_D, so.recv_D, send_DD)
        probs_Q = self.comm.exchange(probs_P.unsqueeze(-1), so.send_D, so.recv_D, send_DD).squeeze(-1)
        self._fill_record()
        return x_Q, probs_Q

    def _fill_record(self) -> None:
        """Complete the latest step's record (its deferred values, see _record) once the token
        all-to-all is launched: on a GPU the host then works while the device exchanges, not before
        it starts."""
        unfilled, self._unfilled = self._unfilled, None
        if unfilled is not None:
            record, rest = unfilled
            record.update(rest())

    @property
    def metrics(self) -> deque[dict]:
        """The latest METRICS_KEPT layer steps' metric records (dicts, see _record), oldest first,
        every one complete."""
        self._fill_record()
        return self._metrics

    # -- 3. group by slot ---------------------------------------------------------------------------
    def split_received(self, x_Q: torch.Tensor, probs_Q: torch.Tensor):
        """Received rows grouped by slot. Returns (x_owner [Q_own, H], tokens per owner slot (int64
        numpy [L]), probs_owner [Q_own]) for the stock experts; the replica / FSEP slots' rows wait
        for `merge`, which computes them after the stock experts, so that the slot weights' fetch
        (started in dispatch) runs under the token all-to-all and the owners' compute."""
        plan = self.plan
        L = plan.placement.owner_slots
        self.recv_order, self.recv_inverse, per_slot = self.sent.receive  # made with the send order
        x_Q, probs_Q = rows(x_Q, self.recv_order, self.recv_inverse), rows(probs_Q, self.recv_order, self.recv_inverse)
        # one split into the owners' rows and each slot's: its backward is one concatenation, where
        # a slice per part would each write a zero-filled copy of all received rows, then be summed
        sizes = [int(per_slot[:L].sum())] + per_slot[L:].tolist()
        x_parts, probs_parts = torch.split(x_Q, sizes), torch.split(probs_Q, sizes)
        self.slot_rows = (x_parts[1:], probs_parts[1:])
        x_own, probs_own, self.link = self.store.return_gate(plan.placement, x_parts[0], probs_parts[0])
        return x_own, per_slot[:L], probs_own

    # -- 4-6. the slots, then back ------------------------------------------------------------------
    def _slot_outputs(self, H: int) -> list[torch.Tensor]:
        """The replica / FSEP slots' outputs for the rows split_received kept, in slot order, and the
        weight exchange's anchor (zero rows) that keeps its autograd node on every rank."""
        x_parts, probs_parts = self.slot_rows
        self.slot_rows = None
        L = self.plan.placement.owner_slots
        weights, anchor = self.store.slot_params(self.plan.placement, self.link)  # waits for the fetch
        self.link = None
        outs = [self.store.compute(weights[s], x_n, probs_n)
                for s, x_n, probs_n in zip(range(L, L + len(x_parts)), x_parts, probs_parts) if x_n.shape[0]]
        if anchor is not None:
            outs.append(anchor.view(0, H))
        return outs

    def merge(self, y_owner: torch.Tensor) -> torch.Tensor:
        """The slots computed now; owner outputs, then the slots' (and the weight exchange's anchor),
        back to the received (source-major) order: y_Q [Q, H]."""
        slot_outs = self._slot_outputs(y_owner.shape[-1])
        return rows_back([y_owner] + [y.to(y_owner.dtype) for y in slot_outs], self.recv_order)

    def return_tokens(self, y_Q: torch.Tensor) -> torch.Tensor:
        """The reverse all-to-all: y_P [P, H] in this rank's send order."""
        maybe_fault("token_combine", self.rank)
        if self.dedup is not None:  # the entries' unit sums and the same-node pairs' outputs: y_N [N, H]
            return self.dedup.give_back(y_Q)
        so = self.sent
        return self.comm.exchange(y_Q, so.recv_D, so.send_D, self.plan.send_DD.T)

    def combine(self, y_P: torch.Tensor, T: int) -> torch.Tensor:
        """[T, H]: every token's expert outputs summed (across nodes: node by node, so that the
        sum is the same bits with dedup on, y_N from return_tokens, or off, y_P)."""
        if self.units is None:
            return sum_pairs(y_P, self.sent, T)
        y_N = y_P if self.dedup is not None else self.units.rows_from_pairs(y_P)
        return self.units.token_sums(y_N, T)

    # -- checks and metrics -----------------------------------------------------------------------
    def _internode(self, send_DD: np.ndarray, units_DV: Optional[np.ndarray], token_bytes: int, dedup: bool) -> dict:
        """Token bytes crossing nodes in the EP group's dispatch: a row per pair (no dedup) and a
        row per unit (dedup), and what this step sent (dedup: whether it sent units)."""
        if units_DV is None:
            return {"internode_token_bytes_pairs": 0, "internode_token_bytes_dedup": 0, "internode_token_bytes": 0,
                    "dedup": False}
        node = np.arange(self.num_ranks) // self.node_size
        pairs = int(send_DD[node[:, None] != node[None, :]].sum()) * token_bytes
        units = int(units_DV.sum()) * token_bytes
        return {"internode_token_bytes_pairs": pairs, "internode_token_bytes_dedup": units,
                "internode_token_bytes": units if dedup else pairs, "dedup": dedup}

    def _check_plan(self, plan: Plan) -> None:
        """Debug mode: every rank validates its plan and all-reduces its digest, so a plan that is
        invalid or differs on any rank raises on every rank (never a hang or a silent mismatch)."""
        try:
            plan.validate()
            invalid = ""
        except PlanError as err:
            invalid = str(err)
        digest = int(plan.digest()[:15], 16)
        dev = collective_device(self.group)
        lo = torch.tensor([digest, -int(bool(invalid))], dtype=torch.int64, device=dev)  # min of -flag = -max flag
        hi = torch.tensor([digest], dtype=torch.int64, device=dev)
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=self.group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.group)
        if lo[1].item() < 0:
            raise PlanMismatchError(f"EP rank {self.rank}: the plan failed validation on some rank"
                                    + (f" (here: {invalid})" if invalid else " (valid here)"))
        if lo[0].item() != hi[0].item():
            raise PlanMismatchError(f"EP rank {self.rank}: plan digests differ across ranks "
                                    f"(this rank {digest:x}, min {lo[0].item():x}, max {hi[0].item():x}); "
                                    f"token counts or planner state diverged")

    def _record(self, plan: Plan, gather_us: float, plan_us: float, x_TH, opened, fetched: int,
                units_DV: Optional[np.ndarray] = None) -> dict:
        """This step's metric record, a dict kept in self.metrics and returned. The balance before
        and after, the plan's time and the unbalanced-step count are in it at once (Megatron's
        tracker reads them every training forward); traffic, weight bytes, per-rank lists and the
        inter-node figures follow when exchange_tokens has launched the token all-to-all, or when
        self.metrics is read: they are a few dozen small numpy calls (140-180 us per layer step on
        the development VM, docs/benchmarks.md) that the device would otherwise wait for here."""
        self._fill_record()  # a step dispatched without its exchange (a fault, a test) completes now
        # compiled sums (rank_totals): numpy's calls cost tens of microseconds on the cold caches here
        before_D, most, total = rank_totals(self._owner_E, plan.load_E, self.num_ranks)
        after = peak_over_mean(*plan.peak_load(), self.num_ranks)
        # the slot budget could not balance this step: say so once per layer, count it in the metric
        limited = plan.policy != "none" and after > 1 + BALANCE_WARN
        if limited:
            self.unbalanced_steps += 1
            if self.unbalanced_steps == 1 and self.rank == 0:
                warnings.warn(f"megatron-rails: {plan.policy} left max/mean tokens per rank at {after:.3f} "
                              f"(> {1 + BALANCE_WARN}). {_unbalanced_advice(self.policy)} Counted in the "
                              f"metric 'unbalanced_steps'.", RuntimeWarning, stacklevel=3)
        now = {
            "policy": plan.policy,
            "max_over_mean_before": peak_over_mean(most, total, self.num_ranks),
            "max_over_mean_after": after,
            "unbalanced": limited,
            "unbalanced_steps": self.unbalanced_steps,
            "plan_us": plan_us,
            "count_gather_us": gather_us,
        }
        # what rest() needs of this step, taken now (x_TH is not kept alive, self.dedup changes)
        token_bytes = x_TH.element_size() * x_TH.shape[-1]
        expert_bytes = self.store.param_bytes if self.store else 0  # weights move in their own dtype
        dedup_rows_DD = self.dedup.rows_DD if self.dedup is not None else None

        def rest() -> dict:
            send = plan.send_DD
            # what the token exchange really moves: with dedup, stage 1's rows and the fan-out's
            moved_DD = send if dedup_rows_DD is None else dedup_rows_DD + fanout_DD(send, self.node_size)
            off_diag = int(moved_DD.sum() - np.trace(moved_DD))
            return {
                "tokens_per_rank_before": before_D.tolist(),
                "tokens_per_rank_after": plan.load_D.tolist(),
                "replicas_used": int(plan.weight_moves),
                "token_bytes_sent": off_diag * token_bytes,
                # weights move when a window of resident slots opens (once per optimizer step), not per microbatch
                "weight_bytes_sent": plan.placement.move_bytes(expert_bytes, fetched),
                "weight_bytes_if_fetched": plan.weight_bytes(expert_bytes),  # per-microbatch movement would send
                "slots_fetched": bool(opened),
                "slots_added": fetched if opened == GROWN else 0,  # replicas the resident placement grew by
                "resident_slots": int(plan.placement.is_moved_R.sum()),
                "layout": "sharded" if plan.placement.layout == SHARDED else "owner",
                # the token exchange (with dedup: stage 1) goes over RailS's three phases
                "rails_sprayed": self.comm.sprays(send if dedup_rows_DD is None else dedup_rows_DD),
                **self._internode(send, units_DV, token_bytes, dedup_rows_DD is not None),
            }

        self._unfilled = (now, rest)
        self._metrics.append(now)
        return now
