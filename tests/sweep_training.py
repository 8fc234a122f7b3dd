"""A randomized sweep of training against the stock dispatcher: Megatron-Core's own DDP, optimizer
and schedule (tests/ddp_harness.py) on gloo ranks, every configuration drawn from a seed.

Each case draws experts, top-k, gated or plain MLP, the policy (or the shipped default config),
slots, tolerance, comm and ranks per node, dedup, DDP's overlap_grad_reduce, the distributed
optimizer and overlap_param_gather, activation recompute, microbatches per step, tokens and routing
skew; trains 3 optimizer steps with both dispatchers from the same weights; and checks, after every
step, each microbatch's loss, the parameters in stock layout and an evaluation forward under
no_grad and under inference_mode, all to 1e-5. It found the bucket-launch order of expert-data-
parallel replicas (megatron/grad_sync.py, InOrderLaunch).

    python tests/sweep_training.py --world 4 --ep 2 --cases 0:40

Not collected by pytest (tests/test_sweep_training.py runs two of its cases); a failing case prints
its configuration and the first mismatch, and the sweep goes on with the next.
"""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_harness import spawn  # noqa: E402

HIDDEN, FFN, STEPS = 16, 24, 3
POLICIES = ("none", "eplb", "ultraep", "lp", "fsep", "default")


def draw(ep: int, world: int, case: int) -> dict:
    """Case `case`'s configuration (the same on every rank; ep: expert-parallel size)."""
    r = np.random.default_rng([world, ep, case])
    E = ep * int(r.integers(1, 4))
    policy = POLICIES[int(r.integers(len(POLICIES)))]
    sizes = [g for g in range(1, ep + 1) if ep % g == 0]
    c = dict(case=case, experts=E, topk=int(r.integers(1, min(4, E) + 1)), glu=bool(r.integers(2)), policy=policy,
             overlap_grad_reduce=bool(r.integers(2)), distopt=bool(r.integers(2)), recompute=bool(r.integers(2)),
             micro=[int(r.integers(1, 5)) for _ in range(STEPS)], tokens=int(r.integers(1, 20)),
             skew=float(r.choice([0.0, 2.0, 5.0])), seed=int(r.integers(1 << 30)))
    c["overlap_param_gather"] = c["distopt"] and not c["recompute"] and bool(r.integers(2))
    if policy != "default":
        c["rails"] = dict(policy=policy, slots=int(r.integers(0 if policy in ("none", "fsep") else 1, 4)),
                          tolerance=float(r.choice([0.0, 0.05])), comm=str(r.choice(["direct", "rails"])),
                          ranks_per_node=sizes[int(r.integers(len(sizes)))], dedup=bool(r.integers(2)))
    return c


def _config(ep: int, dispatcher: str, c: dict):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=c["experts"],
        moe_router_topk=c["topk"], moe_token_dispatcher_type=dispatcher, ffn_hidden_size=FFN,
        moe_ffn_hidden_size=FFN, add_bias_linear=False, expert_model_parallel_size=ep,
        use_cpu_initialization=True, moe_aux_loss_coeff=0.0, gated_linear_unit=c["glu"],
        activation_func=torch.nn.functional.silu if c["glu"] else torch.nn.functional.gelu,
        bias_activation_fusion=False, moe_router_load_balancing_type="none", init_method_std=0.2,
        moe_router_pre_softmax=c["topk"] == 1)


def _chunk(ep: int, c: dict, u: torch.Tensor, rails):
    import megatron_rails
    from ddp_harness import chunk
    from moe_harness import build_moe_layer

    # stock: the allgather dispatcher (every rank has the same token count here)
    cfg = _config(ep, "allgather" if rails is None else "alltoall", c)
    torch.manual_seed(c["seed"] % 1000)
    if rails is not None:
        megatron_rails.install(rails)
    try:
        layer = build_moe_layer(cfg)
    finally:
        if rails is not None:
            megatron_rails.uninstall()
    with torch.no_grad():
        layer.router.weight.add_(c["skew"] * u)
    return chunk(cfg, layer)


def _microbatches(rank: int, step: int, c: dict, u: torch.Tensor) -> list:
    g = torch.Generator().manual_seed(1000 * rank + step + c["seed"] % 997)
    out, E, T = [], c["experts"], c["tokens"]
    for m in range(c["micro"][step]):
        hot = (step + m) % E
        x = torch.randn(T, HIDDEN, generator=g) * 0.5 + 1.5 * u[hot] + 0.8 * u[(hot + 3) % E]
        out.append((x.view(T, 1, HIDDEN), torch.randn(T, 1, HIDDEN, generator=g)))
    return out


def run_case(rank: int, ep: int, c: dict) -> None:
    """Train case `c` with both dispatchers; AssertionError at the first mismatch."""
    from megatron.core import tensor_parallel

    from ddp_harness import full_params, megatron_ddp, train_step

    u = torch.tensor(np.random.default_rng(c["seed"]).standard_normal((c["experts"], HIDDEN)), dtype=torch.float32)
    u /= u.norm(dim=1, keepdim=True)
    models = {"stock": _chunk(ep, c, u, None), "rails": _chunk(ep, c, u, c.get("rails", "default"))}
    models["rails"].layer.load_state_dict(models["stock"].layer.state_dict())
    kind = "adam" if c["distopt"] else "sgd"  # megatron-core 0.16's distributed optimizer takes Adam only
    runs = {name: megatron_ddp(m, overlap_grad_reduce=c["overlap_grad_reduce"], use_distributed_optimizer=c["distopt"],
                               overlap_param_gather=c["overlap_param_gather"], lr=0.1, optimizer=kind,
                               bucket_size=1000 if c["overlap_grad_reduce"] else None,
                               **({"adam_eps": 1.0} if kind == "adam" else {}))
            for name, m in models.items()}

    def loss_fn(model, microbatch):
        x, y = microbatch
        out = tensor_parallel.checkpoint(lambda t: model(t), False, x) if c["recompute"] else model(x)
        return ((out - y) ** 2).mean()

    close = dict(rtol=1e-5, atol=1e-5)
    for step in range(STEPS):
        mbs = _microbatches(rank, step, c, u)
        want = train_step(*runs["stock"], mbs, loss_fn)
        got = train_step(*runs["rails"], mbs, loss_fn)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **close,
                                   msg=lambda m: f"rank {rank} step {step}: losses\n{m}")
        if not c["overlap_param_gather"]:  # else the parameters are current only after the next forward
            state = models["rails"].layer.state_dict()  # stock layout (fsep assembles it from shards)
            for k, v in full_params(runs["stock"][0]).items():
                torch.testing.assert_close(state[k[len("layer."):]], v, **close,
                                           msg=lambda m: f"rank {rank} step {step}: {k}\n{m}")
        x = mbs[0][0] * 1.1  # an evaluation forward between steps: no optimizer, no backward
        with torch.no_grad():
            want = runs["stock"][0](x)
            got = runs["rails"][0](x)
        torch.testing.assert_close(got, want, **close, msg=lambda m: f"rank {rank} step {step}: no_grad forward\n{m}")
        with torch.inference_mode():
            got = runs["rails"][0](x)
        torch.testing.assert_close(got, want, **close,
                                   msg=lambda m: f"rank {rank} step {step}: inference_mode forward\n{m}")


def _worker(rank: int, world: int, ep: int, cases: list) -> None:
    from ddp_harness import cpu_megatron

    with cpu_megatron():
        for case in cases:
            run_case(rank, ep, draw(ep, world, case))


def run(world: int, ep: int, case: int) -> None:
    """One case on `world` spawned ranks (raises on a mismatch)."""
    spawn(_worker, world, ep, [case], ep=ep)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, help="gloo ranks")
    ap.add_argument("--ep", type=int, help="expert-parallel size (default: --world; a divisor of it)")
    ap.add_argument("--cases", default="0:20", help="case numbers FIRST:END (END excluded)")
    args = ap.parse_args(argv)
    ep = args.ep or args.world
    first, end = (int(v) for v in args.cases.split(":"))
    failed = 0
    for case in range(first, end):
        c = draw(ep, args.world, case)
        try:
            run(args.world, ep, case)
            print(f"ok   {c}", flush=True)
        except BaseException as err:  # noqa: BLE001 -- report and go on with the next case
            if isinstance(err, KeyboardInterrupt):
                raise
            failed += 1
            print(f"FAIL {c}\n{str(err)[-3000:] or traceback.format_exc()}", flush=True)
    print(f"{end - first - failed} of {end - first} cases match stock", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
