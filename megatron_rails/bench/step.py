"""`megatron-rails bench step`: training-step time per policy against stock Megatron-Core, with
gradient accumulation, on named routing workloads.

A model of two MoE layers (residual), compute-dominant on CPU, trained by N gloo ranks pinned one
per core (ranks sharing a core cannot show stragglers: only total work would count). One optimizer
step = M microbatches (all but the last under `megatron_rails.no_sync()`, as Megatron's schedules
run them) then SGD. Routing: every router hands the dispatcher the exact routing map of a workload
(core/step_workloads.py: balanced, hot experts on one rank or spread, moderate skew, skew in the
source, zero-load experts, a rotating hot spot, a burst, zipf, the demo model's recorded routing),
a function of (workload, seed, step, microbatch, layer, rank): every case of a workload sees the
same tokens go to the same experts. `stock` is Megatron-Core's own MoEAlltoAllTokenDispatcher (on CPU through the stand-ins
of megatron_rails.megatron.cpu_shims.stock_alltoall around its split-size copy; equal to stock
allgather there, tests/test_bench_step.py); `default` is the shipped default config; the other
policies run over the direct exchange.

The workloads run one after the other; within one, every policy and the ideal (stock on balanced
routing) runs one step per round, in an order drawn afresh each round (seeded, the same on every
rank), so slow spells of the machine hit all alike and no case always follows the same one;
ratios are taken within a round and their median reported:
    ratio_vs_stock = this step / stock's step (same workload, same round)
    of_ideal       = stock's balanced step / this step (same round)
with their quartiles over the rounds beside them (`*_q25`, `*_q75`: how far one round strays).
Per row also: stock's max/mean tokens per rank (from the workload's counts) and the policy's
after balancing, expert-weight bytes moved per step (fetch and gradient return) beside what
per-microbatch movement would send, re-layouts per step (microbatch records, over layers, that
fetched slot weights), and expert bytes per rank after a step's last backward: the experts'
parameters and gradients by storage, and the resident slots' weights by storage with their gradient
accumulator at the weights' size in its dtype (held until the step's gradient return, which has
freed it by then); the busiest rank's, and the most slot bytes a rank held.

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

import contextlib
import dataclasses
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
from ..core.errors import WorkloadError
from ..core.step_workloads import (DEFAULT_WORKLOADS, SHIPPED, TRACE, WORKLOADS, counts_E, parse_workloads,
                                   routing_for, stock_max_over_mean, use_trace)
from ..core.workloads import load_counts
from ..megatron import models, trace_log
from ..megatron.cpu_shims import stock_alltoall
from ..megatron.install import install, uninstall
from ..runtime.comm.base import leave
from ..runtime.residency import no_sync
from ..sim.term import quiet_children, wrapped

SHAPE = dict(layers=2, hidden=256, ffn=1024, experts=8, topk=2, tokens=512)
QUICK_SHAPE = dict(SHAPE, tokens=128)
POLICIES = ["stock", "none", "eplb", "ultraep", "lp", "fsep", "default"]  # default: the shipped default config
BALANCERS = POLICIES[2:]  # what balances (none: our dispatcher on stock's placement)
IDEAL = ("balanced", "stock")  # of_ideal's reference, timed in every workload's rounds
# untimed rounds. glibc keeps fsep's large per-step buffers (window weights, accumulator, gradient
# return: one block of a layer's slots each) from reusing the freed blocks of the step before (an
# aligned request needs a little more than the block freed), so the heap grows until freed blocks
# have merged: counted with getrusage in the full benchmark, fsep and default took 3,000-9,000 minor
# page faults per step in their first three rounds and under 10 from the fourth on (every other
# policy under 30 from the second); the heap then stays put. The first workload warms up for
# WARMUP rounds, the later ones (the heap grown by then, the models new) for WARMUP_NEXT.
WARMUP, WARMUP_NEXT = 3, 0
REPS = 4
HEAP_TOUCH = 1 << 30  # bytes of heap each rank touches and frees before the first round
HEAP_BLOCK = 16 << 20  # below the mmap threshold: the blocks come from the heap, not mmap
LR = 1e-3
SEED = 0  # the workloads' seed
PLACEHOLDER_BYTES = 8  # fsep's freed stock parameters share one element per layer (at most fp64)


class BenchError(ValueError):
    """Bad arguments for the step benchmark (one line, no traceback)."""


RECORDED = "default+trace"  # --record: the default with the routing recorder on (megatron/trace_log.py)
_trace_out: list[str] = []  # the recorded case's trace file, set by each rank's worker


def _policy(name: str):
    if name == "default":
        return as_policy("default")
    if name == RECORDED:
        return dataclasses.replace(as_policy("default"), trace=_trace_out[0])
    return {"policy": name, "comm": "direct"}


class Clock:
    """Where the bench is: the step and microbatch every router's workload routing is drawn for."""

    step = 0
    micro = 0


def _chooser(workload: str, layer: int, rank: int, clock: type[Clock]):
    def choose(T: int, E: int, k: int) -> torch.Tensor:
        return torch.from_numpy(routing_for(workload, SEED, clock.step, clock.micro, layer, rank, T, E, k).copy())

    return choose


def build(world: int, shape: dict, policy: str, workload: str, rank: int, clock: type[Clock] = Clock,
          stock_dispatcher: str = "alltoall"):
    """Two MoE layers under `policy` (stock: Megatron-Core's `stock_dispatcher`, alltoall; allgather
    is the tests' reference; None: whatever megatron_rails.install() set, as the launcher does), weights
    seeded (the same under every policy), every router routing by `workload` at `clock`'s step and
    microbatch."""
    cfg = models.transformer_config(
        num_layers=1, hidden_size=shape["hidden"], num_attention_heads=4, num_moe_experts=shape["experts"],
        moe_router_topk=shape["topk"], ffn_hidden_size=shape["ffn"],
        moe_token_dispatcher_type=stock_dispatcher if policy == "stock" else "alltoall",
        moe_ffn_hidden_size=shape["ffn"], add_bias_linear=False, expert_model_parallel_size=world,
        use_cpu_initialization=True, moe_aux_loss_coeff=0.0, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, bias_activation_fusion=False,
        moe_router_load_balancing_type="none")
    ours = policy not in ("stock", None)
    if ours:
        install(_policy(policy))
    try:
        with _stock(policy):
            torch.manual_seed(0)
            layers = torch.nn.ModuleList([models.build_moe_layer(cfg) for _ in range(shape["layers"])])
    finally:
        if ours:
            uninstall()
    for y, layer in enumerate(layers):
        models.route_by(layer, _chooser(workload, y, rank, clock))
    return layers


def _stock(policy: str):
    """Where stock's dispatcher is built and run: inside the CPU stand-ins."""
    return stock_alltoall() if policy == "stock" else contextlib.nullcontext()


def _microbatches(rank: int, shape: dict, m: int) -> list[torch.Tensor]:
    """m inputs [T, 1, H] of this rank, each its own (the routing does not depend on them)."""
    H, T = shape["hidden"], shape["tokens"]
    rng = np.random.default_rng(100 + rank)
    return [torch.tensor(rng.standard_normal((T, H)) * 0.5, dtype=torch.float32).view(T, 1, H) for _ in range(m)]


def _forward(layers, x):
    for layer in layers:
        x = x + layer(x)[0]
    return x


def _step(layers, opt, xs, step: int, policy: str, clock: type[Clock] = Clock, probe=None) -> None:
    """One optimizer step: every microbatch but the last accumulates under no_sync(); `probe(layers)`
    runs after the last backward, gradients present (the memory measurement)."""
    clock.step = step
    with _stock(policy):
        for i, x in enumerate(xs):
            clock.micro = i
            with no_sync() if i < len(xs) - 1 else contextlib.nullcontext():
                (_forward(layers, x).pow(2).mean() / len(xs)).backward()
        if probe is not None:
            probe(layers)
        opt.step()
        opt.zero_grad(set_to_none=True)


MALLOC_KEEP = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(2 << 30)}


def expert_bytes(layer) -> tuple[int, int]:
    """(bytes of the experts module's parameters and gradients, distinct storages; bytes of the
    resident slots' weights and of their gradient accumulator as the step held it, the weights'
    numel in the store's gradient dtype: after the gradient return it is freed) for one layer on a
    rank (stock: no slots)."""
    seen = {}
    for p in layer.experts.parameters():
        for t in (p, p.grad):
            if t is not None:
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
    store = getattr(layer.token_dispatcher, "store", None)
    w = store.window if store is not None else None
    slots = 0
    if w is not None and w.moved:
        acc_size = torch.empty((), dtype=store.acc_dtype).element_size()
        slots = w.weights_NW.numel() * (w.weights_NW.element_size() + acc_size)
    return sum(seen.values()), slots


def memory_probe(into: dict, case: str):
    """A `_step` probe putting expert_bytes summed over the layers, (experts, slots), in into[case]:
    taken in a case's last timed round (iterating the parameters costs microseconds against a step of
    seconds), not in a step of its own."""
    def probe(layers):
        got = np.sum([expert_bytes(layer) for layer in layers], axis=0)
        into[case] = (int(got[0]), int(got[1]))

    return probe


def _median_and_quartiles(name: str, per_round: np.ndarray) -> dict:
    q25, q50, q75 = np.percentile(per_round, [25, 50, 75])
    return {name: float(q50), f"{name}_q25": float(q25), f"{name}_q75": float(q75)}


def _touch_heap(nbytes: int) -> None:
    """Grow the heap by `nbytes` of touched pages and free them (see the module docstring)."""
    blocks = [torch.ones(HEAP_BLOCK // 4) for _ in range(max(0, nbytes) // HEAP_BLOCK)]
    del blocks


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _worker(rank, world, store, shape, micro, reps, warmups, workloads, out, heap_touch=HEAP_TOUCH, trace=None,
            record=False):
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})  # one core per rank
    _trace_out[:] = [os.path.join(os.path.dirname(store), "recorded.npz")]
    policies = [*POLICIES, RECORDED] if record else list(POLICIES)
    torch.set_num_threads(1)
    if trace is not None:
        use_trace(trace, shape["experts"], micro)
    for name in SHIPPED:  # a recorded workload's microbatch m of step s: its call s M + m
        if name in workloads:
            use_trace(None, shape["experts"], micro, name)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    models.init_model_parallel(world)
    xs = _microbatches(rank, shape, micro)
    ideal = build(world, shape, IDEAL[1], IDEAL[0], rank)
    ideal_opt = torch.optim.SGD(ideal.parameters(), lr=LR)
    ideal_steps = 0
    _touch_heap(heap_touch)
    rows = []
    for w, (workload, warmup) in enumerate(zip(workloads, warmups)):
        cases = list(policies) if workload == IDEAL[0] else [*policies, "ideal"]
        built = {p: build(world, shape, p, workload, rank) for p in policies}
        built["ideal"], policy_of = ideal, dict({p: p for p in policies}, ideal="stock")
        opts = {p: torch.optim.SGD(m.parameters(), lr=LR) for p, m in built.items() if p != "ideal"}
        opts["ideal"] = ideal_opt
        times = {c: [] for c in cases}
        faults = {c: [] for c in cases}
        memory = {}
        for it in range(reps + warmup):
            # a fresh order every round: rotating one fixed order, each case always ran right after the
            # same other, and that placement showed (fsep and default, one computation on one node,
            # came out 1-1.5% apart in four runs; in random order 0.01% apart; cause not found)
            for i in np.random.default_rng([w, it]).permutation(len(cases)):
                c = cases[i]
                step = ideal_steps if c == "ideal" else it
                dist.barrier()
                f0, t0 = _minor_faults(), time.perf_counter()
                last = it == reps + warmup - 1 and c != "ideal"
                _step(built[c], opts[c], xs, step, policy_of[c], probe=memory_probe(memory, c) if last else None)
                dist.barrier()
                ideal_steps += c == "ideal"
                if it >= warmup:
                    times[c].append(time.perf_counter() - t0)
                    faults[c].append(_minor_faults() - f0)
            if rank == 0:
                print(f"  {workload} ({w + 1}/{len(workloads)}): round {it + 1}/{reps + warmup} done",
                      file=sys.stderr, flush=True)
        steps = reps + warmup
        ref = np.array(times["ideal" if "ideal" in times else "stock"])
        fault_p50 = torch.tensor([float(np.median(faults[p])) for p in policies])
        dist.all_reduce(fault_p50, op=dist.ReduceOp.MAX)
        # the busiest rank's expert bytes (replicas sit on the ranks the hot ones hand work to)
        held = torch.tensor([[float(sum(memory[p])), float(memory[p][1])] for p in policies], dtype=torch.float64)
        dist.all_reduce(held, op=dist.ReduceOp.MAX)
        E, k, T, Y = shape["experts"], shape["topk"], shape["tokens"], shape["layers"]
        stock_mm = float(np.mean([stock_max_over_mean(np.stack([counts_E(workload, SEED, i, m, y, d, T, E, k)
                                                                  for d in range(world)]))
                                  for i in range(steps) for m in range(micro) for y in range(Y)]))
        recorder = trace_log.recorders().get(_trace_out[0]) if record else None
        if recorder is not None:  # the recording rank: what recording took, then what finishing the file takes
            record_s, f0 = recorder.seconds, time.perf_counter()
            trace_log.close_all()
            flush_s = time.perf_counter() - f0
        for n, p in enumerate(policies):
            t = np.array(times[p])
            layers = built[p]
            recs = [r for layer in layers for r in getattr(layer.token_dispatcher, "metrics", ())]
            fetch = sum(r["weight_bytes_sent"] for r in recs) / steps
            per_micro = sum(r["weight_bytes_if_fetched"] for r in recs) / steps
            held_bytes, slots = int(held[n, 0]), int(held[n, 1])
            stores = [layer.token_dispatcher.store for layer in layers if p != "stock"]
            rows.append({"policy": p, "workload": workload, "step_ms_p50": float(np.median(t) * 1e3),
                         **_median_and_quartiles("ratio_vs_stock", t / np.array(times["stock"])),
                         **_median_and_quartiles("of_ideal", ref / t),
                         "stock_max_over_mean": stock_mm,
                         "max_over_mean_after": float(np.mean([r["max_over_mean_after"] for r in recs]))
                         if recs else stock_mm,
                         # fetched once, gradients returned once (the same size in fp32; under bf16
                         # with an fp32 main_grad the return is twice the fetch)
                         "weight_bytes_per_step": 2.0 * fetch,
                         "weight_bytes_per_step_if_per_microbatch": 2.0 * per_micro,
                         # windows that moved weights (a fetch on stock's placement moves none)
                         "relayouts_per_step": sum(bool(r["slots_fetched"]) and r["weight_bytes_sent"] > 0
                                                   for r in recs) / steps,
                         "expert_bytes_per_rank": held_bytes, "slot_bytes": slots,
                         # what the stores keep for the step's buffers (runtime/hostbuf.py), in use or not
                         "host_blocks_bytes": sum(st.blocks.kept_bytes() for st in stores),
                         "minor_faults_p50": float(fault_p50[n])})
            if p == RECORDED:
                rows[-1].update(_median_and_quartiles("ratio_vs_default", t / np.array(times["default"])))
                if recorder is not None:
                    rows[-1].update(record_ms_per_step=record_s * 1e3 / steps, trace_flush_ms=flush_s * 1e3,
                                    trace_rows=recorder.stream.rows)
        trace_log.close_all()  # every rank: the next workload's layers start the file anew
        del built, opts
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    leave()  # ends the process: see runtime/comm/base.leave


TRACE_TEXT = ("a recorded trace: microbatch m of step s, layer y, rank d route like its call (s M + m) mod I, "
              "layer y mod Y, rank d mod D, rescaled to the bench's tokens per rank in the same proportions")
FLAT = 1.05  # stock max/mean at most this: balancing can buy nothing there
MOVING = ("rotating", "burst")  # the default's of_ideal target is lower there
FULL_S, QUICK_S = 15 * 60, 2 * 60  # the wall time the default workload set and --quick may take


def targets(rows: list[dict], wall_s: float, quick: bool, workloads: tuple) -> dict:
    """The issue's targets, checked on the rows (True: met)."""
    by = {(r["workload"], r["policy"]): r for r in rows}
    flat = [w for w in workloads if by[(w, "stock")]["stock_max_over_mean"] <= FLAT]
    skewed = [w for w in workloads if w not in flat]
    out = {
        f"flat_routing_ratio_vs_stock_le_1.02 (stock max/mean <= {FLAT})":
            {f"{w} {p}": by[(w, p)]["ratio_vs_stock"] <= 1.02 for w in flat for p in POLICIES[1:]},
        "skewed_of_ideal (default >= 0.93, 0.85 rotating/burst; ultraep, lp >= 0.95)":
            {f"{w} {p}": by[(w, p)]["of_ideal"] >= (0.95 if p != "default" else 0.85 if w in MOVING else 0.93)
             for w in skewed for p in ("default", "ultraep", "lp")},
        "no_balancer_slower_than_stock_by_2pct":
            {f"{w} {p}": by[(w, p)]["ratio_vs_stock"] <= 1.02 for w in workloads for p in BALANCERS},
    }
    recorded = [r for r in rows if r["policy"] == RECORDED and "record_ms_per_step" in r]
    if recorded:
        out["recorder_le_1pct_of_step"] = {r["workload"]: r["record_ms_per_step"] <= 0.01 * r["step_ms_p50"]
                                           for r in recorded}
    if tuple(workloads) == DEFAULT_WORKLOADS:
        out["quick_le_2_min" if quick else "default_set_le_15_min"] = wall_s <= (QUICK_S if quick else FULL_S)
    return out


def load_step_trace(path: str) -> np.ndarray:
    """int64 [I, Y, D, E]: a `megatron-rails trace` file or counts file (2-D and 3-D broadcast over
    calls and layers) for `--trace`; BenchError naming the file for anything else."""
    try:
        c = load_counts(path)
    except (WorkloadError, FileNotFoundError) as e:
        raise BenchError(f"--trace: {e}") from None
    return c.reshape((1,) * (4 - c.ndim) + c.shape) if c.ndim < 4 else c


def bench_step(out: str, ranks: int = 2, microbatches: int = 8, quick: bool = False, plot: str | None = None,
               reps: int | None = None, workloads: str | tuple | None = None, trace: str | None = None,
               record: bool = False) -> dict:
    """The benchmark (see the module docstring); `trace`: also replay that recorded trace as the
    workload "trace" (alone where `workloads` is not given); `record`: also run the default with the
    routing recorder on (the case `default+trace`: its ratio to the default in the same round, and
    the recorder's own time per step, `record_ms_per_step`, and finishing the file, `trace_flush_ms`)."""
    try:
        cores_for_ranks(ranks)
    except ValueError as e:
        raise BenchError(str(e)) from None
    if microbatches < 1:
        raise BenchError(f"--microbatches {microbatches}: need at least 1")
    try:
        workloads = () if trace is not None and workloads is None else parse_workloads(workloads)
        counts_IYDE = None
        if trace is not None:
            counts_IYDE = load_step_trace(trace)
            use_trace(counts_IYDE, SHAPE["experts"], microbatches)  # checked here, before any rank starts
            workloads = (*workloads, TRACE)
    except WorkloadError as e:
        raise BenchError(str(e)) from None
    if ranks == 1:
        print(wrapped("step bench: --ranks 1: one EP rank has nothing to balance, so every policy runs as "
                      "none (a smoke run; ratios mean nothing)"), file=sys.stderr)
    shape = QUICK_SHAPE if quick else SHAPE
    reps = reps if reps is not None else (1 if quick else REPS)
    warmups = [0 if quick else WARMUP if w == 0 else WARMUP_NEXT for w in range(len(workloads))]
    heap_touch = HEAP_TOUCH // 8 if quick else HEAP_TOUCH
    print(wrapped(f"step bench: {ranks} gloo ranks (one core each), {shape['layers']} MoE layers, hidden "
                  f"{shape['hidden']}, ffn {shape['ffn']}, {shape['experts']} experts top-{shape['topk']}, "
                  f"{shape['tokens']} tokens/rank/microbatch, {microbatches} microbatches/step; "
                  f"{len(workloads)} workloads x {len(POLICIES) + record} policies (and the ideal), {reps} timed rounds "
                  f"each"), file=sys.stderr)
    kept = {k: os.environ.get(k) for k in MALLOC_KEEP}
    malloc = {k: kept[k] or v for k, v in MALLOC_KEEP.items()}
    os.environ.update(malloc)  # read by the ranks' glibc
    t0 = time.perf_counter()
    try:
        # rank 0's rows beside the rendezvous, in a directory of our own (not beside --out: /dev/stdout)
        with tempfile.TemporaryDirectory(prefix="rails-bench-") as rdzv:
            with quiet_children():
                mp.start_processes(_worker, args=(ranks, f"{rdzv}/store", shape, microbatches, reps, warmups,
                                                  workloads, f"{rdzv}/rows.json", heap_touch, counts_IYDE,
                                                  record),
                                   nprocs=ranks,
                                   start_method="spawn")
            with open(f"{rdzv}/rows.json") as f:
                rows = json.load(f)
    finally:
        for k, v in kept.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    wall_s = time.perf_counter() - t0
    res = {"meta": {"command": "megatron-rails bench step", "ranks": ranks, "microbatches": microbatches,
                    "shape": shape, "reps": reps, "warmups": warmups, "lr": LR, "seed": SEED, "record": record,
                    "workloads": {w: WORKLOADS.get(w, TRACE_TEXT) for w in workloads}, "wall_s": wall_s,
                    **({"trace": {"path": str(trace), "shape": list(counts_IYDE.shape)}} if trace else {}),
                    "malloc": malloc, "heap_touched_bytes": heap_touch,
                    "note": "CPU gloo, one rank per core. ratio_vs_stock and of_ideal are medians of ratios "
                            "taken within a round (see megatron_rails/bench/step.py); stock is Megatron-Core's "
                            "alltoall dispatcher through megatron_rails.megatron.cpu_shims.stock_alltoall."},
           "rows": rows, "targets": targets(rows, wall_s, quick, workloads)}
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
              ["workload", "policy", "step\nms", "vs\nstock", "of\nideal", "max/mean\nstock", "max/\nmean",
               "weight\nMB/step", "expert\nMB/rank"], left=("workload", "policy"))
    for r in rows:
        t.add_row(r["workload"], r["policy"], f"{r['step_ms_p50']:.0f}", f"{r['ratio_vs_stock']:.3f}",
                  f"{r['of_ideal']:.3f}", f"{r['stock_max_over_mean']:.2f}", f"{r['max_over_mean_after']:.2f}",
                  f"{r['weight_bytes_per_step'] / 1e6:.1f}", f"{r['expert_bytes_per_rank'] / 1e6:.1f}")
    con = console(t, file=stream)
    con.print(t)
    note(con, "vs stock: this step over stock Megatron-Core's in the same round; of ideal: stock's step on "
              "balanced routing over this one; max/mean: tokens on the busiest rank over the mean, stock's "
              "placement and after planning; weight MB/step: slot weights fetched plus gradients returned; "
              "expert MB/rank: experts' and slots' parameters and gradients")


def markdown_table(rows: list[dict]) -> str:
    """The rows as a markdown table (docs/benchmarks.md)."""
    head = ("| workload | policy | step ms | vs stock (quartiles) | of ideal (quartiles) | max/mean stock | "
            "max/mean after | weight MB/step | re-layouts/step | expert MB/rank |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['policy']} | {r['step_ms_p50']:.0f} | {_spread(r, 'ratio_vs_stock')} | "
                     f"{_spread(r, 'of_ideal')} | {r['stock_max_over_mean']:.2f} | {r['max_over_mean_after']:.2f} | "
                     f"{r['weight_bytes_per_step'] / 1e6:.1f} | {r['relayouts_per_step']:.1f} | "
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
    names = list(dict.fromkeys(r["workload"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(names)), 4.8))
    width = 0.8 / len(POLICIES)
    for i, p in enumerate(POLICIES):
        vals = [next(r["ratio_vs_stock"] for r in rows if r["workload"] == w and r["policy"] == p) for w in names]
        ax.bar(np.arange(len(names)) + i * width, vals, width, label=p)
    ax.axhline(1.0, color="k", lw=0.8, label="stock Megatron-Core")
    ax.axhline(1.02, color="gray", lw=0.8, ls=":", label="target: never above 1.02")
    ax.set_xticks(np.arange(len(names)) + width * (len(POLICIES) - 1) / 2, names, rotation=30, ha="right")
    ax.set_ylabel("step time / stock's (same round)")
    ax.set_title(f"bench step: {res['meta']['ranks']} ranks, {res['meta']['microbatches']} microbatches per step")
    # outside the axes: inside, it hides bars
    ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.28))
    fig.tight_layout()
    save_figure(fig, png, dpi=120)
    plt.close(fig)
