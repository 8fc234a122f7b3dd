"""install() / uninstall(): every MoELayer built meanwhile with the alltoall dispatcher type gets a
RailsTokenDispatcher with the installed policy (each dispatcher keeps the policy it was built with).

    import megatron_rails
    megatron_rails.install("configs/policies/default.yaml")   # a path, a preset name, a dict or a PolicyConfig
    ... build models ...
    megatron_rails.uninstall()
"""
from __future__ import annotations

from ..core.policy import PolicyConfig, as_policy
from . import cpu_shims
from .compat import define_te_general_gemm
from .dispatcher import RailsTokenDispatcher, set_installed_policy
from .metrics import log_in_training_loop

_saved: dict = {}


def install(cfg) -> PolicyConfig:
    """From now on MoELayers built with the alltoall dispatcher type use RailsTokenDispatcher with
    this policy (a PolicyConfig, a dict of its keys, a YAML path or a preset name)."""
    pcfg = as_policy(cfg)
    cpu_shims.apply()
    define_te_general_gemm()  # Megatron-Core 0.16 without Transformer Engine: else a NameError in the router
    from megatron.core.transformer.moe import moe_layer

    set_installed_policy(pcfg)
    log_in_training_loop()  # on every rank, so all report the same tracker names
    if not _saved:
        _saved["dispatcher"] = moe_layer.MoEAlltoAllTokenDispatcher
        _saved["init"] = init = moe_layer.MoELayer.__init__

        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            if isinstance(self.token_dispatcher, RailsTokenDispatcher):
                self.token_dispatcher.attach_experts(self.experts, layer=self)

        moe_layer.MoEAlltoAllTokenDispatcher = RailsTokenDispatcher
        moe_layer.MoELayer.__init__ = __init__
    return pcfg


def uninstall() -> None:
    """Restore stock Megatron-Core (layers already built keep their dispatcher and policy)."""
    set_installed_policy(None)
    if not _saved:
        return
    from megatron.core.transformer.moe import moe_layer

    moe_layer.MoEAlltoAllTokenDispatcher = _saved.pop("dispatcher")
    moe_layer.MoELayer.__init__ = _saved.pop("init")
    # the CPU shims stay: layers built meanwhile (stock ones included) still need them on CPU


def is_installed() -> bool:
    return bool(_saved)
