"""Megatron-Core version differences, in one place.

* 0.16.x: `get_moe_module_spec` returns a ModuleSpec (`.submodules` for MoELayer);
* 0.19.x: it returns `functools.partial(MoELayer, submodules=...)`.
* expert modules: 0.16.x has SequentialMLP, GroupedMLP (legacy grouped_gemm) and TEGroupedMLP (built
  from MLPSubmodules through ModuleSpec); 0.19.x dropped GroupedMLP and builds TEGroupedMLP from
  GroupedMLPSubmodules through a partial (expert_kinds.py has the per-kind weight access);
* MoE metric tracker: 0.16.x keeps a dict behind `moe_utils.save_to_aux_losses_tracker` /
  `get_moe_layer_wise_logging_tracker` and logs through `moe_utils.track_moe_metrics`; 0.19.x has
  `moe_logging.get_moe_metrics_tracker()` with `.record()` / `.report()` (the old names are
  deprecated wrappers). Both average over data-parallel ranks only on request (0.16: `avg_group`,
  0.19: `needs_dp_avg`).
* lazy parameter all-gather (DDP with the distributed optimizer and overlap_param_gather): in both,
  `DistributedDataParallel._make_forward_pre_hook` makes the per-module pre-hook that waits for the
  module's own parameters (`wait_param_gather`).
* `moe_utils.permute` returns (tokens, probs, sorted_indices) in 0.16.x and adds pad offsets and
  padded tokens per expert in 0.19.x (`stock_permute`).
* 0.16.x's router GEMM tests `moe_utils.te_general_gemm is not None`, but without Transformer Engine
  the name is never defined: the first MoE forward raises NameError (`define_te_general_gemm`).
* CUDA graph regions: `cuda_graph_scope` in 0.16.x, `cuda_graph_modules` in 0.19.x (which also has
  `cuda_graph_impl="full_iteration"`, and `inference_cuda_graph_scope`, whose `block` captures whole
  decoder blocks in inference); an empty list is the whole layer (`cuda_graphs_capture_dispatch`).
"""
from __future__ import annotations

import functools
import inspect
import sys

from megatron.core import __version__ as MCORE_VERSION  # noqa: F401  (re-exported for reports)


def define_te_general_gemm() -> bool:
    """Define `moe_utils.te_general_gemm = None` where Megatron-Core left it undefined (0.16.x
    without Transformer Engine: its import fallback skips the name its router GEMM then tests), so
    the router takes its torch GEMM, as that test intends. Returns whether the name was missing."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True


def stock_permute(tokens, routing_map, probs, num_out_tokens: int):
    """Megatron-Core's own (unfused) permutation: (permuted tokens, permuted probs, sorted indices)."""
    from megatron.core.transformer.moe.moe_utils import permute

    out = permute(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens)
    return out[0], out[1], out[2]


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


# -- MoE metric tracker ---------------------------------------------------------------------------

def moe_metrics_tracker():
    """0.19's MoE metrics tracker, or None (0.16: the dict behind moe_utils' functions)."""
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:  # 0.16
        return None
    return get_moe_metrics_tracker()


def _data_parallel_group():
    from megatron.core import parallel_state

    try:
        return parallel_state.get_data_parallel_group(with_context_parallel=False, partial_data_parallel=False)
    except (AssertionError, RuntimeError):  # parallel_state not initialized (own process groups)
        return None


def record_moe_metric(name: str, value, layer_number: int, num_layers: int) -> None:
    """Add `value` (a scalar tensor) to Megatron-Core's MoE tracker for `layer_number` (1-based);
    the report sums pipeline stages, averages data-parallel ranks and scales by 1/microbatches."""
    tracker = moe_metrics_tracker()
    if tracker is not None:
        tracker.record(name, value, layer_number=layer_number, num_layers=num_layers, needs_dp_avg=True)
        return
    from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker

    save_to_aux_losses_tracker(name, value, layer_number, num_layers, avg_group=_data_parallel_group())


_REPORT_EXTRA: list[str] = []


def _with_extra_names(fn):
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        names = bound.arguments.get("track_names")
        if names is not None:  # None reports every entry already
            names = [names] if isinstance(names, str) else list(names)
            bound.arguments["track_names"] = names + [n for n in _REPORT_EXTRA if n not in names]
        return fn(*bound.args, **bound.kwargs)

    wrapper.__rails_extra_names__ = True
    return wrapper


def add_to_moe_report(names) -> None:
    """Make Megatron-LM's training log report `names` too. Its `training_log` asks the tracker for an
    explicit list (load_balancing_loss, z_loss, ...): other entries are cleared unreported. We add
    ours to every explicit list, process-wide and for good; with force_initialize (Megatron-LM passes
    it) pipeline stages without such a layer create zero entries, so every rank reduces the same
    names. Every rank must therefore call this (install() does)."""
    _REPORT_EXTRA.extend(n for n in names if n not in _REPORT_EXTRA)
    try:
        from megatron.core.transformer.moe.moe_logging import MoEMetricsTracker
    except ImportError:  # 0.16: training.py imports track_moe_metrics by name
        MoEMetricsTracker = None
    if MoEMetricsTracker is not None:
        if not getattr(MoEMetricsTracker.report, "__rails_extra_names__", False):
            MoEMetricsTracker.report = _with_extra_names(MoEMetricsTracker.report)
        return
    from megatron.core.transformer.moe import moe_utils

    original = moe_utils.track_moe_metrics
    if getattr(original, "__rails_extra_names__", False):
        return
    wrapped = _with_extra_names(original)
    moe_utils.track_moe_metrics = wrapped
    for module in list(sys.modules.values()):  # modules that imported the name already
        if getattr(module, "__name__", "").startswith("megatron.") and \
                getattr(module, "track_moe_metrics", None) is original:
            module.track_moe_metrics = wrapped


_DDP_PARAM_HOOK = "DistributedDataParallel._make_forward_pre_hook.<locals>."


def wait_param_gather(module) -> None:
    """Complete Megatron DDP's pending parameter all-gathers for every parameter under `module`.

    With the distributed optimizer and overlap_param_gather, updated parameters are all-gathered
    lazily: a forward pre-hook on each submodule waits for that module's own parameters just before
    it runs. The expert stores read expert weights in the dispatcher, before the experts' forward,
    so they run those hooks first. Only DDP's hooks are run (they are idempotent: a bucket already
    gathered is a no-op); any other pre-hook waits for the module's real forward."""
    for m in module.modules():
        hooks = m._forward_pre_hooks
        if hooks:
            for hook in list(hooks.values()):
                if getattr(hook, "__qualname__", "").startswith(_DDP_PARAM_HOOK):
                    hook(m, ())


def cuda_graphs_capture_dispatch(config) -> str | None:
    """The CUDA graph setting, as a user names it, under which Megatron would capture the token
    dispatcher's steps (the whole layer, the MoE layer, its preprocessing, the whole iteration, or
    in inference whole blocks); None when CUDA graphs are off or capture other regions only."""
    impl = str(getattr(config, "cuda_graph_impl", "none") or "none")
    if impl == "none":
        return None
    if impl == "full_iteration":
        return "cuda_graph_impl=full_iteration"
    inference = getattr(config, "inference_cuda_graph_scope", None)  # 0.19: an enum, None when unset
    if str(getattr(inference, "name", inference)) == "block":  # inference graphs over whole blocks
        return f"cuda_graph_impl={impl} with inference_cuda_graph_scope=block"
    regions = getattr(config, "cuda_graph_modules", None)
    if regions is None:
        regions = getattr(config, "cuda_graph_scope", None)
    if not isinstance(regions, (list, tuple)):  # one region named alone; None, "" or "full": the layer
        regions = [] if regions in (None, "", "full") else [regions]
    names = [str(getattr(r, "name", r)) for r in regions]
    if not names or "full" in names:
        return f"cuda_graph_impl={impl} over whole layers"
    caught = [n for n in names if n in ("moe", "moe_preprocess", "full_iteration")]
    return f"cuda_graph_impl={impl} with cuda_graph_scope {caught}" if caught else None
