"""One-GPU check of RailsTokenDispatcher (needs CUDA; CI has none, so this is run by hand).

For every policy, a Megatron-Core MoELayer on the GPU with RailsTokenDispatcher against the same
layer with the stock allgather dispatcher (one NCCL rank, EP 1, identical weights, fp32 without
TF32): output and the gradients of input, router and experts must agree to 1e-5. One rank cannot
exercise the exchanges; it checks that the dispatcher's own work (ordering, regrouping, expert
stores, metrics) runs on CUDA tensors. Exit status 1 on any mismatch.

    python scripts/gpu_check.py [nccl|gloo]     (default nccl)
"""
from __future__ import annotations

import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist

POLICIES = ["none", "eplb", "ultraep", "lp", "fsep"]
TOL = 1e-5


def _config(dispatcher: str):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=256, num_attention_heads=2, num_moe_experts=8, moe_router_topk=2,
        moe_token_dispatcher_type=dispatcher, ffn_hidden_size=512, moe_ffn_hidden_size=512, add_bias_linear=False,
        expert_model_parallel_size=1, use_cpu_initialization=True, moe_aux_loss_coeff=0.0, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, bias_activation_fusion=False,
        moe_router_load_balancing_type="none", init_method_std=0.2)


def _run(layer, x, w):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    (out * w).sum().backward()
    grads = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
    store = getattr(layer.token_dispatcher, "store", None)
    if hasattr(store, "owner_layout_grads"):  # fsep: expert grads live on the shards
        grads.update({f"experts.{k}": v for k, v in store.owner_layout_grads().items()})
    return out, x.grad, grads


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.cuda.set_device(0)
    backend = sys.argv[1] if len(sys.argv) > 1 else "nccl"
    with tempfile.TemporaryDirectory() as tmp:
        print(f"gpu_check: {backend} process group, {torch.cuda.get_device_name(0)}", flush=True)
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0) if backend == "nccl" else None)
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        ps.initialize_model_parallel(expert_model_parallel_size=1)
        model_parallel_cuda_manual_seed(0)
        import megatron_rails
        from megatron.core.transformer.moe import moe_utils
        from megatron_rails.megatron.compat import build_moe_layer

        if not hasattr(moe_utils, "te_general_gemm"):  # 0.16.1's router names it even without Transformer Engine
            moe_utils.te_general_gemm = None

        torch.manual_seed(0)
        stock = build_moe_layer(_config("allgather")).cuda()
        g = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(2048, 1, 256, device="cuda", generator=g)
        with torch.no_grad():  # a skewed router: expert e's logit offset by 2 * log(1 / (e + 1))
            stock.router.weight.add_(torch.outer(-2.0 * torch.log(torch.arange(1.0, 9.0)), torch.ones(256) / 256)
                                     .cuda())
        w = torch.linspace(-1, 1, x.numel(), device="cuda").view_as(x)
        ref_out, ref_dx, ref_g = _run(stock, x, w)
        failed = 0
        for policy in POLICIES:
            megatron_rails.install({"policy": policy, "slots": 2, "check_plan": True})
            rails = build_moe_layer(_config("alltoall"))
            megatron_rails.uninstall()
            rails.load_state_dict(stock.state_dict())
            rails = rails.cuda()
            out, dx, grads = _run(rails, x, w)
            diffs = {"output": (out - ref_out).abs().max().item(), "input grad": (dx - ref_dx).abs().max().item()}
            for name, ref in ref_g.items():
                got = grads.get(name)
                diffs[name] = float("inf") if got is None else (got - ref).abs().max().item()
            worst = max(diffs, key=diffs.get)
            ok = diffs[worst] <= TOL
            failed += not ok
            m = rails.token_dispatcher.metrics[-1]
            print(f"{policy:8s} {'ok ' if ok else 'BAD'} worst |diff| {diffs[worst]:.2e} ({worst}); "
                  f"plan {m['plan_us']:.0f} us, device {out.device}", flush=True)
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        rc = main()
    except BaseException:
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    os._exit(rc)  # an NCCL group left by a failure must not hang the exit
