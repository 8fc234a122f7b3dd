"""RailsTokenDispatcher: Megatron-Core's token dispatcher contract over the framework-free runtime.

A thin shim: each of `MoETokenDispatcher`'s six steps calls one step of `runtime.layer.LayerRuntime`
(which plans, orders, exchanges and computes the borrowed slots); what is Megatron's lives here: the
process groups and config it is built with, the experts module it takes over (through the adapters
of expert_kinds.py), DDP's pending parameter all-gathers, and the metric tracker.

Each dispatcher holds its own policy, fixed when it is built: the `policy` argument, else the one
`megatron_rails.install()` set (`installed_policy()`), else the product default `PolicyConfig()`.

Shape letters (docs/architecture.md): T local tokens (sequence x batch), E experts, P pairs sent, Q pairs
received, H hidden size.
"""
from __future__ import annotations

import warnings
from typing import Optional

import numpy as np
import torch
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from ..core.policy import PolicyConfig
from ..runtime.layer import LayerRuntime, PlanMismatchError  # noqa: F401  (PlanMismatchError: part of the API)
from . import metrics as rails_metrics
from .compat import wait_param_gather
from .expert_kinds import expert_kind
from .fsep_checkpoint import wrap_sharded_state_dict
from .grad_sync import hook_ddp
from .settings import unsupported

_installed: Optional[PolicyConfig] = None  # set by megatron_rails.install(), for dispatchers built meanwhile


def set_installed_policy(policy: Optional[PolicyConfig]) -> None:
    global _installed
    _installed = policy


def installed_policy() -> PolicyConfig:
    """The policy a RailsTokenDispatcher built now without one takes."""
    return _installed if _installed is not None else PolicyConfig()


class RailsTokenDispatcher(MoETokenDispatcher):
    def __init__(self, num_local_experts: int, local_expert_indices, config, pg_collection=None,
                 policy: Optional[PolicyConfig] = None):
        super().__init__(config=config, pg_collection=pg_collection)
        if self.tp_size > 1:
            raise NotImplementedError("megatron-rails supports expert tensor parallel size 1")
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.num_experts = config.num_moe_experts
        self.pcfg = policy if policy is not None else installed_policy()
        why = unsupported(config, self.pcfg)
        if why:
            raise NotImplementedError(why)
        if self.pcfg.policy != "none" and getattr(config, "moe_pad_expert_input_to_capacity", False):
            warnings.warn(f"megatron-rails: moe_pad_expert_input_to_capacity gives every expert exactly its "
                          f"capacity, so there is nothing for policy {self.pcfg.policy} to balance and it only "
                          f"adds its cost (the padding rows are sent and computed as stock does); use policy "
                          f"none, or drop the padding", RuntimeWarning, stacklevel=2)
        self.runtime = LayerRuntime(self.pcfg, self.ep_group, self.num_experts)
        if self.pcfg.trace:  # this layer's counts into the policy's routing trace (writer ranks only)
            from .trace_log import recorder_for

            recorder_for(self.pcfg.trace, self)
        hook_ddp()  # slot gradients follow DDP's gradient sync (grad_sync.py)
        self.ep_rank = self.runtime.rank
        self._layer = None  # weak reference to the MoELayer (attach_experts), for Megatron's metric tracker

    @property
    def metrics(self):
        """The latest layer steps' metric records (a deque of dicts; see LayerRuntime._record)."""
        return self.runtime.metrics

    @property
    def store(self):
        return self.runtime.store

    @property
    def plan(self):
        return self.runtime.plan

    @property
    def planner(self):
        return self.runtime.planner

    def attach_experts(self, experts: torch.nn.Module, layer: torch.nn.Module | None = None) -> None:
        """Take over the layer's experts (any kind expert_kinds.py supports); `layer`, the MoELayer,
        gives the layer number for Megatron's metric tracker (held by weak reference)."""
        self._layer = rails_metrics.layer_ref(layer)
        _unmark_sequence_parallel(experts, self.config)
        # DDP's lazy parameter all-gathers finish before the stores read expert weights
        self.runtime.attach(expert_kind(experts), before_read=wait_param_gather)
        if self.runtime.policy.sharded:
            _skip_empty_stock_experts(experts)
            wrap_sharded_state_dict(self.runtime.store)  # checkpoints in the stock layout

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """hidden_states [sequence, batch, H]; routing_map bool [T, E]; probs float [T, E] -> pairs in send order."""
        self.hidden_shape = hidden_states.shape
        if self.shared_experts is not None:  # --moe-shared-expert-overlap: they start on their stream
            self.shared_experts.pre_forward_comm(hidden_states)
        x_TH = hidden_states.reshape(-1, self.hidden_shape[-1])
        layer = self._layer() if self._layer else None
        # a training forward pins the step's resident slots (reentrant recompute runs it without grad)
        training = layer.training if layer is not None else None
        x_PH, probs_P, record = self.runtime.dispatch(x_TH, routing_map, probs, training=training)
        if record is not None:
            rails_metrics.record_step(layer, record, x_TH.device)
        return x_PH, probs_P

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        self._shared_experts_wait()
        x_Q, probs_Q = self.runtime.exchange_tokens(hidden_states, probs)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(x_Q)
        return x_Q, probs_Q

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        x_owner, per_owner_slot, probs_owner = self.runtime.split_received(hidden_states, probs)
        # the stock experts compute the owner slots (none under the sharded layout)
        tokens_per_expert = torch.zeros(self.num_local_experts, dtype=torch.int64)
        tokens_per_expert[:per_owner_slot.size] = torch.from_numpy(np.ascontiguousarray(per_owner_slot))
        return x_owner, tokens_per_expert, probs_owner

    def combine_preprocess(self, hidden_states: torch.Tensor):
        return self.runtime.merge(hidden_states)

    def token_combine(self, hidden_states: torch.Tensor):
        self._shared_experts_wait()
        y_P = self.runtime.return_tokens(hidden_states)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(y_P)
            self.shared_experts.post_forward_comm()
        return y_P

    def combine_postprocess(self, hidden_states: torch.Tensor):
        T = int(np.prod(self.hidden_shape[:-1]))
        out = self.runtime.combine(hidden_states, T).view(self.hidden_shape)
        if self.shared_experts is not None:  # joins the current stream
            out = out + self.shared_experts.get_output()
        return out

    def _shared_experts_wait(self) -> None:
        """Where Megatron-Core's alltoall dispatcher orders the shared experts' stream behind the
        current one before an all-to-all (0.19; 0.16 has no such call): the same here."""
        wait = getattr(self.shared_experts, "wait_current_stream", None)
        if wait is not None:
            wait()


def _unmark_sequence_parallel(experts: torch.nn.Module, config) -> None:
    """Under tensor parallelism with sequence parallelism Megatron-Core marks a RowParallelLinear's
    bias `sequence_parallel`, expert ones included, and finalize_model_grads sums such gradients
    over the tensor-parallel group: right for a bias every TP rank holds whole (each saw part of the
    tokens), wrong for experts that are not tensor-parallel (expert TP 1, which this dispatcher
    requires): the ranks of a TP group then hold different experts (or replicas DDP reduces over
    the expert-data-parallel group anyway), so the sum mixes other experts' bias gradients into
    each one's. Seen in megatron-core 0.16.1 and 0.19.2 with the stock dispatchers alike."""
    if getattr(config, "sequence_parallel", False) and config.tensor_model_parallel_size > 1:
        for param in experts.parameters():
            if getattr(param, "sequence_parallel", False):
                param.sequence_parallel = False


def _skip_empty_stock_experts(experts: torch.nn.Module) -> None:
    """Under the sharded layout every slot is computed by the runtime and the stock experts get no
    rows; their parameters are placeholders that do not train. Megatron's expert modules would still
    run each local expert on zero rows, forward and backward (tens of small autograd ops per layer
    and microbatch): skip them. Empty input -> the empty output (a view of it, so autograd still
    reaches the input) and no bias (the alltoall MoELayer asserts none)."""
    stock_forward = experts.forward

    def forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs, *args, **kwargs):
        if permuted_local_hidden_states.shape[0] == 0:
            return permuted_local_hidden_states[:0], None
        return stock_forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs, *args, **kwargs)

    experts.forward = forward
