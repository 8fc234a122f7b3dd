"""The only place that knows Megatron-Core: install/uninstall of the dispatcher, CPU shims.

    import megatron_rails
    megatron_rails.install("configs/policies/default.yaml")   # or a PolicyConfig
    ... build models: every MoELayer with moe_token_dispatcher_type="alltoall" now balances ...
    megatron_rails.uninstall()
"""
from __future__ import annotations

from pathlib import Path

from ..config import PolicyConfig
from . import cpu_shims
from .args import add_arguments, chain_extra_args, install_from_args  # noqa: F401  (Megatron-LM flags)

_saved: dict = {}


def _as_config(cfg) -> PolicyConfig:
    if isinstance(cfg, PolicyConfig):
        return cfg
    if isinstance(cfg, dict):
        return PolicyConfig.from_dict(cfg)
    if isinstance(cfg, (str, Path)):
        return PolicyConfig.from_yaml(cfg)
    raise TypeError(f"install() takes a PolicyConfig, a dict or a YAML path, got {type(cfg).__name__}")


def install(cfg) -> PolicyConfig:
    """From now on MoELayers built with the alltoall dispatcher type use RailsTokenDispatcher."""
    pcfg = _as_config(cfg)
    cpu_shims.apply()
    from megatron.core.transformer.moe import moe_layer

    from ..dispatcher import RailsTokenDispatcher

    from .metrics import log_in_training_loop

    RailsTokenDispatcher.policy_config = pcfg
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
    """Restore stock Megatron-Core (layers already built keep their dispatcher)."""
    if not _saved:
        return
    from megatron.core.transformer.moe import moe_layer

    moe_layer.MoEAlltoAllTokenDispatcher = _saved.pop("dispatcher")
    moe_layer.MoELayer.__init__ = _saved.pop("init")
    # the CPU shims stay: layers built meanwhile (stock ones included) still need them on CPU


def is_installed() -> bool:
    return bool(_saved)
