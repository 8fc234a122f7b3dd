"""CPU stand-ins that let the grouped expert modules of Megatron-Core run in the gloo tests.

* `install_fake_grouped_gemm()`: a reference `grouped_gemm.ops.gmm` (a loop of matmuls over the
  batch sizes, differentiable) registered as the `grouped_gemm` package, so a real legacy GroupedMLP
  can be built and run. Megatron-Core's `moe/grouped_gemm_util` does `import grouped_gemm` once at
  import time, so this must run before megatron is imported (and it patches that module too if it
  was imported already).
* `CpuGroupedLinear`: the parameter layout and forward contract of Transformer Engine's GroupedLinear
  as Megatron-Core's TEGroupedMLP uses it (`weight{i}` [out, in], `bias{i}` [out],
  `forward(x, m_splits) -> (y, None)` or `(y, [bias_i])` with skip_bias_add), so a real TEGroupedMLP
  can be built without Transformer Engine. `fuse_wgrad=True` imitates TE's fused weight-gradient
  accumulation: weight grads go straight into `param.main_grad` (when the param has one), the param is
  flagged `grad_added_to_main_grad` and autograd receives a zero placeholder, as TE does.
"""
from __future__ import annotations

import sys
import types

import torch


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes, trans_b: bool = False) -> torch.Tensor:
    """a [N, K], b [G, K, M] ([G, M, K] with trans_b), batch_sizes [G] (sum N) -> [N, M]."""
    sizes = batch_sizes.tolist() if torch.is_tensor(batch_sizes) else list(batch_sizes)
    assert len(sizes) == b.shape[0] and sum(sizes) == a.shape[0], (sizes, tuple(a.shape), tuple(b.shape))
    outs = [x @ (w.t() if trans_b else w) for x, w in zip(torch.split(a, sizes), b.unbind(0))]
    return torch.cat(outs)


def install_fake_grouped_gemm() -> types.ModuleType:
    mod = sys.modules.get("grouped_gemm")
    if mod is None or not getattr(mod, "RAILS_CPU_REFERENCE", False):
        mod = types.ModuleType("grouped_gemm")
        mod.RAILS_CPU_REFERENCE = True
        mod.ops = types.ModuleType("grouped_gemm.ops")
        mod.ops.gmm = gmm
        sys.modules["grouped_gemm"] = mod
        sys.modules["grouped_gemm.ops"] = mod.ops
    util = sys.modules.get("megatron.core.transformer.moe.grouped_gemm_util")
    if util is not None and util.grouped_gemm is not mod:  # imported before us: point it at the fake
        util.grouped_gemm, util.ops = mod, mod.ops
    return mod


class _FusedWgradLinear(torch.autograd.Function):
    """y = x @ w.T; the weight grad is added to w.main_grad and autograd gets zeros (TE style)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        w.main_grad.add_(g.t() @ x)
        w.grad_added_to_main_grad = True
        return g @ w, torch.zeros_like(w)


class CpuGroupedLinear(torch.nn.Module):
    """TE GroupedLinear's layout and contract, in plain torch (see the module docstring)."""

    fuse_wgrad = False  # class-wide switch for tests

    def __init__(self, num_gemms, input_size, output_size, *, config, init_method, bias, skip_bias_add,
                 is_expert=True, tp_comm_buffer_name=None, pg_collection=None, name=None, **_):
        super().__init__()
        self.num_gemms, self.in_features, self.out_features = num_gemms, input_size, output_size
        self.use_bias, self.skip_bias_add = bias, skip_bias_add
        for i in range(num_gemms):
            w = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))
            init_method(w)
            self.register_parameter(f"weight{i}", w)
            if bias:
                b = torch.nn.Parameter(0.1 * torch.randn(output_size, dtype=config.params_dtype))
                self.register_parameter(f"bias{i}", b)
        # as TEGroupedLinear marks them, biases included: expert parameters are reduced over the
        # expert-data-parallel group (allreduce False), not with the dense ones over all data-parallel
        # ranks, which hold other experts
        for p in self.parameters():
            p.allreduce = not (is_expert and config.expert_model_parallel_size > 1)

    def forward(self, x, m_splits):
        outs = []
        for i, xi in enumerate(torch.split(x, list(m_splits))):
            w = getattr(self, f"weight{i}")
            if self.fuse_wgrad and hasattr(w, "main_grad"):
                y = _FusedWgradLinear.apply(xi, w)
            else:
                y = xi @ w.t()
            if self.use_bias and not self.skip_bias_add:
                y = y + getattr(self, f"bias{i}")
            outs.append(y)
        y = torch.cat(outs)
        if self.use_bias and self.skip_bias_add:
            return y, [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        return y, None

    def backward_dw(self):
        pass
