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


def no_sync():
    """Context manager: slot weight gradients accumulate locally inside (every microbatch of an
    optimizer step but the last, like data-parallel no_sync); the first backward outside returns
    them to their owners. Megatron DDP's own no_sync() enters it for you once installed."""
    from .runtime.residency import no_sync as _no_sync

    return _no_sync()


def new_step():
    """Tell megatron-rails the expert weights changed by a path no torch optimizer step covers: the
    next forward fetches the slots afresh."""
    from .runtime.residency import new_step as _new_step

    _new_step()


def metrics_summary(model):
    """The latest per-layer metrics of every megatron-rails MoE layer in `model` (a module or a list
    of model chunks): {layer number: the dispatcher's latest record}. See megatron/layers.py."""
    from .megatron.layers import metrics_summary as _summary

    return _summary(model)


def flush_traces():
    """Rewrite every routing trace this process records (the policy key `trace`) from the rows so
    far, as the launcher does after each checkpoint save."""
    from .megatron.trace_log import flush_all

    flush_all()


def close_traces():
    """Finish every routing trace this process records (also done at interpreter exit); layers built
    afterwards with a `trace` policy start the file anew."""
    from .megatron.trace_log import close_all

    close_all()
