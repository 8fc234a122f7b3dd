"""megatron-rails: skew-aware expert parallelism for Megatron-Core."""
__version__ = "0.1.0"


def install(cfg):
    """Route every Megatron-Core MoELayer built with moe_token_dispatcher_type="alltoall" through
    RailsTokenDispatcher with the given policy (PolicyConfig, dict or YAML path)."""
    from .megatron import install as _install

    return _install(cfg)


def uninstall():
    """Restore the stock Megatron-Core dispatcher for layers built from now on."""
    from .megatron import uninstall as _uninstall

    _uninstall()


def metrics_summary(model):
    """The latest per-layer metrics of every megatron-rails MoE layer in `model` (a module or a list
    of model chunks): {layer number: the dispatcher's latest record}. See megatron/metrics.py."""
    from .megatron.metrics import metrics_summary as _summary

    return _summary(model)
