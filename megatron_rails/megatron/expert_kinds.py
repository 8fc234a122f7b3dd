"""Per-expert access to Megatron-Core's expert modules: one adapter per module kind.

The expert stores (runtime/experts.py, runtime/sharded.py) move single experts around as flat vectors
and compute replica / FSEP slots with borrowed weights; what an "expert" is inside each Megatron-Core
module lives here:

| kind            | module (megatron-core)                      | expert i's tensors                              |
|-----------------|---------------------------------------------|-------------------------------------------------|
| `sequential`    | SequentialMLP (0.16, 0.19)                  | `local_experts.{i}.*` (an MLP)                  |
| `grouped`       | GroupedMLP, legacy grouped_gemm (0.16 only) | `weight1.view(E_l, H, -1)[i]`, `weight2.view(E_l, -1, H)[i]` |
| `te_grouped`    | TEGroupedMLP (0.16, 0.19; TE GroupedLinear) | `linear_fc{1,2}.weight{i}` [out, in], `.bias{i}` |

Each adapter gives `slices(i)`: (stock parameter name, view function) pairs whose views of the
stock parameters are expert i's tensors, in a fixed order; applied to a parameter they give
differentiable views (replica weights), applied to a same-shaped buffer (a gradient, a checkpoint
tensor) they give expert i's part of it. `compute(params, x_NH, probs_N)` is the stock module's math
for one expert on its tokens, with probs applied where the stock module applies them.

Legend: N tokens of one slot, H hidden size, F expert ffn size (F2 = 2F with GLU), E_l local experts.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..runtime.expert_kind import ExpertKind as _KindInterface
from ..runtime.expert_kind import UnsupportedExperts

SUPPORTED = ("SequentialMLP", "GroupedMLP (legacy grouped_gemm; in 0.16, gone by 0.19)",
             "TEGroupedMLP (per-expert weight{i} GroupedLinear)")


def _unsupported(module, why: str) -> UnsupportedExperts:
    return UnsupportedExperts(f"megatron-rails cannot move experts of {type(module).__name__}: {why}. "
                              f"Supported: {'; '.join(SUPPORTED)}, with expert tensor parallel size 1 "
                              "and without fp8/fp4")


def _probs_on_input(config, x_NH, probs_N):
    """Megatron applies the router probs to the expert input instead when moe_apply_probs_on_input."""
    if getattr(config, "moe_apply_probs_on_input", False):
        x_NH = (probs_N.unsqueeze(-1) * x_NH).to(x_NH.dtype)
        probs_N = torch.ones_like(probs_N)
    return x_NH, probs_N


class ExpertKind(_KindInterface):
    """Base of the Megatron-Core adapters (runtime/expert_kind.py has the interface): the module,
    its TransformerConfig, and the refusals every kind shares."""

    def __init__(self, module: torch.nn.Module, config):
        self.module, self.config = module, config
        self.num_local = int(module.num_local_experts)
        if getattr(config, "fp8", None) or getattr(config, "fp4", None):
            raise _unsupported(module, "fp8/fp4 experts (replica slots compute in the parameter dtype)")

    def unsupported(self, why: str) -> UnsupportedExperts:
        return _unsupported(self.module, why)


class SequentialKind(ExpertKind):
    """SequentialMLP: `local_experts` of identical MLP modules; the stock MLP code runs on the slot."""

    name = "sequential"

    def __init__(self, module, config):
        super().__init__(module, config)
        if getattr(config, "delay_wgrad_compute", False):
            # the deferred weight gradients are computed later by each stock expert's own linears
            # (SequentialMLP.backward_dw), from what they saved last: a slot's would go astray
            raise _unsupported(module, "delay_wgrad_compute (slots compute on a stock expert's module "
                                       "with borrowed weights; its deferred weight gradients would miss them)")
        self.local = module.local_experts
        self.slot_names = tuple(n for n, _ in self.local[0].named_parameters())
        # where each of the template expert's parameters is registered: (submodule, attribute name)
        self._homes = [(self.local[0].get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2])
                       for n in self.slot_names]
        # Megatron's linears (gradient_accumulation_fusion) and Transformer Engine's
        # (fuse_wgrad_accumulation) then write weight gradients into weight.main_grad
        self.fused_wgrad = any(getattr(m, "gradient_accumulation_fusion", False)
                               or getattr(m, "fuse_wgrad_accumulation", False) for m in self.local[0].modules())

    def slices(self, i):
        return [(f"local_experts.{i}.{n}", _identity) for n in self.slot_names]

    def compute(self, params, x_NH, probs_N):
        x_NH, probs_N = _probs_on_input(self.config, x_NH, probs_N)
        with self._borrowed(params):
            out, bias = self.local[0](x_NH, probs_N)
        if bias is not None:
            out = out + bias
        return out

    @contextlib.contextmanager
    def _borrowed(self, params):
        """Expert 0's module computing with `params` in place of its own parameters. The same as
        torch.func.functional_call for a module whose parameters are all replaced (no buffers, no
        tied weights to find), at a few microseconds where that took ~90 per call (bench step:
        every slot, every microbatch)."""
        held = [home._parameters[name] for home, name in self._homes]
        try:
            for (home, name), key in zip(self._homes, self.slot_names):
                home._parameters[name] = params[key]
            yield
        finally:
            for (home, name), p in zip(self._homes, held):
                home._parameters[name] = p


class GroupedKind(ExpertKind):
    """Legacy GroupedMLP (grouped_gemm): weight1 [H, E_l*F2] is laid out as [E_l, H, F2] and weight2
    [E_l*F, H] as [E_l, F, H] (the views its forward takes); no biases. The slot runs the same
    grouped GEMM with one group and the module's own activation-with-probs function."""

    name = "grouped"
    slot_names = ("weight1", "weight2")

    def __init__(self, module, config):
        super().__init__(module, config)
        self.H = config.hidden_size

    def slices(self, i):
        E, H = self.num_local, self.H
        return [("weight1", lambda t: t.view(E, H, -1)[i]), ("weight2", lambda t: t.view(E, -1, H)[i])]

    def compute(self, params, x_NH, probs_N):
        from megatron.core.transformer.moe import grouped_gemm_util as gg

        x_NH, probs_N = _probs_on_input(self.config, x_NH, probs_N)
        sizes = torch.tensor([x_NH.shape[0]], dtype=torch.int64)  # grouped_gemm wants CPU int64
        fc1 = gg.ops.gmm(x_NH, params["weight1"].unsqueeze(0), sizes, trans_b=False)
        h = self.module.activation_func_with_probs(fc1, probs_N.unsqueeze(-1))
        return gg.ops.gmm(h, params["weight2"].unsqueeze(0), sizes, trans_b=False)


class TEGroupedKind(ExpertKind):
    """TEGroupedMLP over Transformer Engine's GroupedLinear with one parameter per GEMM
    (`weight{i}` [out, in], `bias{i}` [out]). fc1 adds its bias in the GEMM; fc2 skips it and the
    module adds bias * prob afterwards; the activation mirrors TEGroupedMLP.forward's bias_act_func."""

    name = "te_grouped"

    def __init__(self, module, config):
        super().__init__(module, config)
        for lin in (module.linear_fc1, module.linear_fc2):
            if getattr(lin, "single_grouped_weight", False) or getattr(lin, "single_grouped_bias", False):
                raise _unsupported(module, "GroupedLinear with one grouped weight tensor "
                                   "(moe_single_grouped_weight / moe_single_grouped_bias)")
            if not isinstance(getattr(lin, "weight0", None), torch.Tensor):
                raise _unsupported(module, f"{type(lin).__name__} has no per-expert parameter weight0")
        self.bias = isinstance(getattr(module.linear_fc1, "bias0", None), torch.Tensor)
        self.slot_names = ("fc1_weight", "fc2_weight") + (("fc1_bias", "fc2_bias") if self.bias else ())

    def slices(self, i):
        names = [f"linear_fc1.weight{i}", f"linear_fc2.weight{i}"]
        if self.bias:
            names += [f"linear_fc1.bias{i}", f"linear_fc2.bias{i}"]
        return [(n, _identity) for n in names]

    def compute(self, params, x_NH, probs_N):
        probs = probs_N.unsqueeze(-1)
        x_NH, probs = _probs_on_input(self.config, x_NH, probs)
        fc1 = F.linear(x_NH, params["fc1_weight"], params.get("fc1_bias"))
        h = self._bias_act(fc1, probs)
        out = F.linear(h, params["fc2_weight"])
        if "fc2_bias" in params:  # TEGroupedMLP._apply_bias: + bias * prob, in the output dtype
            out = (out + params["fc2_bias"] * probs).to(out.dtype)
        return out

    def _bias_act(self, h, probs):
        """TEGroupedMLP.forward's bias_act_func for one expert (fc1's bias already added)."""
        from megatron.core.transformer.moe import experts as mx

        cfg, mod = self.config, self.module
        interleave = getattr(cfg, "moe_mlp_glu_interleave_size", None) if cfg.gated_linear_unit else None

        def deinterleave(x):
            return mod._remove_glu_interleaving(x, interleave) if interleave is not None else x

        if getattr(cfg, "use_te_activation_func", False):
            a = mod.activation_func(deinterleave(h))
            return (a * probs).to(a.dtype)
        if cfg.bias_activation_fusion and interleave is None:
            if mod.activation_func == F.silu and cfg.gated_linear_unit:
                return mx.weighted_bias_swiglu_impl(h, None, probs, cfg.activation_func_fp8_input_store)
            if mod.activation_func == mx.quick_gelu and cfg.gated_linear_unit:
                return mx.weighted_bias_quick_geglu_impl(h, None, probs, cfg.activation_func_fp8_input_store,
                                                         cfg.glu_linear_offset, cfg.activation_func_clamp_value)
            raise ValueError("Only support fusion of swiglu and quick_gelu in TEGroupedMLP.")
        if mod.activation_func == mx.squared_relu and getattr(cfg, "use_fused_weighted_squared_relu", False):
            return mx.weighted_squared_relu_impl(h, probs)
        if cfg.gated_linear_unit:
            x_glu, x_linear = torch.chunk(deinterleave(h), 2, dim=-1)
            clamp = getattr(cfg, "activation_func_clamp_value", None)
            if clamp is not None:
                x_glu = x_glu.clamp(min=None, max=clamp)
                x_linear = x_linear.clamp(min=-clamp, max=clamp)
            out = cfg.activation_func(x_glu) * (x_linear + getattr(cfg, "glu_linear_offset", 0.0))
        else:
            out = mod.activation_func(h)
        return (out * probs).to(out.dtype)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _classes() -> list[tuple[str, type]]:
    """(kind name, Megatron-Core class) for the classes this Megatron-Core version has."""
    from megatron.core.transformer.moe import experts as mx

    found = []
    for kind, cls_name in (("te_grouped", "TEGroupedMLP"), ("grouped", "GroupedMLP"), ("sequential", "SequentialMLP")):
        cls = getattr(mx, cls_name, None)
        if cls is not None:
            found.append((kind, cls))
    return found


KINDS = {"sequential": SequentialKind, "grouped": GroupedKind, "te_grouped": TEGroupedKind}


def expert_kind(module: torch.nn.Module, config=None) -> ExpertKind:
    """The adapter for a MoELayer's `experts` module; UnsupportedExperts (a TypeError) for others."""
    config = config if config is not None else getattr(module, "config", None)
    for kind, cls in _classes():
        if isinstance(module, cls):
            adapter = KINDS[kind](module, config)
            adapter.check_coverage()
            return adapter
    raise _unsupported(module, "unknown expert module class")
