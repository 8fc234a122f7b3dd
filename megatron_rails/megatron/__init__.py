"""The Megatron adapter: the only code that imports `megatron.*`.

    dispatcher.py     RailsTokenDispatcher, Megatron-Core's dispatcher contract over runtime.layer
    install.py        install() / uninstall(): swap the dispatcher into MoELayer (no fork)
    layers.py         rails_moe_layer_class(), rails_gpt_layer_local_spec() for own specs; metrics_summary
    expert_kinds.py   per-expert access to SequentialMLP, GroupedMLP, TEGroupedMLP
    fsep_checkpoint.py  fsep's shards (and their optimizer state) in distributed checkpoints
    compat.py         what differs between Megatron-Core versions; DDP's lazy parameter gathers
    metrics.py        dispatcher metrics into Megatron's MoE tracker
    cpu_shims.py      what Megatron-Core needs to run on CPU (tests, the demo)
    models.py         building blocks the tools use (parallel state, configs, GPT models)
    args.py, launch_hooks.py   Megatron-LM flags and the zero-fork pretrain_gpt.py launcher
"""
from __future__ import annotations

from .args import add_arguments, chain_extra_args, install_from_args  # noqa: F401  (Megatron-LM flags)

# imported on first use: the dispatcher imports Megatron-Core (~7 s of CPU), which the launcher
# need not pay to refuse a bad flag before Megatron-LM's script would import it anyway
_LAZY = {"installed_policy": ".dispatcher", "install": ".install", "is_installed": ".install",
         "uninstall": ".install"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name], __name__), name)
