"""megatron-rails: skew-aware expert parallelism for Megatron-Core.

Layers, each importing only the ones below it (docs/architecture.md):
    core/       plan model, route, planners, oracle, workloads, policy and topology (numpy only)
    runtime/    local token work, expert stores, exchanges, the per-layer driver (torch only)
    megatron/   the Megatron adapter: the only code that imports megatron.*
    config/, sim/, bench/, demo/, reliability/, cli/, launch.py, pretrain.py   the tools
"""
__version__ = "0.1.0"


def install(cfg):
    """Route every Megatron-Core MoELayer built with moe_token_dispatcher_type="alltoall" through
    RailsTokenDispatcher with the given policy (PolicyConfig, dict, YAML path or preset name)."""
    from .megatron.install import install as _install

    return _install(cfg)


def uninstall():
    """Restore the stock Megatron-Core dispatcher for layers built from now on."""
    from .megatron.install import uninstall as _uninstall

    _uninstall()


def metrics_summary(model):
    """The latest per-layer metrics of every megatron-rails MoE layer in `model` (a module or a list
    of model chunks): {layer number: the dispatcher's latest record}. See megatron/layers.py."""
    from .megatron.layers import metrics_summary as _summary

    return _summary(model)
