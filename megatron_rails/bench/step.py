"""`megatron-rails bench step`: training-step time per policy, with gradient accumulation.

A model of two MoE layers (residual), compute-dominant on CPU, trained by N gloo ranks pinned one
per core (ranks sharing a core cannot show stragglers: only total work would count). One optimizer
step = M microbatches (all but the last under `megatron_rails.no_sync()`, as Megatron's schedules
run them) then SGD. Routing: uniform, zipf 1.2, zipf 2.0 (every microbatch its own tokens, so
counts vary within a step) and forced-balanced (every expert the same count: the ideal).

Every (routing, policy) pair runs one step per round, in an order drawn afresh each round (seeded,
the same on every rank), so slow spells of the machine hit all alike and no case always follows
the same one; ratios are taken within a round and their median reported:
    ratio_vs_none = this step / policy none's step (same routing, same round)
    of_ideal      = policy none's forced-balanced step / this step (same round)
with their quartiles over the rounds beside them (`*_q25`, `*_q75`: how far one round strays).
Per row also: max/mean tokens per rank after balancing, expert-weight bytes moved per step (fetch
and gradient return) beside what per-microbatch movement would send, and expert bytes per rank
(parameters + gradients of the experts and the resident slots, measured by storage).

The ranks run with glibc's malloc told to keep freed memory (MALLOC_MMAP_THRESHOLD_ at its 32 MiB
maximum, MALLOC_TRIM_THRESHOLD_ at 2 GiB, unless already set), as CUDA's caching allocator does.
Left to its dynamic threshold, glibc maps blocks of a few MiB afresh or keeps them depending on
which large blocks the process freed before, so one case's page faults (tens of thousands per
step, several percent of it) depended on the cases that ran before it in the same process. Kept,
the heap still grows into fresh pages for as long as the cases' blocks fragment it (measured with
four of the cases in one process, after four warm-up rounds: some cases took 1,000-3,000 faults a
step, and which ones moved when one policy's allocations changed), so before the first round
every rank touches HEAP_TOUCH bytes of heap and frees them (`--quick`: an eighth): the heap's top
then holds pages already mapped, as a warm caching allocator's pool does. Each row reports its
steps' minor page faults (`minor_faults_p50`, from getrusage on every rank; the larger rank's
median).
"""
from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..core.limits import cores_for_ranks
from ..core.outfile import save_figure, summary_stream, write_text
from ..core.policy import as_policy
from ..megatron import models
from ..megatron.install import install, uninstall
from ..runtime.comm.base import leave
from ..runtime.residency import no_sync
from ..sim.term import quiet_children, wrapped
from .dispatcher import _skew_router

SHAPE = dict(layers=2, hidden=256, ffn=1024, experts=8, topk=2, tokens=512)
QUICK_SHAPE = dict(SHAPE, tokens=128)
POLICIES = ["none", "eplb", "ultraep", "lp", "fsep", "default"]  # default: the shipped default config
SKEWS = {"uniform": 0.0, "zipf:1.2": 1.2, "zipf:2.0": 2.0, "balanced": None}
# untimed rounds. glibc keeps fsep's large per-step buffers (window weights, accumulator, gradient
# return: one block of a layer's slots each) from reusing the freed blocks of the step before (an
# aligned request needs a little more than the block freed), so the heap grows until freed blocks
# have merged: counted with getrusage in the full benchmark, fsep and default took 3,000-9,000 minor
# page faults per step in their first three rounds and under 10 from the fourth on (every other
# policy under 30 from the second); the heap then stays put. A long training run never sees it.
WARMUP = 3
HEAP_TOUCH = 1 << 30  # bytes of heap each rank touches and frees before the first round
HEAP_BLOCK = 16 << 20  # below the mmap threshold: the blocks come from the heap, not mmap
LR = 1e-3
PLACEHOLDER_BYTES = 8  # fsep's freed stock parameters share one element per layer (at most fp64)


class BenchError(ValueError):
    """Bad arguments for the step benchmark (one line, no traceback)."""


def _policy(name: str):
    if name == "default":
        return as_policy("default")
    return {"policy": name, "comm": "direct"}


def _model(world: int, shape: dict, policy: str, s):
    """Two MoE layers built under `policy`, routers skewed zipf(s) (s None: forced-balanced)."""
    cfg = models.transformer_config(
        num_layers=1, hidden_size=shape["hidden"], num_attention_heads=4, num_moe_experts=shape["experts"],
        moe_router_topk=shape["topk"], moe_token_dispatcher_type="alltoall", ffn_hidden_size=shape["ffn"],
        moe_ffn_hidden_size=shape["ffn"], add_bias_linear=False, expert_model_parallel_size=world,
        use_cpu_initialization=True, moe_aux_loss_coeff=0.0, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, bias_activation_fusion=False,
        moe_router_load_balancing_type="none")
    install(_policy(policy))
    try:
        torch.manual_seed(0)
        layers = torch.nn.ModuleList([models.build_moe_layer(cfg) for _ in range(shape["layers"])])
    finally:
        uninstall()
    u = _direction(shape["hidden"])
    for layer in layers:
        if s is None:
            models.force_balanced_routing(layer)
        else:
            _skew_router(layer.router.weight, u, s)
    return layers


def _direction(H: int) -> torch.Tensor:
    u = np.random.default_rng(5).standard_normal(H)
    return torch.tensor(u / np.linalg.norm(u), dtype=torch.float32)


def _microbatches(rank: int, shape: dict, m: int) -> list[torch.Tensor]:
    """m inputs [T, 1, H] of this rank: noise plus 2 u (the router's skew direction), each its own."""
    H, T = shape["hidden"], shape["tokens"]
    u = _direction(H).numpy()
    rng = np.random.default_rng(100 + rank)
    return [torch.tensor(rng.standard_normal((T, H)) * 0.5 + 2.0 * u, dtype=torch.float32).view(T, 1, H)
            for _ in range(m)]


def _forward(layers, x):
    for layer in layers:
        x = x + layer(x)[0]
    return x


def _step(layers, opt, xs) -> None:
    """One optimizer step: every microbatch but the last accumulates under no_sync()."""
    for i, x in enumerate(xs):
        with no_sync() if i < len(xs) - 1 else _Null():
            (_forward(layers, x).pow(2).mean() / len(xs)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


MALLOC_KEEP = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(2 << 30)}


def expert_bytes(layer) -> tuple[int, int]:
    """(bytes of the experts module's parameters and gradients, distinct storages; bytes of the
    resident slots' weights and their gradient accumulator, in the store's gradient dtype) for one
    layer on a rank."""
    seen = {}
    for p in layer.experts.parameters():
        for t in (p, p.grad):
            if t is not None:
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    store = layer.token_dispatcher.store
    w = store.window
    acc_size = torch.empty((), dtype=store.acc_dtype).element_size()
    slots = w.weights_NW.numel() * (w.weights_NW.element_size() + acc_size) if w is not None and w.moved else 0
    return sum(seen.values()), slots


def _measure_memory(layers, xs) -> tuple[int, int]:
    """expert_bytes summed over layers, right after a step's last backward (gradients present)."""
    for i, x in enumerate(xs):
        with no_sync() if i < len(xs) - 1 else _Null():
            (_forward(layers, x).pow(2).mean() / len(xs)).backward()
    got = np.sum([expert_bytes(layer) for layer in layers], axis=0)
    for p in layers.parameters():
        p.grad = None
    return int(got[0]), int(got[1])


def _median_and_quartiles(name: str, per_round: np.ndarray) -> dict:
    q25, q50, q75 = np.percentile(per_round, [25, 50, 75])
    return {name: float(q50), f"{name}_q25": float(q25), f"{name}_q75": float(q75)}


def _touch_heap(nbytes: int) -> None:
    """Grow the heap by `nbytes` of touched pages and free them (see the module docstring)."""
    blocks = [torch.ones(HEAP_BLOCK // 4) for _ in range(max(0, nbytes) // HEAP_BLOCK)]
    del blocks


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _worker(rank, world, store, shape, micro, reps, warmup, out, heap_touch=HEAP_TOUCH):
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})  # one core per rank
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    models.init_model_parallel(world)
    cases = [(skew, p) for skew in SKEWS for p in POLICIES]
    built = {(skew, p): _model(world, shape, p, SKEWS[skew]) for skew, p in cases}
    opts = {c: torch.optim.SGD(m.parameters(), lr=LR) for c, m in built.items()}
    xs = _microbatches(rank, shape, micro)
    times = {c: [] for c in cases}
    faults = {c: [] for c in cases}
    _touch_heap(heap_touch)
    for it in range(reps + warmup):
        # a fresh order every round: rotating one fixed order, each case always ran right after the
        # same other, and that placement showed (fsep and default, one computation on one node,
        # came out 1-1.5% apart in four runs; in random order 0.01% apart; cause not found)
        for i in np.random.default_rng(it).permutation(len(cases)):
            c = cases[i]
            dist.barrier()
            f0, t0 = _minor_faults(), time.perf_counter()
            _step(built[c], opts[c], xs)
            dist.barrier()
            if it >= warmup:
                times[c].append(time.perf_counter() - t0)
                faults[c].append(_minor_faults() - f0)
        if rank == 0:
            print(f"  round {it + 1}/{reps + warmup} done", file=sys.stderr, flush=True)
    steps = reps + warmup
    ideal = np.array(times[("balanced", "none")])
    fault_p50 = torch.tensor([float(np.median(faults[c])) for c in cases])
    dist.all_reduce(fault_p50, op=dist.ReduceOp.MAX)
    rows = []
    for i, (skew, p) in enumerate(cases):
        t = np.array(times[(skew, p)])
        recs = [r for layer in built[(skew, p)] for r in layer.token_dispatcher.metrics]
        fetch = sum(r["weight_bytes_sent"] for r in recs) / steps
        experts, slots = _measure_memory(built[(skew, p)], xs)
        per_micro = sum(r["weight_bytes_if_fetched"] for r in recs) / steps
        rows.append({"policy": p, "skew": skew, "step_ms_p50": float(np.median(t) * 1e3),
                     **_median_and_quartiles("ratio_vs_none", t / np.array(times[(skew, "none")])),
                     **_median_and_quartiles("of_ideal", ideal / t),
                     "max_over_mean_before": float(np.mean([r["max_over_mean_before"] for r in recs])),
                     "max_over_mean_after": float(np.mean([r["max_over_mean_after"] for r in recs])),
                     # fetched once, gradients returned once (the same size in fp32; under bf16 with
                     # an fp32 main_grad the return is twice the fetch)
                     "weight_bytes_per_step": 2.0 * fetch,
                     "weight_bytes_per_step_if_per_microbatch": 2.0 * per_micro,
                     "expert_bytes_per_rank": experts + slots, "slot_bytes": slots,
                     # what the stores keep for the step's buffers (runtime/hostbuf.py), in use or not
                     "host_blocks_bytes": sum(layer.token_dispatcher.store.blocks.kept_bytes()
                                              for layer in built[(skew, p)]),
                     "minor_faults_p50": float(fault_p50[i])})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    leave()  # ends the process: see runtime/comm/base.leave


def targets(rows: list[dict]) -> dict:
    """The issue's targets, checked on the rows (True: met)."""
    by = {(r["skew"], r["policy"]): r for r in rows}
    stock_bytes = by[("uniform", "none")]["expert_bytes_per_rank"]
    fsep = by[("uniform", "fsep")]
    return {
        "uniform_ratio_vs_none_le_1.03": {p: by[("uniform", p)]["ratio_vs_none"] <= 1.03 for p in POLICIES},
        "zipf_of_ideal": {f"{s} {p}": by[(s, p)]["of_ideal"] >= (0.95 if p in ("ultraep", "lp") else 0.93)
                          for s in ("zipf:1.2", "zipf:2.0") for p in ("ultraep", "lp", "fsep", "default")},
        "fsep_uniform_weight_bytes_le_quarter_of_per_microbatch":
            fsep["weight_bytes_per_step"] <= fsep["weight_bytes_per_step_if_per_microbatch"] / 4,
        # + the one element per layer the freed stock parameters point at (runtime/sharded.py)
        "fsep_expert_bytes_le_stock_plus_slots":
            fsep["expert_bytes_per_rank"] <= stock_bytes + fsep["slot_bytes"] + PLACEHOLDER_BYTES * SHAPE["layers"],
    }


def bench_step(out: str, ranks: int = 2, microbatches: int = 8, quick: bool = False, plot: str | None = None,
               reps: int | None = None) -> dict:
    try:
        cores_for_ranks(ranks)
    except ValueError as e:
        raise BenchError(str(e)) from None
    if microbatches < 1:
        raise BenchError(f"--microbatches {microbatches}: need at least 1")
    if ranks == 1:
        print(wrapped("step bench: --ranks 1: one EP rank has nothing to balance, so every policy runs as "
                      "none (a smoke run; ratios mean nothing)"), file=sys.stderr)
    shape = QUICK_SHAPE if quick else SHAPE
    reps = reps if reps is not None else (1 if quick else 6)
    warmup = 0 if quick else WARMUP
    heap_touch = HEAP_TOUCH // 8 if quick else HEAP_TOUCH
    print(wrapped(f"step bench: {ranks} gloo ranks (one core each), {shape['layers']} MoE layers, hidden "
                  f"{shape['hidden']}, ffn {shape['ffn']}, {shape['experts']} experts top-{shape['topk']}, "
                  f"{shape['tokens']} tokens/rank/microbatch, {microbatches} microbatches/step, "
                  f"{len(SKEWS) * len(POLICIES)} cases x {reps + warmup} rounds"), file=sys.stderr)
    kept = {k: os.environ.get(k) for k in MALLOC_KEEP}
    malloc = {k: kept[k] or v for k, v in MALLOC_KEEP.items()}
    os.environ.update(malloc)  # read by the ranks' glibc
    try:
        # rank 0's rows beside the rendezvous, in a directory of our own (not beside --out: /dev/stdout)
        with tempfile.TemporaryDirectory(prefix="rails-bench-") as rdzv:
            with quiet_children():
                mp.start_processes(_worker, args=(ranks, f"{rdzv}/store", shape, microbatches, reps, warmup,
                                                  f"{rdzv}/rows.json", heap_touch), nprocs=ranks, start_method="spawn")
            with open(f"{rdzv}/rows.json") as f:
                rows = json.load(f)
    finally:
        for k, v in kept.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    res = {"meta": {"command": "megatron-rails bench step", "ranks": ranks, "microbatches": microbatches,
                    "shape": shape, "reps": reps, "warmup": warmup, "lr": LR,
                    "malloc": malloc, "heap_touched_bytes": heap_touch,
                    "note": "CPU gloo, one rank per core. ratio_vs_none and of_ideal are medians of ratios "
                            "taken within a round (see megatron_rails/bench/step.py)."},
           "rows": rows, "targets": targets(rows)}
    write_text(out, json.dumps(res, indent=1))  # the results first: a figure that fails loses none of them
    print_table(rows, summary_stream(out))
    if plot is not False:
        plot_step(res, plot or os.path.splitext(out)[0] + ".png")
    return res


def print_table(rows: list[dict], stream) -> None:
    """The rows as a terminal table at the console's width (80 columns when not a terminal; the
    quartiles are in the JSON, and in `markdown_table` for docs/benchmarks.md)."""
    from ..sim.term import console, note, table

    t = table("bench step: per optimizer step, medians over rounds",
              ["routing", "policy", "step\nms", "vs\nnone", "of\nideal", "max/\nmean", "weight\nMB/step",
               "expert\nMB/rank"], left=("routing", "policy"))
    for r in rows:
        t.add_row(r["skew"], r["policy"], f"{r['step_ms_p50']:.0f}", f"{r['ratio_vs_none']:.3f}",
                  f"{r['of_ideal']:.3f}", f"{r['max_over_mean_after']:.2f}",
                  f"{r['weight_bytes_per_step'] / 1e6:.1f}", f"{r['expert_bytes_per_rank'] / 1e6:.1f}")
    con = console(t, file=stream)
    con.print(t)
    note(con, "vs none: this step over none's in the same round; of ideal: none's forced-balanced step over "
              "this one; max/mean: tokens on the busiest rank over the mean, after planning; weight MB/step: "
              "slot weights fetched plus gradients returned; expert MB/rank: experts' and slots' parameters "
              "and gradients")


def markdown_table(rows: list[dict]) -> str:
    """The rows as a markdown table (docs/benchmarks.md)."""
    head = ("| routing | policy | step ms | vs none (quartiles) | of ideal (quartiles) | max/mean after | "
            "weight MB/step (per-microbatch) | expert MB/rank |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['skew']} | {r['policy']} | {r['step_ms_p50']:.0f} | {_spread(r, 'ratio_vs_none')} | "
                     f"{_spread(r, 'of_ideal')} | {r['max_over_mean_after']:.2f} | {r['weight_bytes_per_step'] / 1e6:.1f} "
                     f"({r['weight_bytes_per_step_if_per_microbatch'] / 1e6:.1f}) | "
                     f"{r['expert_bytes_per_rank'] / 1e6:.1f} |")
    return "\n".join(lines)


def _spread(r: dict, name: str) -> str:
    """'median (q25–q75)'."""
    return f"{r[name]:.3f} ({r[name + '_q25']:.3f}–{r[name + '_q75']:.3f})"


def plot_step(res: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    skews = list(dict.fromkeys(r["skew"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4.6))
    width = 0.8 / len(POLICIES)
    for i, p in enumerate(POLICIES):
        vals = [next(r["of_ideal"] for r in rows if r["skew"] == s and r["policy"] == p) for s in skews]
        ax.bar(np.arange(len(skews)) + i * width, vals, width, label=p)
    ax.axhline(1.0, color="k", lw=0.8, label="ideal (forced-balanced none)")
    ax.axhline(0.95, color="k", lw=0.8, ls="--", label="target at zipf: ultraep, lp >= 0.95")
    ax.axhline(0.93, color="gray", lw=0.8, ls=":", label="target at zipf: fsep, default >= 0.93")
    ax.set_xticks(np.arange(len(skews)) + width * (len(POLICIES) - 1) / 2, skews)
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("forced-balanced step / this step")
    ax.set_title(f"bench step: {res['meta']['ranks']} ranks, {res['meta']['microbatches']} microbatches per step")
    # outside the axes: inside, it hides bars
    ax.legend(ncol=3, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    fig.tight_layout()
    save_figure(fig, png, dpi=120)
    plt.close(fig)
