"""Megatron-Core version differences, in one place.

* 0.16.x: `get_moe_module_spec` returns a ModuleSpec (`.submodules` for MoELayer);
* 0.19.x: it returns `functools.partial(MoELayer, submodules=...)`.
"""
from __future__ import annotations

import functools

from megatron.core import __version__ as MCORE_VERSION  # noqa: F401  (re-exported for reports)


def moe_submodules(num_experts: int, grouped_gemm: bool = False, use_te: bool = False):
    """The MoESubmodules of Megatron-Core's MoE spec, for either spec shape."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    spec = get_moe_module_spec(use_te=use_te, num_experts=num_experts, moe_grouped_gemm=grouped_gemm)
    if isinstance(spec, functools.partial):
        return spec.keywords["submodules"]
    return spec.submodules


def build_moe_layer(config, grouped_gemm: bool = False, use_te: bool = False):
    """A stock MoELayer for `config` (whatever dispatcher type the config names)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return MoELayer(config, moe_submodules(config.num_moe_experts, grouped_gemm, use_te))


def rails_moe_layer_class():
    """RailsMoELayer: a MoELayer whose dispatcher is always RailsTokenDispatcher (policy from
    `megatron_rails.install()` or `RailsTokenDispatcher.policy_config`), for users who build their
    own layer specs instead of installing globally."""
    from megatron.core.transformer.moe import moe_layer

    from ..dispatcher import RailsTokenDispatcher

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
                    self.token_dispatcher.attach_experts(self.experts)

        _RailsMoELayer = RailsMoELayer
    return _RailsMoELayer


_RailsMoELayer = None


def rails_gpt_layer_local_spec(num_experts: int, **kwargs):
    """Megatron-Core's local GPT layer spec with the MoE MLP replaced by RailsMoELayer
    (`--spec megatron_rails.megatron.compat rails_gpt_layer_local_spec` style use)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=num_experts, **kwargs)
    mlp = spec.submodules.mlp
    cls = rails_moe_layer_class()
    if isinstance(mlp, functools.partial):
        spec.submodules.mlp = functools.partial(cls, *mlp.args, **mlp.keywords)
    else:
        mlp.module = cls
    return spec
