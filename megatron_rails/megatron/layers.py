"""Megatron-Core layers and specs with the rails dispatcher, and the per-layer metrics summary.

For users who build their own layer specs instead of `megatron_rails.install()`:
`rails_moe_layer_class()` and `rails_gpt_layer_local_spec()`. `metrics_summary(model)` reads the
latest record of every rails MoE layer.
"""
from __future__ import annotations

import functools

import torch

from ..core.errors import is_integer
from ..core.policy import ConfigError
from .dispatcher import RailsTokenDispatcher
from .metrics import log_in_training_loop


def rails_moe_layer_class():
    """RailsMoELayer: a MoELayer whose dispatcher is always RailsTokenDispatcher (policy from
    `megatron_rails.install()`, else the default), for users who build their own layer specs
    instead of installing globally."""
    from megatron.core.transformer.moe import moe_layer

    log_in_training_loop()  # spec builders run on every rank, MoE stage or not
    global _RailsMoELayer
    if _RailsMoELayer is None:
        class RailsMoELayer(moe_layer.MoELayer):
            def __init__(self, config, *args, **kwargs):
                if config.moe_token_dispatcher_type != "alltoall":
                    raise ValueError("RailsMoELayer needs moe_token_dispatcher_type='alltoall' (got "
                                     f"{config.moe_token_dispatcher_type!r})")
                saved = moe_layer.MoEAlltoAllTokenDispatcher
                moe_layer.MoEAlltoAllTokenDispatcher = RailsTokenDispatcher
                try:
                    super().__init__(config, *args, **kwargs)
                finally:
                    moe_layer.MoEAlltoAllTokenDispatcher = saved
                if not getattr(self.token_dispatcher, "store", None):
                    self.token_dispatcher.attach_experts(self.experts, layer=self)

        _RailsMoELayer = RailsMoELayer
    return _RailsMoELayer


_RailsMoELayer = None


def rails_gpt_layer_local_spec(num_experts: int, **kwargs):
    """Megatron-Core's local GPT layer spec with the MoE MLP replaced by RailsMoELayer
    (`--spec megatron_rails.megatron.layers rails_gpt_layer_local_spec` style use)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    # Megatron-Core's spec gives a dense MLP for num_experts None (or 0): no MoE layer to replace
    if not is_integer(num_experts) or num_experts < 1:
        raise ConfigError(f"rails_gpt_layer_local_spec: num_experts must be a positive integer (the MoE "
                          f"layer's experts), got {num_experts!r}")
    spec = get_gpt_layer_local_spec(num_experts=int(num_experts), **kwargs)
    mlp = spec.submodules.mlp
    cls = rails_moe_layer_class()
    if isinstance(mlp, functools.partial):
        spec.submodules.mlp = functools.partial(cls, *mlp.args, **mlp.keywords)
    else:
        mlp.module = cls
    return spec


def _rails_layers(model):
    chunks = model if isinstance(model, (list, tuple)) else [model]
    bad = [c for c in chunks if not isinstance(c, torch.nn.Module)]
    if bad:  # checked up front: a generator would raise only once iterated, and AttributeError there
        raise TypeError(f"expected a torch.nn.Module or a list of model chunks, got {type(bad[0]).__name__}")
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(getattr(module, "token_dispatcher", None), RailsTokenDispatcher):
                yield module


def metrics_summary(model) -> dict:
    """The latest metric record of every RailsTokenDispatcher layer in `model` (a module or a list
    of model chunks), keyed by the layer's number (1-based, as Megatron numbers layers), or by
    "layer{k}" (its position) where Megatron has not numbered it. Layers without a step yet are
    left out. Each record is the dispatcher's own dict (a copy); see runtime/layer.py `LayerRuntime._record`."""
    out = {}
    for k, layer in enumerate(_rails_layers(model)):
        metrics = layer.token_dispatcher.metrics
        if not metrics:
            continue
        key = layer.layer_number if getattr(layer, "layer_number", None) is not None else f"layer{k}"
        out[key] = dict(metrics[-1])
    return out
