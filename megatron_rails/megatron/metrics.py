"""Dispatcher metrics in Megatron's MoE logging, and a summary for callers without it.

Every layer step the dispatcher keeps a record (runtime/layer.py `LayerRuntime._record`). In training forward passes
(module in training mode, autograd on) three of its values also go to Megatron-Core's MoE metric
tracker under the layer's number, next to the router's load_balancing_loss:

| tracker name                  | record key             | meaning                                            |
|-------------------------------|------------------------|----------------------------------------------------|
| `rails_max_over_mean_before`  | `max_over_mean_before` | max/mean tokens per EP rank under stock placement  |
| `rails_max_over_mean_after`   | `max_over_mean_after`  | the same under the plan                            |
| `rails_plan_us`               | `plan_us`              | planner time on this rank, microseconds            |

Megatron's report sums microbatches and scales by 1/num_microbatches (a mean per step), sums
pipeline stages, averages data-parallel ranks, then logs the mean over MoE layers (per layer with
--moe-per-layer-logging) to the console line, TensorBoard and W&B. `install()` makes Megatron-LM's
training log include these names (compat.add_to_moe_report).
"""
from __future__ import annotations

import weakref

import torch

from ..runtime.staging import values_on
from . import compat

TRACKED = {
    "rails_max_over_mean_before": "max_over_mean_before",
    "rails_max_over_mean_after": "max_over_mean_after",
    "rails_plan_us": "plan_us",
}


def log_in_training_loop() -> None:
    """Have Megatron-LM's training log report the TRACKED names (every rank; idempotent)."""
    compat.add_to_moe_report(list(TRACKED))


def layer_ref(layer):
    """A weak reference to a MoELayer (the dispatcher must not keep its layer alive)."""
    return weakref.ref(layer) if layer is not None else None


def record_step(layer, record: dict, device) -> bool:
    """Put one layer step's TRACKED values into Megatron's tracker. Skipped (False) without a layer,
    before Megatron numbered it (`set_layer_number`) and in eval mode. A training forward without
    autograd counts: under activation recompute the first forward runs so (the router records its
    aux losses in the replay instead, which the runtime does not record: it repeats the plan)."""
    if layer is None or getattr(layer, "layer_number", None) is None:
        return False
    if not layer.training:
        return False
    cfg = layer.config
    num_layers = cfg.num_layers + (getattr(cfg, "mtp_num_layers", None) or 0)  # the router's convention
    # one non-blocking copy (pinned on CUDA): a tensor made on the device from a list would copy
    # from pageable memory, which waits for the kernels queued before it, right before the exchange
    values = values_on([float(record[key]) for key in TRACKED.values()], torch.float32, device)
    for name, value in zip(TRACKED, values):
        compat.record_moe_metric(name, value, layer.layer_number, num_layers)
    return True
