"""A tiny Mixtral-shaped GPT (Megatron-Core GPTModel, MoE layers) trained on CPU ranks with gloo.

Used by `megatron-rails demo` (launched with torchrun) and by the training tests (spawned ranks).
Routing is skewed on purpose by a fixed bias added to every router's logits (zipf-like over a fixed
expert order), so the balancing policies have something to do. Data: a learnable token stream (an
affine recurrence with 10% noise) from a fixed seed, different on every rank. Dense parameters are
averaged over ranks; expert parameters live on one EP rank each, their gradients already cover every
rank's tokens and are scaled by 1/world.

    torchrun --nproc-per-node 4 -m megatron_rails.train_demo --policy ultraep --steps 20 --out run.json
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DemoShape:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    ffn: int = 128
    experts: int = 8
    topk: int = 2
    vocab: int = 256
    seq: int = 32
    micro_batch: int = 2
    skew: float = 3.0  # router logit bias of the hottest expert; bias_e = skew / rank_e^1.2


def init_distributed() -> tuple[int, int]:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    from .megatron import cpu_shims

    cpu_shims.apply()
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(expert_model_parallel_size=dist.get_world_size())
    return dist.get_rank(), dist.get_world_size()


def build_model(shape: DemoShape, world: int, dispatcher: str, seed: int = 1234, layer_spec=None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        ffn_hidden_size=shape.ffn, moe_ffn_hidden_size=shape.ffn, num_moe_experts=shape.experts,
        moe_router_topk=shape.topk, moe_token_dispatcher_type=dispatcher, expert_model_parallel_size=world,
        use_cpu_initialization=True, moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, bias_activation_fusion=False,
        add_bias_linear=False, normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.05, masked_softmax_fusion=False, persist_layer_norm=False)
    torch.manual_seed(seed)
    try:
        model_parallel_cuda_manual_seed(seed)
    except Exception:  # CPU: the CUDA RNG tracker is not needed
        pass
    spec = layer_spec or get_gpt_layer_local_spec(num_experts=shape.experts, moe_grouped_gemm=False,
                                                  normalization="RMSNorm")
    model = GPTModel(cfg, spec, vocab_size=shape.vocab, max_sequence_length=shape.seq,
                     position_embedding_type="rope")
    _skew_routers(model, shape)
    return model


def _skew_routers(model, shape: DemoShape) -> None:
    """Add a fixed zipf-like bias to every router's logits (demo-only skew injection)."""
    order = np.random.default_rng(7).permutation(shape.experts)
    bias = torch.tensor(shape.skew / (1.0 + np.argsort(order)) ** 1.2, dtype=torch.float32)
    for mod in model.modules():
        if type(mod).__name__ == "TopKRouter":
            gating = mod.gating
            mod.gating = lambda x, g=gating: g(x) + bias.to(x.dtype)


def batch(shape: DemoShape, rank: int, step: int):
    g = torch.Generator().manual_seed(10_000 * step + rank)
    # a learnable stream: t[i+1] = (5 t[i] + 3) mod vocab from a random start, 10% of tokens random
    start = torch.randint(0, shape.vocab, (shape.micro_batch, 1), generator=g)
    tokens = start.clone().repeat(1, shape.seq + 1)
    for i in range(1, shape.seq + 1):
        tokens[:, i] = (5 * tokens[:, i - 1] + 3) % shape.vocab
    noise = torch.rand(tokens.shape, generator=g) < 0.1
    tokens = torch.where(noise, torch.randint(0, shape.vocab, tokens.shape, generator=g), tokens)
    pos = torch.arange(shape.seq).unsqueeze(0).expand(shape.micro_batch, -1)
    # explicit causal mask (True = masked): Megatron's default mask is allocated on CUDA
    mask = torch.triu(torch.ones(shape.seq, shape.seq), diagonal=1).bool()[None, None]
    return tokens[:, :-1].contiguous(), pos, mask, tokens[:, 1:].contiguous()


def is_expert_param(name: str) -> bool:
    return ".experts." in name


def make_optimizer(model, kind: str = "adam"):
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "sgd":  # stateless: a checkpoint of the weights alone resumes exactly
        return torch.optim.SGD(params, lr=0.05)
    return torch.optim.Adam(params, lr=3e-3)


def train_steps(model, shape: DemoShape, steps: int, rank: int, world: int, opt=None, start: int = 0,
                on_step=None):
    """Run `steps` optimizer steps; returns (per-step global mean losses, optimizer)."""
    opt = opt or make_optimizer(model)
    losses = []
    for step in range(start, start + steps):
        tokens, pos, mask, labels = batch(shape, rank, step)
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = model(tokens, pos, mask, labels=labels).float().mean()
        loss.backward()
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue  # stock expert copies under fsep: the shards train instead
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if is_expert_param(name):  # one EP rank holds it, its grad already covers every rank
                p.grad.div_(world)
            else:
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        opt.step()
        step_s = time.perf_counter() - t0
        g = loss.detach().clone()
        dist.all_reduce(g)
        losses.append(float(g) / world)
        if on_step:
            on_step(step, losses[-1], step_s)
    return losses, opt


def dispatcher_metrics(model) -> list[list[dict]]:
    """Per MoE layer, the RailsTokenDispatcher's per-step metrics (empty for stock layers)."""
    out = []
    for mod in model.modules():
        disp = getattr(mod, "token_dispatcher", None)
        if disp is not None and hasattr(disp, "metrics"):
            out.append(list(disp.metrics))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="none", help="stock (allgather dispatcher) or a megatron-rails policy")
    ap.add_argument("--config", help="policy YAML (overrides --policy)")
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rank, world = init_distributed()
    torch.set_num_threads(1)
    shape = DemoShape()
    if args.policy == "stock" and not args.config:
        model = build_model(shape, world, "allgather")
    else:
        import megatron_rails

        cfg = args.config or {"policy": args.policy, "slots": args.slots, "ranks_per_node": 2}
        megatron_rails.install(cfg)
        model = build_model(shape, world, "alltoall")
        megatron_rails.uninstall()
    times = []

    def progress(step, loss, step_s):
        times.append(step_s)
        if rank == 0:
            print(f"[{args.config or args.policy}] step {step + 1}/{args.steps} loss {loss:.5f} "
                  f"({step_s * 1e3:.0f} ms)", flush=True)

    losses, _ = train_steps(model, shape, args.steps, rank, world, on_step=progress)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"policy": args.config or args.policy, "world": world, "losses": losses,
                       "step_s": times, "layers": dispatcher_metrics(model)}, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
