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
