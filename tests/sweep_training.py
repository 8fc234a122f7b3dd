"""A randomized sweep of training against the stock dispatcher: Megatron-Core's own DDP, optimizer
and schedule (tests/ddp_harness.py) on gloo ranks, every configuration drawn from a seed.

Each case draws experts, top-k, gated or plain MLP, the policy (or the shipped default config),
slots, tolerance, comm and ranks per node, dedup, DDP's overlap_grad_reduce, the distributed
optimizer and overlap_param_gather, activation recompute, microbatches per step, tokens and routing
skew; trains 3 optimizer steps with both dispatchers from the same weights; and checks, after every
step, each microbatch's loss, the parameters in stock layout and an evaluation forward under
no_grad and under inference_mode, all to 1e-5, until a token's routing flips on a near tie
(tests/flips.py); flips are bounded by stock alltoall's own, a control run only where they pass
the slack (--control: always). It found the bucket-launch order of expert-data-
parallel replicas (megatron/grad_sync.py, InOrderLaunch).

--tp runs tensor parallelism with sequence parallelism (each TP rank holds part of every sequence;
experts are not tensor-parallel, so an EP group may span TP ranks), --cp context parallelism (each
CP rank holds part of every sequence; EP groups may span CP ranks). --pp runs Megatron-Core's
pipeline schedules: each case draws 1 or 2 model chunks per stage (1F1B or the interleaved
schedule), each chunk one MoE layer plus its input (a residual: without it every layer's output,
and any error in it, would shrink layer by layer); the losses are the last stage's, the evaluation
runs the forward-only schedule. --features also draws Megatron MoE features per case: shared
experts (in the rails run overlapped inside the dispatcher or not), capacity drops (probs or
position), sigmoid scores with the aux-loss-free expert bias, linear biases, the load-balancing loss.
--grouped builds the experts as grouped modules instead of SequentialMLP, what GPU runs use: each
case draws TEGroupedMLP (over tests/cpu_experts.py's stand-in for Transformer Engine's
GroupedLinear, with or without its fused weight-gradient accumulation into DDP's main_grad) or,
where the megatron-core has it, the legacy GroupedMLP (over a reference grouped_gemm).

    python tests/sweep_training.py --world 4 --ep 2 --cases 0:40
    python tests/sweep_training.py --world 4 --tp 2 --pp 2 --cases 0:30
    python tests/sweep_training.py --world 4 --ep 2 --grouped --features --cases 0:20

Not collected by pytest (tests/test_sweep_training.py runs seven of its cases); a failing case prints
its configuration and the first mismatch, and the sweep goes on with the next.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_harness import spawn  # noqa: E402

HIDDEN, FFN, STEPS = 16, 24, 3
POLICIES = ("none", "eplb", "ultraep", "lp", "fsep", "default")


def draw(ep: int, world: int, case: int, tp: int = 1, pp: int = 1, cp: int = 1, features: bool = False,
         grouped: bool = False) -> dict:
    """Case `case`'s configuration (the same on every rank; ep: expert-parallel size; tp, pp, cp:
    tensor (with sequence parallelism, experts not tensor-parallel), pipeline and context parallel
    sizes; features: also draw Megatron MoE features, grouped: grouped expert modules, each on top
    of the same case without them)."""
    r = np.random.default_rng([world, ep, case] if tp == pp == cp == 1 else
                              [world, ep, case, tp, pp] + ([cp] if cp > 1 else []))
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
    if tp > 1 or pp > 1 or cp > 1:
        # one MoE layer per model chunk; vpp 2: the interleaved schedule, which wants M a multiple
        # of pp (its microbatch groups); whole sequences split over the CP x TP ranks
        c.update(tp=tp, pp=pp, vpp=int(r.integers(1, 3)) if pp > 1 else 1)
        if cp > 1:
            c["cp"] = cp
        c["tokens"] = tp * cp * -(-c["tokens"] // (tp * cp))
        if c["vpp"] > 1:
            c["micro"] = [pp * int(r.integers(1, 3)) for _ in range(STEPS)]
    if features:
        f = np.random.default_rng([world, ep, case, tp, pp, cp, 99])
        c["features"] = {name: value for name, value in (
            ("shared", bool(f.integers(2))),  # shared experts; True: overlapped inside our dispatcher
            ("capacity", str(f.choice(["probs", "position"]))),  # router-side drops at capacity 1
            ("sigmoid_bias", True),  # sigmoid scores with the aux-loss-free expert bias
            ("bias", True),  # linear biases in the experts
            ("aux_loss", True),  # Megatron's load-balancing loss on the router
        ) if f.integers(2)}
        if "shared" in c["features"]:  # Megatron's shared experts take no biases
            c["features"].pop("bias", None)
    if grouped:
        g = np.random.default_rng([world, ep, case, tp, pp, cp, 98])
        legacy, fuse = bool(g.integers(2)), bool(g.integers(2))  # both drawn: the same stream everywhere
        c["module"] = "grouped" if legacy and _has_legacy_grouped_mlp() else "te"
        if c["module"] == "te":
            c["fuse_wgrad"] = fuse
        else:  # GroupedMLP has no linear biases
            c.get("features", {}).pop("bias", None)
    return c


def _has_legacy_grouped_mlp() -> bool:
    """Whether this megatron-core has the legacy GroupedMLP (0.16 does; 0.19 removed it)."""
    from megatron.core.transformer.moe import experts

    return hasattr(experts, "GroupedMLP")


def _features(c: dict, rails: bool) -> dict:
    """TransformerConfig keywords for the case's drawn features (see draw)."""
    f, kw = c.get("features", {}), {}
    if "shared" in f:
        kw.update(moe_shared_expert_intermediate_size=FFN)
        if f["shared"] and rails:  # the stock runs (reference and control) run them unoverlapped
            kw.update(moe_shared_expert_overlap=True)
    if "capacity" in f:
        kw.update(moe_expert_capacity_factor=1.0, moe_token_drop_policy=f["capacity"])
    if "sigmoid_bias" in f:
        kw.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_pre_softmax=False)
    if "bias" in f:
        kw.update(add_bias_linear=True)
    if "aux_loss" in f:
        kw.update(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01)
    return kw


def _config(ep: int, dispatcher: str, c: dict, rails: bool):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=c["experts"],
        moe_router_topk=c["topk"], moe_token_dispatcher_type=dispatcher, ffn_hidden_size=FFN,
        moe_ffn_hidden_size=FFN, add_bias_linear=False, expert_model_parallel_size=ep,
        use_cpu_initialization=True, moe_aux_loss_coeff=0.0, gated_linear_unit=c["glu"],
        num_layers=c.get("pp", 1) * c.get("vpp", 1), tensor_model_parallel_size=c.get("tp", 1),
        sequence_parallel=c.get("tp", 1) > 1, expert_tensor_parallel_size=1, context_parallel_size=c.get("cp", 1),
        pipeline_model_parallel_size=c.get("pp", 1), pipeline_dtype=torch.float32,
        virtual_pipeline_model_parallel_size=c["vpp"] if c.get("vpp", 1) > 1 else None,
        activation_func=torch.nn.functional.silu if c["glu"] else torch.nn.functional.gelu,
        bias_activation_fusion=False, moe_router_load_balancing_type="none", init_method_std=0.2,
        moe_router_pre_softmax=c["topk"] == 1)
    if c.get("module") == "grouped":  # GroupedMLP asserts bf16 (the parameters stay fp32 here)
        kw.update(moe_grouped_gemm=True, bf16=True)
    return TransformerConfig(**{**kw, **_features(c, rails)})


def _build(cfg, c: dict):
    """A MoELayer for `cfg` with the case's expert module: SequentialMLP, TEGroupedMLP over the CPU
    GroupedLinear stand-in, or the legacy GroupedMLP (over the reference grouped_gemm)."""
    from megatron.core.transformer.moe import experts as mx
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from cpu_experts import CpuGroupedLinear
    from mcore_versions import grouped_experts_spec
    from megatron_rails.megatron.compat import build_moe_layer, moe_submodules

    if c.get("module") != "te":
        return build_moe_layer(cfg, grouped_gemm=c.get("module") == "grouped")
    subs = moe_submodules(cfg.num_moe_experts)
    subs.experts = grouped_experts_spec(mx.TEGroupedMLP, CpuGroupedLinear, CpuGroupedLinear)
    return MoELayer(cfg, subs)


def _chunks(ep: int, c: dict, u: torch.Tensor, rails, dispatcher: str = "allgather") -> list:
    """This rank's model chunks: one MoE layer each (layer v * pp + stage of the model, as
    Megatron lays out virtual pipeline stages), seeded by that layer number. rails: the policy of
    the rails run, or None for a stock run with `dispatcher` (allgather: the reference, alltoall:
    the control of tests/flips.py)."""
    import megatron_rails
    from megatron.core import parallel_state as ps

    from ddp_harness import chunk

    # the stock reference: the allgather dispatcher (every rank has the same token count here)
    cfg = _config(ep, dispatcher if rails is None else "alltoall", c, rails is not None)
    pp, stage = c.get("pp", 1), ps.get_pipeline_model_parallel_rank()
    out = []
    for v in range(c.get("vpp", 1)):
        torch.manual_seed(c["seed"] % 1000 + 7 * (v * pp + stage))
        if rails is not None:
            megatron_rails.install(rails)
        try:
            layer = _build(cfg, c)
        finally:
            if rails is not None:
                megatron_rails.uninstall()
        with torch.no_grad():
            layer.router.weight.add_(c["skew"] * u)
        if rails is None:
            # stock Megatron-Core sums `sequence_parallel` gradients over the TP group, experts' fc2
            # biases included, though with expert TP 1 those ranks hold different experts
            # (tests/test_tp_expert_bias.py): the reference is stock without that sum
            for param in layer.experts.parameters():
                param.sequence_parallel = False
        out.append(chunk(cfg, layer, pipeline=pp > 1))
    return out


def _microbatches(step: int, c: dict, u: torch.Tensor, scale: float = 1.0) -> list:
    """(x, y) per microbatch, [T / (cp tp), 1, H] each: a data-parallel rank's sequences (the same
    on the ranks of its pipeline, context- and tensor-parallel groups), this rank's part of them:
    its CP rank's part, of which its TP rank's part (sequence parallelism)."""
    from megatron.core import parallel_state as ps

    g = torch.Generator().manual_seed(1000 * ps.get_data_parallel_rank() + step + c["seed"] % 997)
    out, E, T = [], c["experts"], c["tokens"]
    n = c.get("tp", 1) * c.get("cp", 1)  # parts of a sequence: CP ranks', each split over TP ranks
    i = ps.get_context_parallel_rank() * c.get("tp", 1) + ps.get_tensor_model_parallel_rank()
    part = slice(i * T // n, (i + 1) * T // n)
    for m in range(c["micro"][step]):
        hot = (step + m) % E
        x = torch.randn(T, HIDDEN, generator=g) * 0.5 + 1.5 * u[hot] + 0.8 * u[(hot + 3) % E]
        y = torch.randn(T, 1, HIDDEN, generator=g)
        out.append((scale * x.view(T, 1, HIDDEN)[part], y[part]))
    return out


def run_case(rank: int, ep: int, c: dict) -> None:
    """Train case `c` with both dispatchers; AssertionError at the first mismatch."""
    import torch.distributed as dist
    from megatron.core import tensor_parallel

    from cpu_experts import CpuGroupedLinear
    from ddp_harness import full_params, megatron_ddp, schedule_step
    from flips import SLACK, RoutingLog, check_bound, flips_per_forward, stock_alltoall

    # TE's fused weight-gradient accumulation: the stock experts' weight gradients go straight into
    # DDP's main_grad (both runs; the rails run's slots borrow weights through their own path)
    CpuGroupedLinear.fuse_wgrad = c.get("fuse_wgrad", False)
    u = torch.tensor(np.random.default_rng(c["seed"]).standard_normal((c["experts"], HIDDEN)), dtype=torch.float32)
    u /= u.norm(dim=1, keepdim=True)
    models = {"stock": _chunks(ep, c, u, None), "rails": _chunks(ep, c, u, c.get("rails", "default"))}
    start = [{k: v.clone() if torch.is_tensor(v) else v for k, v in m.layer.state_dict().items()}
             for m in models["stock"]]
    for mine, theirs in zip(models["rails"], start):
        mine.layer.load_state_dict(theirs)
    kind = "adam" if c["distopt"] else "sgd"  # megatron-core 0.16's distributed optimizer takes Adam only

    def ddp(chunks):
        return megatron_ddp(chunks, overlap_grad_reduce=c["overlap_grad_reduce"], use_distributed_optimizer=c["distopt"],
                            overlap_param_gather=c["overlap_param_gather"], lr=0.1, optimizer=kind,
                            bucket_size=1000 if c["overlap_grad_reduce"] else None,
                            **({"adam_eps": 1.0} if kind == "adam" else {}))

    runs = {name: ddp(m) for name, m in models.items()}
    # every router's choices (tests/flips.py): the checks below hold to 1e-5 only until a token's
    # near-tie routing flips; from then on the flips are counted and bounded by stock alltoall's own
    logs = {name: RoutingLog([m.layer for m in chunks]) for name, chunks in models.items()}
    seen, flipped = [0], np.zeros(STEPS, dtype=np.int64)  # forwards counted; flips per step
    ends = []  # the forwards each router made by the end of step k (its evaluation included)

    def new_flips(k) -> int:
        """Tokens routed differently from stock in the forwards since the last call (all ranks')."""
        end = len(logs["stock"].maps[0])
        n = int(flips_per_forward(logs["rails"].slice(seen[0], end), logs["stock"].slice(seen[0], end)).sum())
        seen[0] = end
        flipped[k] += n
        return n

    def forward_fn(model, microbatch):
        x = model.module.stage_input(microbatch[0])
        if not x.requires_grad:
            # the data stands for a model's hidden states, which require grad (they come from the
            # embedding); Megatron's checkpoint otherwise makes an output without a grad_fn, and no
            # gradient would reach the layer's parameters under recompute
            x = x.detach().requires_grad_(True)
        return tensor_parallel.checkpoint(lambda t: model(t), False, x) if c["recompute"] else model(x)

    def loss_fn(out, microbatch):
        return ((out - microbatch[1]) ** 2).mean()

    def step(name, mbs, forward_only=False):
        ddps, opt = runs[name]
        return schedule_step(ddps, opt, mbs, forward_fn, loss_fn, seq_length=c["tokens"], forward_only=forward_only)

    def evaluate(name, k):
        """An evaluation forward after step k: no optimizer, no backward (the interleaved schedule
        wants at least pp microbatches: the step's first ones, scaled)."""
        evals = _microbatches(k, c, u, scale=1.1)[:c.get("pp", 1)]
        if c.get("pp", 1) == 1:  # the output itself
            return runs[name][0][0](evals[0][0])
        return torch.tensor(step(name, evals, True))  # through the pipeline: the last stage's losses

    close = dict(rtol=1e-5, atol=1e-5)
    initial = [{n: p.detach().clone() for n, p in m.layer.experts.named_parameters()} for m in models["stock"]]

    def check_params(k):
        """Every parameter in stock layout equal to stock's after step k (current: with
        overlap_param_gather only after the next forward); after step 0, stock's experts moved."""
        if k == 0:
            # equal parameters prove something only where training moved them (a harness that
            # loses the gradients, as recompute over an input without grad did, trains nothing);
            # on some rank: another's experts may have had no tokens
            for v, (m, before) in enumerate(zip(models["stock"], initial)):
                moved = torch.tensor([float(any(not torch.equal(p, before[n])
                                                for n, p in m.layer.experts.named_parameters()))])
                dist.all_reduce(moved, op=dist.ReduceOp.MAX)
                assert moved.item() == 1.0, f"rank {rank} chunk {v}: no rank's stock experts changed in step 0"
        for v, (mine, ddp) in enumerate(zip(models["rails"], runs["stock"][0])):
            state = mine.layer.state_dict()  # stock layout (fsep assembles it from shards)
            for n, want_p in full_params(ddp).items():
                torch.testing.assert_close(state[n[len("layer."):]], want_p, **close,
                                           msg=lambda m: f"rank {rank} step {k} chunk {v}: {n}\n{m}")
    for k in range(STEPS):
        mbs = _microbatches(k, c, u)
        want, got = step("stock", mbs), step("rails", mbs)
        strict = new_flips(k) == 0 and not flipped.any()
        if strict:
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **close,
                                       msg=lambda m: f"rank {rank} step {k}: losses\n{m}")
        if strict and not c["overlap_param_gather"]:
            check_params(k)
        with torch.no_grad():
            want, got = evaluate("stock", k), evaluate("rails", k)
        strict = new_flips(k) == 0 and not flipped.any()
        if strict:
            torch.testing.assert_close(got, want, **close, msg=lambda m: f"rank {rank} step {k}: no_grad forward\n{m}")
        with torch.inference_mode(), logs["rails"].paused():  # a forward the stock run does not make
            got = evaluate("rails", k)
        ends.append(seen[0])
        if strict:
            torch.testing.assert_close(got, want, **close,
                                       msg=lambda m: f"rank {rank} step {k}: inference_mode forward\n{m}")
        if strict and c["overlap_param_gather"]:  # the evaluation forward finished the step's parameter all-gather
            check_params(k)
    if flipped.sum() > SLACK or c.get("control"):
        # tests/flips.py's control: stock alltoall from the same weights, data, schedule and evaluations
        with stock_alltoall():
            chunks = _chunks(ep, c, u, None, "alltoall")
            for mine, theirs in zip(chunks, start):
                mine.layer.load_state_dict(theirs)
            log = RoutingLog([m.layer for m in chunks])
            runs["control"] = ddp(chunks)
            for k in range(STEPS):
                step("control", _microbatches(k, c, u))
                with torch.no_grad():
                    evaluate("control", k)
        flips_C = flips_per_forward(log, logs["stock"])
        check_bound(flipped, np.array([flips_C[a:b].sum() for a, b in zip([0] + ends[:-1], ends)]),
                    f"rank {rank}: {c}")


def _worker(rank: int, world: int, ep: int, cases: list, tp: int = 1, pp: int = 1, cp: int = 1,
            features: bool = False, grouped: bool = False) -> None:
    import torch._dynamo

    from cpu_experts import install_fake_grouped_gemm
    from ddp_harness import cpu_megatron

    if grouped:
        install_fake_grouped_gemm()  # the legacy GroupedMLP's grouped_gemm, in plain torch
        torch._dynamo.config.disable = True  # Megatron's jit_fuser in the grouped modules: compile time only
    with cpu_megatron():
        for case in cases:
            c = draw(ep, world, case, tp, pp, cp, features, grouped)
            c["control"] = os.environ.get("RAILS_SWEEP_CONTROL") == "1"  # --control
            run_case(rank, ep, c)


def run(world: int, ep: int, case: int, tp: int = 1, pp: int = 1, cp: int = 1, features: bool = False,
        grouped: bool = False) -> None:
    """One case on `world` spawned ranks (raises on a mismatch). world = tp x cp x pp x data-
    parallel; ep divides world / pp (experts are neither tensor- nor context-parallel)."""
    vpp = draw(ep, world, case, tp, pp, cp, features, grouped).get("vpp", 1)
    spawn(_worker, world, ep, [case], tp, pp, cp, features, grouped, ep=ep,
          parallel=dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
                        expert_tensor_parallel_size=1,
                        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, help="gloo ranks")
    ap.add_argument("--ep", type=int, help="expert-parallel size (default: --world / --pp; divides it)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size, with sequence parallelism (experts "
                    "are not tensor-parallel: EP groups may span TP ranks)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (cases draw 1 or 2 model chunks per "
                    "stage: 1F1B or the interleaved schedule)")
    ap.add_argument("--cp", type=int, default=1, help="context-parallel size (each CP rank holds part of every "
                    "sequence; EP groups may span CP ranks)")
    ap.add_argument("--features", action="store_true", help="also draw Megatron MoE features: shared experts "
                    "(overlapped or not), capacity drops, sigmoid scores with expert bias, linear biases, aux loss")
    ap.add_argument("--grouped", action="store_true", help="grouped expert modules: TEGroupedMLP over a CPU "
                    "GroupedLinear (fused weight-gradient accumulation or not) or the legacy GroupedMLP")
    ap.add_argument("--cases", default="0:20", help="case numbers FIRST:END (END excluded)")
    ap.add_argument("--control", action="store_true", help="run the stock alltoall control of tests/flips.py in "
                    "every case (else only past its slack of routing flips), to check that it builds and runs")
    args = ap.parse_args(argv)
    if args.control:
        os.environ["RAILS_SWEEP_CONTROL"] = "1"  # the spawned ranks inherit it
    if args.world % (args.tp * args.pp * args.cp):
        ap.error(f"--world {args.world} is not a multiple of --tp x --pp x --cp = {args.tp * args.pp * args.cp}")
    ep = args.ep or args.world // args.pp
    if (args.world // args.pp) % ep:
        ap.error(f"--ep {ep} does not divide the {args.world // args.pp} ranks of a pipeline stage")
    first, end = (int(v) for v in args.cases.split(":"))
    failed = 0
    for case in range(first, end):
        c = draw(ep, args.world, case, args.tp, args.pp, args.cp, args.features, args.grouped)
        try:
            run(args.world, ep, case, args.tp, args.pp, args.cp, args.features, args.grouped)
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
