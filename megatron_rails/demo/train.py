"""A tiny Mixtral-shaped GPT (Megatron-Core GPTModel, MoE layers) trained on CPU ranks with gloo.

Used by `megatron-rails demo` (launched with torchrun) and by the training tests (spawned ranks).
Routing is skewed on purpose by a fixed bias added to every router's logits (zipf-like over a fixed
expert order), so the balancing policies have something to do. Data: a learnable token stream (an
affine recurrence with 10% noise) from a fixed seed, different on every rank. Dense parameters are
averaged over ranks; expert parameters live on one EP rank each, their gradients already cover every
rank's tokens and are scaled by 1/world.

    torchrun --nproc-per-node 4 -m megatron_rails.demo.train --policy ultraep --steps 20 --out run.json
    torchrun --nproc-per-node 4 -m megatron_rails.demo.train --run-config configs/mini/mini-mixtral.yaml \
        --out run.json balancer.policy=ultraep training.train_iters=5

With --run-config the shape (model section), micro-batch, steps, optimizer, lr, Adam betas, seed and
balancer come from a run config (`key.sub=value` overrides after it); the config must describe what this
loop does: no tensor/pipeline/context parallelism, expert parallel = world size, no weight decay,
clipping, warm-up or decay schedule.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import json
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ..core.policy import as_policy
from ..core.outfile import open_for_writing
from ..megatron import models
from ..megatron.cpu_shims import stock_alltoall
from ..megatron.routing_log import RoutingLog
from ..megatron.install import install, uninstall


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
    hot_first: bool = False  # the hottest experts are experts 0, 1, ... (one EP rank's), else a fixed shuffle


# tiny: the tests' model; compute: experts large enough that expert compute, not per-call overhead,
# dominates a step (as on real hardware), so that balance shows in step time (the `demo` command's)
SHAPES = {"tiny": DemoShape(), "compute": DemoShape(hidden=256, ffn=1024, seq=128, skew=5.0, hot_first=True)}


def init_distributed(timeout_s: float = 600.0) -> tuple[int, int]:
    """gloo process group (every collective, ours included, fails after timeout_s instead of hanging)."""
    if not dist.is_initialized():
        from datetime import timedelta

        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    models.init_model_parallel(dist.get_world_size(), timeout_s)  # Megatron's groups fail after timeout_s too
    return dist.get_rank(), dist.get_world_size()


def build_model(shape: DemoShape, world: int, dispatcher: str, seed: int = 1234, layer_spec=None):
    cfg = models.transformer_config(
        num_layers=shape.layers, hidden_size=shape.hidden, num_attention_heads=shape.heads,
        ffn_hidden_size=shape.ffn, moe_ffn_hidden_size=shape.ffn, num_moe_experts=shape.experts,
        moe_router_topk=shape.topk, moe_token_dispatcher_type=dispatcher, expert_model_parallel_size=world,
        use_cpu_initialization=True, moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, bias_activation_fusion=False,
        add_bias_linear=False, normalization="RMSNorm", hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.05, masked_softmax_fusion=False, persist_layer_norm=False)
    models.seed_model_parallel(seed)
    model = models.gpt_model(cfg, shape.vocab, shape.seq, layer_spec, moe_grouped_gemm=False, normalization="RMSNorm")
    _skew_routers(model, shape)
    return model


def _skew_routers(model, shape: DemoShape) -> None:
    """Add a fixed zipf-like bias to every router's logits (demo-only skew injection)."""
    order = np.arange(shape.experts) if shape.hot_first else np.random.default_rng(7).permutation(shape.experts)
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


def make_optimizer(model, kind: str = "adam", lr: float | None = None, betas=(0.9, 0.999)):
    params = [p for p in model.parameters() if p.requires_grad]
    if kind == "sgd":  # stateless: a checkpoint of the weights alone resumes exactly
        return torch.optim.SGD(params, lr=0.05 if lr is None else lr)
    return torch.optim.Adam(params, lr=3e-3 if lr is None else lr, betas=betas)


# what build_model hard-codes; a run config for the demo trainer must say the same
DEMO_FIXED = {"normalization": "RMSNorm", "norm_epsilon": 1e-5, "swiglu": True, "disable_bias_linear": True,
              "position_embedding_type": "rope", "rotary_base": 10000, "untie_embeddings_and_output_weights": True,
              "init_method_std": 0.05, "hidden_dropout": 0.0, "attention_dropout": 0.0, "num_query_groups": None,
              "moe_aux_loss_coeff": 0.0, "moe_router_load_balancing_type": "none", "moe_grouped_gemm": False,
              "moe_z_loss_coeff": None, "transformer_impl": "local"}


def from_run_config(path: str, overrides=()):
    """(RunConfig, DemoShape) for a run config, or ConfigError if this loop cannot run it as written."""
    from ..core.policy import ConfigError
    from ..config.run import load_run_config

    rc = load_run_config(path, overrides)
    m, p, t, d = rc.model, rc.parallelism, rc.training, rc.data
    rules = [  # (key, why, violated)
        ("parallelism", ("the demo trainer runs expert parallelism only (tensor, pipeline, context and expert "
                         "tensor parallel sizes 1)"), (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                               p.context_parallel_size, p.expert_tensor_parallel_size or 1) != (1, 1, 1, 1)),
        ("parallelism.expert_model_parallel_size", f"must equal the world size {p.world_size}",
         p.expert_model_parallel_size != p.world_size),
        ("parallelism.backend", "the demo trainer runs on CPU: gloo", p.backend != "gloo"),
        ("training", ("the demo trainer applies no weight decay, clipping, warm-up or schedule: set weight_decay 0, "
                      "clip_grad 0, lr_warmup_iters 0, lr_decay_style constant"),
         (t.weight_decay, t.clip_grad, t.lr_warmup_iters, t.lr_decay_style) != (0, 0, 0, "constant")),
        ("training", "the demo trainer trains in fp32: bf16 and fp16 false", t.bf16 or t.fp16),
        ("data.vocab_size", "required (the synthetic token stream's vocabulary)", not d.vocab_size),
        ("model.moe_token_dispatcher_type", "without a balancer: alltoall or allgather (stock Megatron-Core's)",
         rc.balancer is None and m.moe_token_dispatcher_type not in ("alltoall", "allgather")),
    ]
    bad = [f"{key}: {why}" for key, why, violated in rules if violated]
    bad += [f"model.{k}: the demo trainer's model has {v!r}, the config says {getattr(m, k)!r}"
            for k, v in DEMO_FIXED.items() if getattr(m, k) != v]
    bad += [f"model.{k}: the demo trainer needs null or {v}" for k, v in (
        ("moe_ffn_hidden_size", m.ffn_hidden_size), ("max_position_embeddings", m.seq_length))
        if getattr(m, k) not in (None, v)]
    if bad:
        raise ConfigError("\n".join(f"{path}: {b}" for b in bad))
    shape = DemoShape(layers=m.num_layers, hidden=m.hidden_size, heads=m.num_attention_heads, ffn=m.ffn_hidden_size,
                      experts=m.num_experts, topk=m.moe_router_topk, vocab=d.vocab_size, seq=m.seq_length,
                      micro_batch=t.micro_batch_size, skew=m.router_skew)
    return rc, shape


def train_steps(model, shape: DemoShape, steps: int, rank: int, world: int, opt=None, start: int = 0,
                on_step=None, microbatches: int = 1):
    """Run `steps` optimizer steps of `microbatches` microbatches each (gradients accumulated; every
    microbatch but the last under megatron_rails.no_sync(), as Megatron's schedules run them);
    returns (per-step global mean losses, optimizer)."""
    from ..runtime.residency import no_sync

    opt = opt or make_optimizer(model)
    losses = []
    for step in range(start, start + steps):
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        total = 0.0
        for mb in range(microbatches):
            # microbatch mb of step s is the batch (s * microbatches + mb): microbatches=1 is the old stream
            tokens, pos, mask, labels = batch(shape, rank, step * microbatches + mb)
            with no_sync() if mb < microbatches - 1 else contextlib.nullcontext():
                loss = model(tokens, pos, mask, labels=labels).float().mean()
                (loss / microbatches).backward()
            total += loss.detach()
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
        g = (total / microbatches).clone()
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
    ap.add_argument("--policy", help=("stock (Megatron-Core's alltoall dispatcher; on CPU through the stand-ins of "
                                      "megatron_rails.megatron.cpu_shims), stock-allgather, or a megatron-rails "
                                      "policy (default none)"))
    ap.add_argument("--config", help="policy YAML (overrides --policy)")
    ap.add_argument("--slots", type=int, help="R for --policy (default 2)")
    ap.add_argument("--steps", type=int, help="optimizer steps (default 20)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny",
                    help="model shape without --run-config (default tiny; compute: hidden 256, ffn 1024, seq 128)")
    ap.add_argument("--run-config", help="a run config YAML (configs/mini/*.yaml); overrides follow as KEY=VALUE")
    ap.add_argument("--ranks-per-node", type=int,
                    help="virtual node size for --policy/--config (default: 2, or the config's)")
    ap.add_argument("--microbatches", type=int, default=1,
                    help="microbatches per optimizer step, gradients accumulated (default 1)")
    ap.add_argument("--pin", action="store_true",
                    help="pin every rank to a core of its own (refused with more ranks than cores)")
    ap.add_argument("--timeout-s", type=float, default=600.0,
                    help="process-group timeout: a collective waiting longer on a dead or stuck rank fails")
    ap.add_argument("--routing", help="write every router's top-k choice per forward, all ranks (npz: maps; with "
                                      "--against-stock: maps_stock and maps)")
    ap.add_argument("--against-stock", action="store_true",
                    help="also train stock Megatron-Core (its alltoall dispatcher) from the same weights, the two "
                         "alternating step by step (stock first on even steps): --out holds both runs")
    ap.add_argument("--out", required=True)
    ap.add_argument("overrides", nargs="*", help="run-config overrides, e.g. training.train_iters=5")
    args = ap.parse_args(argv)
    rc, seed, opt, stock = None, 1234, None, None
    if args.run_config:
        mixed = [f for f in ("policy", "config", "slots", "steps", "ranks_per_node") if getattr(args, f) is not None]
        if mixed:
            ap.error(f"--{mixed[0]} with --run-config: use overrides instead "
                     "(balancer.policy=NAME, balancer.slots=R, training.train_iters=N)")
        rc, shape = from_run_config(args.run_config, args.overrides)
        steps, seed = rc.training.train_iters, rc.training.seed
        label = rc.balancer.policy if rc.balancer else "stock"
    elif args.overrides:
        ap.error(f"overrides ({args.overrides[0]} ...) need --run-config")
    else:
        shape, steps = SHAPES[args.shape], 20 if args.steps is None else args.steps
        label = args.config or args.policy or "none"
    if args.microbatches < 1:
        ap.error(f"--microbatches {args.microbatches}: need at least 1")
    if args.against_stock and (args.run_config or args.policy in ("stock", "stock-allgather")):
        ap.error("--against-stock trains a policy beside stock: give --policy or --config, not --run-config or "
                 "a stock --policy")
    rank, world = init_distributed(args.timeout_s)
    if args.pin:
        cores = sorted(os.sched_getaffinity(0))
        if world > len(cores):
            raise SystemExit(f"--pin: {world} ranks but {len(cores)} cores; every rank needs its own")
        os.sched_setaffinity(0, {cores[int(os.environ.get("LOCAL_RANK", rank))]})
    if rc is not None and rc.world_size != world:
        raise SystemExit(f"{args.run_config}: the run config is for {rc.world_size} ranks, this run has {world}")
    torch.set_num_threads(1)
    if rc is not None:
        if rc.balancer is None:
            stock = rc.model.moe_token_dispatcher_type
            with stock_alltoall() if stock == "alltoall" else contextlib.nullcontext():
                model = build_model(shape, world, stock, seed=seed)
        else:
            install(rc.balancer)
            model = build_model(shape, world, "alltoall", seed=seed)
            uninstall()
        t = rc.training
        opt = make_optimizer(model, t.optimizer, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2))
    elif args.policy in ("stock", "stock-allgather") and not args.config:
        stock = "alltoall" if args.policy == "stock" else "allgather"
        with stock_alltoall():
            model = build_model(shape, world, stock)
    else:
        cfg = args.config or {"policy": args.policy or "none", "slots": 2 if args.slots is None else args.slots,
                              "ranks_per_node": 2}
        if args.ranks_per_node is not None:
            import dataclasses

            cfg = dataclasses.replace(as_policy(cfg), ranks_per_node=args.ranks_per_node)
        install(cfg)
        model = build_model(shape, world, "alltoall")
        uninstall()
    # (label, model, its dispatcher type where stock, optimizer): with --against-stock stock beside, from
    # the same weights (build_model seeds them), each step run by both, which one first alternating
    runs = [(label, model, stock, opt)]
    if args.against_stock:
        with stock_alltoall():
            runs.insert(0, ("stock", build_model(shape, world, "alltoall"), "alltoall", None))
    times = {name: [] for name, *_ in runs}
    losses = {name: [] for name, *_ in runs}
    logs = {name: RoutingLog(m) for name, m, *_ in runs} if args.routing else {}
    opts = {name: o for name, _, _, o in runs}
    for s in range(steps):
        for name, m, kind, _ in (runs if s % 2 == 0 else runs[::-1]):
            def progress(step, loss, step_s, name=name):
                times[name].append(step_s)
                if rank == 0:
                    print(f"[{name}] step {step + 1}/{steps} loss {loss:.5f} ({step_s * 1e3:.0f} ms)", flush=True)

            with stock_alltoall() if kind == "alltoall" else contextlib.nullcontext():
                got, opts[name] = train_steps(m, shape, 1, rank, world, opt=opts[name], start=s, on_step=progress,
                                              microbatches=args.microbatches)
            losses[name] += got
    maps = {("maps" if name == label else "maps_stock"): log.gathered() for name, log in logs.items()}
    if rank == 0 and logs:
        with open_for_writing(args.routing, "wb") as f:  # np.savez(str) would append .npz to other names
            np.savez_compressed(f, **maps)
    if rank == 0:
        results = {name: {"policy": name, "world": world, "losses": losses[name], "step_s": times[name],
                          "microbatches": args.microbatches, "layers": dispatcher_metrics(m)}
                   for name, m, *_ in runs}
        out = results[label] if not args.against_stock else {"stock": results["stock"], "policy": results[label]}
        if rc is not None:
            out.update(run_config=args.run_config, overrides=list(args.overrides), seed=seed, steps=steps)
        with open(args.out, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from ..runtime.comm.base import leave

    leave(main())  # no interpreter finalization after gloo collectives (see leave)
