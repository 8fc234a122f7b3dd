"""What the tests need from Megatron-Core that differs between 0.16.x and 0.19.x, beside the adapter's
own (megatron_rails/megatron/compat.py): building TEGroupedMLP specs over other grouped linears, and
reading, clearing and reporting the MoE metric tracker as Megatron-LM's training loop does."""
from __future__ import annotations

import functools

from megatron_rails.megatron.compat import moe_metrics_tracker


def grouped_experts_spec(experts_cls, linear_fc1, linear_fc2):
    """What MoESubmodules.experts takes for a TEGroupedMLP-style module built over the given grouped
    linear classes (any class with Transformer Engine GroupedLinear's constructor and contract)."""
    from megatron.core.transformer.moe import experts as mx

    if hasattr(mx, "GroupedMLPSubmodules"):  # 0.19: builders
        return functools.partial(experts_cls, submodules=mx.GroupedMLPSubmodules(
            linear_fc1=linear_fc1, linear_fc2=linear_fc2))
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=experts_cls, submodules=MLPSubmodules(linear_fc1=linear_fc1, linear_fc2=linear_fc2))


def moe_metric_values(name: str):
    """The tracker's per-layer values [num_layers] for `name`, or None when it holds none."""
    tracker = moe_metrics_tracker()
    if tracker is not None:
        entry = tracker.metrics.get(name)
        return None if entry is None else entry.values
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    entry = get_moe_layer_wise_logging_tracker().get(name)
    return None if entry is None else entry["values"]


def clear_moe_metrics() -> None:
    tracker = moe_metrics_tracker()
    if tracker is not None:
        tracker.clear()
        return
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()


def report_moe_metrics(**kwargs):
    """Megatron-Core's end-of-step MoE report (sync, log to `writer`, clear), either version; keyword
    arguments as in 0.16's track_moe_metrics / 0.19's MoEMetricsTracker.report."""
    tracker = moe_metrics_tracker()
    if tracker is not None:
        return tracker.report(**kwargs)
    from megatron.core.transformer.moe import moe_utils

    return moe_utils.track_moe_metrics(**kwargs)
