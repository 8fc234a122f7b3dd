"""Multi-rank check of RailsTokenDispatcher against Megatron-Core's stock alltoall dispatcher.

Made for one GPU shared by several ranks (CI has none, so it is run by hand; `--device cpu` runs the
same check on CPU and is what the test suite runs). Every rank owns EP rank r of one expert-parallel
group over gloo; on CUDA all ranks' tensors live on the one GPU and gloo stages them through host
memory. First, each rank checks that its backend moves its device's tensors through uneven
all_to_all_single and all_gather (exit 1 with the collective named if not).

Then, for every policy x comm (`direct`, and `rails` with the EP group split into 2 virtual nodes so
RailS sprays and dedup runs): the same skewed MoE layer with the stock `alltoall` dispatcher and with
ours, trained side by side for --steps optimizer steps (SGD with momentum) of --micro microbatches,
all but the last under `no_sync()` (weights fetched once per step, in the background from the plan
until first computed, gradients returned once). Compared, fp32 without TF32, max |ours - stock| <=
1e-5 max(1, max |stock|) per tensor: every microbatch's output and input gradient, every parameter
gradient (stock layout) before each optimizer step, every parameter after it. The exchanges must
have happened: weights moved (every balancing policy), sprayed token exchanges (`rails`), node dedup
(2 nodes); and slot gradients must have gone back at most once per step (on CUDA the backward runs on
autograd's device thread, where no_sync() must still hold). Rank 0 prints one line per case; exit
status 1 on any mismatch.

    python scripts/gpu_check.py                       # 4 ranks on cuda:0, every policy, both comms
    python scripts/gpu_check.py --device cpu --ranks 4 --hidden 16 --tokens 64
    python scripts/gpu_check.py --ranks 1 --backend nccl   # one NCCL rank (no exchange happens)
    python scripts/gpu_check.py --shared-experts --policies fsep   # shared experts on their stream
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile
import textwrap
import time
import traceback
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

POLICIES = ["none", "eplb", "ultraep", "lp", "fsep"]
COMMS = ["direct", "rails"]
TOL = 1e-5
EXPERTS, TOPK = 8, 2


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="gpu_check.py")
    p.add_argument("--ranks", type=int, default=4, help="EP ranks, all on one device (default 4)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                   help="nccl only with --ranks 1 (NCCL refuses two ranks on one GPU)")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=POLICIES)
    p.add_argument("--comms", nargs="+", choices=COMMS, default=COMMS)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    p.add_argument("--micro", type=int, default=2, help="microbatches per step (default 2)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank per microbatch")
    p.add_argument("--shared-experts", action="store_true",
                   help="add shared experts, on CUDA overlapped with the dispatcher (--moe-shared-expert-overlap: "
                        "the dispatcher runs them on their own stream)")
    p.add_argument("--perturb", action="store_true",
                   help="self-test: nudge one of our expert weights by 1e-3; the check must then fail")
    a = p.parse_args(argv)
    if a.backend == "nccl" and a.ranks != 1:
        p.error("--backend nccl needs --ranks 1: NCCL refuses two ranks on one GPU")
    if a.ranks < 1 or EXPERTS % a.ranks:
        p.error(f"--ranks must divide the {EXPERTS} experts")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device visible (use --device cpu)")
    return a


def _config(world: int, dispatcher: str, hidden: int, shared: bool = False, overlap: bool = False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    extra = dict(moe_shared_expert_intermediate_size=2 * hidden, moe_shared_expert_overlap=overlap) if shared else {}
    return TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=2, num_moe_experts=EXPERTS, moe_router_topk=TOPK,
        moe_token_dispatcher_type=dispatcher, ffn_hidden_size=2 * hidden, moe_ffn_hidden_size=2 * hidden,
        add_bias_linear=False, expert_model_parallel_size=world, use_cpu_initialization=True,
        moe_aux_loss_coeff=0.0, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        bias_activation_fusion=False, moe_router_load_balancing_type="none", init_method_std=0.2, **extra)


def _probe(dev: torch.device, rank: int, world: int) -> None:
    """Uneven all_to_all_single and all_gather on `dev` tensors, checked against their definition."""
    send_splits = [(rank + d) % 3 + 1 for d in range(world)]  # rank r sends (r + d) % 3 + 1 rows to d
    recv_splits = [(s + rank) % 3 + 1 for s in range(world)]
    x = torch.cat([torch.full((n, 2), 100.0 * rank + d, device=dev) for d, n in enumerate(send_splits)])
    y = torch.empty(sum(recv_splits), 2, device=dev)
    dist.all_to_all_single(y, x, recv_splits, send_splits)
    want = torch.cat([torch.full((n, 2), 100.0 * s + rank, device=dev) for s, n in enumerate(recv_splits)])
    if not torch.equal(y, want):
        raise RuntimeError(f"all_to_all_single moved {dev.type} tensors wrongly over {dist.get_backend()}")
    got = [torch.empty(3, device=dev) for _ in range(world)]
    dist.all_gather(got, torch.full((3,), float(rank), device=dev))
    if any(not torch.equal(g, torch.full((3,), float(s), device=dev)) for s, g in enumerate(got)):
        raise RuntimeError(f"all_gather moved {dev.type} tensors wrongly over {dist.get_backend()}")


def _stock_dispatcher(dev: torch.device) -> str:
    """Megatron-Core's alltoall dispatcher needs CUDA streams; on CPU its allgather one is the
    reference (the same expert math, a different exchange)."""
    return "alltoall" if dev.type == "cuda" else "allgather"


def _layers(world, policy, comm, a, dev):
    import megatron_rails
    from megatron_rails.megatron.compat import build_moe_layer

    torch.manual_seed(11)
    # overlapped shared experts need a CUDA stream, and the stock dispatcher that takes them is alltoall
    overlap = a.shared_experts and dev.type == "cuda"
    stock = build_moe_layer(_config(world, _stock_dispatcher(dev), a.hidden, a.shared_experts, overlap))
    # tolerances 0: every policy re-plans and RailS sprays at any imbalance; 2 virtual nodes (>= 2 ranks)
    megatron_rails.install({"policy": policy, "slots": 2, "comm": comm, "tolerance": 0.0, "window": 2,
                            "interval": 2, "ranks_per_node": max(1, world // 2), "dedup": True, "rails_tolerance": 0.0,
                            "check_plan": True})
    try:
        rails = build_moe_layer(_config(world, "alltoall", a.hidden, a.shared_experts, overlap))
    finally:
        megatron_rails.uninstall()
    rails.load_state_dict(stock.state_dict())
    # a router direction per expert: microbatch m leans on expert HOT[m], so counts differ between them
    u = torch.tensor(np.random.default_rng(3).standard_normal((EXPERTS, a.hidden)), dtype=torch.float32)
    u /= u.norm(dim=1, keepdim=True)
    with torch.no_grad():
        for layer in (stock, rails):
            layer.router.weight.add_(4.0 * u)
    if a.perturb:
        with torch.no_grad():
            name, p = next((n, p) for n, p in rails.named_parameters() if "experts" in n or "shards" in n)
            p.view(-1)[0] += 1e-3
    return stock.to(dev), rails.to(dev), u.to(dev)


def _batch(rank, step, micro, u, a, dev):
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    hot = (step + micro) % EXPERTS  # a different hot expert in every microbatch of a step
    x = torch.randn(a.tokens, a.hidden, generator=gen).to(dev) * 0.5 + 1.5 * u[hot] + 0.8 * u[(hot + 3) % EXPERTS]
    return x.view(a.tokens, 1, a.hidden)


def _grads(layer) -> dict:
    """Every parameter gradient in stock layout (FSEP's live on its shards: gathered, collective)."""
    grads = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
    store = getattr(layer.token_dispatcher, "store", None)
    if hasattr(store, "owner_layout_grads"):
        grads = {n: g for n, g in grads.items() if "shards" not in n}
        grads.update({f"experts.{k}": v for k, v in store.owner_layout_grads().items()})
    return grads


class _Diff:
    """The worst |ours - stock| relative to TOL * max(1, max |stock|) seen (per tensor), and where."""

    def __init__(self):
        self.ratio, self.abs, self.where = 0.0, 0.0, ""

    def add(self, got, ref, where: str) -> None:
        if got is None or got.shape != ref.shape:
            self.ratio, self.abs, self.where = float("inf"), float("inf"), f"{where} (missing or misshapen)"
            return
        err = (got.float() - ref.float()).abs()
        # fp32 to 1e-5 of the tensor's scale: a GEMM over fewer rows (a replica's share) may take
        # another cuBLAS kernel and round differently, ~1e-6 relative; a wrong or stale weight is O(1)
        scale = max(1.0, ref.float().abs().max().item()) if ref.numel() else 1.0
        ratio = err.max().item() / (TOL * scale) if err.numel() else 0.0
        if not math.isfinite(ratio):  # NaN compares false with everything: make it the worst
            ratio = math.inf
        if ratio > self.ratio or not self.where:
            self.ratio, self.abs, self.where = ratio, err.max().item() if err.numel() else 0.0, where


def _case(rank, world, policy, comm, a, dev) -> dict:
    from megatron_rails import no_sync

    stock, rails, u = _layers(world, policy, comm, a, dev)
    # a loss of order one whatever the shape: SGD then keeps the weights bounded (a diverging run
    # compares numbers too large for any tolerance)
    w = torch.linspace(-1, 1, a.tokens * a.hidden, device=dev).view(a.tokens, 1, a.hidden) / a.tokens
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (stock, rails)]
    diff = _Diff()
    t0 = time.perf_counter()
    for step in range(a.steps):
        for micro in range(a.micro):
            x = _batch(rank, step, micro, u, a, dev)
            got = []
            for layer in (stock, rails):
                gate = no_sync() if (layer is rails and micro < a.micro - 1) else contextlib.nullcontext()
                with gate:
                    xi = x.clone().requires_grad_(True)
                    out = layer(xi)[0]
                    (out * w).sum().backward()
                got.append((out.detach(), xi.grad))
            where = f"step {step} microbatch {micro} rank {rank}"
            diff.add(got[1][0], got[0][0], f"output, {where}")
            diff.add(got[1][1], got[0][1], f"input grad, {where}")
        ref, mine = _grads(stock), _grads(rails)
        for k, g in ref.items():
            diff.add(mine.get(k), g, f"grad {k}, step {step} rank {rank}")
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        ref, mine = stock.state_dict(), rails.state_dict()
        for k, v in ref.items():
            if torch.is_tensor(v):
                diff.add(mine.get(k), v, f"param {k} after step {step}, rank {rank}")
    if dev.type == "cuda":
        torch.cuda.synchronize()
    for name, layer in (("stock", stock), ("our", rails)):
        scale = max(p.abs().max().item() for p in layer.parameters() if p.numel())
        if not math.isfinite(scale) or scale > 100:
            diff.ratio, diff.where = math.inf, f"{name} weights ran away (max |w| {scale:.1e})"
    m = rails.token_dispatcher.metrics
    store = rails.token_dispatcher.store
    return {"returns": store.returns if store is not None else 0, "steps": a.steps, "ratio": diff.ratio, "abs": diff.abs, "where": diff.where, "s": time.perf_counter() - t0,
            "weight_bytes": sum(r["weight_bytes_sent"] for r in m), "sprayed": sum(bool(r["rails_sprayed"]) for r in m),
            "records": len(m), "fetches": sum(bool(r["slots_fetched"]) for r in m), "dedup": sum(bool(r["dedup"]) for r in m),
            "pairs_bytes": sum(r["internode_token_bytes_pairs"] for r in m),
            "units_bytes": sum(r["internode_token_bytes_dedup"] for r in m), "device": str(rails.router.weight.device)}


def _verdict(policy, comm, world, per_rank: list[dict]) -> tuple[bool, str]:
    worst = max(per_rank, key=lambda r: r["ratio"])
    ok, why = worst["ratio"] <= 1.0, []
    total = {k: sum(r[k] for r in per_rank) for k in ("weight_bytes", "sprayed", "dedup", "records", "fetches",
                                                      "pairs_bytes", "units_bytes")}
    if world > 1 and policy != "none" and total["weight_bytes"] == 0:
        ok, why = False, why + ["no weights moved"]
    if world > 2 and comm == "rails" and total["sprayed"] == 0:
        ok, why = False, why + ["RailS never sprayed"]
    if world > 2 and total["dedup"] != total["records"]:
        ok, why = False, why + [f"dedup ran in {total['dedup']} of {total['records']} layer calls"]
    returns, steps = max(r["returns"] for r in per_rank), per_rank[0]["steps"]
    if returns > steps:  # a backward inside no_sync() returned them (CUDA runs backward on another thread)
        ok, why = False, why + [f"gradients returned {returns} times in {steps} steps"]
    head = (f"{policy:8s} {comm:6s} {'ok ' if ok else 'BAD'} worst |diff| {worst['abs']:.1e} = "
            f"{worst['ratio']:.2f} of tol, {max(r['s'] for r in per_rank):.1f} s on {worst['device']}")
    body = (f"at {worst['where']}; weights {total['weight_bytes'] / 2**20:.1f} MiB in {total['fetches'] // world} "
            f"fetches, gradients back {returns} times, sprayed {total['sprayed']}/{total['records']}, dedup {total['pairs_bytes'] / 2**20:.2f} -> "
            f"{total['units_bytes'] / 2**20:.2f} MiB" + ("; " + ", ".join(why) if why else ""))
    # 80 columns: the verdict, then what was compared and moved, indented
    return ok, "\n".join([head] + textwrap.wrap(body, 80, initial_indent="    ", subsequent_indent="    "))


def _rank(rank, world, store, a) -> None:
    torch.set_num_threads(1 if a.device == "cpu" else 2)
    dev = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group(a.backend, init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=5), device_id=dev if a.backend == "nccl" else None)
    _probe(dev, rank, world)
    from megatron.core import parallel_state as ps

    if dev.type == "cpu":
        from megatron_rails.megatron import cpu_shims

        cpu_shims.apply()
    ps.initialize_model_parallel(expert_model_parallel_size=world, distributed_timeout_minutes=5)
    if dev.type == "cuda":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer.moe import moe_utils

        model_parallel_cuda_manual_seed(0)
        if not hasattr(moe_utils, "te_general_gemm"):  # 0.16.1's router names it even without Transformer Engine
            moe_utils.te_general_gemm = None
    if rank == 0:
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        print(textwrap.fill(f"gpu_check: {world} ranks on {name}, {a.backend}: all_to_all_single and all_gather "
                            f"carry {dev.type} tensors; stock dispatcher {_stock_dispatcher(dev)}; layer hidden "
                            f"{a.hidden}, {EXPERTS} experts top-{TOPK}, {a.tokens} tokens per rank, {a.steps} steps x "
                            f"{a.micro} microbatches", 80), flush=True)
    failed = 0
    for policy in a.policies:
        for comm in a.comms:
            res = _case(rank, world, policy, comm, a, dev)
            everyone = [None] * world
            dist.all_gather_object(everyone, res)
            ok, line = _verdict(policy, comm, world, everyone)
            failed += not ok
            if rank == 0:
                print(line, flush=True)
    if rank == 0:
        n = len(a.policies) * len(a.comms)
        print(f"gpu_check: FAILED: {failed} of {n} cases" if failed else
              f"gpu_check: every case ({n}) matches stock", flush=True)
    if failed:
        raise SystemExit(1)


def _entry(rank, world, store, a) -> None:
    from megatron_rails.runtime.comm.base import leave

    try:
        _rank(rank, world, store, a)
    except SystemExit as e:
        leave(int(e.code or 0))
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # peers waiting in a collective are ended by the parent
    leave(0)


SEND_ORDER_SHAPES = [(4096, 8, 2), (4096, 64, 6), (2048, 256, 8), (333, 8, 1)]  # (tokens, experts, top-k)


def _same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a.cpu(), b.cpu()))


def _send_order_paths(a) -> bool:
    """Before the ranks start: the send order's paths (host; device torch ops; on CUDA the Triton
    kernel where importable) on this device give the same tensors (pairs' tokens and probs,
    by_token, split sizes) for every policy at Mixtral-like and wide expert counts, uniform and
    zipf 1.2 routing."""
    import numpy as np

    from megatron_rails.bench.local import routing
    from megatron_rails.core.planners import make_planner
    from megatron_rails.core.policy import PolicyConfig
    from megatron_rails.runtime import local, local_triton

    dev = torch.device(a.device)
    paths = {"host": local.order_pairs, "device": local.order_pairs_on_device}
    if dev.type == "cuda" and local_triton.available():
        paths["triton"] = local.order_pairs_triton
    D, cases = 8, 0
    for T, E, k in SEND_ORDER_SHAPES:
        for s in (0.0, 1.2):
            maps = [routing(dict(tokens=T, experts=E, topk=k), s, 50 + d, dev) for d in range(D)]
            counts_DE = np.stack([m.sum(dim=0).cpu().numpy() for m, _ in maps]).astype(np.int64)
            for policy in POLICIES:
                plan, _ = (pl := make_planner(policy, PolicyConfig(policy=policy).planner_config(D, E))).plan(
                    counts_DE, pl.initial_state())
                me = int(np.argmax(plan.send_DD.sum(axis=0)))
                rmap, probs = maps[me]
                got = {}
                for name, fn in paths.items():
                    so = fn(plan, me, rmap, probs, True)
                    got[name] = (so.token_P, so.probs_P, so.by_token, so.send_D, so.recv_D)
                ref = got["host"]
                for name, g in got.items():
                    if not (all(_same(x, y) for x, y in zip(g[:3], ref[:3])) and g[3:] == ref[3:]):
                        print(f"gpu_check: FAILED: the {name} send order differs from the host's: {policy}, "
                              f"T={T} E={E} k={k} zipf {s}", flush=True)
                        return False
                cases += 1
    print(textwrap.fill(f"gpu_check: send order on {dev.type}: {', '.join(paths)} paths agree on {cases} cases "
                        f"(every policy, (T, E, k) in {SEND_ORDER_SHAPES}, uniform and zipf 1.2)", 80), flush=True)
    return True


def _gather_sum(a) -> bool:
    """On CUDA with Triton: the combine's gather-sum kernel against torch's gather and [k, T, H]
    sum, bit for bit, bf16 / fp16 / fp32 at Mixtral widths, for the k it serves (a mismatch fails
    the check); for k up to 8 it also reports whether the two agree (evidence for serving more)."""
    import numpy as np

    from megatron_rails.runtime import local_triton

    dev = torch.device(a.device)
    if dev.type != "cuda" or not local_triton.available():
        print("gpu_check: combine gather-sum: no CUDA Triton here, skipped", flush=True)
        return True
    rng = np.random.default_rng(0)
    agree = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for k in range(1, 9):
            for T, H in ((4096, 4096), (1024, 6144), (333, 1000)):
                y = torch.randn(k * T + 3, H, device=dev).to(dtype)
                by = torch.from_numpy(rng.permutation(k * T + 3)[:k * T]).to(dev)
                want = y.index_select(0, by)
                want = want if k == 1 else want.view(k, T, H).sum(0)
                # the kernel itself, beyond the k it serves too (gather_sum_fits draws that line)
                same = torch.equal(local_triton.gather_sum(y, by, k), want)
                agree[k] = agree.get(k, True) and same
                if not same and k <= local_triton.GATHER_SUM_MAX_K:
                    print(f"gpu_check: FAILED: the Triton gather-sum differs from torch's: {dtype}, k={k}, "
                          f"T={T}, H={H}", flush=True)
                    return False
    per_k = ", ".join(f"{k}: {'same' if v else 'differs'}" for k, v in agree.items())
    print(textwrap.fill("gpu_check: combine gather-sum (Triton) equals torch's bit for bit for k <= "
                        f"{local_triton.GATHER_SUM_MAX_K} (bf16, fp16, fp32); per k up to 8: {per_k}", 80), flush=True)
    return True


def main(argv=None) -> int:
    a = _parse(argv)
    import torch.multiprocessing as mp

    if not (_send_order_paths(a) and _gather_sum(a)):
        return 1

    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        try:
            mp.start_processes(_entry, args=(a.ranks, os.path.join(tmp, "store"), a), nprocs=a.ranks,
                               join=True, start_method="spawn")
        except mp.ProcessExitedException as err:
            print(f"gpu_check: {err}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
